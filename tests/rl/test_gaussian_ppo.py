"""Gaussian PPO: the likelihood used in the loss, which parameters train, and that fine-tuning learns."""


import pytest
import torch
from tiny_specs import tiny_spec_and_normalizer

from robotft.policies.gaussian import GaussianPolicy, GaussianPolicyConfig
from robotft.rl.gaussian_ppo import GaussianPPO, GaussianPPOConfig


def _policy() -> GaussianPolicy:
    torch.manual_seed(0)
    spec, norm = tiny_spec_and_normalizer()
    cfg = GaussianPolicyConfig(obs_steps=2, horizon_steps=4, act_steps=2, hidden_dims=(32,))
    return GaussianPolicy(cfg, spec, norm)


def test_logprob_and_entropy_equal_torch_distributions():
    policy = _policy()
    algo = GaussianPPO(policy, GaussianPPOConfig(ent_coef=0.1))
    obs = {"state": torch.randn(5, 2, 3)}
    out = algo.act(obs)
    chunk = out.sample["action"]
    assert out.logprob.shape == (5, 1) and out.actions.shape == (5, 4, 2)

    cond = policy.normalizer.normalize("state", obs["state"]).reshape(5, -1)
    dist = torch.distributions.Normal(policy.mean_net(cond).view(5, 4, 2), policy.std())
    executed = dist.log_prob(chunk)[:, :2]  # the executed act_steps only
    assert torch.allclose(out.logprob[:, 0], executed.mean(dim=(1, 2)), atol=1e-5)  # the default, DPPO's
    algo.logprob_reduction = "sum"  # the exact joint density (`--rl.logprob_reduction sum`)
    assert torch.allclose(algo.logprob(obs, out.sample)[:, 0], executed.sum(dim=(1, 2)), atol=1e-5)
    loss, metrics = algo.extra_loss(obs, out.sample)
    entropy = dist.entropy()[:, :2].sum(dim=(1, 2)).mean()
    assert torch.allclose(loss, -0.1 * entropy, atol=1e-5)
    assert metrics["entropy"] == pytest.approx(entropy.item(), rel=1e-5)


def test_deterministic_act_is_the_mean():
    policy = _policy()
    obs = {"state": torch.randn(3, 2, 3)}
    out = GaussianPPO(policy, GaussianPPOConfig()).act(obs, deterministic=True)
    assert torch.allclose(out.actions, policy.predict_chunk(obs, deterministic=True))


def test_gradients_reach_mean_and_log_std():
    policy = _policy()
    algo = GaussianPPO(policy, GaussianPPOConfig(ent_coef=0.1))
    obs = {"state": torch.randn(6, 2, 3)}
    sample = algo.act(obs).sample
    (-algo.logprob(obs, sample).mean() + algo.extra_loss(obs, sample)[0]).backward()
    assert {id(p) for p in algo.actor_parameters()} == {id(p) for p in policy.parameters()}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


def test_pretrain_then_ppo_raises_success_on_toy(tmp_path, weak_gaussian_bc, toy_success, toy_finetune):
    """A weak Gaussian BC → PPO must beat BC beyond evaluation noise."""
    before = toy_success(weak_gaussian_bc)
    ft = toy_finetune(weak_gaussian_bc, tmp_path / "ppo", "ppo",
                      {"iterations": 20, "steps_per_iter": 10, "minibatch_size": 100})  # PPO's defaults
    after = toy_success(ft)
    assert before > 0.1, f"BC should beat a policy that never reaches the goal, got {before:.2f}"
    assert after > before + 0.15, f"PPO should improve on BC: {before:.2f} -> {after:.2f}"


def test_cli_finetunes_a_freshly_initialised_policy(tmp_path):
    """From scratch: `pretrain --steps 1 --train.lr 0` writes the initial weights (and the normalizer), then
    `finetune --algo ppo` with a `--ppo.*` override runs on it and writes a checkpoint."""
    from robotft.checkpoint import load_policy
    from robotft.cli import main

    demos, init, ft = tmp_path / "demos.zarr", tmp_path / "init", tmp_path / "ppo"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "5", "--out", str(demos)]) == 0
    torch.manual_seed(0)
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--data", str(demos), "--steps", "1",
                 "--out", str(init), "--policy.hidden_dims", "16", "--train.lr", "0", "--train.eval_episodes", "0"]) == 0
    policy, _ = load_policy(init)
    torch.manual_seed(0)
    fresh = GaussianPolicy(policy.config, policy.spec, policy.normalizer)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in policy.state_dict().items())
    assert main(["finetune", "--from", str(init), "--algo", "ppo", "--out", str(ft), "--iterations", "2",
                 "--ppo.ent_coef", "0.01", "--rl.steps_per_iter", "3", "--rl.critic_warmup_iters", "1",
                 "--env.num_envs", "4", "--eval_episodes", "2"]) == 0
    _, loaded = load_policy(ft)
    assert loaded.config["run"]["ppo"]["ent_coef"] == 0.01 and loaded.meta["algo"] == "ppo"
