"""Observation encoders and small building blocks shared by the policies.

Low-dim observation histories are normalized and flattened here, in one place, so every policy checks
keys and shapes the same way; `ObsEncoder` adds the image keys (`rgb/<camera>`, robotft.policies.vision)
next to them for the policies that take images (diffusion, Gaussian, flow)."""

from __future__ import annotations

import math

import torch
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.envs.base import Obs
from robotft.policies.base import PolicyConfig
from robotft.policies.vision import ImageObsEncoder, image_encoder_without_file
from robotft.specs import EnvSpec


def low_dim_obs_shapes(
    config: PolicyConfig, spec: EnvSpec, normalizer: Normalizer, policy_name: str, images: str = "refuse"
) -> dict[str, tuple[int, ...]]:
    """Expected per-key obs shape without batch, `(obs_steps, *feature_shape)`, of the low-dim keys; checks
    that the env spec and the normalizer know every key (and the action). Image keys (`rgb/`, `depth/`)
    are an error with `images="refuse"` (policies without an image encoder) and left out with `"skip"`
    (`ObsEncoder` encodes them). Errors name the key and the policy."""
    if spec.action is None:
        raise ValueError(f"{policy_name}: the env spec has no action spec")
    shapes = {}
    for key in config.obs_keys:
        if key.startswith(("rgb/", "depth/")):
            if images == "skip":
                continue
            raise ValueError(f"{policy_name} conditions on low-dim keys only; {key!r} needs an image encoder")
        if key not in spec.observations:
            raise KeyError(f"policy.obs_keys has {key!r}, not in the env spec's {sorted(spec.observations)}")
        shapes[key] = (config.obs_steps, *spec.observations[key].shape)
    missing = [k for k in [*shapes, "action"] if k not in set(normalizer.keys())]
    if missing:
        raise KeyError(
            f"{policy_name}: normalizer has no statistics for {missing}; it has {normalizer.keys()}"
        )
    return shapes


OBS_CLIP = 5.0
"""Normalized low-dim observations are clipped to ±OBS_CLIP (identity keys, which are not normalized, are not).
Min-max statistics of a feature that barely moves in the demonstrations blow up on states the policy meets later:
on PushCube a quaternion component that spans 0.002 in 100 demos normalizes to -1890 when its sign flips, and 6%
of the BC's own evaluation observations leave ±5. Clipped, its success is unchanged (90% against 88%, 100
episodes) while its BC loss on such states goes from ~1000 to 0.2, which is what training on online data (PA-RL's
distillation, filtered BC) needs. The critics clip their inputs the same way (robotft.rl.critic)."""


def flatten_obs(obs: Obs, shapes: dict[str, tuple[int, ...]], normalizer: Normalizer) -> torch.Tensor:
    """Normalized, flattened observation history `[B, F]`, F = Σ_key prod(shapes[key]), clipped to ±OBS_CLIP.

    `obs[key]`: `[B, obs_steps, *feature_shape]` in env units; shapes from `low_dim_obs_shapes`.
    """
    parts: list[torch.Tensor] = []
    for key, shape in shapes.items():
        if key not in obs:
            raise KeyError(f"observation key {key!r} missing: policy reads {list(shapes)}, got {sorted(obs)}")
        x = obs[key]
        if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != shape:
            raise ValueError(
                f"observation {key!r}: expected shape [B, {', '.join(map(str, shape))}] "
                f"(obs_steps={shape[0]}, feature shape {shape[1:]}), got {tuple(x.shape)}"
            )
        if parts and x.shape[0] != parts[0].shape[0]:
            raise ValueError(f"observation {key!r}: batch size {x.shape[0]} differs from {parts[0].shape[0]}")
        z = normalizer.normalize(key, x)
        if normalizer.mode[key] != "identity":
            z = z.clamp(-OBS_CLIP, OBS_CLIP)
        parts.append(z.flatten(1))
    return torch.cat(parts, dim=1)


def image_obs_shapes(config: PolicyConfig, spec: EnvSpec, policy_name: str) -> dict[str, tuple[int, ...]]:
    """`(obs_steps, H, W, 3)` of each `rgb/<camera>` key in `config.obs_keys`, checked against the env spec
    (uint8 HxWx3). Depth keys are refused: no depth encoder exists yet."""
    shapes = {}
    for key in config.obs_keys:
        if key.startswith("depth/"):
            raise ValueError(f"{policy_name}: {key!r}: depth observations have no encoder yet (use rgb/ keys)")
        if not key.startswith("rgb/"):
            continue
        if key not in spec.observations:
            raise KeyError(f"policy.obs_keys has {key!r}, not in the env spec's {sorted(spec.observations)}")
        feat = spec.observations[key]
        if feat.dtype != "uint8" or len(feat.shape) != 3 or feat.shape[-1] != 3:
            raise ValueError(
                f"{policy_name}: {key!r} is {feat.dtype} {feat.shape} in the env spec, expected uint8 (H, W, 3)"
            )
        shapes[key] = (config.obs_steps, *feat.shape)
    return shapes


