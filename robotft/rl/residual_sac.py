"""Residual SAC: soft actor-critic on a Gaussian residual over a frozen base policy, with RLPD's demo mixing.

The residual policy of ResiP (robotft.policies.residual): a = clip(a^base + s ⊙ r), r ~ N(r_θ(o, a^base), σ²),
trained off-policy with SAC instead of by PPO, on RLPD's recipe (Ball et al. 2023, arXiv 2302.02948). The critic sees the executed part of the chunk
(normalized, `act_steps × A`), so transitions from demonstrations or recorded deployments enter it unchanged
(`offpolicy.demo_data`). The actor minimises E[α log π(r | o) - mean_j Q_j(o, a(r))] with a reparameterised r,
log π summed over the executed entries. Only r_θ and σ train; a checkpoint that is not a residual policy is wrapped
in a zero-initialised residual at the start (so fine-tuning starts exactly at the base).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs
from robotft.policies.base import Policy
from robotft.policies.denoising_chain import gaussian_logprob_elementwise
from robotft.policies.residual import ResidualPolicy, wrap_residual
from robotft.rl.algorithm import register_algorithm
from robotft.rl.offpolicy import OffPolicyAlgorithm
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import ReplayBatch
from robotft.rl.sac import Temperature


@dataclass
class ResidualSACConfig:
    """Residual-SAC settings (the off-policy core's are under `offpolicy.`)."""

    residual_hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the residual MLP (used when wrapping a base policy)."""
    log_std_init: float = -2.0
    """Initial log σ of the residual, normalized action units (used when wrapping a base policy)."""
    actor_lr: float = 1e-4
    """Learning rate of the residual (at 3e-4 the toy suite's residual overshoots and collapses)."""
    alpha_init: float = 0.01
    """Initial entropy coefficient α."""
    alpha_lr: float = 3e-4
    """Learning rate of log α; 0 keeps α fixed."""
    target_entropy_per_dim: float = -1.0
    """Target entropy per executed action entry (SAC's heuristic: -1)."""

    def __post_init__(self) -> None:
        if self.actor_lr <= 0 or self.alpha_init <= 0 or self.alpha_lr < 0:
            raise ValueError("residual_sac.actor_lr and residual_sac.alpha_init must be > 0, alpha_lr >= 0")


@register_algorithm
class ResidualSAC(OffPolicyAlgorithm):
    name = "residual_sac"
    config_cls = ResidualSACConfig
    # The critic learns alone for 3 iterations and twice as often as the actor: on the toy suite the residual
    # otherwise follows an untrained Q and collapses.
    offpolicy_defaults: ClassVar[dict[str, Any]] = {"critic_warmup_iters": 3, "actor_every": 2}

    def __init__(self, policy: Policy, cfg: ResidualSACConfig) -> None:
        if not isinstance(policy, ResidualPolicy):
            policy = wrap_residual(policy, cfg.residual_hidden, cfg.log_std_init)
        self.policy, self.cfg = policy, cfg
        self.act_steps = policy.config.act_steps
        self.action_dim = self.act_steps * policy.act_dim
        params = [*policy.residual_net.parameters(), *policy.log_std.parameters()]
        self.actor_opt = torch.optim.Adam(params, lr=cfg.actor_lr)
        self.temperature = Temperature(cfg.alpha_init, cfg.target_entropy_per_dim * self.action_dim,
                                       cfg.alpha_lr, learn=cfg.alpha_lr > 0)

    def critic_action_from_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        """The executed `act_steps` of a chunk (env units), normalized and flattened: `[N, act_steps · A]`."""
        return self.policy.normalizer.normalize("action", chunk[:, : self.act_steps]).flatten(1)

    def _sample(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(chunk [N, H, A] env units, log π(r|o) [N] over the executed entries)`, reparameterised in r."""
        base = self.policy.base_chunk(obs)
        mean, std = self.policy.residual_mean(obs, base), self.policy.std()
        residual = mean if deterministic else mean + std * torch.randn_like(mean)
        logprob = gaussian_logprob_elementwise(residual, mean, std)[:, : self.act_steps].sum(dim=(1, 2))
        return self.policy.to_actions(base, residual), logprob

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, _ = self._sample(obs, deterministic)
        return chunk, self.critic_action_from_chunk(chunk)

    @torch.no_grad()
    def target_action(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, logprob = self._sample(obs)
        return self.critic_action_from_chunk(chunk), logprob

    def alpha(self) -> float:
        return float(self.temperature.alpha)

    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        """min E[α log π(r|o) - mean_j Q_j(o, a(r))], then the α step."""
        chunk, logprob = self._sample(batch.obs)
        q = critic(batch.obs, self.critic_action_from_chunk(chunk)).mean(dim=0)
        loss = (self.temperature.alpha * logprob - q).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.actor_opt.step()
        return {"actor_loss": loss.item(), "noise_std": self.policy.std().mean().item(),
                **self.temperature.update(logprob)}

    def state_dict(self) -> dict:
        return {"actor_opt": self.actor_opt.state_dict(), "temperature": self.temperature.state()}

    def load_state_dict(self, state: dict) -> None:
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.temperature.load(state["temperature"])
