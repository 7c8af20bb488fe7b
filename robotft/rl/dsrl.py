"""DSRL: diffusion steering by RL in the latent-noise space (Wagenmaker et al. 2025, arXiv 2506.15799).

The env executes `base.decode_noise(o, w)` (DDIM η = 0 or the flow ODE, deterministic) for a noise w chosen by an
actor π_ψ(w | o) (robotft.policies.noise_steered); the base is frozen and used as a black box, so its weights stay
bit-identical, and diffusion and flow policies, LeRobot's included, are steered alike. A checkpoint that is not
yet noise-steered is wrapped at the start. Two variants, both from the paper:

- DSRL-SAC (`dsrl.noise_aliasing false`): SAC whose action is w. The critic learns Q(o, w) from the replayed
  noises and the actor maximises E[Q(o, w) - α log π_ψ(w | o)]. Demonstrations hold no noise, so
  `offpolicy.demo_data` is refused.
- DSRL-NA (noise aliasing, the default; the paper's robomimic runs): the core's critic learns Q^A(o, a) over the
  executed chunk a, with the soft target at a' = decode(o', w'), w' ~ π_ψ(· | o'); a noise critic Q^W(o, w) is
  distilled from it,

      min E_w [(Q^W(o, w) - Q^A(o, decode(o, w)))²],   w from the prior N(0, I) (clipped to ±b) and from π_ψ,

  and the actor maximises E[Q^W(o, w) - α log π_ψ(w | o)]. Q^W is fitted over the whole prior, not only where
  the actor has been, and noises that decode to the same chunk share one value; Q^A sees actions, so
  demonstrations and recorded deployments mix into its minibatches (RLPD).

WSRL's warm-up rollouts draw w ~ N(0, I) (clipped to ±b), i.e. the base's own sampling.
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
from robotft.rl.offpolicy import OffPolicyAlgorithm, executed_action
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
    noise_aliasing: bool = True
    """DSRL-NA: the critic learns Q^A over executed chunks and a noise critic Q^W is distilled from it (see the
    module docstring); false: DSRL-SAC, the critic learns Q(o, w) from the replayed noises."""
    noise_critic_lr: float = 3e-4
    """Learning rate of DSRL-NA's noise critic Q^W."""
    noise_critic_steps: int = 1
    """Distillation steps of Q^W before each actor step (DSRL-NA)."""

    def __post_init__(self) -> None:
        if self.noise_bound <= 0 or self.actor_lr <= 0 or self.alpha_init <= 0 or self.alpha_lr < 0:
            raise ValueError("dsrl.noise_bound, dsrl.actor_lr and dsrl.alpha_init must be > 0, dsrl.alpha_lr >= 0")
        if self.noise_critic_lr <= 0 or self.noise_critic_steps < 1:
            raise ValueError("dsrl.noise_critic_lr must be > 0 and dsrl.noise_critic_steps >= 1")


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
        self.noise_dim = math.prod(policy.noise_shape)
        self.action_dim = policy.config.act_steps * policy.spec.action.dim if cfg.noise_aliasing else self.noise_dim
        self.actor_opt = torch.optim.Adam(policy.actor.parameters(), lr=cfg.actor_lr)
        self.temperature = Temperature(cfg.alpha_init, cfg.target_entropy_per_dim * self.noise_dim,
                                       cfg.alpha_lr, learn=cfg.alpha_lr > 0)
        self.noise_critic: QEnsemble | None = None
        """DSRL-NA's Q^W(o, w), built beside the core's critic (attach_critic)."""
        self.noise_critic_opt: torch.optim.Optimizer | None = None

    def attach_critic(self, critic: QEnsemble | None) -> None:
        self.critic = critic
        if self.cfg.noise_aliasing and critic is not None:
            self.noise_critic = critic.like(self.noise_dim)
            self.noise_critic_opt = torch.optim.Adam(self.noise_critic.parameters(), lr=self.cfg.noise_critic_lr)

    def _critic_action(self, obs: Obs, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(chunk, critic action)` for noises `[B, H·A]`: the executed chunk (DSRL-NA) or the noise itself."""
        chunk = self.policy.decode(obs, noise)
        return chunk, executed_action(self.policy, chunk) if self.cfg.noise_aliasing else noise

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        noise, _ = self.policy.noise(obs, deterministic)
        return self._critic_action(obs, noise)

    def _prior_noise(self, batch: int, device: torch.device) -> torch.Tensor:
        """w ~ N(0, I) clipped to the actor's range: the base's own sampling."""
        bound = self.policy.config.noise_bound
        return torch.randn(batch, self.noise_dim, device=device).clamp(-bound, bound)

    @torch.no_grad()
    def warmup_act(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's own sampling, so the critic sees valid actions."""
        obs0 = next(iter(obs.values()))
        return self._critic_action(obs, self._prior_noise(obs0.shape[0], obs0.device))

    def critic_action_from_chunk(self, chunk: torch.Tensor) -> torch.Tensor | None:
        return executed_action(self.policy, chunk) if self.cfg.noise_aliasing else None

    @torch.no_grad()
    def target_action(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        noise, logprob = self.policy.noise(obs)
        return self._critic_action(obs, noise)[1], logprob

    def alpha(self) -> float:
        return float(self.temperature.alpha)

    def distill_noise_critic(self, obs: Obs, critic: QEnsemble) -> dict[str, float]:
        """One step on Σ_j mean (Q^W_j(o, w) - mean_k Q^A_k(o, decode(o, w)))², half the noises from the prior,
        half from the actor (DSRL-NA)."""
        obs0 = next(iter(obs.values()))
        n = obs0.shape[0]
        with torch.no_grad():
            noise = torch.cat([self._prior_noise(n - n // 2, obs0.device),
                               self.policy.noise({k: v[: n // 2] for k, v in obs.items()})[0]])
            target = critic(obs, self._critic_action(obs, noise)[1]).mean(dim=0)
        loss = ((self.noise_critic(obs, noise) - target[None]) ** 2).mean(dim=1).sum()
        self.noise_critic_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.noise_critic_opt.step()
        return {"noise_critic_loss": loss.item() / self.noise_critic.ensemble}

    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        """SAC's actor step in noise space: min E[α log π_ψ(w|o) - mean_j Q_j(o, w)] against the noise critic
        (DSRL-NA, distilled first) or the core's Q(o, w) (DSRL-SAC), then the α step."""
        stats: dict[str, float] = {}
        q_noise = critic
        if self.cfg.noise_aliasing:
            for _ in range(self.cfg.noise_critic_steps):
                stats = self.distill_noise_critic(batch.obs, critic)
            q_noise = self.noise_critic
        noise, logprob = self.policy.noise(batch.obs)
        q = q_noise(batch.obs, noise).mean(dim=0)
        loss = (self.temperature.alpha * logprob - q).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.actor_opt.step()
        return {**stats, "actor_loss": loss.item(), "noise_abs": noise.abs().mean().item(),
                **self.temperature.update(logprob)}

    def state_dict(self) -> dict:
        state = {"actor_opt": self.actor_opt.state_dict(), "temperature": self.temperature.state()}
        if self.noise_critic is not None:
            state.update(noise_critic=self.noise_critic.state_dict(), noise_critic_opt=self.noise_critic_opt.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.temperature.load(state["temperature"])
        if self.noise_critic is not None:
            self.noise_critic.load_state_dict(state["noise_critic"])
            self.noise_critic_opt.load_state_dict(state["noise_critic_opt"])
