"""Per-key normalizers whose statistics travel with the checkpoint (`normalizer.safetensors`).

`minmax` maps each dimension's [min, max] over the dataset to [-1, 1] (diffusion_policy's
LinearNormalizer); `meanstd` subtracts the mean and divides by the std. Dimensions with (near) zero
range are *constant*: they normalize to 0 unscaled (no division by zero) and unnormalize to their one
value whatever the normalized input, so that a policy's clip of normalized actions to [-1, 1] still maps
into the data's range (a gripper that is always -1 stays -1, not anywhere in [-2, 0]).
`identity` passes a key through (images are scaled by their encoder, not here).
"""

from __future__ import annotations

import numpy as np
import torch

MODES = ("minmax", "meanstd", "identity")
_EPS = 1e-6


class Normalizer:
    """Affine per-dimension normalization `y = (x - offset) / scale` for each registered key."""

    def __init__(self) -> None:
        self.offset: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        self.mode: dict[str, str] = {}
        self.constant: dict[str, torch.Tensor] = {}
        """Per key, bool mask of the dimensions that were constant over the data (unnormalize to `offset`)."""

    @classmethod
    def fit(cls, data: dict[str, np.ndarray], modes: dict[str, str]) -> Normalizer:
        """Fit statistics over axis 0 of each array (`[N, *feature_shape]`). `modes[key]` in MODES."""
        norm = cls()
        for key, mode in modes.items():
            if mode not in MODES:
                raise ValueError(f"normalizer mode for {key!r} must be one of {MODES}, got {mode!r}")
            if key not in data:
                raise KeyError(f"normalizer: no data for key {key!r}; have {sorted(data)}")
            x = np.asarray(data[key], dtype=np.float64)
            if x.ndim < 1 or x.shape[0] == 0:
                raise ValueError(f"normalizer: key {key!r} has no samples (shape {x.shape})")
            if not np.isfinite(x).all():
                raise ValueError(f"normalizer: key {key!r} contains NaN or inf")
            feat = x.shape[1:]
            if mode == "minmax":
                lo, hi = x.min(axis=0), x.max(axis=0)
                scale = (hi - lo) / 2.0
                offset = (hi + lo) / 2.0
            elif mode == "meanstd":
                offset, scale = x.mean(axis=0), x.std(axis=0)
            else:
                offset, scale = np.zeros(feat), np.ones(feat)
            degenerate = (scale < _EPS) & (mode != "identity")
            scale = np.where(degenerate, 1.0, scale)
            norm.offset[key] = torch.as_tensor(offset, dtype=torch.float32)
            norm.scale[key] = torch.as_tensor(scale, dtype=torch.float32)
            norm.constant[key] = torch.as_tensor(degenerate, dtype=torch.bool)
            norm.mode[key] = mode
        return norm

    def keys(self) -> list[str]:
        return list(self.mode)

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Env units → normalized; broadcasts over leading axes."""
        offset, scale = self._stats(key, x)
        return (x.float() - offset) / scale

    def unnormalize(self, key: str, y: torch.Tensor) -> torch.Tensor:
        """Normalized → env units; constant dimensions come back as their one value."""
        offset, scale = self._stats(key, y)
        x = y * scale + offset
        constant = self.constant.get(key)
        if constant is None:
            return x
        if constant.device != x.device:  # kept on the data's device, as offset and scale are
            constant = self.constant[key] = constant.to(x.device)
        # `where` even when no dimension is constant: a branch on `constant.any()` would be a host sync (and a
        # graph break under torch.compile) on every sampled chunk.
        return torch.where(constant, offset, x)

    def _stats(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.mode:
            raise KeyError(f"normalizer has no statistics for key {key!r}; have {self.keys()}")
        offset, scale = self.offset[key], self.scale[key]
        if offset.ndim and tuple(x.shape[-offset.ndim :]) != tuple(offset.shape):
            raise ValueError(
                f"normalizer key {key!r}: trailing shape {tuple(x.shape)} does not end with {tuple(offset.shape)}"
            )
        if offset.device != x.device:
            offset, scale = offset.to(x.device), scale.to(x.device)
            self.offset[key], self.scale[key] = offset, scale
        return offset, scale

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat tensor dict for safetensors: `<key>.offset`, `<key>.scale` (mode in metadata)."""
        out = {}
        for key in self.mode:
            out[f"{key}.offset"] = self.offset[key].detach().cpu().contiguous()
            out[f"{key}.scale"] = self.scale[key].detach().cpu().contiguous()
            if key in self.constant:
                out[f"{key}.constant"] = self.constant[key].detach().cpu().contiguous()
        return out

    def metadata(self) -> dict[str, str]:
        """String metadata for safetensors: the mode of each key."""
        return {f"{key}.mode": mode for key, mode in self.mode.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Normalizer:
        norm = cls()
        for name, mode in metadata.items():
            if not name.endswith(".mode"):
                continue
            key = name[: -len(".mode")]
            if f"{key}.offset" not in tensors or f"{key}.scale" not in tensors:
                raise KeyError(f"normalizer statistics for {key!r} are incomplete (need offset and scale)")
            norm.mode[key] = mode
            norm.offset[key] = tensors[f"{key}.offset"].float()
            norm.scale[key] = tensors[f"{key}.scale"].float()
            if f"{key}.constant" in tensors:  # absent from checkpoints written before constant dimensions
                norm.constant[key] = tensors[f"{key}.constant"].bool()
        return norm
