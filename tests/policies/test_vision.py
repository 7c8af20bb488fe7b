"""Image observations: the ResNet-18 keypoint encoder, local weights, and policies that take `rgb/<camera>` keys
(BC on a task only the image can solve, checkpoint round trips for diffusion MLP/UNet, Gaussian and flow)."""

import dataclasses

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn

from robotft.checkpoint import load_policy, write_checkpoint
from robotft.config import from_dict, load_preset, to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy, policy_config_class
from robotft.policies.diffusion import DiffusionPolicyConfig
from robotft.policies.flow import FlowPolicyConfig
from robotft.policies.gaussian import GaussianPolicyConfig
from robotft.policies.vision import (
    ImageEncoderConfig,
    ImageObsEncoder,
    SpatialSoftmax,
    crop_images,
    resnet18_trunk,
)
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

SIDE, ACT_DIM, H = 32, 2, 4
SMALL = ImageEncoderConfig(stages=2, crop=0.875, num_keypoints=8)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(batch: int, steps: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, steps, SIDE, SIDE, 3), dtype=torch.uint8, generator=gen(seed))


# --- the encoder -----------------------------------------------------------------------------------


def test_encoder_gives_one_token_per_camera_and_step_and_no_batchnorm():
    shapes = {"rgb/base": (2, SIDE, SIDE, 3), "rgb/wrist": (2, 24, 20, 3)}
    separate = ImageObsEncoder(dataclasses.replace(SMALL, shared=False), shapes)
    shared = ImageObsEncoder(dataclasses.replace(SMALL, shared=True), shapes)
    obs = {"rgb/base": images(3, 2), "rgb/wrist": torch.zeros(3, 2, 24, 20, 3, dtype=torch.uint8)}
    for enc in (separate, shared):
        assert enc.eval()(obs).shape == (3, 4, 16) and enc.num_tokens == 4 and enc.feature_dim == 16
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in enc.modules())
        assert any(isinstance(m, nn.GroupNorm) for m in enc.modules())
    n_params = [sum(p.numel() for p in e.parameters()) for e in (separate, shared)]
    assert n_params[0] == 2 * n_params[1]  # one trunk per camera vs one for both
    full = resnet18_trunk(4, None)
    assert full(torch.zeros(1, 3, 96, 96)).shape == (1, 512, 3, 3)  # all four stages: stride 32
    with pytest.raises(ValueError, match="'rgb/base': expected uint8"):
        separate(dict(obs, **{"rgb/base": obs["rgb/base"].float()}))
    with pytest.raises(ValueError, match=r"'rgb/wrist': expected shape \[B, 2, 24, 20, 3\]"):
        separate(dict(obs, **{"rgb/wrist": obs["rgb/wrist"][:, :1]}))


def test_spatial_softmax_keypoints_lie_in_the_square_and_find_the_peak():
    ss = SpatialSoftmax(channels=1, num_keypoints=1)
    with torch.no_grad():
        ss.to_maps.weight.fill_(1.0)
        ss.to_maps.bias.zero_()
    fmap = torch.zeros(2, 1, 5, 9)
    fmap[0, 0, 0, 8] = 100.0  # top-right corner: x = 1, y = -1
    fmap[1, 0, 2, 4] = 100.0  # the center
    torch.testing.assert_close(ss(fmap), torch.tensor([[[1.0, -1.0]], [[0.0, 0.0]]]), atol=1e-4, rtol=0)
    torch.manual_seed(0)
    random = SpatialSoftmax(channels=8, num_keypoints=6)(torch.randn(4, 8, 3, 7) * 50)
    # Expectations of coordinates in [-1, 1]: inside the square up to float rounding of the weighted sum.
    assert random.shape == (4, 6, 2) and random.abs().max() <= 1.0 + 1e-6


