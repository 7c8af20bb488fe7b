"""Residual PPO: the likelihood used in the loss, the critic's base-action input, which parameters train,
and that fine-tuning learns."""


import numpy as np
import pytest
import torch

from robotft.config import EnvConfig
from robotft.datasets.normalizer import Normalizer
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.policies.gaussian import GaussianPolicy, GaussianPolicyConfig
from robotft.policies.residual import ResidualPolicy, ResidualPolicyConfig
from robotft.rl.critic import ValueCritic
from robotft.rl.ppo import PPO, PPOConfig
from robotft.rl.residual_ppo import ResidualPPO, ResidualPPOConfig, ResidualPPOStep
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec


def _policy(spec: EnvSpec | None = None, state_dim: int = 3) -> ResidualPolicy:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    spec = spec or EnvSpec(
        observations={"state": FeatureSpec("state", (state_dim,), "float32")},
        action=ActionSpec("test", 2, (-1.0, -1.0), (1.0, 1.0)),
    )
    norm = Normalizer.fit(
        {"state": rng.normal(size=(50, state_dim)), "action": rng.uniform(-1, 1, (50, 2))},
        {"state": "meanstd", "action": "minmax"},
    )
    base = GaussianPolicy(GaussianPolicyConfig(obs_steps=1, horizon_steps=4, act_steps=2, hidden_dims=(16,)),
                          spec, norm)
    cfg = ResidualPolicyConfig(base_checkpoint="(built in the test)", obs_steps=1, horizon_steps=4, act_steps=2,
                               hidden_dims=(16,))
    policy = ResidualPolicy(cfg, spec, norm, base)
    torch.nn.init.normal_(policy.residual_net[-1].weight, std=0.1)  # a non-trivial residual mean
    return policy


def test_logprob_equals_torch_distributions_and_critic_sees_the_base_action():
    policy = _policy()
    algo = ResidualPPO(policy, ResidualPPOConfig())
    obs = {"state": torch.randn(5, 1, 3)}
    out = algo.act(obs)
    base, residual = out.sample["base_action"], out.sample["residual"]
    assert torch.allclose(base, policy.base.predict_chunk(obs, deterministic=True))

    cond = policy.normalizer.normalize("state", obs["state"]).reshape(5, 1, -1).expand(-1, 4, -1)
    inputs = torch.cat([cond, torch.eye(4).expand(5, -1, -1), policy.normalizer.normalize("action", base)], dim=-1)
    dist = torch.distributions.Normal(policy.residual_net(inputs), policy.std())
    assert torch.allclose(out.logprob[:, 0], dist.log_prob(residual)[:, :2].sum(dim=(1, 2)), atol=1e-5)
    expected_actions = (base + policy.normalizer.scale["action"] * residual).clamp(-1, 1)
    assert torch.allclose(out.actions, expected_actions, atol=1e-6)

    extra = algo.critic_extra(obs, out.sample)
    assert extra.shape == (5, algo.critic_extra_dim) == (5, 8)
    assert torch.allclose(extra, policy.normalizer.normalize("action", base).flatten(1))
    assert torch.allclose(algo.critic_extra(obs, None), extra)  # the base is deterministic here


def test_gradients_reach_only_the_residual():
    policy = _policy()
    algo = ResidualPPO(policy, ResidualPPOConfig(ent_coef=0.1))
    obs = {"state": torch.randn(6, 1, 3)}
    sample = algo.act(obs).sample
    (-algo.logprob(obs, sample).mean() + algo.extra_loss(obs, sample)[0]).backward()
    assert all(p.grad is None for p in policy.base.parameters())
    trained = list(policy.residual_net.parameters()) + list(policy.log_std.parameters())
    assert {id(p) for p in algo.actor_parameters()} == {id(p) for p in trained}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)


