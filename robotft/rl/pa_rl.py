"""PA-RL: policy-agnostic RL (Mark et al. 2024, arXiv 2412.06685).

Any policy with a stochastic `predict_chunk` and a BC `loss` (diffusion, flow, Gaussian, ...) is improved through
its actions rather than its likelihood:

1. global step: draw `num_samples` chunks from the policy at an observation and keep the one the critic ranks
   highest, mean_j Q_j(o, a);
2. local step: `local_steps` gradient-ascent steps on that chunk's executed part, a ← a + η ∇_a Q(o, a), clipped to
   the actions the policy can produce, keeping the point of the path the critic ranks highest (the reference
   code's `keep_action_with_max_value`: a step that overshoots never makes the chunk worse by Q);
3. distillation: train the policy with its own BC loss on the optimized chunks (`distill_steps` per actor step).

Rollouts act with steps 1-2 (the policy proposes, the critic chooses); the critic's target uses step 1 (a max over
the policy's samples, no entropy term). The critic sees the executed part of a chunk, normalized, so
demonstrations and recorded deployments mix into its minibatches (RLPD). The checkpoint is the distilled policy
itself, evaluated by its own `predict_chunk`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs, repeat_obs
from robotft.policies.base import Policy
from robotft.rl.algorithm import register_algorithm
from robotft.rl.offpolicy import OffPolicyAlgorithm, executed_action
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import ReplayBatch


@dataclass
class PARLConfig:
    """PA-RL settings (the off-policy core's are under `offpolicy.`)."""

    num_samples: int = 8
    """Chunks drawn from the policy per observation for the global (re-ranking) step."""
    local_steps: int = 10
    """Gradient-ascent steps on the best chunk's executed part (0: global step only); the reference code's 10."""
    local_lr: float = 3e-4
    """Step size η of the local step, normalized action units per unit of ∇_a Q (the reference code's 3e-4: the
    gradient of a critic fitted to a few episodes is large and mostly wrong, and the global step does the work)."""
    distill_lr: float = 5e-5
    """Learning rate of the policy's BC loss on the optimized chunks (the reference code's 5e-5)."""
    distill_steps: int = 1
    """Policy gradient steps per actor step."""

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.distill_steps < 1 or self.local_steps < 0:
            raise ValueError("pa_rl.num_samples and pa_rl.distill_steps must be >= 1, pa_rl.local_steps >= 0")
        if self.local_lr < 0 or self.distill_lr <= 0:
            raise ValueError("pa_rl.local_lr must be >= 0 and pa_rl.distill_lr > 0")


@register_algorithm
class PARL(OffPolicyAlgorithm):
    name = "pa_rl"
    config_cls = PARLConfig
    offpolicy_defaults: ClassVar[dict[str, Any]] = {"critic_warmup_iters": 3}
    """Re-ranking with an untrained Q is noise: the critic learns alone for 3 iterations."""
    target_is_policy_sample = False

    def __init__(self, policy: Policy, cfg: PARLConfig) -> None:
        self.policy, self.cfg = policy, cfg
        self.act_steps = policy.config.act_steps
        self.act_dim = policy.spec.action.dim
        self.action_dim = self.act_steps * self.act_dim
        self.critic: QEnsemble | None = None
        """Set by the core; rollouts re-rank with it."""
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=cfg.distill_lr)
        self.low = torch.tensor(policy.spec.action.low, dtype=torch.float32)
        self.high = torch.tensor(policy.spec.action.high, dtype=torch.float32)

    def critic_action_from_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        return executed_action(self.policy, chunk)

    @torch.no_grad()
    def global_step(self, obs: Obs, critic: QEnsemble) -> torch.Tensor:
        """The highest-ranked of `num_samples` policy chunks per observation: `[B, H, A]` env units."""
        n = self.cfg.num_samples
        batch = next(iter(obs.values())).shape[0]
        rep = repeat_obs(obs, n)
        chunks = self.policy.predict_chunk(rep, deterministic=False)
        q = critic(rep, self.critic_action_from_chunk(chunks)).mean(dim=0).view(batch, n)
        best = q.argmax(dim=1) + torch.arange(batch, device=q.device) * n
        return chunks[best]

    def normalized_bounds(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The box the local step stays in, normalized units `[A]`: the env's action bounds and, under a min-max
        normalizer, the demonstrations' range [-1, 1], which the policies' samplers clip their actions to: a chunk
        outside it is one the policy cannot produce, and distillation would chase it."""
        norm = self.policy.normalizer
        low = norm.normalize("action", self.low.to(device))
        high = norm.normalize("action", self.high.to(device))
        if norm.mode["action"] == "minmax":
            low, high = low.clamp(min=-1.0), high.clamp(max=1.0)
        return low, high

    def local_step(self, obs: Obs, chunk: torch.Tensor, critic: QEnsemble) -> torch.Tensor:
        """`local_steps` ascent steps of the executed part on mean_j Q_j within `normalized_bounds`; per chunk,
        the point of the path (start included) with the highest mean_j Q_j."""
        if self.cfg.local_steps == 0 or self.cfg.local_lr == 0:
            return chunk
        norm = self.policy.normalizer
        low, high = self.normalized_bounds(chunk.device)
        x = torch.clamp(norm.normalize("action", chunk[:, : self.act_steps]), low, high).detach()
        best, best_q = x, torch.full(x.shape[:1], -torch.inf, device=x.device)
        for step in range(self.cfg.local_steps + 1):
            with torch.enable_grad():  # rollouts run under no_grad; the ascent needs ∇_a Q all the same
                x.requires_grad_(True)
                q = critic(obs, x.flatten(1)).mean(dim=0)
                grad, = torch.autograd.grad(q.sum(), x)
            x, q = x.detach(), q.detach()
            better = q > best_q
            best, best_q = torch.where(better[:, None, None], x, best), torch.where(better, q, best_q)
            if step < self.cfg.local_steps:
                x = torch.clamp(x + self.cfg.local_lr * grad, low, high)
        out = chunk.clone()
        out[:, : self.act_steps] = norm.unnormalize("action", best)
        return out

    def improve(self, obs: Obs, critic: QEnsemble) -> torch.Tensor:
        """PA-RL's optimized chunks `[B, H, A]` env units: the global then the local step."""
        return self.local_step(obs, self.global_step(obs, critic), critic).detach()

    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.critic is None:
            chunk = self.policy.predict_chunk(obs, deterministic=deterministic)
        else:
            chunk = self.improve(obs, self.critic)
        return chunk, self.critic_action_from_chunk(chunk)

    @torch.no_grad()
    def warmup_act(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's own samples, without the critic (it knows nothing yet)."""
        chunk = self.policy.predict_chunk(obs, deterministic=False)
        return chunk, self.critic_action_from_chunk(chunk)

    @torch.no_grad()
    def target_action(self, obs: Obs) -> tuple[torch.Tensor, None]:
        return self.critic_action_from_chunk(self.global_step(obs, self.critic)), None

    @torch.no_grad()
    def policy_action(self, obs: Obs) -> torch.Tensor:
        """One sample of the policy itself, not the best of `num_samples`: what the conservative term pushes down is
        the policy's own distribution."""
        return self.critic_action_from_chunk(self.policy.predict_chunk(obs, deterministic=False))

    def distill(self, obs: Obs, targets: torch.Tensor) -> list[float]:
        """`distill_steps` steps of the policy's own BC loss towards `targets` `[B, H, A]`; the losses before each."""
        losses = []
        for _ in range(self.cfg.distill_steps):
            loss, _ = self.policy.loss({"obs": obs, "action": targets})
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.policy.on_train_step_end()
            losses.append(loss.item())
        return losses

    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        targets = self.improve(batch.obs, critic)
        self.policy.train()
        losses = self.distill(batch.obs, targets)
        self.policy.eval()
        return {"distill_loss": float(sum(losses) / len(losses))}

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])
