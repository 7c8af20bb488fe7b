"""ReinFlow: the chain likelihood used in the loss, the learned noise net, which parameters train."""

import pytest
import torch
from tiny_specs import tiny_spec_and_normalizer

from robotft.policies.encoders import sinusoidal_embedding
from robotft.policies.flow import FlowPolicy, FlowPolicyConfig
from robotft.rl.reinflow import ReinFlow, ReinFlowConfig


def _policy() -> FlowPolicy:
    torch.manual_seed(0)
    spec, norm = tiny_spec_and_normalizer()
    cfg = FlowPolicyConfig(obs_steps=2, horizon_steps=4, act_steps=2, width=32, num_layers=1, num_heads=2,
                           state_hidden_dims=(32,), time_embed_dim=16, num_steps=3)
    return FlowPolicy(cfg, spec, norm)


def _algo(policy: FlowPolicy, **kwargs) -> ReinFlow:
    algo = ReinFlow(policy, ReinFlowConfig(sigma_min=0.05, sigma_max=0.3, noise_hidden_dims=(16,), **kwargs))
    torch.nn.init.normal_(algo.noise_net.net[-1].weight, std=0.5)  # σ that varies with obs, step and entry
    return algo


def test_logprob_equals_independent_chain_computation():
    policy = _policy()
    algo = _algo(policy)
    algo.logprob_reduction = "sum"  # the exact joint density of the chain (the default averages its entries)
    obs = {"state": torch.randn(5, 2, 3)}
    out = algo.act(obs)
    chain = out.sample["chain"]  # [B, K+1, H, A]
    assert chain.shape == (5, 4, 4, 2) and out.logprob.shape == (5, 1)

    # Independently: σ from the noise net's formula, the Euler means, log N via torch.distributions.
    cond = policy.normalizer.normalize("state", obs["state"]).reshape(5, -1)
    prefix = policy.encode_prefix(obs)
    expected = torch.distributions.Normal(0.0, 1.0).log_prob(chain[:, 0]).sum(dim=(1, 2))
    for k in range(3):
        t_in = sinusoidal_embedding(torch.full((5,), k / 3), 16)
        raw = algo.noise_net.net(torch.cat([cond, t_in], dim=-1)).view(5, 4, 2)
        sigma = 0.05 + 0.25 * (torch.tanh(raw) + 1) / 2
        mean = chain[:, k] + policy.velocity(prefix, chain[:, k], k / 3) / 3
        expected = expected + torch.distributions.Normal(mean, sigma).log_prob(chain[:, k + 1]).sum(dim=(1, 2))
    assert torch.allclose(out.logprob[:, 0], expected, atol=1e-4)
    assert torch.allclose(algo.logprob(obs, out.sample), out.logprob, atol=1e-5)
    algo.logprob_reduction = "mean"  # ReinFlow's normalization by the (K + 1) H A entries
    assert torch.allclose(algo.logprob(obs, out.sample)[:, 0], expected / (4 * 4 * 2), atol=1e-5)


def test_sampled_chain_follows_the_learned_noise():
    """x_{k+1} - mean_k divided by σ_φ is standard normal; deterministic sampling is the ODE."""
    policy = _policy()
    algo = _algo(policy)
    obs = {"state": torch.randn(1, 2, 3).expand(4000, -1, -1)}
    chain = algo.act(obs).sample["chain"]
    with torch.no_grad():
        sigma = algo.noise_net(obs)
        prefix = policy.encode_prefix(obs)
        z = torch.stack([(chain[:, k + 1] - chain[:, k] - policy.velocity(prefix, chain[:, k], k / 3) / 3) / sigma[:, k]
                         for k in range(3)])
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05
    few = {"state": obs["state"][:3]}
    torch.manual_seed(1)
    ode = algo.act(few, deterministic=True).actions
    torch.manual_seed(1)
    assert torch.allclose(ode, policy.predict_chunk(few), atol=1e-5)


def test_gradients_reach_flow_and_noise_net_and_state_round_trips():
    policy = _policy()
    algo = _algo(policy, ent_coef=0.1)
    obs = {"state": torch.randn(6, 2, 3)}
    sample = algo.act(obs).sample
    (-algo.logprob(obs, sample).mean() + algo.extra_loss(obs, sample)[0]).backward()
    trained = list(policy.parameters()) + list(algo.noise_net.parameters())
    assert {id(p) for p in algo.actor_parameters()} == {id(p) for p in trained}
    assert all(p.grad is not None for p in trained)
    assert all(p.grad.abs().sum() > 0 for p in algo.noise_net.parameters())

    fresh = _algo(_policy())
    fresh.load_state_dict(algo.state_dict())
    assert torch.equal(fresh.noise_net(obs), algo.noise_net(obs))


@pytest.mark.slow
def test_pretrain_then_reinflow_raises_success_on_toy(tmp_path, toy_pretrain, toy_success, toy_finetune):
    """A deliberately short flow BC (weak) → ReinFlow must beat BC beyond evaluation noise.
    Slow (about 25 s on one CPU thread): every update re-scores whole chains, K velocity calls per sample."""
    bc = toy_pretrain(tmp_path / "bc", "flow_transformer", 200, "--policy.width", "64", "--policy.num_layers", "1",
                      "--policy.num_steps", "4", "--policy.state_hidden_dims", "64", "--train.lr", "3e-3",
                      "--train.batch_size", "128")
    before = toy_success(bc)
    ft = toy_finetune(bc, tmp_path / "reinflow", "reinflow",
                      {"iterations": 15, "steps_per_iter": 10, "minibatch_size": 250})  # ReinFlow's defaults
    after = toy_success(ft)
    assert before > 0.1, f"BC should beat a policy that never reaches the goal, got {before:.2f}"
    assert after > before + 0.1, f"ReinFlow should improve on BC: {before:.2f} -> {after:.2f}"