def test_ppo_core_feeds_the_critic_the_base_action():
    """The core calls V(obs, critic_extra(obs, sample)) in rollouts, bootstraps and the value loss."""
    env = make_env(EnvConfig(type="toy", task="nav2d", num_envs=4, max_episode_steps=6, control_mode="velocity_2d"))
    policy = _policy(env.spec, state_dim=4)
    algo = ResidualPPO(policy, ResidualPPOConfig())
    critic = ValueCritic(["state"], 4, policy.normalizer, hidden_dims=(16,), extra_dim=algo.critic_extra_dim)
    seen = []
    critic.register_forward_pre_hook(lambda module, args: seen.append(args[1] is not None))
    ppo = PPO(algo, critic, ChunkedEnv(env, 1, 2), PPOConfig(steps_per_iter=4, minibatch_size=8, update_epochs=1))
    buf, next_value, _ = ppo.collect()  # episodes of 3 chunks: one truncation bootstrap per env
    ppo.update(buf, next_value)
    assert len(seen) > 4 + 1 + 2 and all(seen)


def test_a_plain_bc_policy_is_wrapped_in_a_zero_residual_that_acts_like_it():
    """`finetune --algo residual_ppo --from BC` needs no residual checkpoint: the algorithm wraps the base."""
    base = _policy().base
    algo = ResidualPPO(base, ResidualPPOConfig(residual_hidden=(16,), log_std_init=-3.0))
    assert isinstance(algo.policy, ResidualPolicy) and algo.policy.base is base
    assert torch.allclose(algo.policy.std(), torch.full_like(algo.policy.std(), np.exp(-3.0)))
    obs = {"state": torch.randn(5, 1, 3)}
    out = algo.act(obs, deterministic=True)
    assert torch.equal(out.actions, base.predict_chunk(obs, deterministic=True))
    assert not any(p.requires_grad for p in algo.policy.base.parameters())


def test_pretrain_then_residual_ppo_raises_success_on_toy(tmp_path, weak_gaussian_bc, toy_pretrain, toy_success,
                                                          toy_finetune):
    """A weak Gaussian BC base → a zero-initialised residual on it → residual PPO must beat the base beyond
    evaluation noise."""
    # The residual's checkpoint: the zero-initialised residual (lr 0 in its one step), base = the BC policy.
    preset = tmp_path / "residual.yaml"
    preset.write_text(f"type: residual\nbase_checkpoint: {weak_gaussian_bc}\nobs_steps: 1\nhorizon_steps: 8\n"
                      "act_steps: 4\nhidden_dims: [64, 64]\n")
    res = toy_pretrain(tmp_path / "res", preset, 1, "--train.lr", "0", "--train.batch_size", "128")
    before = toy_success(res)
    assert abs(before - toy_success(weak_gaussian_bc)) < 1e-9, "a zero residual must evaluate like its base"
    ft = toy_finetune(res, tmp_path / "residual_ppo", "residual_ppo",
                      PPOConfig(iterations=20, steps_per_iter=10, minibatch_size=100, update_epochs=10,
                                actor_lr=3e-4, clip_eps=0.2))
    after = toy_success(ft)
    assert before > 0.1, f"the BC base should beat a policy that never reaches the goal, got {before:.2f}"
    assert after > before + 0.15, f"residual PPO should improve on its base: {before:.2f} -> {after:.2f}"


def _closed_loop(num_envs: int = 3):
    """A closed-loop residual (non-zero residual mean) over a Gaussian base that plans 8 and executes 4, and a
    nav2d env config for it."""
    env_cfg = EnvConfig(type="toy", task="nav2d", num_envs=num_envs, max_episode_steps=20, control_mode="velocity_2d")
    spec = make_env(env_cfg).spec
    torch.manual_seed(0)
    norm = Normalizer.fit({"state": np.random.default_rng(0).normal(size=(50, 4)),
                           "action": np.random.default_rng(1).uniform(-1, 1, (50, 2))},
                          {"state": "meanstd", "action": "minmax"})
    base = GaussianPolicy(GaussianPolicyConfig(obs_steps=2, horizon_steps=8, act_steps=4, hidden_dims=(16,)), spec, norm)
    algo = ResidualPPOStep(base, ResidualPPOConfig(residual_hidden=(16,), log_std_init=-3.0))
    return algo, env_cfg


