"""An ensemble of LayerNorm Q-networks Q_j(s, a) over chunk transitions, with Polyak-averaged target copies.

RLPD (Ball et al. 2023, arXiv 2302.02948, §3): LayerNorm in the critic keeps Q from extrapolating far beyond the
data, and an ensemble of E critics whose target takes the minimum over a random subset of `num_min` members
(REDQ, Chen et al. 2021, arXiv 2101.05982) curbs overestimation at high update-to-data ratios. All E members run
as one batched matrix product per layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.envs.base import Obs
from robotft.policies.encoders import OBS_CLIP
from robotft.rl.critic import critic_features


class EnsembleLinear(nn.Module):
    """E independent linear layers `[E, N, in] → [E, N, out]`, each initialised like nn.Linear."""

    def __init__(self, ensemble: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = nn.Parameter(torch.empty(ensemble, in_dim, out_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(ensemble, 1, out_dim).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class QEnsemble(nn.Module):
    """E critics Q_j(s, a) `[E, N]` over the normalized, clipped low-dim observation history and a flat action.

    Each member: (Linear → LayerNorm → ReLU) per hidden width, then Linear to one value (RLPD's critic)."""

    def __init__(self, obs_keys: list[str], obs_dim: int, action_dim: int, normalizer: Normalizer,
                 hidden_dims: tuple[int, ...] = (256, 256), ensemble: int = 2, input_clip: float = OBS_CLIP) -> None:
        super().__init__()
        if ensemble < 2:
            raise ValueError(f"offpolicy.num_critics must be >= 2 (the target takes a minimum), got {ensemble}")
        self.obs_keys, self.normalizer, self.input_clip = list(obs_keys), normalizer, input_clip
        self.ensemble, self.obs_dim, self.hidden_dims = ensemble, obs_dim, tuple(hidden_dims)
        layers: list[nn.Module] = []
        width = obs_dim + action_dim
        for h in hidden_dims:
            layers += [EnsembleLinear(ensemble, width, h), nn.LayerNorm(h), nn.ReLU()]
            width = h
        layers.append(EnsembleLinear(ensemble, width, 1))
        self.net = nn.Sequential(*layers)

    def like(self, action_dim: int) -> QEnsemble:
        """A fresh ensemble with this one's observation input, widths and size over actions of `action_dim`
        (DSRL-NA's noise critic beside the action critic), on this one's device."""
        q = QEnsemble(self.obs_keys, self.obs_dim, action_dim, self.normalizer, self.hidden_dims, self.ensemble,
                      self.input_clip)
        return q.to(next(self.parameters()).device)

    def features(self, obs: Obs) -> torch.Tensor:
        """`[N, obs_dim]` normalized, clipped observation features (robotft.rl.critic.critic_features)."""
        return critic_features(obs, self.obs_keys, self.normalizer, self.input_clip)

    def forward(self, obs: Obs, action: torch.Tensor) -> torch.Tensor:
        """`[E, N]` Q-values of every member for actions `[N, action_dim]`."""
        x = torch.cat([self.features(obs), action.reshape(action.shape[0], -1)], dim=-1)
        return self.net(x.unsqueeze(0).expand(self.ensemble, -1, -1)).squeeze(-1)


def subset_min(q: torch.Tensor, num_min: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """`[N]` min over `num_min` randomly chosen members of `q` `[E, N]` (REDQ's in-target minimisation)."""
    if num_min >= q.shape[0]:
        return q.min(dim=0).values
    pick = torch.randperm(q.shape[0], generator=generator)[:num_min].to(q.device)
    return q[pick].min(dim=0).values


@torch.no_grad()
def polyak(target: nn.Module, source: nn.Module, tau: float) -> None:
    """θ_target ← (1 - τ) θ_target + τ θ (Lillicrap et al. 2016, arXiv 1509.02971)."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)
