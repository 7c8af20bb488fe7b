"""robosuite adapter: in-process env, worker processes, every robomimic task preset, cameras (EGL)."""

import dataclasses
import os
import signal
import time

import pytest
import torch

try:
    import robosuite  # noqa: F401
except ImportError as e:
    pytest.skip(f"robosuite is not installed ({e})", allow_module_level=True)

from robotft.config import EnvConfig, load_env_config
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.envs.robosuite import RobosuiteEnv
from robotft.envs.workers import WorkerError

pytestmark = pytest.mark.robosuite

MAX_STEPS = 8


def lift(num_envs: int = 1, **kw) -> EnvConfig:
    return EnvConfig(
        type="robosuite", task="Lift", num_envs=num_envs, control_mode="OSC_POSE", max_episode_steps=MAX_STEPS, **kw
    )


def actions(n: int, num_envs: int = 1, seed: int = 0) -> torch.Tensor:
    """`[n, num_envs, 7]` fixed pseudo-random OSC_POSE actions."""
    return torch.rand(n, num_envs, 7, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def rollout(env, seed: int, acts: torch.Tensor) -> list[torch.Tensor]:
    """States and rewards after `reset(seed)` and each action of `acts` (`[n, B, 7]`)."""
    out = [env.reset(seed=seed)["state"]]
    for a in acts:
        obs, reward, *_ = env.step(a)
        out += [obs["state"], reward]
    return out


@pytest.fixture(scope="module")
def single():
    with RobosuiteEnv(lift()) as env:
        yield env


@pytest.fixture(scope="module")
def pool():
    cfg = lift(2)
    cfg.worker_processes = 2  # one env per process, on any number of cores
    with RobosuiteEnv(cfg) as env:
        yield env


def test_reset_step_shapes_and_spec(single):
    obs = single.reset(seed=0)
    names = single.spec.observations["state"].names
    assert obs.keys() == {"state"} and obs["state"].shape == (1, 19) and obs["state"].dtype == torch.float32
    assert len(names) == 19 and names[:3] == ("robot0_eef_pos.x", "robot0_eef_pos.y", "robot0_eef_pos.z")
    # The cube rests on the table (top at z = 0.8 m, cube half-size 2 cm): the object dims are in place.
    assert obs["state"][0, names.index("object.cube_pos.z")].item() == pytest.approx(0.82, abs=0.015)
    obs, reward, term, trunc, info = single.step(torch.zeros(1, 7))
    assert obs["state"].shape == (1, 19) and reward.shape == (1,) and reward.dtype == torch.float32
    assert term.dtype == trunc.dtype == info["success"].dtype == torch.bool and info["success"].shape == (1,)
    assert not info["success"].item() and torch.equal(term, info["success"])
    spec = single.spec.action
    assert (spec.control_mode, spec.dim, spec.control_hz, spec.frame) == ("OSC_POSE", 7, 20.0, "robot_base")
    assert spec.low == (-1.0,) * 7 and spec.high == (1.0,) * 7
    assert single.worker_pids == [] and single.render_rgb() is None


def test_actions_move_the_end_effector(single):
    """OSC_POSE input +1 on z asks for 5 cm per step: the gripper rises by centimetres, not metres."""
    start = single.reset(seed=0)["state"][0, 2].item()
    up = torch.tensor([[0, 0, 1.0, 0, 0, 0, -1]])
    for _ in range(5):
        obs = single.step(up)[0]
    assert 0.05 < obs["state"][0, 2].item() - start < 0.3


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


def test_chunked_execution_auto_resets_with_final_obs(single):
    env = ChunkedEnv(single, obs_steps=2, act_steps=4)
    obs = env.reset(seed=0)
    assert obs["state"].shape == (1, 2, 19)
    obs, reward, term, trunc, info = env.step(torch.zeros(1, 8, 7))
    assert info["steps"] == 4 and reward.shape == (1,) and not info["done"].item() and "success" in info
    before = obs["state"][:, -1]
    obs, _, _, trunc, info = env.step(torch.zeros(1, 8, 7))  # steps 5-8: truncated, then reset
    assert trunc.item() and info["done"].item() and info["episode_length"].item() == MAX_STEPS
    final = info["final_obs"]["state"]
    # The final history holds the episode's last frames; the returned one is a fresh episode's first frame.
    assert not torch.equal(final[:, -1], obs["state"][:, -1]) and not torch.equal(final[:, -1], before)
    assert torch.equal(obs["state"][:, 0], obs["state"][:, 1])


def test_workers_match_separate_single_envs(pool, single):
    acts = actions(4, num_envs=2, seed=1)
    batched = rollout(pool, 20, acts)
    assert len(pool.worker_pids) == 2 and pool.spec == single.spec
    for i in range(2):
        alone = rollout(single, 20 + i, acts[:, i : i + 1])
        assert all(torch.equal(b[i], s[0]) for b, s in zip(batched, alone, strict=True))
    # A partial reset touches only the chosen worker.
    before, *_, info = pool.step(torch.zeros(2, 7))
    before = before["state"]
    assert info["milestone/grasped"].shape == (2,)  # the task's milestones come back from every worker
    after = pool.reset(seed=20, env_ids=torch.tensor([1]))["state"]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], batched[0][1])


