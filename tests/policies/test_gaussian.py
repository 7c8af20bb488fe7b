"""Gaussian MLP policy: exact log-densities, BC on the toy suite, checkpoint round trip."""

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from robotft.config import REPO_ROOT, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.gaussian import GaussianPolicy, GaussianPolicyConfig
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O = 3, 2, 4, 2

def make_policy(**overrides) -> GaussianPolicy:
    torch.manual_seed(0)
    spec = EnvSpec({"state": FeatureSpec("state", (OBS_DIM,), "float32")},
                   ActionSpec("test", ACT_DIM, (-3.0,) * ACT_DIM, (3.0,) * ACT_DIM))
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, OBS_DIM)), "action": rng.uniform(-2, 3, size=(64, ACT_DIM))},
        {"state": "meanstd", "action": "minmax"},
    )
    kwargs = dict(obs_steps=T_O, horizon_steps=H, act_steps=2, hidden_dims=(32, 32), **overrides)
    policy = build_policy(GaussianPolicyConfig(**kwargs), spec, normalizer)
    assert isinstance(policy, GaussianPolicy)
    return policy


def make_obs(batch: int = 5) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(batch, T_O, OBS_DIM, generator=torch.Generator().manual_seed(1))}


def test_logprob_and_entropy_equal_torch_normal():
    policy = make_policy(log_std_init=-0.7)
    obs = make_obs()
    actions, sample, logprob = policy.sample_with_logprob(obs, generator=torch.Generator().manual_seed(2))
    assert actions.shape == sample.shape == (5, H, ACT_DIM) and logprob.shape == (5,)
    dist = Normal(policy.mean(obs), policy.std().expand(H, ACT_DIM))
    expected = dist.log_prob(sample).sum(dim=(1, 2))
    torch.testing.assert_close(logprob, expected.detach())
    torch.testing.assert_close(policy.logprob(obs, sample), expected)
    torch.testing.assert_close(policy.entropy(obs), dist.entropy().sum(dim=(1, 2)))
    assert policy.std()[0].item() == pytest.approx(np.exp(-0.7), rel=1e-5)
    # The executed chunk is the sample clipped to the data range, in env units.
    torch.testing.assert_close(actions, policy.normalizer.unnormalize("action", sample.clamp(-1, 1)))


def test_logprob_trains_mean_and_std_and_log_std_is_bounded():
    policy = make_policy(log_std_min=-2.0, log_std_max=0.0, log_std_init=-1.0)
    obs = make_obs()
    _, sample, _ = policy.sample_with_logprob(obs)
    policy.logprob(obs, sample).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    with torch.no_grad():
        policy.log_std.raw.fill_(100.0)
    assert policy.log_std().max().item() == pytest.approx(0.0)


@pytest.mark.parametrize("bc_loss", ["nll", "mse"])
def test_bc_loss_modes(bc_loss):
    policy = make_policy(bc_loss=bc_loss)
    batch = {"obs": make_obs(), "action": torch.rand(5, H, ACT_DIM) * 5 - 2}
    loss, metrics = policy.loss(batch)
    target = policy.normalizer.normalize("action", batch["action"])
    if bc_loss == "mse":
        expected = ((policy.mean(batch["obs"]) - target) ** 2).mean()
    else:
        expected = -Normal(policy.mean(batch["obs"]), policy.std()).log_prob(target).mean()
    torch.testing.assert_close(loss, expected)
    assert metrics["bc_loss"] == pytest.approx(loss.item())


def test_preset_builds():
    cfg = from_dict(GaussianPolicyConfig, load_yaml(REPO_ROOT / "policies" / "gaussian_mlp.yaml"))
    assert cfg.type == "gaussian_mlp" and cfg.horizon_steps == 8 and cfg.act_steps == 4


def test_pretrain_beats_random_and_checkpoint_round_trips(tmp_path, nav2d_success):
    from robotft.checkpoint import load_policy
    from robotft.cli import main

    demos, run = tmp_path / "demos.zarr", tmp_path / "bc"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "60", "--out", str(demos)]) == 0
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--data", str(demos),
                 "--steps", "300", "--out", str(run), "--train.batch_size", "128", "--train.lr", "3e-3",
                 "--train.eval_episodes", "0"]) == 0
    policy, _ = load_policy(run)
    steps = (policy.config.obs_steps, policy.config.act_steps, policy.config.horizon_steps)
    bc = nav2d_success(lambda o: policy.predict_chunk(o), *steps)
    random = nav2d_success(None, *steps)
    assert bc > random + 0.1, f"BC should beat uniform random actions: {bc:.2f} vs {random:.2f}"

    again, _ = load_policy(run)
    obs = {"state": torch.randn(7, 1, 4)}
    torch.testing.assert_close(again.predict_chunk(obs), policy.predict_chunk(obs), rtol=0, atol=0)
    sampled = [p.predict_chunk(obs, deterministic=False, generator=torch.Generator().manual_seed(3))
               for p in (policy, again)]
    torch.testing.assert_close(sampled[0], sampled[1], rtol=0, atol=0)
