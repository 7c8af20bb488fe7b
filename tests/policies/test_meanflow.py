"""MeanFlow one-step policy: the jump sampler, the MeanFlow identity in the loss (JVP target), the RL chain
interface, BC on the toy suite with one step against the K-step flow policy, and the checkpoint round trip."""

import numpy as np
import pytest
import torch

from robotft.config import REPO_ROOT, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.meanflow import MeanFlowPolicy, MeanFlowPolicyConfig
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O = 3, 2, 4, 2


def make_policy(num_steps: int = 1, **overrides) -> MeanFlowPolicy:
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
    policy = build_policy(MeanFlowPolicyConfig(**kwargs), spec, normalizer)
    assert isinstance(policy, MeanFlowPolicy)
    return policy.eval()


def make_obs(batch: int = 5) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(batch, T_O, OBS_DIM, generator=torch.Generator().manual_seed(1))}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("num_steps", [1, 3])
def test_sampler_jumps_with_the_average_velocity(num_steps):
    policy = make_policy(num_steps)
    obs = make_obs()
    with torch.no_grad():
        x = torch.randn(5, H, ACT_DIM, generator=gen(4))
        prefix = policy.encode_prefix(obs)
        for k in range(num_steps):
            tau, end = torch.full((5,), k / num_steps), torch.full((5,), (k + 1) / num_steps)
            x = x + (end - tau)[:, None, None] * policy.expert(prefix, x, tau, end - tau)
    expected = policy.normalizer.unnormalize("action", x.clamp(-1, 1))
    torch.testing.assert_close(policy.predict_chunk(obs, generator=gen(4)), expected)
    chain = policy.sample_chain(obs, noise_std=0.1, deterministic=True, generator=gen(4))
    assert chain.latents.shape == (5, num_steps + 1, H, ACT_DIM)
    torch.testing.assert_close(chain.actions, expected)


def point_mass_field(a, bias: float = 0.0):
    """u(x, τ, s) = (a - x) / (1 - τ) + bias · (s - τ); exact average velocity of the point mass a iff bias = 0."""

    def u(prefix, x, tau, end):
        return (a - x) / (1 - tau)[:, None, None] + bias * (end - tau)[:, None, None]

    return u


def test_loss_is_the_meanflow_identity_on_a_point_mass():
    """For data a* alone, x_s = x_τ + (s - τ)(a* - ε) with ε = (x_τ - τ a*) / (1 - τ): the average velocity is
    (a* - x) / (1 - τ) for every s. That field has zero MeanFlow loss and one jump lands on a*. A field that is
    right on the diagonal s = τ but wrong off it is caught only through the JVP term of the target."""
    a_star = torch.tensor([1.5, -1.0])
    policy = make_policy(1, adaptive_loss_power=0.0, mean_flow_ratio=1.0)
    a_norm = policy.normalizer.normalize("action", a_star)
    batch = {"obs": make_obs(64), "action": a_star.expand(64, H, ACT_DIM)}
    policy.average_velocity = point_mass_field(a_norm)
    assert policy.loss(batch)[0].item() < 1e-8
    for num_steps in (1, 4):
        policy.config.num_steps = num_steps
        torch.testing.assert_close(policy.predict_chunk(make_obs()), a_star.expand(5, H, ACT_DIM))
    policy.average_velocity = point_mass_field(a_norm, bias=0.5)
    assert policy.loss(batch)[0].item() > 1e-2
    policy.config.mean_flow_ratio = 0.0  # the diagonal only: plain flow matching cannot see the error
    assert policy.loss(batch)[0].item() < 1e-8


def test_time_pairs():
    torch.manual_seed(0)
    policy = make_policy(mean_flow_ratio=0.25)
    tau, end = policy.sample_times(20000, "cpu")
    assert bool((tau <= end).all()) and tau.min() >= 0 and end.max() <= 1
    assert (end > tau).float().mean().item() == pytest.approx(0.25, abs=0.01)


def test_reinflow_scores_the_chain():
    from robotft.rl.reinflow import ReinFlow, ReinFlowConfig

    policy = make_policy(num_steps=2)
    algo = ReinFlow(policy, ReinFlowConfig())
    obs = make_obs()
    out = algo.act(obs)
    assert out.actions.shape == (5, H, ACT_DIM) and out.logprob.shape == (5, 1)
    rescored = algo.logprob(obs, out.sample)
    torch.testing.assert_close(rescored, out.logprob)
    rescored.sum().backward()
    assert all(p.grad is not None for p in policy.expert.parameters())


def test_preset_builds():
    cfg = from_dict(MeanFlowPolicyConfig, load_yaml(REPO_ROOT / "policies" / "flow_meanflow.yaml"))
    assert (cfg.type, cfg.num_steps, cfg.horizon_steps) == ("flow_meanflow", 1, 8)
    with pytest.raises(ValueError, match="mean_flow_ratio"):
        MeanFlowPolicyConfig(mean_flow_ratio=1.5)


def pretrain(main, demos, run, policy, *extra):
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", policy, "--data", str(demos),
                 "--steps", "400", "--out", str(run), "--train.batch_size", "64", "--train.lr", "3e-3",
                 "--policy.width", "32", "--policy.state_hidden_dims", "64", "--policy.time_embed_dim", "32",
                 "--train.eval_episodes", "0", *extra]) == 0


def test_one_step_bc_beats_random_and_matches_the_k_step_flow(tmp_path, nav2d_success):
    from robotft.checkpoint import load_policy
    from robotft.cli import main

    demos = tmp_path / "demos.zarr"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "60", "--out", str(demos)]) == 0
    pretrain(main, demos, tmp_path / "meanflow", "flow_meanflow")
    pretrain(main, demos, tmp_path / "flow", "flow_transformer", "--policy.num_steps", "5")
    policy, _ = load_policy(tmp_path / "meanflow")
    flow, _ = load_policy(tmp_path / "flow")
    assert policy.config.num_steps == 1
    steps = (policy.config.obs_steps, policy.config.act_steps, policy.config.horizon_steps)
    one_step = nav2d_success(lambda o: policy.predict_chunk(o), *steps)
    k_step = nav2d_success(lambda o: flow.predict_chunk(o), *steps)
    random = nav2d_success(None, *steps)
    assert one_step > random + 0.1, f"1-step MeanFlow BC should beat random actions: {one_step:.2f} vs {random:.2f}"
    assert one_step >= k_step - 0.1, f"1-step MeanFlow {one_step:.2f} vs 5-step flow {k_step:.2f}"

    again, _ = load_policy(tmp_path / "meanflow")
    obs = {"state": torch.randn(7, 1, 4)}
    out = [p.predict_chunk(obs, generator=gen(3)) for p in (policy, again)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