class ObsEncoder(nn.Module):
    """The observation history → conditioning features, for policies that take images and low-dim keys.

    Low-dim keys are normalized and flattened (`flatten_obs`, `low_dim_dim` features); each `rgb/<camera>`
    key goes through the image encoder of `config.image_encoder`, one token of `image_feature_dim` features
    per camera and history step (`num_image_tokens` of them). `forward` concatenates both into `[B, F]`;
    the flow policy reads the two parts separately (`low_dim`, `image_tokens`) to build prefix tokens.
    With no image keys it has no parameters and is exactly `flatten_obs`.

    The config it was built from is `image_config`, with a weights file moved to `init_from` (the policy's
    checkpoint holds the weights), for the policy to record.
    """

    def __init__(self, config: PolicyConfig, spec: EnvSpec, normalizer: Normalizer, policy_name: str):
        super().__init__()
        self.normalizer = normalizer
        self.low_dim_shapes = low_dim_obs_shapes(config, spec, normalizer, policy_name, images="skip")
        image_shapes = image_obs_shapes(config, spec, policy_name)
        self.images = ImageObsEncoder(config.image_encoder, image_shapes) if image_shapes else None
        self.image_config = image_encoder_without_file(config.image_encoder)
        self.low_dim_dim = sum(math.prod(shape) for shape in self.low_dim_shapes.values())
        self.num_image_tokens = self.images.num_tokens if self.images is not None else 0
        self.image_feature_dim = self.images.feature_dim if self.images is not None else 0
        self.out_dim = self.low_dim_dim + self.num_image_tokens * self.image_feature_dim
        if self.out_dim == 0:
            raise ValueError(f"{policy_name}: policy.obs_keys is empty; name at least one observation key")

    def low_dim(self, obs: Obs) -> torch.Tensor | None:
        """Normalized, flattened low-dim history `[B, low_dim_dim]`; None when the policy reads only images."""
        return flatten_obs(obs, self.low_dim_shapes, self.normalizer) if self.low_dim_shapes else None

    def image_tokens(self, obs: Obs) -> torch.Tensor | None:
        """Image features `[B, num_image_tokens, image_feature_dim]`; None without image keys."""
        return self.images(obs) if self.images is not None else None

    def forward(self, obs: Obs) -> torch.Tensor:
        """Conditioning `[B, out_dim]`: low-dim features, then the image tokens flattened."""
        parts = [p.flatten(1) for p in (self.low_dim(obs), self.image_tokens(obs)) if p is not None]
        if len(parts) == 2 and parts[0].shape[0] != parts[1].shape[0]:
            raise ValueError(f"observation batch sizes differ: low-dim {parts[0].shape[0]}, images {parts[1].shape[0]}")
        return torch.cat(parts, dim=1)


def mlp(in_dim: int, hidden_dims: tuple[int, ...], out_dim: int) -> nn.Sequential:
    """Linear → Mish → … → Linear: `[*, in_dim]` → `[*, out_dim]`."""
    layers: list[nn.Module] = []
    for width in hidden_dims:
        layers += [nn.Linear(in_dim, width), nn.Mish()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)


class BoundedLogStd(nn.Module):
    """A learned log σ `[A]` bounded smoothly: log σ = lo + (hi - lo) · sigmoid(raw) (so gradients never
    vanish at a hard clamp), initialised at `init`."""

    def __init__(self, dim: int, init: float, lo: float, hi: float):
        super().__init__()
        self.lo, self.hi = lo, hi
        p = (init - lo) / (hi - lo)
        self.raw = nn.Parameter(torch.full((dim,), math.log(p / (1 - p))))

    def forward(self) -> torch.Tensor:
        """log σ `[A]`."""
        return self.lo + (self.hi - self.lo) * torch.sigmoid(self.raw)


def diagonal_gaussian_chunk_entropy(log_std: torch.Tensor, horizon: int, batch: int) -> torch.Tensor:
    """Entropy `[batch]` of a chunk of `horizon` i.i.d. diagonal Gaussians with log σ `[A]` (state-independent):
    H · Σ_a (log σ_a + ½ log 2πe) (Bishop 2006, PRML eq. 2.283 per dimension)."""
    per_chunk = horizon * (log_std.sum() + 0.5 * math.log(2.0 * math.pi * math.e) * log_std.numel())
    return per_chunk.expand(batch)


def check_chunk(name: str, x: torch.Tensor, horizon: int, act_dim: int) -> None:
    """Raise unless `x` is `[B, horizon, act_dim]`."""
    if x.ndim != 3 or tuple(x.shape[1:]) != (horizon, act_dim):
        raise ValueError(f"{name}: expected [B, {horizon}, {act_dim}], got {tuple(x.shape)}")


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer position encoding of timesteps `[B]` → `[B, dim]` (Vaswani et al. 2017, Sec. 3.5;
    used for diffusion time by Ho et al. 2020, Appendix B)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / max(half - 1, 1))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)
