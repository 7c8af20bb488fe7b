"""ManiSkill's GPU-backend semantics, on CPU: the real robotft ManiSkill adapter over a batched stand-in of
ManiSkill 3.0.1's raw GPU env (tests/maniskill_standin.py), compared with ManiSkill's own
`ManiSkillVectorEnv` and `TimeLimitWrapper` where they define the behaviour."""

import numpy as np
import pytest
import torch

from robotft.config import EnvConfig
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.evaluation import evaluate

pytest.importorskip("mani_skill")
import maniskill_standin  # noqa: E402
from mani_skill.utils.registration import TimeLimitWrapper  # noqa: E402
from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv  # noqa: E402

pytestmark = pytest.mark.gpu_semantics


@pytest.fixture
def gpu_env(monkeypatch):
    """`gpu_env(num_envs, max_episode_steps, **kwargs)`: robotft's ManiSkill env on the stand-in, built through
    `make_env` as on a GPU machine (in-process, all envs in one simulator)."""
    env_id = maniskill_standin.register()
    monkeypatch.setattr("robotft.envs.maniskill.resolve_sim_backend", lambda backend, device="cpu": "physx_cuda")
    built = []

    def build(num_envs: int, max_episode_steps: int = 20, **kwargs):
        cfg = EnvConfig(type="maniskill", task=env_id, num_envs=num_envs, max_episode_steps=max_episode_steps,
                        control_mode="pd_ee_delta_pos", kwargs=kwargs)
        env = make_env(cfg)
        built.append(env)
        assert env.worker_pids == []  # the in-process path, not CPU workers
        return env

    yield build
    for env in built:
        env.close()


def raw(env):
    """The stand-in under robotft's adapter."""
    return env._impl._env


def test_a_reset_batch_is_seeded_from_its_first_seed():
    sim = maniskill_standin.BatchedStandInEnv(num_envs=6)
    a, _ = sim.reset(seed=[7, 1, 2, 3, 4, 5])
    b, _ = sim.reset(seed=7)
    c, _ = sim.reset(seed=[7, 99, 98, 97, 96, 95])
    assert torch.equal(a, b) and torch.equal(a, c)  # only the first seed decides the batch
    assert len({tuple(r.tolist()) for r in a}) == 6  # ... and the envs still differ


