"""The state-value critic V(s) on the policy's (normalized) observation history."""

from __future__ import annotations

import torch
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.envs.base import Obs
from robotft.policies.encoders import OBS_CLIP


class ValueCritic(nn.Module):
    """MLP V(s) over the flattened, normalized low-dim observation history `[B, obs_steps, D]`.

    `extra_dim` adds inputs concatenated after the observation (residual PPO feeds the base action)."""

    def __init__(
        self,
        obs_keys: list[str],
        obs_dim: int,
        normalizer: Normalizer,
        hidden_dims: tuple[int, ...] = (256, 256, 256),
        extra_dim: int = 0,
        input_clip: float = OBS_CLIP,
    ) -> None:
        super().__init__()
        self.input_clip = input_clip
        self.obs_keys = list(obs_keys)
        self.normalizer = normalizer
        layers: list[nn.Module] = []
        width = obs_dim + extra_dim
        for h in hidden_dims:
            layers += [nn.Linear(width, h), nn.Mish()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def features(self, obs: Obs) -> torch.Tensor:
        return critic_features(obs, self.obs_keys, self.normalizer, self.input_clip)

    def forward(self, obs: Obs, extra: torch.Tensor | None = None) -> torch.Tensor:
        """`[B]` values."""
        x = self.features(obs)
        if extra is not None:
            x = torch.cat([x, extra.reshape(x.shape[0], -1)], dim=-1)
        return self.net(x).squeeze(-1)


def critic_features(obs: Obs, obs_keys: list[str], normalizer: Normalizer, input_clip: float) -> torch.Tensor:
    """`[N, obs_dim]` the flattened observation history of `obs_keys`, normalized and clipped to ±input_clip:
    RL visits states outside the demonstrations' range, where min-max statistics of a nearly constant feature
    blow up; bounded inputs keep a critic's regression from exploding. Shared by the value critic and the Q
    ensemble."""
    parts = []
    for key in obs_keys:
        if key not in obs:
            raise KeyError(f"critic needs observation key {key!r}; got {sorted(obs)}")
        x = obs[key]
        x = normalizer.normalize(key, x) if key in normalizer.mode else x.float()
        parts.append(x.reshape(x.shape[0], -1).clamp(-input_clip, input_clip))
    return torch.cat(parts, dim=-1)
