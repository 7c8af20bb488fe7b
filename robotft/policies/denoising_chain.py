"""The denoising chain shared by diffusion and flow policies (docs/design.md, "The interfaces").

A chain is a sequence of Gaussian transitions

    x_{k-1} ~ N(μ_θ(x_k, k, obs), σ_k² I)

whose means come from the network and whose stds come from the algorithm (DPPO's clipped
posterior std, ReinFlow's learned noise, Flow-SDE's σ_t). An RL algorithm treats every transition
as one action of an inner MDP (DPPO, Ren et al. 2024, arXiv 2409.00588, Sec. 4.1), so the
log-probability of a chain is the exact sum of its transitions' Gaussian log-densities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_LOG_2PI = math.log(2.0 * math.pi)


def gaussian_logprob_elementwise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-entry log-density of `x` under N(mean, diag(std²)), shaped like `x`:

    log N(x_i; μ_i, σ_i²) = -(x_i - μ_i)² / (2 σ_i²) - log σ_i - ½ log 2π
    (the univariate normal density, Bishop 2006, PRML eq. 1.46).

    `x`, `mean`: `[B, ...]`; `std`: broadcastable to `x`, must be > 0 (a zero std is a point mass
    and has no density; callers check it where it can happen).
    """
    std = std.expand_as(x)
    return -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * _LOG_2PI


def scaled_tanh_log_det(u: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-entry log |d(b tanh u)/du| = log b + log(1 - tanh² u), shaped like `u`, in the numerically stable form
    log(1 - tanh² u) = 2 (log 2 - u - softplus(-2u)) (Haarnoja et al. 2018, arXiv 1812.05905, App. C): subtracted
    from a Gaussian's log-density of u it gives the log-density of the squashed b tanh u."""
    return 2 * (math.log(2) - u - F.softplus(-2 * u)) + math.log(scale)


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density `[B]` of `x` under N(mean, diag(std²)): the per-entry log-densities summed over all
    non-batch dims (a diagonal Gaussian factorizes, Bishop 2006, PRML eq. 2.43)."""
    return gaussian_logprob_elementwise(x, mean, std).flatten(1).sum(dim=1)


def chain_transitions(
    latents: torch.Tensor, step_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All transitions of chains `[B, K+1, H, A]` at steps `[K]` as one flat batch, row `b * K + j` =
    transition j of chain b.

    Returns `(x_k, x_prev, step_index)`: `[B*K, H, A]`, `[B*K, H, A]`, `[B*K]` long; reshape per-row
    results with `.view(B, K, ...)`. Lets a policy score whole chains in one network call.
    """
    x_k = latents[:, :-1].flatten(0, 1)
    x_prev = latents[:, 1:].flatten(0, 1)
    index = step_indices.to(latents.device).repeat(latents.shape[0])
    return x_k, x_prev, index


@dataclass
class Chain:
    """The recorded part of one batch of denoising chains, in normalized action space.

    Only the transitions an RL algorithm scores are recorded (DPPO fine-tunes the last
    `ft_denoising_steps` of them); the earlier ones are not part of the policy's action.
    """

    latents: torch.Tensor
    """`[B, K+1, H, A]` normalized chunks x_K, ..., x_0: before the first recorded transition first,
    the final sample last (not clipped: the chain's own values, so its log-density is exact)."""
    step_indices: torch.Tensor
    """`[K]` long: which steps of the sampler's step sequence these transitions are (0 = first
    denoising step from pure noise)."""
    logprob: torch.Tensor
    """`[B, K]` log-density of each transition, summed over H×A."""
    actions: torch.Tensor
    """`[B, H, A]` the chunk in env units (x_0 clipped and unnormalized)."""
    elementwise_logprob: torch.Tensor | None = None
    """`[B, K, H, A]` the per-entry log-densities that `logprob` sums, when the sampler kept them (an
    algorithm that clamps or averages entries, as DPPO does, then needs no second network pass)."""

    def __post_init__(self) -> None:
        if self.latents.ndim != 4:
            raise ValueError(f"Chain.latents must be [B, K+1, H, A], got shape {tuple(self.latents.shape)}")
        batch, num_latents = self.latents.shape[:2]
        k = num_latents - 1
        if self.step_indices.shape != (k,):
            raise ValueError(
                f"Chain.step_indices must be [K={k}] for latents {tuple(self.latents.shape)}, "
                f"got {tuple(self.step_indices.shape)}"
            )
        if self.logprob.shape != (batch, k):
            raise ValueError(f"Chain.logprob must be [B={batch}, K={k}], got {tuple(self.logprob.shape)}")

    @property
    def num_transitions(self) -> int:
        """K, the number of recorded transitions."""
        return self.latents.shape[1] - 1

    def transitions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`chain_transitions(self.latents, self.step_indices)`."""
        return chain_transitions(self.latents, self.step_indices)
