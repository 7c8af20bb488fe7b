"""Residual SAC: soft actor-critic on a bounded residual over a frozen base policy (Policy Decorator), with
RLPD's demo mixing.

The residual policy of robotft.policies.residual: a = clip(a^base + s ⊙ b tanh(u)), u ~ N(r_θ(o, a^base), σ²),
trained off-policy with SAC, as Policy Decorator does (Yuan et al. 2024, arXiv 2412.13630), on RLPD's recipe
(Ball et al. 2023, arXiv 2302.02948). The critic sees the executed part of the chunk (normalized,
`act_steps × A`: Policy Decorator's "sum" critic input), so transitions from demonstrations or recorded
deployments enter it unchanged (`offpolicy.demo_data`). The actor minimises E[α log π(r | o) - mean_j Q_j(o, a(r))]
with a reparameterised r, log π summed over the executed entries (with the tanh's change of variables). Only r_θ
and σ train; a checkpoint that is not a residual policy is wrapped in a zero-initialised residual at the start (so
fine-tuning starts exactly at the base).

Policy Decorator's two controls on exploration (ibid. §4.2) are the defaults: the residual is bounded
(`residual_bound`, so no critic error can move the arm far from the base), and the progressive exploration
schedule applies the residual in each env's chunk with probability min(1, t / H) at env step t
(`progressive_steps` = H), so early rollouts stay mostly the base's while the critic learns. As in Policy
Decorator's runs, the critic learns from the sparse success minus 1 per chunk (`offpolicy.reward_offset`), so Q
measures the time to success.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs
from robotft.policies.base import Policy
from robotft.policies.denoising_chain import gaussian_logprob_elementwise
from robotft.policies.residual import ResidualPolicy, wrap_residual
from robotft.rl.algorithm import register_algorithm
from robotft.rl.offpolicy import OffPolicyAlgorithm, executed_action
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import ReplayBatch
from robotft.rl.sac import Temperature


@dataclass
class ResidualSACConfig:
    """Residual-SAC settings (the off-policy core's are under `offpolicy.`)."""

    residual_hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the residual MLP (used when wrapping a base policy)."""
    log_std_init: float = -2.0
    """Initial log σ of the residual's pre-squash u (used when wrapping a base policy)."""
    residual_bound: float = 0.1
    """b: the residual is b · tanh(u), at most b normalized action units (Policy Decorator's α, 0.1 by
    default there); 0 leaves it an unbounded Gaussian. Used when wrapping a base policy (a residual checkpoint
    keeps its own `policy.bound`)."""
    progressive_steps: int = 5_000
    """H of the progressive exploration schedule: at env step t each env's chunk carries the residual with
    probability min(1, t / H), otherwise it is the base's alone (Policy Decorator uses 10⁵ of 4·10⁶ steps; this
    default is sized for a CPU run of ~10⁴-10⁵ env steps). 0: the residual from the start."""
    base_memo_size: int = 500_000
    """Observation histories whose base chunk is kept (robotft.rl.residual_sac.BaseChunkMemo); 0 turns the memo
    off."""
    actor_lr: float = 1e-4
    """Learning rate of the residual (at 3e-4 the toy suite's residual overshoots and collapses)."""
    alpha_init: float = 0.01
    """Initial entropy coefficient α."""
    alpha_lr: float = 3e-4
    """Learning rate of log α; 0 keeps α fixed."""
    target_entropy_per_dim: float = -1.0
    """Target entropy per executed action entry (SAC's heuristic: -1), of the unit residual tanh(u) when the
    residual is bounded (the target in r's units is lower by log b)."""

    def __post_init__(self) -> None:
        if self.actor_lr <= 0 or self.alpha_init <= 0 or self.alpha_lr < 0:
            raise ValueError("residual_sac.actor_lr and residual_sac.alpha_init must be > 0, alpha_lr >= 0")
        if self.residual_bound < 0 or self.progressive_steps < 0 or self.base_memo_size < 0:
            raise ValueError(f"residual_sac.residual_bound, progressive_steps and base_memo_size must be >= 0, got "
                             f"{self.residual_bound}, {self.progressive_steps} and {self.base_memo_size}")


class BaseChunkMemo:
    """The frozen base's chunk per observation history, computed once: every critic and actor step needs the base's
    chunk for a minibatch of replayed histories (a 20-step denoising chain per row was 85% of an update's time on
    PushCube), and the same histories are drawn again and again. Exact only for a base whose deterministic chunk is
    a function of the observation, so the first call runs the base twice and keeps the memo only if both agree bit
    for bit (a DDPM base with `deterministic_sampler: model_std` still samples, and is never memoised). Keys are
    16-byte digests of each row's bytes; the memo is cleared when it holds `max_entries`."""

    def __init__(self, base_chunk: Callable[[Obs], torch.Tensor], max_entries: int) -> None:
        self.base_chunk, self.max_entries = base_chunk, max_entries
        self.chunks: dict[bytes, torch.Tensor] = {}
        self.enabled: bool | None = None if max_entries > 0 else False
        """None until the first call has checked that the base is deterministic."""

    @staticmethod
    def _keys(obs: Obs) -> list[bytes]:
        rows = [v.detach().cpu().reshape(v.shape[0], -1).numpy() for _, v in sorted(obs.items())]
        return [hashlib.blake2b(b"".join(r[i].tobytes() for r in rows), digest_size=16).digest()
                for i in range(rows[0].shape[0])]

    def __call__(self, obs: Obs) -> torch.Tensor:
        if self.enabled is None:
            first = self.base_chunk(obs)
            self.enabled = torch.equal(first, self.base_chunk(obs))
            if self.enabled:
                self.chunks.update(zip(self._keys(obs), first.unbind(0), strict=True))
            return first
        if not self.enabled:
            return self.base_chunk(obs)
        keys = self._keys(obs)
        missing = [i for i, k in enumerate(keys) if k not in self.chunks]
        if missing:
            if len(self.chunks) + len(missing) > self.max_entries:
                self.chunks.clear()
            rows = torch.tensor(missing, device=next(iter(obs.values())).device)
            fresh = self.base_chunk({k: v[rows] for k, v in obs.items()})
            self.chunks.update(zip((keys[i] for i in missing), fresh.unbind(0), strict=True))
        return torch.stack([self.chunks[k] for k in keys])


@register_algorithm
class ResidualSAC(OffPolicyAlgorithm):
    name = "residual_sac"
    config_cls = ResidualSACConfig
    # The critic learns alone for 3 iterations and twice as often as the actor: on the toy suite the residual
    # otherwise follows an untrained Q and collapses. Reward - 1 per chunk: Policy Decorator's sparse reward.
    offpolicy_defaults: ClassVar[dict[str, Any]] = {"critic_warmup_iters": 3, "actor_every": 2,
                                                    "reward_offset": -1.0}

    def __init__(self, policy: Policy, cfg: ResidualSACConfig) -> None:
        if not isinstance(policy, ResidualPolicy):
            policy = wrap_residual(policy, cfg.residual_hidden, cfg.log_std_init, cfg.residual_bound)
        self.policy, self.cfg = policy, cfg
        self.env_steps = 0
        """Env steps acted so far (chunks × act_steps per env), the clock of the progressive schedule."""
        self.base_chunk = BaseChunkMemo(policy.base_chunk, cfg.base_memo_size)
        self.act_steps = policy.config.act_steps
        self.action_dim = self.act_steps * policy.act_dim
        params = [*policy.residual_net.parameters(), *policy.log_std.parameters()]
        self.actor_opt = torch.optim.Adam(params, lr=cfg.actor_lr)
        # The target refers to the unit residual tanh(u), as Policy Decorator's does: r = b tanh(u) has log b
        # nats less entropy per entry, so with b = 0.1 a target of -1 per entry in r's units could not be met
        # (uniform on [-b, b] has log 2b = -1.6) and α would grow without end.
        bound = policy.config.bound
        per_dim = cfg.target_entropy_per_dim + (math.log(bound) if bound > 0 else 0.0)
        self.temperature = Temperature(cfg.alpha_init, per_dim * self.action_dim, cfg.alpha_lr,
                                       learn=cfg.alpha_lr > 0)

    def critic_action_from_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        return executed_action(self.policy, chunk)

    def _sample(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(chunk [N, H, A] env units, log π(r|o) [N] over the executed entries, base chunk [N, H, A])`,
        reparameterised in r."""
        base = self.base_chunk(obs)
        mean, std = self.policy.residual_mean(obs, base), self.policy.std()
        residual = mean if deterministic else mean + std * torch.randn_like(mean)
        logdensity = gaussian_logprob_elementwise(residual, mean, std) - self.policy.squash_log_det(residual)
        logprob = logdensity[:, : self.act_steps].sum(dim=(1, 2))
        return self.policy.to_actions(base, residual), logprob, base

    def residual_probability(self) -> float:
        """min(1, t / H): the progressive schedule's chance that a chunk carries the residual."""
        horizon = self.cfg.progressive_steps
        return 1.0 if horizon == 0 else min(1.0, self.env_steps / horizon)

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, _, base = self._sample(obs, deterministic)
        if not deterministic:
            # Progressive exploration: where the coin says no, the env executes the base's chunk (a zero
            # residual, clipped as to_actions clips), and the critic sees the action actually executed.
            keep = torch.rand(chunk.shape[0], device=chunk.device) < self.residual_probability()
            chunk = torch.where(keep[:, None, None], chunk, self.policy.to_actions(base, torch.zeros_like(base)))
            self.env_steps += chunk.shape[0] * self.act_steps
        return chunk, self.critic_action_from_chunk(chunk)

    @torch.no_grad()
    def target_action(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, logprob, _ = self._sample(obs)
        return self.critic_action_from_chunk(chunk), logprob

    def alpha(self) -> float:
        return float(self.temperature.alpha)

    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        """min E[α log π(r|o) - mean_j Q_j(o, a(r))], then the α step."""
        chunk, logprob, _ = self._sample(batch.obs)
        q = critic(batch.obs, self.critic_action_from_chunk(chunk)).mean(dim=0)
        loss = (self.temperature.alpha * logprob - q).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.actor_opt.step()
        return {"actor_loss": loss.item(), "noise_std": self.policy.std().mean().item(),
                "residual_probability": self.residual_probability(), **self.temperature.update(logprob)}

    def state_dict(self) -> dict:
        return {"actor_opt": self.actor_opt.state_dict(), "temperature": self.temperature.state(),
                "env_steps": self.env_steps}

    def load_state_dict(self, state: dict) -> None:
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.temperature.load(state["temperature"])
        self.env_steps = int(state.get("env_steps", 0))
