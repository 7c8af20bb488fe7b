"""ManiSkill3 adapter on the CPU backend: the in-process path (the GPU code path, one env) and workers."""

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

try:
    import mani_skill  # noqa: F401
except ImportError as e:
    pytest.skip(f"mani_skill is not installed ({e})", allow_module_level=True)

from robotft.config import EnvConfig
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.maniskill import ManiSkillEnv, WorkerError

pytestmark = pytest.mark.maniskill

MAX_STEPS = 8


def push_cube(num_envs: int) -> EnvConfig:
    return EnvConfig(
        type="maniskill",
        task="PushCube-v1",
        num_envs=num_envs,
        sim_backend="physx_cpu",
        max_episode_steps=MAX_STEPS,
    )


def actions(n: int, seed: int = 0) -> torch.Tensor:
    """`[n, 7]` fixed pseudo-random pd_ee_delta_pose actions."""
    return torch.rand(n, 7, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def rollout(env, seed: int, acts: torch.Tensor) -> list[torch.Tensor]:
    """States and rewards of one env (index 0 of acts' batch dim = step) after `reset(seed)`."""
    out = [env.reset(seed=seed)["state"]]
    for a in acts:
        obs, reward, *_ = env.step(a.expand(env.num_envs, -1))
        out += [obs["state"], reward]
    return out


@pytest.fixture(scope="module")
def single():
    with ManiSkillEnv(push_cube(1)) as env:
        yield env


@pytest.fixture(scope="module")
def pool():
    cfg = push_cube(2)
    cfg.worker_processes = 2  # one env per process, on any number of cores
    with ManiSkillEnv(cfg) as env:
        yield env


def test_reset_step_shapes_and_spec(single):
    obs = single.reset(seed=0)
    dim = single.spec.observations["state"].shape[0]
    assert obs["state"].shape == (1, dim) and obs["state"].dtype == torch.float32
    obs, reward, term, trunc, info = single.step(torch.zeros(1, 7))
    assert obs["state"].shape == (1, dim) and reward.shape == (1,) and reward.dtype == torch.float32
    assert term.dtype == trunc.dtype == info["success"].dtype == torch.bool and info["success"].shape == (1,)
    spec = single.spec.action
    assert spec.control_mode == "pd_ee_delta_pose" and spec.dim == 7 and spec.control_hz == 20.0
    assert single.worker_pids == []


def test_seeded_rollouts_are_identical(single):
    a, b = rollout(single, 3, actions(5)), rollout(single, 3, actions(5))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], single.reset(seed=4)["state"])


def test_truncation_at_max_episode_steps(single):
    single.reset(seed=0)
    truncs = [single.step(torch.zeros(1, 7))[3].item() for _ in range(MAX_STEPS)]
    assert truncs == [False] * (MAX_STEPS - 1) + [True]
    single.reset(seed=0, env_ids=torch.tensor([0]))
    assert not single.step(torch.zeros(1, 7))[3].item()


def test_chunked_execution(single):
    env = ChunkedEnv(single, obs_steps=2, act_steps=4)
    obs = env.reset(seed=0)
    assert obs["state"].shape == (1, 2, single.spec.observations["state"].shape[0])
    obs, reward, term, trunc, info = env.step(torch.zeros(1, 8, 7))
    assert info["steps"] == 4 and reward.shape == (1,) and "success" in info
    _, _, _, trunc, info = env.step(torch.zeros(1, 8, 7))  # 8 steps = MAX_STEPS: truncated and reset
    assert trunc.item() and info["done"].item() and info["episode_length"].item() == MAX_STEPS


def test_workers_match_separate_single_envs(pool, single):
    acts = actions(6, seed=1)
    batched = rollout(pool, 20, acts)
    for i in range(2):
        alone = rollout(single, 20 + i, acts)
        assert all(torch.equal(b[i], s[0]) for b, s in zip(batched, alone, strict=True))
    # A partial reset touches only the chosen worker.
    before = pool.step(torch.zeros(2, 7))[0]["state"]
    after = pool.reset(seed=20, env_ids=torch.tensor([1]))["state"]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], batched[0][1])


