"""PPO core mechanics on the toy env with a tiny diffusion policy under DPPO."""

import copy

import numpy as np
import pytest
import torch

from robotft.config import EnvConfig
from robotft.datasets.normalizer import Normalizer
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.finetune import kl_stop_message
from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig
from robotft.rl.critic import ValueCritic
from robotft.rl.dppo import DPPO, DPPOConfig
from robotft.rl.ppo import PPO, PPOConfig, cosine_with_warmup


def _setup(reward_mode: str = "dense", **ppo_kwargs):
    torch.manual_seed(0)
    env = make_env(EnvConfig(type="toy", task="nav2d", num_envs=8, max_episode_steps=40, control_mode="velocity_2d",
                             reward_mode=reward_mode))
    norm = Normalizer.fit({"state": np.random.uniform(-1, 1, (100, 4)), "action": np.random.uniform(-1, 1, (100, 2))},
                          {"state": "minmax", "action": "minmax"})
    cfg = DiffusionPolicyConfig(type="diffusion_mlp", obs_steps=1, horizon_steps=4, act_steps=2, hidden_dims=(32, 32),
                                num_train_timesteps=5)
    policy = DiffusionPolicy(cfg, env.spec, norm)
    algo = DPPO(policy, DPPOConfig(ft_denoising_steps=3))
    critic = ValueCritic(["state"], 4, norm, hidden_dims=(32,))
    chunked = ChunkedEnv(env, 1, 2)
    return PPO(algo, critic, chunked, PPOConfig(steps_per_iter=6, minibatch_size=16, **ppo_kwargs)), policy


def test_rollout_buffer_shapes_and_env_steps():
    ppo, policy = _setup()
    buf, next_value, stats = ppo.collect()
    assert buf.samples["chain"].shape == (6, 8, 4, 4, 2)  # [T, B, K+1, H, A]
    assert buf.logprobs.shape == (6, 8, 3) and next_value.shape == (8,)
    assert stats.env_steps == 6 * 8 * 2 == ppo.env_steps


def test_critic_warmup_leaves_actor_untouched_then_actor_trains():
    ppo, policy = _setup(critic_warmup_iters=1, update_epochs=2, actor_lr=1e-2)
    ft_before = copy.deepcopy(policy.ft_net.state_dict())
    critic_before = copy.deepcopy(ppo.critic.state_dict())
    metrics = ppo.update(*ppo.collect()[:2])
    assert metrics["actor_trained"] == 0.0
    assert all(torch.equal(v, policy.ft_net.state_dict()[k]) for k, v in ft_before.items())
    assert any(not torch.equal(v, ppo.critic.state_dict()[k]) for k, v in critic_before.items())
    metrics = ppo.update(*ppo.collect()[:2])
    assert metrics["actor_trained"] == 1.0 and "approx_kl" in metrics
    assert any(not torch.equal(v, policy.ft_net.state_dict()[k]) for k, v in ft_before.items())
    frozen = policy.net.state_dict()
    assert all(torch.equal(frozen[k], v) for k, v in ft_before.items()), "the pretrained net must stay frozen"


def test_kl_early_stop_stops_the_epoch_loop():
    ppo, _ = _setup(critic_warmup_iters=0, update_epochs=50, target_kl=1e-12, actor_lr=1e-2)
    ppo.update(*ppo.collect()[:2])  # first update moves the policy away from the rollout's
    metrics = ppo.update(*ppo.collect()[:2])
    assert metrics["kl_early_stop"] == 1.0
    # The stopping minibatch takes no step; its KL, above the limit, is what the log shows as the reason.
    assert metrics["stop_kl"] > 1e-12
    assert metrics["actor_steps"] < 50 * 3


def test_actor_steps_counts_every_minibatch_step_without_a_stop():
    ppo, _ = _setup(critic_warmup_iters=0, update_epochs=2, target_kl=0.0)
    metrics = ppo.update(*ppo.collect()[:2])  # 6 steps x 8 envs = 48 chunks, minibatches of 16
    assert metrics["actor_steps"] == 2 * 3 and metrics["kl_early_stop"] == 0.0 and "stop_kl" not in metrics
    assert kl_stop_message(1, metrics, ppo.cfg) is None


def test_an_update_stopped_after_one_step_warns_and_names_the_learning_rate():
    """One step at a large learning rate already passes the KL limit: the rest of the rollout goes unused."""
    ppo, _ = _setup(critic_warmup_iters=0, update_epochs=4, target_kl=1e-6, actor_lr=0.5)
    metrics = ppo.update(*ppo.collect()[:2])
    assert metrics["kl_early_stop"] == 1.0 and metrics["actor_steps"] <= 1
    message = kl_stop_message(7, metrics, ppo.cfg)
    assert message is not None and "iteration 7" in message and "rl.actor_lr 0.5" in message
    assert "rl.target_kl 1e-06" in message