def test_a_zero_closed_loop_residual_executes_its_base_open_loop_step_for_step():
    """residual_ppo_step wraps a base in a per-step residual: the base's plan comes from the env's plan anchor,
    so with a zero residual the closed loop replays the base's open-loop chunks exactly, through episode ends,
    while the same policy also serves another env in between (evaluation during training)."""
    algo, env_cfg = _closed_loop()
    policy, base = algo.policy, algo.policy.base
    assert policy.config.closed_loop and policy.config.plan_every == 4
    assert (policy.config.horizon_steps, policy.config.act_steps) == (1, 1) and algo.critic_extra_dim == 4 * 2 + 4
    chunked_open = ChunkedEnv.for_policy(make_env(env_cfg), base.config)
    chunked_closed = ChunkedEnv.for_policy(make_env(env_cfg), policy.config)
    other = ChunkedEnv.for_policy(make_env(env_cfg), policy.config)
    obs_open, obs_closed, obs_other = chunked_open.reset(seed=3), chunked_closed.reset(seed=3), other.reset(seed=9)
    low, high = policy.action_low, policy.action_high
    for _ in range(8):  # 32 steps: every env ends an episode (20 steps) and starts another
        chunk = base.predict_chunk(obs_open).clamp(low, high)
        obs_open, *_ = chunked_open.step(chunk)
        for k in range(4):
            action = policy.predict_chunk(obs_closed)
            assert action.shape == (3, 1, 2)
            assert torch.equal(action[:, 0], chunk[:, k])
            obs_closed, *_ = chunked_closed.step(action)
            obs_other, *_ = other.step(policy.predict_chunk(obs_other))
        assert torch.equal(obs_closed["state"], obs_open["state"])


def test_the_closed_loop_residual_scores_one_step_from_the_current_observation():
    algo, env_cfg = _closed_loop()
    policy = algo.policy
    torch.nn.init.normal_(policy.residual_net[-1].weight, std=0.1)
    obs = ChunkedEnv.for_policy(make_env(env_cfg), policy.config).reset(seed=0)
    for _ in range(2):  # plan step 2
        obs = {k: v for k, v in obs.items()}
        obs["plan_step"] = obs["plan_step"] + 1
    out = algo.act(obs)
    base, residual = out.sample["base_action"], out.sample["residual"]
    plan = policy.base.predict_chunk({"state": obs["plan/state"]}).clamp(policy.action_low, policy.action_high)
    torch.testing.assert_close(base[:, 0], plan[:, 2], rtol=0, atol=1e-6)
    cond = policy.normalizer.normalize("state", obs["state"]).reshape(3, -1)
    inputs = torch.cat([cond, torch.eye(4)[2].expand(3, -1), policy.normalizer.normalize("action", base[:, 0])], -1)
    dist = torch.distributions.Normal(policy.residual_net(inputs), policy.std())
    assert torch.allclose(out.logprob[:, 0], dist.log_prob(residual[:, 0]).sum(-1), atol=1e-5)
    # The critic sees the base's whole plan (what it will execute whatever it observes) and the step in it.
    extra = algo.critic_extra(obs, out.sample)
    torch.testing.assert_close(extra[:, :8], policy.normalizer.normalize("action", plan[:, :4]).flatten(1))
    assert extra[:, 8:].tolist() == [[0.0, 0.0, 1.0, 0.0]] * 3
    torch.testing.assert_close(algo.critic_extra(obs, None), extra)
    with pytest.raises(KeyError, match="plan anchors"):
        algo.act({"state": obs["state"]})
    with pytest.raises(ValueError, match="closed-loop residual"):
        ResidualPPOStep(_policy(), ResidualPPOConfig())


def test_pretrain_then_closed_loop_residual_ppo_raises_success_on_toy(tmp_path, weak_gaussian_bc, toy_success,
                                                                      toy_finetune):
    """The closed loop learns as the open loop does (the budget above in env steps), and its checkpoint evaluates
    with no flags: the evaluation env carries the plan anchors its config asks for."""
    before = toy_success(weak_gaussian_bc)
    ft = toy_finetune(weak_gaussian_bc, tmp_path / "residual_ppo_step", "residual_ppo_step",
                      PPOConfig(iterations=20, steps_per_iter=40, num_minibatches=10, update_epochs=10,
                                actor_lr=3e-4, clip_eps=0.2, gamma=0.99 ** 0.25, gae_lambda=0.95 ** 0.25),
                      residual_ppo_step=ResidualPPOConfig(residual_hidden=(64, 64), log_std_init=-2.0))
    after = toy_success(ft)
    assert after > before + 0.15, f"closed-loop residual PPO should improve on its base: {before:.2f} -> {after:.2f}"
