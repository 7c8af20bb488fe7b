"""PPO core options: group-relative (critic-free) advantages, the dual-clip surrogate and per-entry ratios."""

import copy

import numpy as np
import pytest
import torch

from robotft.config import EnvConfig
from robotft.datasets.normalizer import Normalizer
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.envs.start_states import fresh_start_seed
from robotft.policies.gaussian import GaussianPolicy, GaussianPolicyConfig
from robotft.rl.critic import ValueCritic
from robotft.rl.gaussian_ppo import GaussianPPO, GaussianPPOConfig
from robotft.rl.ppo import PPO, PPOConfig, group_relative_advantages


def _ppo(**ppo_kwargs) -> PPO:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    env = make_env(EnvConfig(type="toy", task="nav2d", num_envs=8, max_episode_steps=8, control_mode="velocity_2d",
                             reward_mode="dense"))
    norm = Normalizer.fit({"state": rng.uniform(-1, 1, (100, 4)), "action": rng.uniform(-1, 1, (100, 2))},
                          {"state": "minmax", "action": "minmax"})
    policy = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(16,)), env.spec, norm)
    critic = ValueCritic(["state"], 4, norm, hidden_dims=(16,))
    cfg = PPOConfig(steps_per_iter=6, minibatch_size=16, **ppo_kwargs)
    return PPO(GaussianPPO(policy, GaussianPPOConfig()), critic, ChunkedEnv(env, 1, 2), cfg)


def test_group_relative_advantages_by_hand():
    # env 0: episodes [1, 2] (R=3) and [4] (R=4), then [5] unfinished; env 1: [0, 0, 2] (R=2), then [1] unfinished.
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [4.0, 2.0], [5.0, 1.0]])
    dones = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    returns = torch.tensor([3.0, 4.0, 2.0])
    z = (returns - returns.mean()) / (returns.std() + 1e-8)
    expected = torch.tensor([[z[0], z[2]], [z[0], z[2]], [z[1], z[2]], [0.0, 0.0]])
    assert torch.allclose(group_relative_advantages(rewards, dones), expected)
    assert torch.equal(group_relative_advantages(rewards, torch.zeros_like(dones)), torch.zeros_like(rewards))


