"""DPPO: Diffusion Policy Policy Optimization (Ren et al. 2024, arXiv 2409.00588).

The denoising chain is part of the MDP: each of the last `ft_denoising_steps` transitions
x_k → x_{k-1} ~ N(μ_θ(x_k, k, s), σ_k²) is an action scored by PPO, with the env's chunk advantage
discounted across denoising steps by γ_denoise^(K-1-i) (§4.2). Only a copy of the noise network trains,
and only for those last steps; the earlier steps keep the pretrained network. σ_k is clipped from below
for exploration (`min_sampling_std`) and for the likelihood (`min_logprob_std`). As in the authors'
code, the surrogate uses the per-dimension mean log-density, clamped to [-5, 2], over the executed
`act_steps` of the chunk, and the clip range grows exponentially from `clip_eps_base` at the noisiest
scored step to `rl.clip_eps` at the last one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from robotft.envs.base import Obs
from robotft.policies.diffusion import DiffusionPolicy
from robotft.rl.algorithm import ActOutput, Algorithm, register_algorithm


@dataclass
class DPPOConfig:
    """DPPO-specific settings (the PPO core's are under `rl.`)."""

    ft_denoising_steps: int = 10
    """How many final denoising transitions are fine-tuned (and scored), capped at the policy sampler's steps
    (a 5-step DDIM policy fine-tunes all 5). DPPO's 10: on a 20-step DDPM policy for ManiSkill PickCube,
    fine-tuning all 20 steps put the exploration std on every step and dropped the rollouts' success from the
    policy's 82% to 0-25%."""
    min_sampling_std: float = 0.1
    """Lower bound on each fine-tuned transition's std while sampling rollouts (exploration)."""
    min_logprob_std: float = 0.1
    """Lower bound on the std used in log-likelihoods."""
    gamma_denoising: float = 0.99
    """Discount of the advantage across denoising steps."""
    clip_eps_base: float = 1e-3
    """PPO clip range at the noisiest fine-tuned step (grows to rl.clip_eps at the last)."""
    clip_eps_rate: float = 3.0
    """Exponential rate of that growth."""
    logprob_clamp: tuple[float, float] = (-5.0, 2.0)
    """Per-dimension clamp of log-densities in the surrogate (numerical safety, as in the paper's code)."""
    bc_coef: float = 0.0
    """Weight of the BC regularizer: likelihood of the frozen base policy's chains under the fine-tuned
    one (the paper's Appendix, following Eq. 2 of arXiv 2403.03949); 0 disables it."""

    def __post_init__(self) -> None:
        if self.ft_denoising_steps < 1:
            raise ValueError(f"dppo.ft_denoising_steps must be >= 1, got {self.ft_denoising_steps}")
        # A zero std makes DDPM's last transition a point mass, which has no density to score.
        if self.min_sampling_std <= 0 or self.min_logprob_std <= 0:
            raise ValueError(
                f"dppo.min_sampling_std and dppo.min_logprob_std must be > 0, got "
                f"{self.min_sampling_std} and {self.min_logprob_std}"
            )


@register_algorithm
class DPPO(Algorithm):
    """The PPO core's defaults (`rl.`) are DPPO's: per-entry mean log-density, clip 0.01 at the last denoising
    step, target KL 1, 10 epochs; with actor learning rate 3e-5 and 3 critic warm-up iterations, measured on
    ManiSkill PushCube on CPU."""

    name = "dppo"
    config_cls = DPPOConfig
    exploration_flags = "--dppo.min_sampling_std"

    def __init__(self, policy: DiffusionPolicy, cfg: DPPOConfig) -> None:
        if not isinstance(policy, DiffusionPolicy):
            raise TypeError(f"dppo fine-tunes diffusion policies; got {type(policy).__name__}")
        self.policy, self.cfg = policy, cfg
        wanted = min(cfg.ft_denoising_steps, policy.config.num_denoising_steps)
        if policy.config.ft_denoising_steps == 0:
            policy.enable_finetuning(wanted)
        elif policy.config.ft_denoising_steps != wanted:
            raise ValueError(
                f"checkpoint was fine-tuned with ft_denoising_steps={policy.config.ft_denoising_steps}, "
                f"but dppo.ft_denoising_steps={wanted}"
            )
        self.k = policy.config.ft_denoising_steps

    def num_scored(self) -> int:
        return self.k

    def act(self, obs: Obs, deterministic: bool = False) -> ActOutput:
        """Sample a chain; its log-probabilities come from the sampling pass itself (the per-entry densities
        under the `min_logprob_std` floor), not from running the network over the chain a second time."""
        chain = self.policy.sample_chain(obs, min_std=self.cfg.min_sampling_std, deterministic=deterministic,
                                         logprob_min_std=self.cfg.min_logprob_std)
        sample = {"chain": chain.latents}
        return ActOutput(actions=chain.actions, sample=sample, logprob=self._reduce(chain.elementwise_logprob))

    def logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[N, K]`: per-transition log N(x_{k-1}; μ_θ(x_k), max(σ_k, min_logprob_std)²), clamped per
        dimension and averaged (DPPO's default `rl.logprob_reduction`) over the executed `act_steps × act_dim`
        entries."""
        lp = self.policy.chain_elementwise_logprob(obs, sample["chain"], min_std=self.cfg.min_logprob_std)
        return self._reduce(lp)

    def _reduce(self, elementwise: torch.Tensor) -> torch.Tensor:
        """Per-entry log-densities `[N, K, H, A]` → the surrogate's `[N, K]` (clamp, executed entries, mean)."""
        lo, hi = self.cfg.logprob_clamp
        act_steps = self.policy.config.act_steps
        return self.reduce_entries(elementwise.clamp(lo, hi)[:, :, :act_steps])

    def actor_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.ft_net.parameters() if p.requires_grad]

    def advantage_weights(self) -> torch.Tensor:
        """γ_denoise^(K-1-i) for scored step i = 0 (noisiest) … K-1 (produces the executed action)."""
        return torch.tensor([self.cfg.gamma_denoising ** (self.k - 1 - i) for i in range(self.k)])

    def clip_coefs(self, clip_eps: float) -> torch.Tensor:
        if self.k == 1:
            return torch.tensor([clip_eps])
        t = torch.arange(self.k, dtype=torch.float32) / (self.k - 1)
        base, rate = self.cfg.clip_eps_base, self.cfg.clip_eps_rate
        return base + (clip_eps - base) * (torch.exp(rate * t) - 1) / (math.exp(rate) - 1)

    def extra_loss(self, obs: Obs, sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The optional BC regularizer; reports the exploration noise scale (mean std of the scored steps)."""
        stats = {"noise_std": self.policy.exploration_std(self.cfg.min_sampling_std).mean().item()}
        if self.cfg.bc_coef <= 0:
            loss, _ = super().extra_loss(obs, sample)
            return loss, stats
        with torch.no_grad():
            base_chain = self.policy.sample_chain(obs, min_std=self.cfg.min_sampling_std, use_base=True)
        bc_logprob = self.logprob(obs, {"chain": base_chain.latents})
        bc_loss = -bc_logprob.mean()
        return self.cfg.bc_coef * bc_loss, {**stats, "bc_loss": bc_loss.item()}