def test_chunk_messages_match_single_steps(pool):
    acts = actions(4, seed=2)[None].expand(2, -1, -1)
    pool.reset(seed=7)
    chunked = pool.step_chunk(acts)
    pool.reset(seed=7)
    stepped = [pool.step(acts[:, t]) for t in range(4)]
    for (obs_c, rew_c, *_), (obs_s, rew_s, *_) in zip(chunked, stepped, strict=True):
        assert torch.equal(obs_c["state"], obs_s["state"]) and torch.equal(rew_c, rew_s)


def test_unseeded_partial_resets_differ_between_workers_and_are_reproducible(pool):
    """Partial resets pass no seed; each worker continues the stream its seeded reset started, so two workers
    do not replay the same episodes (every spawned process starts with torch's same default seed)."""

    def episodes():
        pool.reset(seed=11)
        return [pool.reset(env_ids=torch.tensor([0, 1]))["state"] for _ in range(2)]

    first, again = episodes(), episodes()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    for states in first:
        assert not torch.equal(states[0], states[1])


def test_several_envs_per_worker_process_match_separate_single_envs(single):
    """3 envs in 2 processes (envs 0-1 in the first): each env is the single env seeded `seed + i`, a partial reset
    of one env of a shared process touches only that env, and chunks match single steps."""
    cfg = push_cube(3)
    cfg.worker_processes = 2
    acts = actions(5, seed=3)
    with ManiSkillEnv(cfg) as env:
        assert len(env.worker_pids) == 2
        batched = rollout(env, 30, acts)
        for i in range(3):
            alone = rollout(single, 30 + i, acts)
            assert all(torch.equal(b[i], s[0]) for b, s in zip(batched, alone, strict=True)), f"env {i}"
        before = env.step(torch.zeros(3, 7))[0]["state"]
        after = env.reset(seed=30, env_ids=torch.tensor([2, 1]))["state"]
        assert torch.equal(after[0], before[0])
        assert torch.equal(after[1], batched[0][1]) and torch.equal(after[2], batched[0][2])
        chunk = acts[:4][None].expand(3, -1, -1)
        env.reset(seed=5)
        chunked = env.step_chunk(chunk)
        env.reset(seed=5)
        for t, (obs, reward, *_) in enumerate(chunked):
            stepped_obs, stepped_reward, *_ = env.step(chunk[:, t])
            assert torch.equal(obs["state"], stepped_obs["state"]) and torch.equal(reward, stepped_reward)


def test_worker_processes_default_to_the_available_cores_and_split_evenly():
    from robotft.envs.workers import process_count, split_envs
    from robotft.threads import available_cores

    assert process_count(64, 0) == min(64, available_cores()) and process_count(4, 8) == 4
    assert process_count(4, 3) == 3
    assert split_envs(5, 2) == [range(0, 3), range(3, 5)] and split_envs(2, 2) == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="worker_processes must be >= 0"):
        EnvConfig(type="maniskill", task="PushCube-v1", worker_processes=-1)


