"""gymnasium MuJoCo locomotion adapter: contract, chunked execution, auto-reset, seeding, success."""

import dataclasses

import pytest
import torch

pytest.importorskip("mujoco")
gym = pytest.importorskip("gymnasium")

from robotft.config import EnvConfig, load_env_config  # noqa: E402
from robotft.envs.chunked import ChunkedEnv  # noqa: E402
from robotft.envs.factory import make_env  # noqa: E402
from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv  # noqa: E402


def hopper(num_envs: int = 2, **kw) -> EnvConfig:
    return dataclasses.replace(load_env_config("mujoco/hopper"), num_envs=num_envs, **kw)


def actions(n: int, act_dim: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, act_dim, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("preset, obs_dim, act_dim, hz", [
    ("mujoco/hopper", 11, 3, 125.0), ("mujoco/walker2d", 17, 6, 125.0), ("mujoco/half_cheetah", 17, 6, 20.0),
])
def test_reset_step_shapes_dtypes_and_spec(preset, obs_dim, act_dim, hz):
    cfg = dataclasses.replace(load_env_config(preset), num_envs=3)
    with make_env(cfg) as env:
        assert isinstance(env, MujocoLocomotionEnv)
        assert env.spec.action.dim == act_dim and env.spec.action.control_hz == hz
        assert env.spec.action.control_mode == "joint_torque"
        obs = env.reset(seed=0)
        assert set(obs) == {"state"} and obs["state"].shape == (3, obs_dim) and obs["state"].dtype == torch.float32
        obs, reward, terminated, truncated, info = env.step(actions(3, act_dim))
        assert obs["state"].shape == (3, obs_dim) and obs["state"].dtype == torch.float32
        assert reward.shape == (3,) and reward.dtype == torch.float32
        assert terminated.dtype == torch.bool and truncated.dtype == torch.bool
        assert info["success"].shape == (3,) and info["success"].dtype == torch.bool


def test_matches_gymnasium_stepped_directly():
    """The adapter adds nothing to the simulation: same seed and actions, same numbers as plain gymnasium."""
    acts = actions(30, 3, seed=1)
    raw = gym.make("Hopper-v5")
    ref_obs, _ = raw.reset(seed=7)
    with MujocoLocomotionEnv(hopper(1)) as env:
        obs = env.reset(seed=7)
        assert torch.equal(obs["state"][0], torch.from_numpy(ref_obs).float())
        for a in acts:
            ref_obs, ref_r, ref_term, _, _ = raw.step(a.numpy())
            obs, r, term, _, _ = env.step(a[None])
            assert torch.equal(obs["state"][0], torch.from_numpy(ref_obs).float())
            assert r[0].item() == pytest.approx(ref_r, rel=1e-6) and bool(term[0]) == ref_term
            if ref_term:
                break


def test_seeding_gives_identical_trajectories():
    acts = actions(40, 3, seed=2)

    def rollout(seed):
        with MujocoLocomotionEnv(hopper(2)) as env:
            out = [env.reset(seed=seed)["state"]]
            for a in acts:
                obs, r, *_ = env.step(a.expand(2, -1))
                out += [obs["state"], r]
            return torch.cat([x.flatten() for x in out])

    assert torch.equal(rollout(3), rollout(3))
    assert not torch.equal(rollout(3), rollout(4))


def test_truncation_at_episode_limit_is_not_termination():
    with MujocoLocomotionEnv(hopper(1, max_episode_steps=5)) as env:
        env.reset(seed=0)
        for t in range(5):
            _, _, terminated, truncated, _ = env.step(torch.zeros(1, 3))
            assert bool(truncated[0]) == (t == 4) and not terminated[0]


def test_chunked_autoreset_keeps_final_observation_of_a_fallen_hopper():
    """Full torque on every joint makes the Hopper fall (terminated, not truncated). ChunkedEnv must return
    the new episode's observation and keep the fallen state in final_obs, equal to what gymnasium returned."""
    push = torch.ones(1, 3)
    raw = gym.make("Hopper-v5")
    raw.reset(seed=5)
    fallen_at = None
    for t in range(200):
        ref_obs, _, terminated, _, _ = raw.step(push[0].numpy())
        if terminated:
            fallen_at = t + 1
            break
    assert fallen_at is not None, "the Hopper did not fall under full torque"

    env = ChunkedEnv(MujocoLocomotionEnv(hopper(1)), obs_steps=2, act_steps=8)
    try:
        env.reset(seed=5)
        for _ in range(50):
            obs, reward, terminated, truncated, info = env.step(push.unsqueeze(1).expand(1, 8, 3))
            if info["done"][0]:
                break
        assert bool(terminated[0]) and not truncated[0]
        assert int(info["episode_length"][0]) == fallen_at
        final = info["final_obs"]["state"][0, -1]
        assert torch.equal(final, torch.from_numpy(ref_obs).float())
        height, angle = final[0].item(), final[1].item()
        assert height < 0.7 or abs(angle) > 0.2  # gymnasium's definition of unhealthy
        # The returned history belongs to the new episode: both frames are its first observation.
        assert torch.equal(obs["state"][0, 0], obs["state"][0, 1])
        assert not torch.equal(obs["state"][0, -1], final)
    finally:
        env.close()


def test_chunk_rewards_are_the_sum_of_step_rewards():
    acts = actions(4, 3, seed=3)
    with MujocoLocomotionEnv(hopper(1)) as single:
        single.reset(seed=11)
        expected = sum(single.step(a[None])[1][0].item() for a in acts)
    chunked = ChunkedEnv(MujocoLocomotionEnv(hopper(1)), obs_steps=1, act_steps=4)
    try:
        chunked.reset(seed=11)
        _, reward, _, _, info = chunked.step(acts[None])
        assert reward[0].item() == pytest.approx(expected, rel=1e-5) and info["steps"] == 4
    finally:
        chunked.close()


def test_success_is_the_return_reaching_the_threshold():
    with MujocoLocomotionEnv(hopper(1, kwargs={"success_return": 5.0})) as env:
        env.reset(seed=0)
        total, seen = 0.0, []
        for _ in range(10):
            _, r, term, _, info = env.step(torch.zeros(1, 3))
            total += r[0].item()
            seen.append((total >= 5.0, bool(info["success"][0])))
        assert all(a == b for a, b in seen) and seen[-1][1] and not seen[0][1]
        env.reset(seed=1)
        assert not env.step(torch.zeros(1, 3))[4]["success"][0]  # the return restarts at reset
    with MujocoLocomotionEnv(hopper(1)) as env:
        assert env.success_return == gym.spec("Hopper-v5").reward_threshold


def test_partial_reset_only_touches_the_given_envs():
    with MujocoLocomotionEnv(hopper(3)) as env:
        env.reset(seed=0)
        stepped = env.step(actions(3, 3))[0]["state"]
        obs = env.reset(seed=100, env_ids=torch.tensor([1]))["state"]
        assert torch.equal(obs[[0, 2]], stepped[[0, 2]])
        with MujocoLocomotionEnv(hopper(3)) as fresh:
            assert torch.equal(obs[1], fresh.reset(seed=99)["state"][2])  # env 1 got seed 100 + 1 = 99 + 2


def test_wrong_config_is_refused_with_the_expected_value():
    with pytest.raises(ValueError, match="joint_torque"):
        MujocoLocomotionEnv(hopper(1, control_mode="pd_ee_delta_pose"))
    with pytest.raises(ValueError, match="Hopper-v5"):
        MujocoLocomotionEnv(hopper(1, task="Ant-v5"))
