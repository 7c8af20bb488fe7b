"""Domain randomization changes what it says it changes, and nothing when it is off."""

import dataclasses

import numpy as np
import pytest
import torch

from robotft.config import ConfigError, DomainRandomizationConfig, EnvConfig, apply_overrides, load_env_config
from robotft.envs.factory import make_env
from robotft.envs.randomization import RandomizedEnv
from robotft.envs.toy import MAX_STEP, ToyNavEnv


def toy(num_envs: int, **dr) -> RandomizedEnv:
    return RandomizedEnv(ToyNavEnv(num_envs, task="reach2d", max_episode_steps=1000),
                         DomainRandomizationConfig(**dr))


# -- generic: observation noise, action noise, action latency (on the pure-torch toy env) -------------


def test_observation_noise_has_the_configured_std():
    clean, noisy = ToyNavEnv(4096, task="reach2d"), toy(4096, obs_noise_std=0.05)
    diff = noisy.reset(seed=0)["state"] - clean.reset(seed=0)["state"]
    assert diff.std().item() == pytest.approx(0.05, rel=0.03) and abs(diff.mean().item()) < 2e-3
    a = torch.zeros(4096, 2)
    diff = noisy.step(a)[0]["state"] - clean.step(a)[0]["state"]
    assert diff.std().item() == pytest.approx(0.05, rel=0.03)


def test_action_latency_delays_actions_by_exactly_k_steps():
    k, n = 3, 10
    env = toy(2, action_latency_steps=(k, k))
    commanded = torch.linspace(-0.9, 0.9, n)
    pos = env.reset(seed=0)["state"][:, :2]
    executed = []
    for t in range(n):
        new = env.step(torch.stack([commanded[t], -commanded[t]]).expand(2, 2))[0]["state"][:, :2]
        executed.append((new - pos) / MAX_STEP)
        pos = new
    executed = torch.stack(executed)  # [n, B, 2]
    assert torch.allclose(executed[:k], torch.zeros(k, 2, 2), atol=1e-5)  # neutral until the first arrives
    assert torch.allclose(executed[k:, :, 0], commanded[: n - k, None].expand(-1, 2), atol=1e-5)
    assert torch.allclose(executed[k:, :, 1], -commanded[: n - k, None].expand(-1, 2), atol=1e-5)


def test_latency_restarts_at_a_partial_reset_and_is_drawn_in_range():
    env = toy(64, action_latency_steps=(0, 2))
    env.reset(seed=1)
    assert set(env._latency.tolist()) == {0, 1, 2}
    env = toy(2, action_latency_steps=(1, 1))
    env.reset(seed=0)
    env.step(torch.full((2, 2), 0.5))
    env.reset(env_ids=torch.tensor([1]))
    pos = env.env._pos.clone()
    env.step(torch.full((2, 2), -0.5))
    moved = (env.env._pos - pos) / MAX_STEP
    assert torch.allclose(moved[0], torch.tensor([0.5, 0.5])) and torch.allclose(moved[1], torch.zeros(2))


def test_action_noise_has_the_configured_std_and_stays_in_bounds():
    env = toy(4096, action_noise_std=0.1)
    pos = env.reset(seed=0)["state"][:, :2]
    moved = (env.step(torch.zeros(4096, 2))[0]["state"][:, :2] - pos) / MAX_STEP
    assert moved.std().item() == pytest.approx(0.1, rel=0.03)
    env = toy(4096, action_noise_std=0.5)
    pos = env.reset(seed=0)["state"][:, :2]
    moved = (env.step(torch.ones(4096, 2))[0]["state"][:, :2] - pos) / MAX_STEP
    assert moved.max().item() <= 1.0 + 1e-5 and moved.min().item() < 0.9


def test_generic_randomization_is_reproducible_from_the_seed():
    def run(seed):
        env = toy(3, obs_noise_std=0.1, action_noise_std=0.1, action_latency_steps=(0, 3))
        out = [env.reset(seed=seed)["state"]]
        out += [env.step(torch.full((3, 2), 0.3))[0]["state"] for _ in range(5)]
        return torch.stack(out)

    assert torch.equal(run(4), run(4)) and not torch.equal(run(4), run(5))


def test_no_randomization_means_no_wrapper_and_unsupported_fields_are_refused():
    assert type(make_env(EnvConfig(type="toy"))) is ToyNavEnv
    cfg = EnvConfig(type="toy", randomization=DomainRandomizationConfig(friction_scale=(0.5, 1.5)))
    with pytest.raises(ValueError, match="friction_scale.*'toy'"):
        make_env(cfg)
    wrapped = make_env(EnvConfig(type="toy", randomization=DomainRandomizationConfig(obs_noise_std=0.1)))
    assert isinstance(wrapped, RandomizedEnv)


