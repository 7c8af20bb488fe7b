"""Potential-based shaping (robotft.rl.shaping): the chunk rewards by hand, returns that stay the sparse ones, the
envs it refuses, and learning on the toy suite's normalized dense reward."""

import dataclasses

import pytest
import torch
from toy_fixtures import TOY_NAV2D

from robotft.config import EnvConfig
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.rl.ppo import PPOConfig
from robotft.rl.shaping import PotentialShaping, check_shaping_env

GAMMA = 0.9


def _chunk(last_reward, success, terminated, truncated):
    info = {"last_reward": torch.tensor(last_reward), "success": torch.tensor(success)}
    return info, torch.tensor(terminated), torch.tensor(truncated)


def test_shaped_chunk_rewards_by_hand():
    shaping = PotentialShaping(num_envs=2, gamma=GAMMA, device="cpu")
    # Env 0 reaches states of potential 0.2, then 0.5, then succeeds (terminal, Φ = 0).
    # Env 1 reaches 0.3, then hits the time limit at a state of potential 0.1, then starts over at 0.4.
    steps = [_chunk([0.2, 0.3], [False, False], [False, False], [False, False]),
             _chunk([0.5, 0.1], [False, False], [False, False], [False, True]),
             _chunk([1.7, 0.4], [True, False], [True, False], [False, False])]
    rewards = torch.stack([shaping(*step) for step in steps])
    expected = torch.tensor([[GAMMA * 0.2 - 0.0, GAMMA * 0.3 - 0.0],
                             [GAMMA * 0.5 - 0.2, GAMMA * 0.1 - 0.3],   # a cut episode keeps Φ(s_T)
                             [1.0 + 0.0 - 0.5, GAMMA * 0.4 - 0.0]])    # success earns 1; a new episode starts at Φ = 0
    assert torch.allclose(rewards, expected)
    # The successful episode's discounted return is the sparse one: the shaping terms telescope to 0.
    assert torch.allclose((rewards[:, 0] * GAMMA ** torch.arange(3.0)).sum(), torch.tensor(GAMMA**2))
    shaping.restart()
    assert torch.equal(shaping.potential, torch.zeros(2))


def test_chunked_env_reports_each_envs_last_step_reward():
    cfg = dataclasses.replace(TOY_NAV2D, num_envs=3, reward_mode="normalized_dense")
    chunked, stepwise = ChunkedEnv(make_env(cfg), 1, 3), make_env(cfg)
    chunked.reset(seed=5)
    stepwise.reset(seed=5)
    actions = torch.rand(3, 3, 2) * 2 - 1
    _, reward_sum, _, _, info = chunked.step(actions)
    rewards = torch.stack([stepwise.step(actions[:, t])[1] for t in range(3)])
    assert torch.allclose(info["last_reward"], rewards[-1]) and torch.allclose(reward_sum, rewards.sum(0))
    assert ((rewards > 0) & (rewards < 0.5)).all()  # away from the goal: 0.5 (1 - tanh(distance))


@pytest.mark.parametrize("env_type, reward_mode, ok", [
    ("toy", "normalized_dense", True), ("maniskill", "dense", True), ("maniskill", "normalized_dense", True),
    ("robosuite", "dense", True), ("toy", "dense", False), ("robosuite", "sparse", False), ("mujoco", "dense", False),
])
def test_only_rewards_measured_on_the_state_serve_as_potentials(env_type, reward_mode, ok):
    env = EnvConfig(type=env_type, task="T", reward_mode=reward_mode)
    if ok:
        check_shaping_env(env)
    else:
        with pytest.raises(ValueError, match=f"rl.potential_shaping.*{env_type} T's reward_mode '{reward_mode}'"):
            check_shaping_env(env)


def test_shaping_is_refused_beside_options_that_change_the_same_returns(tmp_path, tiny_sources):
    with pytest.raises(ValueError, match="bootstrap_on_success"):
        PPOConfig(potential_shaping=True, bootstrap_on_success=True)
    with pytest.raises(ValueError, match="potential_shaping"):
        PPOConfig(potential_shaping=True, group_advantages=True)
    cfg = FinetuneConfig(source=str(tiny_sources["gaussian"]), out=str(tmp_path / "run"), algo="ppo",
                         env=dataclasses.replace(TOY_NAV2D, num_envs=2), rl=PPOConfig(potential_shaping=True))
    with pytest.raises(ValueError, match="set env.reward_mode to normalized_dense"):
        run_finetune(cfg)
    with pytest.raises(ValueError, match="potential_shaping.*off-policy core"):
        run_finetune(dataclasses.replace(cfg, algo="filtered_bc"))
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_potential_shaping_raises_success_on_toy_where_the_dense_reward_itself_does_not(
        tmp_path, weak_gaussian_bc, toy_success, toy_finetune):
    """Gaussian PPO on the sparse success shaped by the normalized dense reward beats a weak Gaussian BC; the same
    dense reward used as it is pays for lingering near the goal (0.5 per step there, 1 once at success)."""
    before = toy_success(weak_gaussian_bc)
    after = {}
    for shaped in (True, False):
        rl = PPOConfig(iterations=15, steps_per_iter=10, minibatch_size=100, update_epochs=10, actor_lr=3e-4,
                       clip_eps=0.2, potential_shaping=shaped)
        run = toy_finetune(weak_gaussian_bc, tmp_path / f"shaped_{shaped}", "ppo", rl,
                           env_fields={"reward_mode": "normalized_dense"})
        after[shaped] = toy_success(run)
    assert after[True] > before + 0.15, f"shaped PPO should improve on BC: {before:.2f} -> {after[True]:.2f}"
    assert after[True] > after[False] + 0.15, f"shaping should beat the raw dense reward: {after}"
