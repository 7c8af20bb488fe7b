"""The UNet-1D backbone of the diffusion policy: shapes, FiLM, config checks, DPPO fine-tuning, checkpoint
round trips, and a tiny BC run on toy nav2d through the CLI that must beat uniform-random chunks."""

import numpy as np
import pytest
import torch

from robotft.checkpoint import load_policy, write_checkpoint
from robotft.config import REPO_ROOT, from_dict, load_yaml, to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig
from robotft.policies.unet import NoiseUNet1D
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O = 3, 2, 8, 2
PRESET = REPO_ROOT / "policies" / "diffusion_unet.yaml"
SPEC = EnvSpec(
    {"state": FeatureSpec("state", (OBS_DIM,), "float32")},
    ActionSpec("joint_delta_pos", ACT_DIM, (-1.0,) * ACT_DIM, (1.0,) * ACT_DIM),
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_policy(seed: int = 0, **overrides) -> DiffusionPolicy:
    torch.manual_seed(seed)
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, OBS_DIM)), "action": rng.uniform(-2, 3, size=(64, ACT_DIM))},
        {"state": "minmax", "action": "minmax"},
    )
    kwargs = dict(backbone="unet", obs_steps=T_O, horizon_steps=H, act_steps=4, unet_down_dims=(16, 32, 32),
                  time_embed_dim=16, num_train_timesteps=10)
    kwargs.update(overrides)
    policy = build_policy(DiffusionPolicyConfig(**kwargs), SPEC, normalizer)
    assert isinstance(policy, DiffusionPolicy) and isinstance(policy.net, NoiseUNet1D)
    return policy


def make_obs(batch: int = 5, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(batch, T_O, OBS_DIM, generator=gen(seed))}


def test_shapes_film_and_row_independence():
    torch.manual_seed(0)
    net = NoiseUNet1D(H, ACT_DIM, cond_dim=5, down_dims=(16, 32, 64), kernel_size=5, n_groups=8, time_embed_dim=16)
    x, t, cond = torch.randn(6, H * ACT_DIM, generator=gen(1)), torch.arange(6), torch.randn(6, 5, generator=gen(2))
    out = net(x, t, cond)
    assert out.shape == (6, H * ACT_DIM)
    # the conditioning and the diffusion step both reach the output
    assert not torch.allclose(net(x, t, cond + 1), out)
    assert not torch.allclose(net(x, t + 3, cond), out)
    # GroupNorm is per sample: a row's output does not depend on the rest of the batch (DPPO splits rows
    # between ft_net and the frozen net)
    torch.testing.assert_close(net(x[:2], t[:2], cond[:2]), out[:2])
    films = [m for m in net.modules() if hasattr(m, "film")]
    assert len(films) == 2 * 3 + 2 + 2 * 2  # down, mid, up residual blocks all FiLM-conditioned
    with torch.no_grad():
        for block in films:
            block.film[1].weight.zero_()
            block.film[1].bias.zero_()
    zeroed = net(x, t, cond)
    assert not torch.allclose(zeroed, out)  # FiLM is not an identity at init
    torch.testing.assert_close(net(x, t + 3, cond + 1), zeroed)  # with FiLM zeroed, cond and t are ignored


def test_config_validation_and_preset():
    with pytest.raises(ValueError, match="divisible by 2\\*\\*\\(len\\(unet_down_dims\\)-1\\)=4"):
        DiffusionPolicyConfig(backbone="unet", horizon_steps=6, act_steps=4)
    DiffusionPolicyConfig(backbone="unet", horizon_steps=6, act_steps=4, unet_down_dims=(64, 128))  # 6 % 2 == 0
    DiffusionPolicyConfig(backbone="mlp", horizon_steps=6, act_steps=4)  # the MLP has no such constraint
    with pytest.raises(ValueError, match="unet_n_groups"):
        DiffusionPolicyConfig(backbone="unet", unet_down_dims=(12, 24))
    with pytest.raises(ValueError, match="unet_kernel_size"):
        DiffusionPolicyConfig(backbone="unet", unet_kernel_size=4)
    with pytest.raises(ValueError, match="backbone"):
        DiffusionPolicyConfig(backbone="transformer")
    cfg = from_dict(DiffusionPolicyConfig, load_yaml(PRESET))
    assert cfg.type == "diffusion_mlp" and cfg.backbone == "unet"
    assert (cfg.horizon_steps, cfg.act_steps, cfg.unet_down_dims) == (8, 4, (64, 128, 256))


