"""One-step flow policy: MeanFlow (Geng et al. 2025, arXiv 2505.13447), as used for one-step robot policies by
DMPO, on the π0-style action expert of robotft.policies.flow.

Times follow flow.py (τ = 0 noise, τ = 1 data, x_τ = τ a + (1 - τ) ε, instantaneous velocity v = a - ε). The
network predicts the *average* velocity over an interval [τ, s], s ≥ τ,

    u(x_τ, τ, s) = 1 / (s - τ) ∫_τ^s v(x_σ, σ) dσ,   so that   x_s = x_τ + (s - τ) u(x_τ, τ, s),

and one network call moves the noise x_0 to a chunk x_1 = x_0 + u(x_0, 0, 1). Differentiating
(s - τ) u = ∫_τ^s v dσ in τ along the trajectory gives the MeanFlow identity (the paper's eq. 6 with its
t = 1 - τ, r = 1 - s):

    u(x_τ, τ, s) = v(x_τ, τ) + (s - τ) · d/dτ u(x_τ, τ, s),   d/dτ u = v ∂_x u + ∂_τ u,

whose right side is the regression target (stop-gradient), with the total derivative computed by one
forward-mode JVP of u_θ along the tangent (v, 1, 0) (torch.func.jvp; the paper's Algorithm 1). On the
diagonal s = τ the target is v and the loss is plain flow matching; a fraction `mean_flow_ratio` of the
samples uses s > τ (the paper's Table 1a: 25% is best for one-step sampling). The per-sample loss can be
weighted adaptively, w = 1 / (‖Δ‖² + c)^p with w detached (the paper's Sec. 4.3; p = 0, plain MSE, by default).

Sampling with K steps (K = 1 is MeanFlow's one-step generation) jumps over the grid τ_k = k / K:
x_{k+1} = x_k + u(x_k, τ_k, τ_{k+1}) / K. `velocity(prefix, x, τ_k)` returns that step's average velocity, so
FlowPolicy's Euler chain, `predict_chunk` and the Gaussian chain (`sample_chain`, `chain_elementwise_logprob`)
that ReinFlow fine-tunes apply unchanged, with exact transition log-densities. Flow-SDE's score correction
assumes the instantaneous velocity; with this policy it uses the step's average velocity instead.

Example:
    config = MeanFlowPolicyConfig(obs_steps=1, horizon_steps=8, act_steps=4, num_steps=1)
    policy = build_policy(config, spec, normalizer)
    loss, metrics = policy.loss({"obs": {"state": s}, "action": a})  # s [B, 1, D], a [B, 8, A]
    actions = policy.predict_chunk({"state": s})                       # [B, 8, A], one network call
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import register_policy
from robotft.policies.encoders import check_chunk
from robotft.policies.flow import ActionExpert, FlowPolicy, FlowPolicyConfig, interpolate, target_velocity
from robotft.specs import EnvSpec


@dataclasses.dataclass
class MeanFlowPolicyConfig(FlowPolicyConfig):
    """A flow policy whose action expert predicts average velocities u(x_τ, τ, s) (MeanFlow)."""

    type: str = "flow_meanflow"
    """Registered policy name."""
    num_steps: int = 1
    """Sampling steps K (1: one-step generation; up to 10 for a finer jump grid)."""
    time_sampling: str = "uniform"
    """Distribution of the two training times before sorting: `uniform` or `beta` (flow.py's π0 Beta)."""
    time_max: float = 1.0
    """Training times lie in [0, time_max]; 1 so the one-step jump (0 → 1) is inside the training range."""
    mean_flow_ratio: float = 0.25
    """Fraction of training samples with s > τ (the rest use s = τ: flow matching); MeanFlow Table 1a: 25%."""
    adaptive_loss_power: float = 0.0
    """p of the adaptive loss weight 1 / (‖Δ‖² + c)^p (MeanFlow Sec. 4.3 uses p = 1 on images); 0 is plain MSE,
    which did better on the toy BC task (one-step success 0.56 with p = 0 vs 0.35 with p = 1, 400 steps)."""
    adaptive_loss_eps: float = 1e-3
    """c of the adaptive loss weight, with ‖Δ‖² the per-sample mean squared error."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mean_flow_ratio <= 1:
            raise ValueError(f"policy.mean_flow_ratio must be in [0, 1], got {self.mean_flow_ratio}")
        if self.adaptive_loss_power < 0:
            raise ValueError(f"policy.adaptive_loss_power must be >= 0, got {self.adaptive_loss_power}")
        if self.adaptive_loss_eps <= 0:
            raise ValueError(f"policy.adaptive_loss_eps must be > 0, got {self.adaptive_loss_eps}")


class MeanFlowPolicy(FlowPolicy):
    """FlowPolicy whose expert takes (τ, s - τ) and predicts the average velocity over [τ, s]."""

    instantaneous_velocity = False

    def __init__(self, config: MeanFlowPolicyConfig, spec: EnvSpec, normalizer: Normalizer):
        super().__init__(config, spec, normalizer)
        # The same expert with a second time input: the interval length s - τ (MeanFlow feeds (t, t - r)).
        self.expert = ActionExpert(self.act_dim, config.horizon_steps, config, num_times=2)

    def average_velocity(
        self, prefix: torch.Tensor, x: torch.Tensor, tau: torch.Tensor, end: torch.Tensor
    ) -> torch.Tensor:
        """u_θ(x, τ, s) `[B, H, A]` for normalized chunks `x` `[B, H, A]` at times `tau`, `end` `[B]`."""
        return self.expert(prefix, x, tau, end - tau)

    def velocity(self, prefix: torch.Tensor, x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """The Euler step's velocity from τ_k: u_θ(x, τ_k, τ_k + 1/K), so x_{k+1} = x_k + u / K is MeanFlow's
        K-step sampler. `tau` `[B]` or a float."""
        tau = torch.as_tensor(tau, dtype=torch.float32, device=x.device).expand(x.shape[0])
        return self.average_velocity(prefix, x, tau, tau + 1.0 / self.config.num_steps)

    def sample_times(self, batch: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(τ, s) `[batch]` each: two draws of `sample_time` sorted so τ ≤ s; s = τ except for a fraction
        `mean_flow_ratio` of the samples."""
        pair = torch.stack([self.sample_time(batch, device), self.sample_time(batch, device)], dim=1)
        tau, end = pair.min(dim=1).values, pair.max(dim=1).values
        diagonal = torch.rand(batch, device=device) >= self.config.mean_flow_ratio
        return tau, torch.where(diagonal, tau, end)

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """MeanFlow loss w · ‖u_θ(x_τ, τ, s) - sg(v + (s - τ) d/dτ u_θ)‖², v = a - ε (module docstring).

        `batch`: `{"obs": Obs, "action": [B, H, A]}` in env units.
        """
        check_chunk("batch['action']", batch["action"], self.config.horizon_steps, self.act_dim)
        action = self.normalizer.normalize("action", batch["action"])
        noise = torch.randn_like(action)
        tau, end = self.sample_times(action.shape[0], action.device)
        v = target_velocity(action, noise)
        prefix = self.encode_prefix(batch["obs"])

        def u(x: torch.Tensor, tau: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
            return self.average_velocity(prefix, x, tau, end)

        # Forward-mode AD through attention needs the math SDPA kernel (the fused CPU/GPU kernels have no JVP).
        with sdpa_kernel(SDPBackend.MATH):
            pred, du_dtau = torch.func.jvp(
                u, (interpolate(action, noise, tau), tau, end), (v, torch.ones_like(tau), torch.zeros_like(end))
            )
        target = (v + (end - tau)[:, None, None] * du_dtau).detach()
        per_sample = (pred - target).pow(2).mean(dim=(1, 2))
        weight = (per_sample.detach() + self.config.adaptive_loss_eps).pow(-self.config.adaptive_loss_power)
        loss = (weight * per_sample).mean()
        return loss, {"bc_loss": loss.item(), "mse": per_sample.mean().item()}


@register_policy("flow_meanflow", MeanFlowPolicyConfig)
def build_meanflow_policy(
    config: MeanFlowPolicyConfig, spec: EnvSpec, normalizer: Normalizer
) -> MeanFlowPolicy:
    """The registered factory."""
    return MeanFlowPolicy(config, spec, normalizer)
