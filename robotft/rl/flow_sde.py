"""Flow-SDE (π_RL, arXiv 2510.25889; the ODE-to-SDE step of Flow-GRPO, Liu et al. 2025, arXiv 2505.05470):
PPO on a flow policy whose ODE is turned into an SDE with the same marginals.

Times: the flow's τ (τ = 0 noise, τ = 1 data; robotft.policies.flow) and the papers' t = 1 - τ (t = 1 noise).
With σ_t = a · sqrt(t / (1 - t)) the Euler–Maruyama step from x at τ_k = k / K over Δτ = 1 / K is

    x_{k+1} ~ N(x + [v_θ - σ_t² / (2t) · (x - τ_k v_θ)] Δτ,  σ_t² Δτ),

the ODE velocity plus the score correction σ²/2 · ∇log p_τ(x) with ∇log p_τ(x) = -(x - τ v_θ) / (1 - τ) for the
linear path x_τ = τ a + (1 - τ) ε. At the first step (t = 1) σ_t is infinite, so there σ uses the next grid
time t = 1 - Δτ, as Flow-GRPO's implementation does.

Two-layer MDP (π_RL): in every rollout chunk one integration step j, drawn uniformly per sample, is this
stochastic transition and the other steps are the deterministic Euler ODE. `ignore_last` (RLinf's option) never
draws the last step, whose noise lands on the executed action uncorrected; it is off by default, because the last
step's σ is the smallest of the chain and its ratio is what most constrains the update (see the field). The sample
stores j, x_j and x_{j+1}; the one scored transition of the PPO core (`num_scored() = 1`) is the exact Gaussian
log-density of x_{j+1}, whose `H × A` entries the PPO core clips one by one by default
(`rl.logprob_reduction none`). The whole flow policy trains; evaluation runs the ODE (no noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs
from robotft.policies.denoising_chain import gaussian_logprob_elementwise
from robotft.policies.flow import FlowPolicy, euler_times
from robotft.rl.algorithm import ActOutput, Algorithm, register_algorithm


@dataclass
class FlowSDEConfig:
    """Flow-SDE settings (the PPO core's are under `rl.`)."""

    noise_level: float = 0.5
    """a in σ_t = a · sqrt(t / (1 - t)): the SDE's noise scale (larger explores more)."""

    ignore_last: bool = False
    """Never make the last integration step the stochastic one (RLinf's `ignore_last`); False draws j from all K
    steps, as Flow-GRPO does. From a StackCube flow BC (66%), 10 iterations: with it 0% success and a KL to the BC
    of 114 after the first update; without it 28% and 9. The last step has the smallest σ, so its ratio clips the
    velocity change that the deterministic steps of the evaluated ODE also feel."""

    def __post_init__(self) -> None:
        if self.noise_level <= 0:
            raise ValueError(f"flow_sde.noise_level must be > 0, got {self.noise_level}")


@register_algorithm
class FlowSDE(Algorithm):
    name = "flow_sde"
    config_cls = FlowSDEConfig
    exploration_flags = "--flow_sde.noise_level"
    rl_defaults: ClassVar[dict[str, Any]] = {"logprob_reduction": "none", "clip_eps": 0.2, "actor_lr": 1e-4,
                                             "update_epochs": 4}
    """π_RL's PPO on the one scored SDE step: per-entry ratios, each clipped at 0.2 (RLinf's `token_level`), few epochs.
    A mean over the H × A entries hides a coherent shift of the Gaussian mean (`rl.logprob_reduction`): on the toy
    suite at 1e-4 both took a weak BC from 0.33 to 0.94 success in 15 iterations, with a KL to the BC of 7 with
    per-entry ratios against 1306 with the mean; from a StackCube flow BC (66%) the mean took the ODE policy to 2%
    within 10 iterations, per-entry ratios to 26-28% (3e-5 and 1e-4). The actor learning rate is sized for
    robotft's small flow transformers (π_RL's 5e-6 is for a 3B VLA): on the toy suite with per-entry ratios, 0.44
    at 3e-5 and 0.94 at 1e-4 (with the mean: 0.86 at 3e-5)."""

    def __init__(self, policy: FlowPolicy, cfg: FlowSDEConfig) -> None:
        if not isinstance(policy, FlowPolicy):
            raise TypeError(f"flow_sde fine-tunes flow_transformer policies; got {type(policy).__name__}")
        if not policy.instantaneous_velocity:
            raise TypeError(f"flow_sde converts the flow's ODE into an SDE, which needs the instantaneous velocity; "
                            f"{type(policy).__name__} predicts average velocities over each step (use reinflow)")
        if policy.config.num_steps < 2:
            raise ValueError("flow_sde needs policy.num_steps >= 2 (σ_t of the first step uses the second's time)")
        self.policy, self.cfg = policy, cfg

    @property
    def stochastic_steps(self) -> int:
        """How many integration steps j may be the stochastic one: the first K - 1 with `ignore_last`, else all K."""
        return self.policy.config.num_steps - int(self.cfg.ignore_last)

    def sigma(self, step: torch.Tensor) -> torch.Tensor:
        """σ_t at Euler step indices `step` `[B]`: a · sqrt(t / (1 - t)), t = 1 - τ_k, t = 1 replaced by 1 - Δτ."""
        k = self.policy.config.num_steps
        t = 1 - step.clamp(min=1).float() / k
        return self.cfg.noise_level * torch.sqrt(t / (1 - t))

    def sde_mean(self, x: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """x + [v - σ_t² / (2t) (x - τ v)] Δτ `[B, H, A]` for latents x, velocities v and step indices `[B]`."""
        k = self.policy.config.num_steps
        tau = (step.float() / k)[:, None, None]
        sigma = self.sigma(step)[:, None, None]
        return x + (v - sigma**2 / (2 * (1 - tau)) * (x - tau * v)) / k

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> ActOutput:
        policy, k = self.policy, self.policy.config.num_steps
        prefix = policy.encode_prefix(obs)
        batch = prefix.shape[0]
        x = policy.initial_noise(batch, prefix.device)
        step = torch.randint(self.stochastic_steps, (batch,), device=prefix.device)
        x_step = x_next = x
        for i, tau in enumerate(euler_times(k, x.device)):
            v = policy.velocity(prefix, x, tau)
            nxt = x + v / k
            chosen = (step == i)[:, None, None]
            if not deterministic:
                noise = torch.randn_like(x) * (self.sigma(step) / math.sqrt(k))[:, None, None]
                nxt = torch.where(chosen, self.sde_mean(x, v, step) + noise, nxt)
            x_step, x_next = torch.where(chosen, x, x_step), torch.where(chosen, nxt, x_next)
            x = nxt
        sample = {"x": x_step, "x_next": x_next, "step": step}
        return ActOutput(actions=policy.to_actions(x), sample=sample, logprob=self.logprob(obs, sample))

    def logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """log N(x_{j+1}; SDE mean at x_j, σ_t² Δτ): `[N, H · A]` per entry (default), or `[N, 1]` averaged or
        summed over the entries (`rl.logprob_reduction`)."""
        step, k = sample["step"], self.policy.config.num_steps
        v = self.policy.velocity(self.policy.encode_prefix(obs), sample["x"], step.float() / k)
        std = (self.sigma(step) / math.sqrt(k))[:, None, None]
        lp = gaussian_logprob_elementwise(sample["x_next"], self.sde_mean(sample["x"], v, step), std)
        return self.reduce_entries(lp[:, None])

    def extra_loss(self, obs: Obs, sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """No extra loss; reports the noise scale: the mean std σ_t sqrt(Δτ) of the scored SDE steps."""
        loss, _ = super().extra_loss(obs, sample)
        std = self.sigma(sample["step"]) / math.sqrt(self.policy.config.num_steps)
        return loss, {"noise_std": std.mean().item()}