def test_failed_start_states_replay_exactly_through_the_workers(pool):
    """Each worker's env resets to the start state its seed names, so a replayed start state is the same one."""
    from robotft.envs.start_states import FailedStartReplay

    starts = FailedStartReplay(retries=1, replay_prob=1.0)
    env = ChunkedEnv(pool, obs_steps=1, act_steps=4)
    first = env.reset(start_states=starts)["state"][:, 0].clone()
    for _ in range(2):  # both episodes truncate after 8 steps, unsolved
        _, _, _, _, info = env.step(torch.zeros(2, 4, 7))
    seeds = info["start_seed"].tolist()
    assert info["done"].all() and len(set(seeds)) == 2
    for s in seeds:
        starts.report(s, success=False)
    for _ in range(2):
        obs, _, _, _, info = env.step(torch.zeros(2, 4, 7))
    assert torch.equal(obs["state"][:, 0], first)
    assert [int(s) for s in env._start_seed] == seeds


def test_killed_worker_raises_a_clear_error(pool):
    pool.reset(seed=0)
    os.kill(pool.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"robosuite worker 1 .*exit code -9"):
        pool.step(torch.zeros(2, 7))
    assert time.monotonic() - start < 10


def test_worker_failure_reports_its_traceback():
    cfg = lift(2, kwargs={"no_such_argument": 1})  # robosuite.make raises inside each worker
    with pytest.raises(WorkerError, match=r"(?s)robosuite worker 0 .*failed.*Traceback.*no_such_argument"):
        RobosuiteEnv(cfg)


@pytest.mark.parametrize(
    ("preset", "state_dim", "act_dim"),
    [
        ("robosuite/lift", 19, 7),
        ("robosuite/pick_place_can", 23, 7),
        ("robosuite/nut_assembly_square", 23, 7),
        ("robosuite/two_arm_transport", 59, 14),
    ],
)
def test_presets_build_and_step(preset, state_dim, act_dim):
    """Every robomimic task: robomimic's low-dim state size (per arm eef pos, quat, gripper; object)."""
    cfg = load_env_config(preset, {"max_episode_steps": "2"})
    with make_env(cfg) as env:
        assert env.spec.observations["state"].shape == (state_dim,) and env.spec.action.dim == act_dim
        obs = env.reset(seed=0)
        assert obs["state"].shape == (1, state_dim)
        _, reward, term, trunc, info = env.step(torch.zeros(1, act_dim))
        _, reward, term, trunc, info = env.step(torch.zeros(1, act_dim))
        assert trunc.item() and not info["success"].item() and reward.item() == 0.0  # sparse reward


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"control_mode": "JOINT_VELOCITY"}, "env.control_mode 'JOINT_VELOCITY'.*only 'OSC_POSE'"),
        ({"task": "Door"}, "env.task 'Door'.*supports"),
        ({"kwargs": {"control_freq": 10}}, r"env.kwargs \['control_freq'\].*env.control_hz"),
        ({"obs_mode": "depth"}, "env.obs_mode 'depth'"),
        ({"task": "TwoArmTransport", "reward_mode": "dense"}, "only a sparse reward for TwoArmTransport"),
    ],
)
def test_bad_config_is_a_clear_error(change, match):
    cfg = lift(2)  # checked before any worker process starts
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=match):
        RobosuiteEnv(cfg)


def test_camera_observations():
    """Offscreen rendering (EGL on these machines) into rgb/agentview and rgb/robot0_eye_in_hand."""
    with RobosuiteEnv(lift(obs_mode="rgb", kwargs={"camera_heights": 64, "camera_widths": 48})) as env:
        spec = env.spec.observations
        assert set(spec) == {"state", "rgb/agentview", "rgb/robot0_eye_in_hand"}
        assert spec["rgb/agentview"].shape == (64, 48, 3) and spec["rgb/agentview"].dtype == "uint8"
        obs = env.reset(seed=0)
        obs, *_ = env.step(torch.zeros(1, 7))
        for cam in ("agentview", "robot0_eye_in_hand"):
            frame = obs[f"rgb/{cam}"]
            assert frame.shape == (1, 64, 48, 3) and frame.dtype == torch.uint8
            assert frame.float().std() > 10  # a rendered scene, not a blank buffer
        assert torch.equal(env.render_rgb(), obs["rgb/agentview"])
        assert not torch.equal(obs["rgb/agentview"], obs["rgb/robot0_eye_in_hand"])


def test_pick_place_can_milestones_follow_the_scripted_expert():
    """The scripted expert's episode grasps the can, lifts it, carries it over its bin and then succeeds, each first
    reached in that order; with the gripper never closing, the can is never grasped or lifted."""
    from robotft.datasets.robosuite_demos import PickPlaceExpert

    cfg = dataclasses.replace(load_env_config("robosuite/pick_place_can"), num_envs=1)
    with RobosuiteEnv(cfg) as env:
        expert = PickPlaceExpert("PickPlaceCan", env.spec, 1)
        first: dict[str, int] = {}
        for open_gripper in (False, True):
            obs = env.reset(seed=3)
            expert.reset(torch.tensor([0]), obs)
            first.clear()
            for t in range(cfg.max_episode_steps):
                action = expert(obs)
                if open_gripper:
                    action[:, 6] = -1.0
                obs, _, terminated, truncated, info = env.step(action)
                for key in ("milestone/grasped", "milestone/lifted", "milestone/over_bin", "success"):
                    if bool(info[key][0]):
                        first.setdefault(key.removeprefix("milestone/"), t)
                if bool(terminated[0] | truncated[0]):
                    break
            if not open_gripper:
                assert list(first) == ["grasped", "lifted", "over_bin", "success"], first
                assert first["grasped"] < first["lifted"] < first["over_bin"] < first["success"], first
        assert "grasped" not in first and "lifted" not in first, first