def test_per_start_state_group_advantages_by_hand():
    # Start state 7: episodes of returns 1 and 0 (one in each env); start state 8: two successes (equal returns);
    # start state 9: one episode alone; env 3's last chunk is an unfinished episode.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    dones = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    groups = torch.tensor([[-1, -1, -1, -1], [7, 7, 8, 8], [-1, -1, 9, -1]])
    z = (1.0 - 0.5) / (torch.tensor([1.0, 0.0]).std() + 1e-8)
    expected = torch.tensor([[z, -z, 0.0, 0.0], [z, -z, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(group_relative_advantages(rewards, dones, groups=groups), expected)


def test_start_state_groups_share_start_states_and_train_on_mixed_outcomes_only():
    ppo = _ppo(group_advantages=True, group_size=4, update_epochs=1, actor_lr=1e-2)
    buf, next_value, _ = ppo.collect()  # 6 chunks of 2 steps, episodes of 8 steps: each env ends one episode
    first = buf.obs["state"][0, :, 0]
    assert torch.equal(first[:4], first[:1].expand(4, -1)) and torch.equal(first[4:], first[4:5].expand(4, -1))
    assert not torch.equal(first[0], first[4])
    seeds = buf.start_seeds[3]  # the 8-step episodes end with the 4th chunk
    assert buf.dones[3].all() and len(set(seeds[:4].tolist())) == 1 and len(set(seeds[4:].tolist())) == 1
    advantages = group_relative_advantages(buf.rewards, buf.dones, groups=buf.start_seeds)
    assert advantages[:4].ne(0).all() and advantages[4:].eq(0).all()  # the dense returns differ within a group
    metrics = ppo.update(buf, next_value)
    assert metrics["informative_fraction"] == pytest.approx(4 / 6) and metrics["actor_trained"] == 1.0
    # Equal outcomes within every group (e.g. all failed under a sparse reward): nothing to learn, no step.
    buf, next_value, _ = ppo.collect()
    buf.rewards.zero_()
    actor_before = copy.deepcopy(ppo.algo.policy.state_dict())
    metrics = ppo.update(buf, next_value, signal=True)
    assert metrics["informative_fraction"] == 0.0 and metrics["actor_skipped_no_signal"] == 1.0
    assert all(torch.equal(v, ppo.algo.policy.state_dict()[k]) for k, v in actor_before.items())


def test_the_skip_message_says_whether_the_rollout_or_its_groups_lacked_a_signal():
    from robotft.finetune import no_signal_message

    assert "no success and a constant reward" in no_signal_message(3, rollout_signal=False)
    assert "group of episodes had equal returns (rl.group_size)" in no_signal_message(3, rollout_signal=True)


def test_start_state_groups_are_refused_where_they_cannot_share_a_start_state():
    with pytest.raises(ValueError, match="group_size must be >= 0 and needs rl.group_advantages"):
        PPOConfig(group_size=2)
    with pytest.raises(ValueError, match="group_size 3 must divide env.num_envs 8"):
        _ppo(group_advantages=True, group_size=3)


def test_group_advantages_train_the_actor_without_the_critic():
    ppo = _ppo(group_advantages=True, critic_warmup_iters=3, update_epochs=2, actor_lr=1e-2)
    actor_before = copy.deepcopy(ppo.algo.policy.state_dict())
    critic_before = copy.deepcopy(ppo.critic.state_dict())
    buf, next_value, stats = ppo.collect()  # 6 chunks of 2 steps, episodes of 8 steps: 8 finished episodes
    assert stats.episodes == 8
    metrics = ppo.update(buf, next_value)
    assert metrics["actor_trained"] == 1.0 and "value_loss" not in metrics
    assert all(torch.equal(v, ppo.critic.state_dict()[k]) for k, v in critic_before.items())
    assert any(not torch.equal(v, ppo.algo.policy.state_dict()[k]) for k, v in actor_before.items())
    first_obs = buf.obs["state"][0].clone()
    buf, _, _ = ppo.collect()  # every iteration starts from fresh resets
    assert not torch.equal(buf.obs["state"][0], first_obs)
    assert torch.equal(buf.obs["state"][0], ppo.env.reset(seed=fresh_start_seed(ppo.seed, ppo.iteration))["state"])


def test_group_advantages_reject_scaled_or_bootstrapped_rewards():
    with pytest.raises(ValueError, match="group_advantages"):
        PPOConfig(group_advantages=True, reward_scale=True)


class _Fixed:
    """An algorithm stand-in whose log-probability is a parameter, to set the ratio directly."""

    def __init__(self, logp: torch.Tensor):
        self.logp = logp

    def logprob(self, obs, sample):
        return self.logp


@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
def test_dual_clip_bounds_the_loss_of_negative_advantages(dual_clip):
    ppo = _ppo(dual_clip=dual_clip, clip_eps=0.2, norm_adv=False)
    ratio = torch.tensor([[10.0], [10.0], [0.5], [1.1]])
    adv = torch.tensor([-1.0, 2.0, -1.0, -1.0])
    new_logp = ratio.log().requires_grad_(True)
    ppo.algo = _Fixed(new_logp)
    loss, _, _ = ppo._policy_loss({}, {}, torch.zeros(4, 1), adv, torch.ones(1), torch.tensor([0.2]))
    # Standard clipped terms max(-A r, -A clip(r, 0.8, 1.2)): 10, -2.4, 0.8, 1.1.
    expected = torch.tensor([10.0, -2.4, 0.8, 1.1])
    if dual_clip:
        expected[0] = 3.0  # A < 0: capped at -c A
    assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-5)
    loss.backward()
    assert (new_logp.grad[0, 0] == 0) == bool(dual_clip), "the capped entry must pass no gradient"


def test_per_entry_ratios_clip_a_shift_that_the_mean_log_ratio_hides():
    """`rl.logprob_reduction none`: a coherent shift δ = 0.5 s of a Gaussian mean over 64 entries moves each
    entry's log-ratio by δ ε - δ²/2 (most beyond a 0.2 clip), their mean only by -δ²/2 ± δ/8."""
    ppo = _ppo(clip_eps=0.2, norm_adv=False)
    torch.manual_seed(1)
    eps = torch.randn(256, 64)
    per_entry = 0.5 * eps - 0.5**2 / 2
    adv = torch.randn(256)
    ppo.algo = _Fixed(per_entry)
    _, _, each = ppo._policy_loss({}, {}, torch.zeros(256, 64), adv, torch.ones(1), torch.tensor([0.2]))
    ppo.algo = _Fixed(per_entry.mean(dim=1, keepdim=True))
    _, _, mean = ppo._policy_loss({}, {}, torch.zeros(256, 1), adv, torch.ones(1), torch.tensor([0.2]))
    assert each["clip_fraction"] > 0.6 and mean["clip_fraction"] < 0.1, (each, mean)


def test_per_entry_ratios_repeat_each_transitions_weight_and_clip():
    """K = 2 transitions of 3 entries each ([N, K · E], transition-major): entry columns take their transition's
    advantage weight and clip range."""
    ppo = _ppo(norm_adv=False)
    logratio = torch.tensor([[0.0, 0.0, 0.0, 0.15, 0.15, 0.15]])
    ppo.algo = _Fixed(logratio)
    _, _, m = ppo._policy_loss({}, {}, torch.zeros(1, 6), torch.ones(1), torch.tensor([1.0, 0.5]),
                               torch.tensor([0.2, 0.1]))
    assert m["clip_fraction"] == pytest.approx(0.5), "only the second transition's entries exceed their 0.1 clip"


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        PPOConfig(dual_clip=0.5)


def test_group_advantages_raise_success_on_toy(tmp_path, weak_gaussian_bc, toy_success, toy_finetune):
    """Critic-free: Gaussian PPO with group-relative advantages must beat a weak Gaussian BC on the toy task."""
    before = toy_success(weak_gaussian_bc)
    ft = toy_finetune(weak_gaussian_bc, tmp_path / "grpo", "ppo",  # 10 chunks per env = one 40-step episode
                      PPOConfig(iterations=20, steps_per_iter=10, minibatch_size=100, update_epochs=10,
                                actor_lr=3e-4, clip_eps=0.2, group_advantages=True))
    after = toy_success(ft)
    assert before > 0.1, f"BC should beat a policy that never reaches the goal, got {before:.2f}"
    assert after > before + 0.15, f"group-relative PPO should improve on BC: {before:.2f} -> {after:.2f}"


def test_start_state_groups_raise_success_on_toy(tmp_path, weak_gaussian_bc, toy_success, toy_finetune):
    """Groups of 5 envs per start state (10 groups of the 50 envs): critic-free PPO beats the weak BC."""
    before = toy_success(weak_gaussian_bc)
    ft = toy_finetune(weak_gaussian_bc, tmp_path / "grpo_groups", "ppo",
                      PPOConfig(iterations=20, steps_per_iter=10, minibatch_size=100, update_epochs=10,
                                actor_lr=3e-4, clip_eps=0.2, group_advantages=True, group_size=5))
    after = toy_success(ft)
    assert after > before + 0.15, f"per-start-state group PPO should improve on BC: {before:.2f} -> {after:.2f}"
