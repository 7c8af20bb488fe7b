"""DSRL: diffusion steering by RL in the latent-noise space (Wagenmaker et al. 2025, arXiv 2506.15799).

SAC whose action is the base policy's initial noise w: the env executes `base.decode_noise(o, w)` (DDIM η = 0 or
the flow ODE, deterministic), the critic learns Q(o, w) and the actor π_ψ(w | o) (robotft.policies.
noise_steered) maximises E[Q(o, w) - α log π_ψ(w | o)] (the paper's DSRL-SAC). The base is frozen and used as a
black box, so its weights stay bit-identical, and diffusion and flow policies, LeRobot's included, are steered
alike. A checkpoint that is not yet noise-steered is wrapped at the start. Demonstrations hold no noise, so the
critic cannot be fed them (`offpolicy.demo_data` is refused); WSRL's warm-up rollouts draw w ~ N(0, I) (clipped to
±b), i.e. the base's own sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs
from robotft.policies.base import Policy
from robotft.policies.noise_steered import NoiseSteeredPolicy, steer
from robotft.rl.algorithm import register_algorithm
from robotft.rl.offpolicy import OffPolicyAlgorithm
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import ReplayBatch
from robotft.rl.sac import Temperature


@dataclass
class DSRLConfig:
    """DSRL settings (the off-policy core's are under `offpolicy.`)."""

    actor_hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the noise actor (used when wrapping a base policy)."""
    noise_bound: float = 1.5
    """b: the actor's noise lies in [-b, b]^(H·A) (used when wrapping a base policy)."""
    actor_lr: float = 3e-4
    """Learning rate of the noise actor."""
    alpha_init: float = 0.01
    """Initial entropy coefficient α. The actor starts at σ = 1 (entropy ≈ 0.95 per noise dimension, ≈ 30 for a
    horizon-8 chunk of 4 actions): α = 0.01 keeps the entropy bonus α·H (≈ 0.3 per chunk) below a sparse
    success reward of 1, where SAC's usual α = 1 (or 0.1) lets the bonus dominate Q (measured on PickCube: mean Q
    37 for returns ≤ 1 with α = 0.1)."""
    alpha_lr: float = 3e-4
    """Learning rate of log α; 0 keeps α fixed."""
    target_entropy_per_dim: float = 0.0
    """Target entropy per noise dimension (DSRL's reference runs: a total target of 0, i.e. σ ≈ 0.1 per entry
    around the mean)."""

    def __post_init__(self) -> None:
        if self.noise_bound <= 0 or self.actor_lr <= 0 or self.alpha_init <= 0 or self.alpha_lr < 0:
            raise ValueError("dsrl.noise_bound, dsrl.actor_lr and dsrl.alpha_init must be > 0, dsrl.alpha_lr >= 0")


@register_algorithm
class DSRL(OffPolicyAlgorithm):
    name = "dsrl"
    config_cls = DSRLConfig
    offpolicy_defaults: ClassVar[dict[str, Any]] = {"critic_warmup_iters": 3}
    """The actor waits 3 iterations for a critic fitted to the first rollouts (PORL's from-scratch Q)."""

    def __init__(self, policy: Policy, cfg: DSRLConfig) -> None:
        if not isinstance(policy, NoiseSteeredPolicy):
            policy = steer(policy, cfg.actor_hidden, cfg.noise_bound)
        self.policy, self.cfg = policy, cfg
        self.action_dim = math.prod(policy.noise_shape)
        self.actor_opt = torch.optim.Adam(policy.actor.parameters(), lr=cfg.actor_lr)
        self.temperature = Temperature(cfg.alpha_init, cfg.target_entropy_per_dim * self.action_dim,
                                       cfg.alpha_lr, learn=cfg.alpha_lr > 0)

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        noise, _ = self.policy.noise(obs, deterministic)
        return self.policy.decode(obs, noise), noise

    @torch.no_grad()
    def warmup_act(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's own sampling: w ~ N(0, I), clipped to the actor's range so the critic sees valid actions."""
        batch = next(iter(obs.values())).shape[0]
        bound = self.policy.config.noise_bound
        device = next(iter(obs.values())).device
        noise = torch.randn(batch, self.action_dim, device=device).clamp(-bound, bound)
        return self.policy.decode(obs, noise), noise

    def critic_action_from_chunk(self, chunk: torch.Tensor) -> None:
        return None

    @torch.no_grad()
    def target_action(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy.noise(obs)

    def alpha(self) -> float:
        return float(self.temperature.alpha)

    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        """SAC's actor step in noise space: min E[α log π_ψ(w|o) - mean_j Q_j(o, w)], then the α step."""
        noise, logprob = self.policy.noise(batch.obs)
        q = critic(batch.obs, noise).mean(dim=0)
        loss = (self.temperature.alpha * logprob - q).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.actor_opt.step()
        return {"actor_loss": loss.item(), "noise_abs": noise.abs().mean().item(), **self.temperature.update(logprob)}

    def state_dict(self) -> dict:
        return {"actor_opt": self.actor_opt.state_dict(), "temperature": self.temperature.state()}

    def load_state_dict(self, state: dict) -> None:
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.temperature.load(state["temperature"])