def test_randomization_fields_are_overridable_and_validated():
    cfg = apply_overrides(EnvConfig(), {"randomization.friction_scale": "[0.5,1.5]",
                                        "randomization.action_latency_steps": "[1,2]"}, prefix="env.")
    assert cfg.randomization.friction_scale == (0.5, 1.5) and cfg.randomization.action_latency_steps == (1, 2)
    with pytest.raises(ConfigError, match="friction_scale"):
        apply_overrides(EnvConfig(), {"randomization.friction_scale": "[1.5,0.5]"}, prefix="env.")
    with pytest.raises(ConfigError, match="obs_noise_std"):
        apply_overrides(EnvConfig(), {"randomization.obs_noise_std": "-1"}, prefix="env.")


# -- MuJoCo locomotion: friction, mass, camera field of view, light -----------------------------------

mujoco = pytest.importorskip("mujoco")


def hopper(num_envs: int = 1, **dr) -> EnvConfig:
    return dataclasses.replace(load_env_config("mujoco/hopper"), num_envs=num_envs,
                               randomization=DomainRandomizationConfig(**dr))


def test_mujoco_friction_and_mass_differ_across_resets_within_range():
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    with MujocoLocomotionEnv(hopper(2, friction_scale=(0.5, 1.5), mass_scale=(0.8, 1.2),
                                    camera_fov_range=(-10, 10), light_scale=(0.5, 1.0))) as env:
        m0 = env.models[0]
        nominal = {k: v.copy() for k, v in env._nominal[0].items()}
        factors = []
        for seed in range(8):
            env.reset(seed=seed * 10)
            f = m0.geom_friction / nominal["geom_friction"]
            m = m0.body_mass[1:] / nominal["body_mass"][1:]  # body 0 is the massless world
            assert np.allclose(f, f.flat[0]) and np.allclose(m, m[0])  # one factor per episode
            assert np.allclose(m0.body_inertia[1:] / nominal["body_inertia"][1:], m[0])
            fov = m0.vis.global_.fovy - float(nominal["fovy"])
            light = m0.light_diffuse / nominal["light_diffuse"]
            factors.append((f.flat[0], m[0], fov, light.flat[0]))
        factors = np.array(factors)
        assert (factors[:, 0] >= 0.5).all() and (factors[:, 0] <= 1.5).all()
        assert (factors[:, 1] >= 0.8).all() and (factors[:, 1] <= 1.2).all()
        assert (np.abs(factors[:, 2]) <= 10).all() and (factors[:, 3] >= 0.5).all() and (factors[:, 3] <= 1).all()
        assert all(len(np.unique(factors[:, j])) == 8 for j in range(4))  # every reset draws anew
        # The two envs draw independently, and the same seed draws the same values.
        env.reset(seed=0)
        first = m0.geom_friction.copy()
        assert not np.allclose(env.models[1].geom_friction / nominal["geom_friction"], first / nominal["geom_friction"])
        env.reset(seed=10)
        env.reset(seed=0)
        assert np.array_equal(m0.geom_friction, first)


def test_mujoco_mass_randomization_changes_the_dynamics():
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    def final_state(**dr):
        with MujocoLocomotionEnv(hopper(1, **dr)) as env:
            env.reset(seed=0)
            for _ in range(20):
                obs = env.step(torch.full((1, 3), 0.5))[0]
            return obs["state"]

    assert not torch.allclose(final_state(mass_scale=(2.0, 2.0)), final_state(), atol=1e-3)


def test_mujoco_randomization_off_is_bit_identical_to_the_plain_env():
    import gymnasium as gym

    env = make_env(hopper(1, friction_scale=(1.0, 1.0)))
    assert type(env).__name__ == "MujocoLocomotionEnv"
    raw = gym.make("Hopper-v5")
    with env:
        for seed in (0, 1):
            ref, _ = raw.reset(seed=seed)
            obs = env.reset(seed=seed)["state"][0]
            assert torch.equal(obs, torch.from_numpy(ref).float())
            assert np.array_equal(env.models[0].geom_friction, raw.unwrapped.model.geom_friction)
            assert np.array_equal(env.models[0].body_mass, raw.unwrapped.model.body_mass)
            for t in range(15):
                a = np.full(3, np.sin(t), dtype=np.float32)
                ref, *_ = raw.step(a)
                assert torch.equal(env.step(torch.from_numpy(a)[None])[0]["state"][0], torch.from_numpy(ref).float())


def test_mujoco_refuses_what_it_cannot_randomize():
    with pytest.raises(ValueError, match="object_pos_range"):
        make_env(hopper(1, object_pos_range=0.05))


def test_the_example_preset_declares_randomization():
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    with make_env(load_env_config("mujoco/hopper_dr")) as env:
        assert isinstance(env, RandomizedEnv) and isinstance(env.env, MujocoLocomotionEnv)
        env.reset(seed=0)
        assert env.env.models[0].body_mass[1] != env.env._nominal[0]["body_mass"][1]
        assert 0 <= int(env._latency[0]) <= 2