def test_finetuning_gradients_reach_only_ft_net():
    policy = make_policy()
    policy.enable_finetuning(3)
    assert isinstance(policy.ft_net, NoiseUNet1D) and policy.ema_net is None
    assert not any(p.requires_grad for p in policy.net.parameters())
    obs = make_obs()
    chain = policy.sample_chain(obs, min_std=0.1, generator=gen())
    assert chain.latents.shape == (5, 4, H, ACT_DIM) and chain.logprob.shape == (5, 3)
    with torch.no_grad():
        torch.testing.assert_close(policy.chain_logprob(obs, chain, 0.1), chain.logprob, rtol=1e-5, atol=1e-4)
    lp = policy.chain_logprob(obs, chain, 0.1)
    lp.sum().backward()
    grads = [p.grad for p in policy.ft_net.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    assert all(p.grad is None for p in policy.net.parameters())
    # the base steps are untouched by a change to ft_net, the fine-tuned tail is not
    with torch.no_grad():
        policy.ft_net.out.bias.add_(0.5)
    after = policy.sample_chain(obs, min_std=0.1, generator=gen())
    torch.testing.assert_close(after.latents[:, 0], chain.latents[:, 0])
    assert not torch.allclose(after.latents[:, -1], chain.latents[:, -1])


@pytest.mark.parametrize("finetuned", [False, True])
def test_checkpoint_round_trip(tmp_path, finetuned):
    policy = make_policy(ema_decay=0.9)
    opt = torch.optim.SGD(policy.net.parameters(), lr=0.1)
    for _ in range(3):
        loss, _ = policy.loss({"obs": make_obs(), "action": torch.rand(5, H, ACT_DIM)})
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.on_train_step_end()
    if finetuned:
        policy.enable_finetuning(2)
        with torch.no_grad():
            policy.ft_net.out.bias.add_(0.3)
    write_checkpoint(tmp_path / "ckpt", model_state=policy.export_state_dict(), normalizer=policy.normalizer,
                     config={"policy": to_dict(policy.config), "spec": SPEC.to_dict()}, meta={"step": 3})
    loaded, _ = load_policy(tmp_path / "ckpt")
    assert isinstance(loaded.net, NoiseUNet1D) and loaded.config == policy.config
    obs = make_obs()
    for deterministic in (True, False):
        torch.testing.assert_close(
            loaded.predict_chunk(obs, deterministic, generator=gen()),
            policy.predict_chunk(obs, deterministic, generator=gen()),
            rtol=0, atol=0,
        )


def test_unet_bc_on_nav2d_beats_random(tmp_path, nav2d_success):
    """The preset, shrunk to two levels and 5 DDIM steps to fit the CPU budget (measured: ~0.38 vs 0.00)."""
    from robotft.cli import main

    demos, run = tmp_path / "demos.zarr", tmp_path / "unet"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "60", "--out", str(demos)]) == 0
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", str(PRESET), "--data", str(demos),
                 "--steps", "300", "--out", str(run), "--policy.unet_down_dims", "32,64",
                 "--policy.sampler", "ddim", "--policy.ema_decay", "0.9", "--train.batch_size", "128",
                 "--train.lr", "1e-2", "--train.eval_episodes", "0"]) == 0
    policy, _ = load_policy(run)
    assert isinstance(policy.net, NoiseUNet1D)
    steps = (policy.config.obs_steps, policy.config.act_steps, policy.config.horizon_steps)
    bc = nav2d_success(lambda o: policy.predict_chunk(o, generator=gen()), *steps)
    random = nav2d_success(None, *steps)
    assert bc > random + 0.1, f"UNet diffusion BC {bc:.2f} vs random {random:.2f}"
