"""Flow-matching policy (π0-style): the Euler chain, the prefix cache, the loss's sign, the RL chain's
likelihoods, BC on the toy suite and the checkpoint round trip."""

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from robotft.config import REPO_ROOT, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.flow import FlowPolicy, FlowPolicyConfig
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O = 3, 2, 4, 2

def make_policy(num_steps: int = 10, **overrides) -> FlowPolicy:
    torch.manual_seed(0)
    spec = EnvSpec({"state": FeatureSpec("state", (OBS_DIM,), "float32")},
                   ActionSpec("test", ACT_DIM, (-3.0,) * ACT_DIM, (3.0,) * ACT_DIM))
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, OBS_DIM)), "action": rng.uniform(-2, 3, size=(64, ACT_DIM))},
        {"state": "minmax", "action": "minmax"},
    )
    kwargs = dict(obs_steps=T_O, horizon_steps=H, act_steps=2, width=32, num_heads=4, state_hidden_dims=(32,),
                  time_embed_dim=16, num_steps=num_steps, **overrides)
    policy = build_policy(FlowPolicyConfig(**kwargs), spec, normalizer)
    assert isinstance(policy, FlowPolicy)
    return policy.eval()


def make_obs(batch: int = 5) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(batch, T_O, OBS_DIM, generator=torch.Generator().manual_seed(1))}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def count_calls(monkeypatch, policy: FlowPolicy, name: str) -> list[int]:
    calls = [0]
    original = getattr(policy, name)

    def spy(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(policy, name, spy)
    return calls


@pytest.mark.parametrize("num_steps", [1, 10])
def test_euler_chain_matches_an_independent_integration(num_steps):
    policy = make_policy(num_steps)
    obs = make_obs()
    with torch.no_grad():
        # Independent Euler integration of the learned field, calling the network modules directly.
        x = torch.randn(5, H, ACT_DIM, generator=gen(4))
        cond = policy.normalizer.normalize("state", obs["state"]).flatten(1)
        prefix = policy.state_encoder(cond)[:, None]
        path = [x]
        for k in range(num_steps):
            x = x + policy.expert(prefix, x, torch.full((5,), k / num_steps)) * (1.0 / num_steps)
            path.append(x)
    expected = policy.normalizer.unnormalize("action", x.clamp(-1, 1))
    torch.testing.assert_close(policy.predict_chunk(obs, generator=gen(4)), expected)
    chain = policy.sample_chain(obs, noise_std=0.1, deterministic=True, generator=gen(4))
    assert chain.latents.shape == (5, num_steps + 1, H, ACT_DIM) and chain.logprob.shape == (5, num_steps)
    torch.testing.assert_close(chain.latents, torch.stack(path, dim=1))
    torch.testing.assert_close(chain.actions, expected)


def test_prefix_is_encoded_once_per_chunk(monkeypatch):
    policy = make_policy(num_steps=10)
    prefix_calls = count_calls(monkeypatch, policy, "encode_prefix")
    velocity_calls = count_calls(monkeypatch, policy, "velocity")
    policy.predict_chunk(make_obs())
    assert (prefix_calls[0], velocity_calls[0]) == (1, 10)
    policy.sample_chain(make_obs(), noise_std=0.2)
    assert (prefix_calls[0], velocity_calls[0]) == (2, 20)


def test_loss_target_sign_on_a_point_mass():
    """Data a* only: the exact velocity field of x_τ = τ a* + (1 - τ) ε is (a* - x) / (1 - τ). It has zero
    flow-matching loss with the target a - ε, and Euler integration of it lands on a* for any K."""
    a_star = torch.tensor([1.5, -1.0])
    for num_steps in (1, 10):
        policy = make_policy(num_steps)
        a_norm = policy.normalizer.normalize("action", a_star)
        policy.velocity = lambda prefix, x, tau, a=a_norm: (a - x) / (1 - torch.as_tensor(tau)).reshape(-1, 1, 1)
        batch = {"obs": make_obs(64), "action": a_star.expand(64, H, ACT_DIM)}
        loss, _ = policy.loss(batch)
        assert loss.item() < 1e-8
        torch.testing.assert_close(policy.predict_chunk(make_obs()), a_star.expand(5, H, ACT_DIM))
    policy.velocity = lambda prefix, x, tau, a=a_norm: -(a - x) / (1 - torch.as_tensor(tau)).reshape(-1, 1, 1)
    assert policy.loss(batch)[0].item() > 0.1


@pytest.mark.parametrize("time_sampling, mean", [("beta", 0.999 * 0.4), ("uniform", 0.999 * 0.5)])
def test_time_sampling(time_sampling, mean):
    torch.manual_seed(0)
    tau = make_policy(time_sampling=time_sampling).sample_time(20000, "cpu")
    assert tau.min() >= 0 and tau.max() <= 0.999
    assert tau.mean().item() == pytest.approx(mean, abs=0.01)  # π0: E[1 - Beta(1.5, 1)] = 0.4


def test_chain_logprobs_are_exact_and_rescored_with_gradients():
    policy = make_policy(num_steps=3)
    obs = make_obs()
    std = torch.tensor([0.3, 0.2, 0.1])
    chain = policy.sample_chain(obs, noise_std=std, generator=gen(5))
    prefix = policy.encode_prefix(obs)
    expected = []
    for k in range(3):
        x = chain.latents[:, k]
        mean = x + policy.velocity(prefix, x, k / 3) / 3
        expected.append(Normal(mean, std[k]).log_prob(chain.latents[:, k + 1]).sum(dim=(1, 2)))
    expected = torch.stack(expected, dim=1)
    torch.testing.assert_close(chain.logprob, expected.detach())
    rescored = policy.chain_logprob(obs, chain, std)
    torch.testing.assert_close(rescored, expected)
    rescored.sum().backward()
    assert all(p.grad is not None for p in policy.expert.parameters())
    with pytest.raises(ValueError, match="noise_std > 0"):
        policy.sample_chain(obs, noise_std=0.0)


def test_preset_builds():
    cfg = from_dict(FlowPolicyConfig, load_yaml(REPO_ROOT / "policies" / "flow_transformer.yaml"))
    assert (cfg.obs_steps, cfg.horizon_steps, cfg.act_steps, cfg.num_steps) == (1, 8, 4, 10)
    with pytest.raises(ValueError, match="num_steps"):
        FlowPolicyConfig(num_steps=11)


def test_pretrain_beats_random_and_checkpoint_round_trips(tmp_path, nav2d_success):
    from robotft.checkpoint import load_policy
    from robotft.cli import main

    demos, run = tmp_path / "demos.zarr", tmp_path / "bc"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "60", "--out", str(demos)]) == 0
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", "flow_transformer", "--data", str(demos),
                 "--steps", "400", "--out", str(run), "--train.batch_size", "64", "--train.lr", "3e-3",
                 "--policy.width", "32", "--policy.state_hidden_dims", "64", "--policy.time_embed_dim", "32",
                 "--policy.num_steps", "5", "--train.eval_episodes", "0"]) == 0
    policy, _ = load_policy(run)
    steps = (policy.config.obs_steps, policy.config.act_steps, policy.config.horizon_steps)
    bc = nav2d_success(lambda o: policy.predict_chunk(o), *steps)
    random = nav2d_success(None, *steps)
    assert bc > random + 0.1, f"BC should beat uniform random actions: {bc:.2f} vs {random:.2f}"

    again, _ = load_policy(run)
    obs = {"state": torch.randn(7, 1, 4)}
    out = [p.predict_chunk(obs, generator=gen(3)) for p in (policy, again)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