def test_crop_is_random_only_in_training():
    x = images(6)[:, 0]
    center = crop_images(x, (28, 28), random=False)
    torch.testing.assert_close(center, x[:, 2:30, 2:30])
    torch.manual_seed(0)
    crops = crop_images(x, (28, 28), random=True)
    # every random crop is some window of its own image, and they are not all the center one
    for img, crop in zip(x, crops, strict=True):
        windows = img.unfold(0, 28, 1).unfold(1, 28, 1).permute(0, 1, 3, 4, 2)  # [5, 5, 28, 28, 3]
        assert (windows == crop).flatten(2).all(dim=2).any()
    assert not torch.equal(crops, center)

    enc = ImageObsEncoder(SMALL, {"rgb/base": (1, SIDE, SIDE, 3)})
    obs = {"rgb/base": images(4)}
    enc.eval()
    torch.testing.assert_close(enc(obs), enc(obs))
    enc.train()
    assert not torch.allclose(enc(obs), enc(obs))


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_local_weights_load_into_the_groupnorm_trunk(tmp_path, fmt):
    torch.manual_seed(3)
    reference = torchvision.models.resnet18(weights=None)
    with torch.no_grad():
        reference.bn1.weight.uniform_(0.5, 1.5)
    path = tmp_path / f"resnet18.{fmt}"
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, path) if fmt == "safetensors" else torch.save(state, path)
    trunk = resnet18_trunk(2, str(path))
    torch.testing.assert_close(trunk[0].weight, reference.conv1.weight)
    assert isinstance(trunk[1], nn.GroupNorm)
    torch.testing.assert_close(trunk[1].weight, reference.bn1.weight)  # BN's affine carried over
    torch.testing.assert_close(trunk[4][0].conv1.weight, reference.layer1[0].conv1.weight)

    save_file({"conv1.weight": torch.zeros(1)}, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="bad.safetensors is not a torchvision ResNet-18 state dict"):
        resnet18_trunk(2, str(tmp_path / "bad.safetensors"))
    with pytest.raises(FileNotFoundError, match="missing.pt is not a file"):
        resnet18_trunk(2, str(tmp_path / "missing.pt"))

    # A policy reads the file once; its config then rebuilds (from a checkpoint) without it.
    policy = make_policy(GaussianPolicyConfig, image_encoder=dataclasses.replace(SMALL, weights=str(path)))
    torch.testing.assert_close(
        policy.obs_encoder.images.cameras["rgb__base"].trunk[0].weight, reference.conv1.weight
    )
    assert policy.config.image_encoder.weights is None and policy.config.image_encoder.init_from == str(path)
    path.unlink()
    assert_checkpoint_round_trip(tmp_path / "ckpt", policy)


# --- policies with image keys ----------------------------------------------------------------------


def image_spec() -> EnvSpec:
    return EnvSpec(
        {"state": FeatureSpec("state", (2,), "float32"), "rgb/base": FeatureSpec("rgb/base", (SIDE, SIDE, 3), "uint8")},
        ActionSpec("test", ACT_DIM, (-1.0,) * ACT_DIM, (1.0,) * ACT_DIM),
    )


def make_policy(config_cls, obs_keys=("state", "rgb/base"), obs_steps=1, **overrides):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, 2)), "action": rng.uniform(-1, 1, size=(64, ACT_DIM)),
         "rgb/base": np.zeros((1, SIDE, SIDE, 3))},
        {"state": "meanstd", "action": "minmax", "rgb/base": "identity"},
    )
    kwargs = {"obs_keys": list(obs_keys), "obs_steps": obs_steps, "horizon_steps": H, "act_steps": 2,
              "image_encoder": SMALL, **overrides}
    return build_policy(config_cls(**kwargs), image_spec(), normalizer)


def dot_task(batch: int, seed: int) -> dict:
    """A white 5x5 dot at a random pixel; the action chunk is the dot's position in [-1, 1]^2 (x, y) at every
    step. The state is noise, so only the image tells where to go."""
    g = gen(seed)
    pos = torch.randint(4, SIDE - 4, (batch, 2), generator=g)
    img = torch.zeros(batch, 1, SIDE, SIDE, 3, dtype=torch.uint8)
    for i, (x, y) in enumerate(pos.tolist()):
        img[i, 0, y - 2 : y + 3, x - 2 : x + 3] = 255
    target = (pos.float() - SIDE / 2) / (SIDE / 2 - 4)
    return {"obs": {"state": torch.randn(batch, 1, 2, generator=g), "rgb/base": img},
            "action": target[:, None].expand(-1, H, -1).contiguous()}