def test_adapter_seeds_full_resets_once_and_partial_resets_not_at_all(gpu_env):
    env = gpu_env(16, max_episode_steps=6)
    chunked = ChunkedEnv(env, obs_steps=1, act_steps=4)
    sim = raw(env)
    sim.seeds_received.clear()
    first = chunked.reset(seed=5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        rng_before = torch.get_rng_state()
        chunked.step(torch.rand(16, 4, 2, generator=gen) * 2 - 1)
        # partial resets draw their episodes from the adapter's own stream, not the caller's RNG
        assert torch.equal(torch.get_rng_state(), rng_before)
    assert sim.seeds_received[0] == 5  # one int: ManiSkill seeds the batch from it
    assert len(sim.seeds_received) > 1 and all(s is None for s in sim.seeds_received[1:])
    assert max(sim.reset_batches[1:]) <= 16
    # the same seed gives the same initial states
    torch.testing.assert_close(chunked.reset(seed=5)["state"], first["state"])


def test_partial_reset_resets_only_env_idx(gpu_env):
    env = gpu_env(8)
    obs = env.reset(seed=3)
    env.step(torch.full((8, 2), 0.3))
    moved = env.step(torch.full((8, 2), 0.3))[0]["state"]
    after = env.reset(env_ids=torch.tensor([1, 5]))["state"]
    keep = torch.tensor([0, 2, 3, 4, 6, 7])
    torch.testing.assert_close(after[keep], moved[keep])
    assert not torch.allclose(after[[1, 5]], moved[[1, 5]])
    assert env._impl._elapsed.tolist() == [2, 0, 2, 2, 2, 0, 2, 2]
    assert raw(env).elapsed_steps.tolist() == [2, 0, 2, 2, 2, 0, 2, 2]
    assert obs["state"].shape == (8, 6)


def test_auto_reset_matches_maniskill_vector_env(gpu_env):
    """ChunkedEnv's auto-reset (one env step per chunk) against ManiSkillVectorEnv over ManiSkill's
    TimeLimitWrapper: same rewards, terminations, truncations, final observations, episode returns and
    success_once / success_at_end, step by step, for 12 envs over several episodes each."""
    b, limit, steps = 12, 7, 30
    env = gpu_env(b, max_episode_steps=limit, init="indexed")
    chunked = ChunkedEnv(env, obs_steps=1, act_steps=1)
    ref_sim = maniskill_standin.BatchedStandInEnv(num_envs=b, init="indexed")
    ref = ManiSkillVectorEnv(TimeLimitWrapper(ref_sim, max_episode_steps=limit), auto_reset=True,
                             record_metrics=True)
    obs = chunked.reset(seed=0)
    ref.reset()  # the adapter resets once when it is built (to read the observation spec)
    ref_obs, _ = ref.reset(seed=0)
    torch.testing.assert_close(obs["state"][:, -1], ref_obs)
    gen = torch.Generator().manual_seed(1)
    episodes = 0
    for _ in range(steps):
        action = (torch.rand(b, 2, generator=gen) * 2 - 1) * 0.8
        obs, reward, term, trunc, info = chunked.step(action[:, None])
        ref_obs, ref_rew, ref_term, ref_trunc, ref_info = ref.step(action)
        torch.testing.assert_close(reward, ref_rew.float())
        assert torch.equal(term, ref_term) and torch.equal(trunc, ref_trunc)
        torch.testing.assert_close(obs["state"][:, -1], ref_obs)
        done = info["done"]
        assert torch.equal(done, ref_term | ref_trunc)
        if done.any():
            episodes += int(done.sum())
            final, ep = ref_info["final_observation"], ref_info["final_info"]["episode"]
            torch.testing.assert_close(info["final_obs"]["state"][done, -1], final[done])
            torch.testing.assert_close(info["episode_return"][done], ep["return"][done])
            assert torch.equal(info["success_once"][done], ep["success_once"][done])
            assert torch.equal(info["success"][done], ref_info["final_info"]["success"][done])
    assert episodes > 2 * b


def test_evaluation_counts_only_the_requested_episodes_at_many_envs(gpu_env, tmp_path):
    """20 episodes on 256 envs: only the first 20 envs count, so it takes about one episode of env steps;
    video: one file per episode of env 0, at the control rate, ending on the episode's last frame."""
    env = ChunkedEnv(gpu_env(256, max_episode_steps=10), obs_steps=1, act_steps=4)

    def toward_goal(obs):
        to_goal = obs["state"][:, -1, 4:6]
        return (to_goal / 0.05).clamp(-1, 1)[:, None].expand(-1, 4, -1)

    result = evaluate(toward_goal, env, 20, seed=0, video_path=tmp_path / "eval.mp4")
    assert result.episodes == 20
    assert result.env_steps <= 256 * 4 * 3  # at most 3 chunks of 4 steps: the 10-step limit, not 256 episodes
    assert result.success_rate > 0.8 and result.success_once >= result.success_at_end == result.success_rate
    videos = sorted(tmp_path.glob("eval_ep*.mp4"))
    assert [v.name for v in videos] == ["eval_ep0.mp4"]
    import imageio

    frames = imageio.mimread(videos[0])
    # the initial frame, then one per env step of env 0's first episode (it ends within the 10-step limit)
    assert 2 <= len(frames) <= 11
    assert np.asarray(frames[0]).shape[:2] == (16, 16)


def test_auto_sim_backend_follows_the_run_device(monkeypatch):
    from robotft.envs.maniskill import resolve_sim_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_sim_backend("auto", "cpu") == "physx_cpu"  # --device cpu on a GPU machine
    assert resolve_sim_backend("auto", "cuda:1") == "physx_cuda"
    assert resolve_sim_backend("physx_cuda", "cpu") == "physx_cuda"  # explicit stays explicit