def test_killed_worker_raises_a_clear_error(pool):
    pool.reset(seed=0)
    os.kill(pool.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 1 .*exit code -9"):
        pool.step(torch.zeros(2, 7))
    assert time.monotonic() - start < 10


def test_time_the_learner_spent_stopped_does_not_count_against_its_workers(monkeypatch):
    """A run paused with SIGSTOP (learner and workers alike) and continued must not die of the worker timeout
    when it wakes: the learner's clock jumped while nobody ran. Here the worker is stopped for a moment while the
    learner's clock jumps 1000 s; a worker that stays stopped still times out."""
    from robotft.envs import workers

    cfg = push_cube(2)
    cfg.worker_processes = 1  # both envs in one worker process
    with ManiSkillEnv(cfg) as env:
        env._impl.step_timeout_s = 3.0
        (pid,) = env.worker_pids
        jump = [0.0]
        monkeypatch.setattr(workers, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + jump[0]))

        def wake():
            time.sleep(0.5)
            jump[0] = 1000.0  # the learner was stopped as long as that, by its own clock
            time.sleep(0.5)
            os.kill(pid, signal.SIGCONT)

        env.reset(seed=0)
        os.kill(pid, signal.SIGSTOP)
        waker = threading.Thread(target=wake)
        waker.start()
        obs, *_ = env.step(torch.zeros(2, 7))  # answers once continued, with no timeout error
        waker.join()
        assert obs["state"].shape[0] == 2
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(WorkerError, match=r"worker 0 .*did not answer within 3 s"):
                env.step(torch.zeros(2, 7))
        finally:
            os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - start < 10


def test_worker_failure_reports_its_traceback():
    cfg = push_cube(2)
    cfg.task = "NoSuchTask-v1"
    with pytest.raises(WorkerError, match=r"(?s)worker 0 .*failed.*Traceback.*NoSuchTask"):
        ManiSkillEnv(cfg)


def test_a_missing_physx_gpu_library_gets_an_error_that_says_what_to_do(monkeypatch, tmp_path):
    """Offline, SAPIEN's download of its PhysX GPU library fails with a bare connection error; robotft names the
    folder the library belongs in, where to get it, and the CPU sim as the way around."""
    import sapien.physx as physx

    from robotft.envs.maniskill import enable_physx_gpu

    def offline():
        raise ConnectionError("Failed to resolve 'github.com'")

    monkeypatch.setattr(physx, "enable_gpu", offline)
    monkeypatch.setattr(physx, "is_gpu_enabled", lambda: False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RuntimeError) as err:
        enable_physx_gpu()
    message = str(err.value)
    assert str(tmp_path / ".sapien" / "physx" / physx.version()) in message
    assert "physx-precompiled/releases" in message and "github.com" in message
    assert "--env.sim_backend physx_cpu" in message


def test_peg_insertion_milestones_follow_the_peg():
    """PegInsertionSide reports `grasped` and `aligned` (the peg's head and centre within 1 cm of the hole's axis,
    its dense reward's pre-insertion stage): neither at the start; `aligned` on the axis short of the hole and 5 mm
    off it, not 2 cm off it."""
    import sapien

    from robotft.envs.maniskill import MILESTONES

    cfg = EnvConfig(type="maniskill", task="PegInsertionSide-v1", num_envs=1, sim_backend="physx_cpu",
                    control_mode="pd_ee_delta_pose", max_episode_steps=4)
    with ManiSkillEnv(cfg) as env:
        env.reset(seed=0)
        _, _, _, _, info = env.step(torch.zeros(1, 7))
        names = ["grasped", "aligned"]
        assert [k for k in info if k.startswith("milestone/")] == [f"milestone/{m}" for m in names]
        assert not any(bool(info[f"milestone/{m}"][0]) for m in names)
        raw = env._impl._env
        milestones = dict(MILESTONES["PegInsertionSide-v1"])

        def aligned(offset_y: float) -> bool:
            # 8 cm short of the hole, slightly tilted
            raw.peg.set_pose(raw.goal_pose * sapien.Pose([-0.08, offset_y, 0.002], [0.999, 0.02, 0.03, 0.01]))
            info = raw.evaluate()
            assert not bool(info["success"][0])
            # the dense reward's own test, on ManiSkill's composed poses
            yz = [torch.linalg.norm((raw.goal_pose.inv() * pose).p[:, 1:], dim=1) for pose in
                  (raw.peg_head_pose, raw.peg.pose)]
            reference = bool(((yz[0] < 0.01) & (yz[1] < 0.01))[0])
            assert bool(milestones["aligned"](raw, info)[0]) == reference
            return reference

        assert aligned(0.0) and aligned(0.005) and not aligned(0.02)