@pytest.mark.parametrize("clip_value", [0.0, 0.1])
def test_value_loss_clipping(clip_value):
    ppo, _ = _setup(clip_value=clip_value)
    obs = {"state": torch.zeros(4, 1, 4)}
    with torch.no_grad():
        v = ppo.critic(obs)
    returns = v + 1.0
    old = v - 0.5  # the old value is far below: clipping limits how far V may move from it
    loss = ppo._value_loss(obs, returns, old)
    unclipped = 0.5 * ((v - returns) ** 2).mean()
    if clip_value == 0:
        assert torch.allclose(loss, unclipped)
    else:
        clipped = 0.5 * ((old + 0.1 - returns) ** 2).mean()  # V - old = 0.5 is clipped to 0.1
        assert torch.allclose(loss, torch.max(unclipped, clipped))


def test_state_dict_round_trip_resumes_counters():
    ppo, _ = _setup(critic_warmup_iters=0)
    ppo.update(*ppo.collect()[:2])
    state = ppo.state_dict()
    fresh, _ = _setup(critic_warmup_iters=0)
    fresh.algo.policy.load_state_dict(ppo.algo.policy.state_dict())
    fresh.load_state_dict(state)
    assert fresh.iteration == 1 and fresh.env_steps == ppo.env_steps
    for k, v in ppo.critic.state_dict().items():
        assert torch.equal(v, fresh.critic.state_dict()[k])


def test_a_rollout_without_learning_signal_does_not_move_the_actor():
    """Sparse reward, never reached: the normalized advantages would be the critic's noise at unit scale."""
    ppo, policy = _setup(reward_mode="sparse", critic_warmup_iters=0, actor_lr=1e-2)
    buf, next_value, stats = ppo.collect()
    assert stats.successes == 0 and not stats.signal, "precondition: an untrained policy never reaches the goal"
    ft_before = copy.deepcopy(policy.ft_net.state_dict())
    metrics = ppo.update(buf, next_value, signal=stats.signal)
    assert metrics["actor_skipped_no_signal"] == 1.0 and metrics["actor_trained"] == 0.0
    assert all(torch.equal(v, policy.ft_net.state_dict()[k]) for k, v in ft_before.items())

    ppo_off, policy_off = _setup(reward_mode="sparse", critic_warmup_iters=0, actor_lr=1e-2, skip_no_signal=False)
    buf, next_value, stats = ppo_off.collect()
    ft_before = copy.deepcopy(policy_off.ft_net.state_dict())
    ppo_off.update(buf, next_value, signal=stats.signal)  # the old behaviour: noise moves the policy
    assert any(not torch.equal(v, policy_off.ft_net.state_dict()[k]) for k, v in ft_before.items())


def test_a_dense_reward_is_a_signal_even_without_success():
    ppo, _ = _setup(reward_mode="dense")
    assert ppo.collect()[2].signal


def test_reward_clip_bounds_the_stored_rewards():
    ppo, _ = _setup(reward_mode="dense", reward_clip=1e-3)
    buf, _, _ = ppo.collect()  # 6 chunks of 2 steps: no episode reaches its 40-step limit, nothing bootstrapped
    assert buf.rewards.abs().max() <= 1e-3 and buf.rewards.abs().max() > 0


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    lrs = [cosine_with_warmup(i, 10, 2, 1.0, 0.1) for i in range(11)]
    assert lrs[0] == pytest.approx(1 / 3) and lrs[1] == pytest.approx(2 / 3) and lrs[2] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:], strict=False))
    # The last iteration (9) still learns above the floor, reached one iteration later.
    assert lrs[9] > 0.1 and lrs[10] == pytest.approx(0.1)
    ppo, _ = _setup(critic_warmup_iters=0, lr_schedule="cosine", iterations=4, actor_lr=1e-3, actor_min_lr=1e-4,
                    critic_lr=1e-2, critic_min_lr=1e-3)
    seen = []
    for _ in range(4):
        metrics = ppo.update(*ppo.collect()[:2])
        seen.append((metrics["actor_lr"], ppo.actor_opt.param_groups[0]["lr"], ppo.critic_opt.param_groups[0]["lr"]))
    last = (cosine_with_warmup(3, 4, 0, 1e-3, 1e-4), cosine_with_warmup(3, 4, 0, 1e-2, 1e-3))
    assert seen[0][:2] == (1e-3, 1e-3) and seen[-1][0] == pytest.approx(last[0]) and seen[-1][2] == pytest.approx(last[1])
    assert 1e-4 < seen[-1][0] < seen[-2][0]
