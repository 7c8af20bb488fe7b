"""Gaussian MLP policy: a state-dependent mean chunk and a learned, state-independent log-std.

The baseline actor of PPO (Schulman et al. 2017, arXiv 1707.06347; CleanRL's `ppo_continuous_action`):
π(a | o) = N(μ_θ(o), diag(σ²)) over the normalized action chunk `[H, A]`, with one learned log σ per action
dimension shared by all chunk steps, bounded to [log_std_min, log_std_max]. BC fits the mean (MSE) or the
whole Gaussian (NLL); RL samples from it and scores samples with the exact diagonal-Gaussian log-density.

Observations (low-dim keys and `rgb/<camera>` images) are encoded by the shared `ObsEncoder`.

Example:
    config = GaussianPolicyConfig(obs_steps=1, horizon_steps=8, act_steps=4)
    policy = build_policy(config, spec, normalizer)
    loss, metrics = policy.loss({"obs": {"state": s}, "action": a})  # s [B, 1, D], a [B, 8, A]
    actions = policy.predict_chunk({"state": s})                       # [B, 8, A], env units: the mean
    actions, sample, logprob = policy.sample_with_logprob({"state": s})  # for PPO rollouts
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import Obs, Policy, PolicyConfig, register_policy
from robotft.policies.denoising_chain import gaussian_logprob_elementwise
from robotft.policies.encoders import (
    BoundedLogStd,
    ObsEncoder,
    check_chunk,
    diagonal_gaussian_chunk_entropy,
    mlp,
)
from robotft.specs import EnvSpec

BC_LOSSES = ("nll", "mse")


@dataclasses.dataclass
class GaussianPolicyConfig(PolicyConfig):
    """Gaussian MLP policy over whole action chunks (the PPO baseline)."""

    type: str = "gaussian_mlp"
    """Registered policy name."""
    hidden_dims: tuple[int, ...] = (256, 256)
    """Widths of the mean MLP's hidden layers (Mish activations)."""
    log_std_init: float = -1.0
    """Initial log σ of every action dimension (normalized action units)."""
    log_std_min: float = -5.0
    """Lower bound of log σ (the bound is smooth: log σ = min + (max - min) · sigmoid(raw))."""
    log_std_max: float = 0.5
    """Upper bound of log σ."""
    bc_loss: str = "nll"
    """BC objective: `nll` (Gaussian negative log-likelihood, trains mean and σ) or `mse` (mean only)."""
    final_action_clip: float = 1.0
    """Clip the normalized chunk to [-final_action_clip, final_action_clip] before unnormalizing."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bc_loss not in BC_LOSSES:
            raise ValueError(f"policy.bc_loss must be one of {BC_LOSSES}, got {self.bc_loss!r}")
        if not self.log_std_min < self.log_std_init < self.log_std_max:
            raise ValueError(
                f"policy.log_std_init must lie strictly inside (log_std_min, log_std_max) = "
                f"({self.log_std_min}, {self.log_std_max}), got {self.log_std_init}"
            )
        if self.final_action_clip <= 0:
            raise ValueError(f"policy.final_action_clip must be > 0, got {self.final_action_clip}")
        if not self.hidden_dims:
            raise ValueError("policy.hidden_dims must name at least one hidden layer")


# --- policy ----------------------------------------------------------------------------------------


class GaussianPolicy(Policy):
    """π(a | o) = N(μ_θ(o), diag(σ²)) over normalized chunks `[B, H, A]`; σ `[A]` shared by the H steps."""

    def __init__(self, config: GaussianPolicyConfig, spec: EnvSpec, normalizer: Normalizer):
        super().__init__()
        self.spec, self.normalizer = spec, normalizer
        self.obs_encoder = ObsEncoder(config, spec, normalizer, "gaussian_mlp")
        self.config = dataclasses.replace(config, image_encoder=self.obs_encoder.image_config)
        self.obs_shapes = self.obs_encoder.low_dim_shapes
        self.act_dim = spec.action.dim
        self.mean_net = mlp(self.obs_encoder.out_dim, tuple(config.hidden_dims), config.horizon_steps * self.act_dim)
        self.log_std = BoundedLogStd(
            self.act_dim, config.log_std_init, config.log_std_min, config.log_std_max
        )

    def mean(self, obs: Obs) -> torch.Tensor:
        """μ_θ(o): normalized mean chunk `[B, H, A]`."""
        return self.mean_net(self.obs_encoder(obs)).view(-1, self.config.horizon_steps, self.act_dim)

    def std(self) -> torch.Tensor:
        """σ `[A]` in normalized action units."""
        return self.log_std().exp()

    def to_actions(self, sample: torch.Tensor) -> torch.Tensor:
        """Normalized chunk `[B, H, A]` → env units (clipped to ±final_action_clip first)."""
        clip = self.config.final_action_clip
        return self.normalizer.unnormalize("action", sample.clamp(-clip, clip))

    @torch.no_grad()
    def predict_chunk(
        self, obs: Obs, deterministic: bool = True, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Actions `[B, H, A]` in env units: the mean (`deterministic`) or a sample of π."""
        if deterministic:
            return self.to_actions(self.mean(obs))
        return self.sample_with_logprob(obs, generator=generator)[0]

    @torch.no_grad()
    def sample_with_logprob(
        self, obs: Obs, *, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a ~ π(· | o). Returns `(actions [B, H, A] env units, sample [B, H, A] normalized and
        unclipped (what `logprob` scores), logprob [B])`."""
        mean = self.mean(obs)
        std = self.std()
        sample = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)
        logprob = gaussian_logprob_elementwise(sample, mean, std).sum(dim=(1, 2))
        return self.to_actions(sample), sample, logprob

    def elementwise_logprob(self, obs: Obs, sample: torch.Tensor) -> torch.Tensor:
        """Per-entry log N(sample; μ_θ(o), σ²) `[B, H, A]` with gradients (for algorithms that score only the
        executed `act_steps`: slice `[:, :act_steps]` before summing)."""
        check_chunk("sample", sample, self.config.horizon_steps, self.act_dim)
        return gaussian_logprob_elementwise(sample, self.mean(obs), self.std())

    def logprob(self, obs: Obs, sample: torch.Tensor) -> torch.Tensor:
        """log π(sample | o) `[B]`: the diagonal Gaussian's log-density, summed over H × A (Bishop 2006,
        PRML eq. 2.43). `sample` `[B, H, A]` normalized, as returned by `sample_with_logprob`."""
        return self.elementwise_logprob(obs, sample).sum(dim=(1, 2))

    def entropy(self, obs: Obs) -> torch.Tensor:
        """Entropy of π(· | o) `[B]`: H · Σ_a (log σ_a + ½ log 2πe) (σ does not depend on o)."""
        batch = next(iter(obs.values())).shape[0]
        return diagonal_gaussian_chunk_entropy(self.log_std(), self.config.horizon_steps, batch)

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """BC on `{"obs": Obs, "action": [B, H, A]}` (env units): the mean NLL per entry (`nll`) or the MSE
        of the mean (`mse`)."""
        check_chunk("batch['action']", batch["action"], self.config.horizon_steps, self.act_dim)
        target = self.normalizer.normalize("action", batch["action"])
        mean = self.mean(batch["obs"])
        mse = F.mse_loss(mean, target)
        if self.config.bc_loss == "mse":
            return mse, {"bc_loss": mse.item(), "mse": mse.item()}
        nll = -gaussian_logprob_elementwise(target, mean, self.std()).mean()
        return nll, {"bc_loss": nll.item(), "mse": mse.item(), "std": self.std().mean().item()}


@register_policy("gaussian_mlp", GaussianPolicyConfig)
def build_gaussian_policy(
    config: GaussianPolicyConfig, spec: EnvSpec, normalizer: Normalizer
) -> GaussianPolicy:
    """The registered factory."""
    return GaussianPolicy(config, spec, normalizer)
