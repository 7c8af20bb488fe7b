"""Residual policy (ResiP): starts equal to its base, trains only the residual, exact log-densities, a
self-contained checkpoint, and BC of the residual on the toy suite."""

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from robotft.checkpoint import load_policy, write_checkpoint
from robotft.config import to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.diffusion import DiffusionPolicyConfig
from robotft.policies.residual import ResidualPolicy, ResidualPolicyConfig
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O = 3, 2, 4, 2
SPEC = EnvSpec({"state": FeatureSpec("state", (OBS_DIM,), "float32")},
               ActionSpec("test", ACT_DIM, (-3.0,) * ACT_DIM, (3.0,) * ACT_DIM))

def normalizer(seed: int) -> Normalizer:
    rng = np.random.default_rng(seed)
    return Normalizer.fit(
        {"state": rng.normal(size=(64, OBS_DIM)), "action": rng.uniform(-2, 3, size=(64, ACT_DIM))},
        {"state": "minmax", "action": "minmax"},
    )


def save(policy, path, norm: Normalizer) -> None:
    write_checkpoint(path, model_state=policy.export_state_dict(), normalizer=norm, meta={"stage": "test"},
                     config={"policy": to_dict(policy.config), "spec": SPEC.to_dict()})


@pytest.fixture
def residual(tmp_path) -> ResidualPolicy:
    """A residual over a DDPM diffusion base (stochastic even when deterministic: a strict test of seeding),
    with a normalizer different from the base's."""
    torch.manual_seed(0)
    base_cfg = DiffusionPolicyConfig(obs_steps=T_O, horizon_steps=H, act_steps=2, hidden_dims=(32, 32),
                                     num_train_timesteps=5)
    save(build_policy(base_cfg, SPEC, normalizer(0)), tmp_path / "base", normalizer(0))
    cfg = ResidualPolicyConfig(base_checkpoint=str(tmp_path / "base"), obs_steps=T_O, horizon_steps=H, act_steps=2,
                               hidden_dims=(32, 32))
    policy = build_policy(cfg, SPEC, normalizer(1))
    assert isinstance(policy, ResidualPolicy) and cfg.base["policy"]["type"] == "diffusion_mlp"
    return policy


def make_obs(batch: int = 5) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(batch, T_O, OBS_DIM, generator=torch.Generator().manual_seed(1))}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_zero_initialised_residual_equals_the_base(residual):
    obs = make_obs()
    base = residual.base.predict_chunk(obs, generator=gen(2))
    torch.testing.assert_close(residual.predict_chunk(obs, generator=gen(2)), base, rtol=0, atol=0)
    residual.train()
    assert not residual.base.training and residual.residual_net.training


def test_gradients_reach_only_the_residual(residual):
    obs = make_obs()
    _, sample, _ = residual.sample_with_logprob(obs, generator=gen(3))
    residual.logprob(obs, sample).sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in residual.base.parameters())
    trainable = [p for p in residual.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in [*residual.residual_net.parameters(),
                                                          *residual.log_std.parameters()]}
    assert residual.residual_net[-1].weight.grad.abs().sum() > 0 and residual.log_std.raw.grad.abs().sum() > 0


def test_logprob_equals_torch_normal(residual):
    obs = make_obs()
    actions, sample, logprob = residual.sample_with_logprob(obs, generator=gen(4))
    mean = residual.residual_mean(obs, sample["base_action"])
    dist = Normal(mean, residual.std())
    expected = dist.log_prob(sample["residual"]).sum(dim=(1, 2))
    torch.testing.assert_close(logprob, expected.detach())
    torch.testing.assert_close(residual.logprob(obs, sample), expected)
    torch.testing.assert_close(residual.entropy(obs), dist.entropy().sum(dim=(1, 2)))
    scale = residual.normalizer.scale["action"]
    torch.testing.assert_close(actions, (sample["base_action"] + scale * sample["residual"]).clamp(-3, 3))


