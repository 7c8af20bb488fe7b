"""Observation encoders and small building blocks shared by the policies.

Low-dim observation histories are normalized and flattened here, in one place, so every policy checks
keys and shapes the same way (image encoders will sit beside these)."""

from __future__ import annotations

import math

import torch
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.envs.base import Obs
from robotft.policies.base import PolicyConfig
from robotft.specs import EnvSpec


def low_dim_obs_shapes(
    config: PolicyConfig, spec: EnvSpec, normalizer: Normalizer, policy_name: str
) -> dict[str, tuple[int, ...]]:
    """Expected per-key obs shape without batch, `(obs_steps, *feature_shape)`; checks that the env spec
    and the normalizer know every key (and the action). Errors name the key and the policy."""
    if spec.action is None:
        raise ValueError(f"{policy_name}: the env spec has no action spec")
    shapes = {}
    for key in config.obs_keys:
        if key.startswith(("rgb/", "depth/")):
            raise ValueError(f"{policy_name} conditions on low-dim keys only; {key!r} needs an image encoder")
        if key not in spec.observations:
            raise KeyError(f"policy.obs_keys has {key!r}, not in the env spec's {sorted(spec.observations)}")
        shapes[key] = (config.obs_steps, *spec.observations[key].shape)
    missing = [k for k in [*config.obs_keys, "action"] if k not in set(normalizer.keys())]
    if missing:
        raise KeyError(
            f"{policy_name}: normalizer has no statistics for {missing}; it has {normalizer.keys()}"
        )
    return shapes


def flatten_obs(obs: Obs, shapes: dict[str, tuple[int, ...]], normalizer: Normalizer) -> torch.Tensor:
    """Normalized, flattened observation history `[B, F]`, F = Σ_key prod(shapes[key]).

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
        parts.append(normalizer.normalize(key, x).flatten(1))
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