@pytest.mark.parametrize(
    ("config_cls", "overrides", "steps", "max_ratio"),
    [
        (GaussianPolicyConfig, {"bc_loss": "mse", "hidden_dims": (64,)}, 60, 0.1),
        # sampled through the EMA of noise net and image encoder
        (DiffusionPolicyConfig, {"hidden_dims": (128, 128), "num_train_timesteps": 10, "ema_decay": 0.9}, 200, 0.4),
    ],
    ids=["gaussian", "diffusion"],
)
def test_policy_with_an_image_key_learns_what_the_state_cannot_tell(config_cls, overrides, steps, max_ratio):
    policy = make_policy(config_cls, **overrides)
    opt = torch.optim.Adam(policy.parameters(), lr=2e-3)
    policy.train()
    for step in range(steps):
        loss, _ = policy.loss(dot_task(32, seed=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.on_train_step_end()
    test = dot_task(128, seed=10_000)
    policy.eval()
    mse = torch.mean((policy.predict_chunk(test["obs"], generator=gen()) - test["action"]) ** 2).item()
    # The best a policy blind to the image can do is the mean action.
    baseline = torch.mean((test["action"] - test["action"].mean(dim=0)) ** 2).item()
    assert mse < max_ratio * baseline, (mse, baseline)


def assert_checkpoint_round_trip(path, policy, **predict_kwargs):
    obs = dot_task(3, seed=5)["obs"]
    policy.eval()
    expected = policy.predict_chunk(obs, generator=gen(7), **predict_kwargs)
    write_checkpoint(
        path,
        model_state=policy.export_state_dict(),
        config={"policy": to_dict(policy.config), "spec": policy.spec.to_dict()},
        normalizer=policy.normalizer,
        meta={"stage": "test"},
    )
    loaded, _ = load_policy(path)
    torch.testing.assert_close(loaded.predict_chunk(obs, generator=gen(7), **predict_kwargs), expected)


@pytest.mark.parametrize(
    ("config_cls", "overrides"),
    [
        (DiffusionPolicyConfig, {"hidden_dims": (32, 32), "num_train_timesteps": 5}),
        (DiffusionPolicyConfig, {"backbone": "unet", "unet_down_dims": (16, 32), "num_train_timesteps": 5}),
        (GaussianPolicyConfig, {"hidden_dims": (32,)}),
        (FlowPolicyConfig, {"width": 32, "num_heads": 4, "state_hidden_dims": (32,), "num_steps": 3}),
    ],
    ids=["diffusion_mlp", "diffusion_unet", "gaussian", "flow"],
)
def test_image_policies_train_and_round_trip_through_a_checkpoint(tmp_path, config_cls, overrides):
    two_cameras = dataclasses.replace(SMALL, shared=False)
    policy = make_policy(config_cls, obs_steps=1, image_encoder=two_cameras, **overrides)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    policy.train()
    for step in range(2):
        loss, _ = policy.loss(dot_task(4, seed=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.on_train_step_end()
    trunk = policy.obs_encoder.images.cameras["rgb__base"].trunk
    assert trunk[0].weight.grad is not None and trunk[0].weight.grad.abs().sum() > 0
    assert_checkpoint_round_trip(tmp_path / "ckpt", policy)


def test_flow_prefix_has_a_state_token_and_one_token_per_image_step():
    policy = make_policy(FlowPolicyConfig, obs_steps=2, width=32, num_heads=4, state_hidden_dims=(32,))
    obs = {"state": torch.zeros(5, 2, 2), "rgb/base": images(5, 2)}
    assert policy.eval().encode_prefix(obs).shape == (5, 3, 32)
    image_only = make_policy(FlowPolicyConfig, obs_keys=("rgb/base",), width=32, num_heads=4)
    assert image_only.eval().encode_prefix({"rgb/base": images(5)}).shape == (5, 1, 32)
    assert image_only.predict_chunk({"rgb/base": images(5)}).shape == (5, H, ACT_DIM)


def test_diffusion_ema_covers_the_image_encoder():
    policy = make_policy(DiffusionPolicyConfig, hidden_dims=(32,), num_train_timesteps=5, ema_decay=0.5)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    loss, _ = policy.loss(dot_task(4, seed=0))
    loss.backward()
    opt.step()
    policy.on_train_step_end()
    live = policy.obs_encoder.images.cameras["rgb__base"].trunk[0].weight
    ema = policy.ema_obs_encoder.images.cameras["rgb__base"].trunk[0].weight
    assert not torch.equal(live, ema)
    shipped = policy.export_state_dict()
    torch.testing.assert_close(shipped["obs_encoder.images.cameras.rgb__base.trunk.0.weight"], ema)
    assert not any(k.startswith("ema_") for k in shipped)
    assert policy.ema_obs_encoder.normalizer is policy.normalizer  # shared, not a stale copy


def test_finetuned_diffusion_rescores_chains_with_the_crops_it_sampled_with():
    policy = make_policy(DiffusionPolicyConfig, hidden_dims=(32,), num_train_timesteps=5)
    policy.enable_finetuning(2)
    obs = dot_task(3, seed=0)["obs"]
    chain = policy.eval().sample_chain(obs, min_std=0.1, generator=gen())
    policy.train()  # PPO's update phase: the frozen encoder must keep its center crops
    assert policy.ft_net.training and not policy.obs_encoder.training
    torch.testing.assert_close(policy.chain_logprob(obs, chain, 0.1), chain.logprob)


def test_image_keys_are_checked_against_the_spec():
    with pytest.raises(KeyError, match="'rgb/wrist', not in the env spec"):
        make_policy(GaussianPolicyConfig, obs_keys=("state", "rgb/wrist"))
    with pytest.raises(ValueError, match="depth observations have no encoder"):
        make_policy(GaussianPolicyConfig, obs_keys=("state", "depth/base"))


def test_rgb_preset_builds():
    _, data = load_preset("policies", "diffusion_unet_rgb")
    cfg = from_dict(policy_config_class(data["type"]), data)
    assert "rgb/base_camera" in cfg.obs_keys and cfg.image_encoder.backbone == "resnet18"
    assert cfg.backbone == "unet"