def test_a_bounded_residual_stays_within_its_bound_with_the_tanh_log_density(residual):
    """Policy Decorator's bounded residual: |a - a^base| ≤ b·s whatever u is, and the log-density of r = b tanh(u)
    is torch's Normal pushed through tanh and the scale b."""
    from torch.distributions import AffineTransform, TanhTransform, TransformedDistribution

    residual.config.bound = 0.1
    with torch.no_grad():
        residual.residual_net[-1].bias.fill_(-50.0)  # a residual mean far beyond the bound (downwards: the base sits near the top of the action range)
    obs = make_obs()
    actions, sample, _ = residual.sample_with_logprob(obs, generator=gen(6))
    scale = residual.normalizer.scale["action"]
    assert ((actions - sample["base_action"]).abs() <= 0.1 * scale + 1e-6).all()
    assert ((actions - sample["base_action"]).abs() > 0.09 * scale).all(), "a saturated residual reaches its bound"
    u = torch.randn(5, H, ACT_DIM, generator=gen(7))
    mean = torch.zeros_like(u)
    pushed = TransformedDistribution(Normal(mean, residual.std()), [TanhTransform(), AffineTransform(0.0, 0.1)])
    ours = Normal(mean, residual.std()).log_prob(u) - residual.squash_log_det(u)
    torch.testing.assert_close(ours, pushed.log_prob(residual.squash(u)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="policy.bound"):
        ResidualPolicyConfig(base_checkpoint="x", bound=-1.0)


def test_checkpoint_is_self_contained_and_round_trips(residual, tmp_path):
    with torch.no_grad():
        residual.residual_net[-1].weight.normal_()  # a non-zero residual
    save(residual, tmp_path / "residual", residual.normalizer)
    for f in (tmp_path / "base").iterdir():
        f.unlink()
    (tmp_path / "base").rmdir()  # evaluation needs no other file
    loaded, _ = load_policy(tmp_path / "residual")
    obs = make_obs()
    for deterministic in (True, False):
        out = [p.predict_chunk(obs, deterministic, generator=gen(5)) for p in (residual, loaded)]
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_base_must_fit():
    with pytest.raises(ValueError, match="base_checkpoint"):
        ResidualPolicyConfig()


def test_base_with_another_horizon_is_refused(residual):
    cfg = ResidualPolicyConfig(base=residual.config.base, obs_steps=T_O, horizon_steps=H + 1, act_steps=2)
    with pytest.raises(ValueError, match="horizon_steps: base 4 vs residual 5"):
        build_policy(cfg, SPEC, normalizer(1))


def test_residual_bc_on_a_weak_base_beats_random(tmp_path, nav2d_success):
    """A barely trained Gaussian base, then BC of the residual to the demos' offset from it."""
    from robotft.cli import main

    demos, base, run = tmp_path / "demos.zarr", tmp_path / "base", tmp_path / "residual"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "60", "--out", str(demos)]) == 0
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--data", str(demos), "--steps", "5",
                 "--out", str(base), "--policy.hidden_dims", "32", "--train.eval_episodes", "0"]) == 0
    preset = tmp_path / "residual.yaml"
    preset.write_text(f"type: residual\nbase_checkpoint: {base}\nobs_steps: 1\nhorizon_steps: 8\nact_steps: 4\n"
                      "hidden_dims: [128, 128]\n")
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", str(preset), "--data", str(demos), "--steps", "300",
                 "--out", str(run), "--train.batch_size", "128", "--train.lr", "1e-2",
                 "--train.eval_episodes", "0"]) == 0
    policy, _ = load_policy(run)
    steps = (policy.config.obs_steps, policy.config.act_steps, policy.config.horizon_steps)
    bc = nav2d_success(lambda o: policy.predict_chunk(o), *steps)
    base_sr = nav2d_success(lambda o: policy.base.predict_chunk(o), *steps)
    random = nav2d_success(None, *steps)
    assert bc > max(random, base_sr) + 0.1, f"residual BC {bc:.2f} vs base {base_sr:.2f}, random {random:.2f}"
