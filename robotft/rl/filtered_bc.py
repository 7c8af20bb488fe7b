"""Filtered BC: behaviour cloning on the policy's own successful rollouts (and successful demonstrations).

The policy rolls out with its own sampler (`predict_chunk(deterministic=False)`); when an episode ends in
success, its chunks become training data, and the policy takes steps of its own BC `loss` on minibatches drawn
only from successful episodes (the replay buffer labels every transition with its episode's outcome). This is
rejection-sampling fine-tuning, the binary-reward case of reward-weighted regression (Peters & Schaal 2007) and
the cheap baseline the RL methods must beat. No critic is trained. Demonstrations from `offpolicy.demo_data`
(successful episodes only) mix into the minibatches at `offpolicy.demo_ratio`; by default they are the dataset the
source policy was behaviour-cloned on, with 8 BC steps per collected chunk (`offpolicy.utd`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs
from robotft.policies.base import Policy
from robotft.rl.algorithm import register_algorithm
from robotft.rl.offpolicy import SOURCE_DEMOS, OffPolicyAlgorithm
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import ReplayBatch


@dataclass
class FilteredBCConfig:
    """Filtered-BC settings (the off-policy core's are under `offpolicy.`; `offpolicy.utd` sets the BC steps)."""

    lr: float = 1e-4
    """Learning rate of the policy's BC loss."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"filtered_bc.lr must be > 0, got {self.lr}")


@register_algorithm
class FilteredBC(OffPolicyAlgorithm):
    name = "filtered_bc"
    config_cls = FilteredBCConfig
    uses_critic = False
    only_successful = True
    # Measured on PushCube, PickPlaceCan and PegInsertionSide (docs/offpolicy.md): with the BC's demonstrations
    # mixed in and 8 BC steps per collected chunk it gained; with one step per chunk it did not move PushCube.
    offpolicy_defaults: ClassVar[dict[str, Any]] = {"demo_data": SOURCE_DEMOS, "utd": 8.0}

    def __init__(self, policy: Policy, cfg: FilteredBCConfig) -> None:
        self.policy, self.cfg = policy, cfg
        self.act_steps = policy.config.act_steps
        self.action_dim = self.act_steps * policy.spec.action.dim
        self.opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)

    def critic_action_from_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        """The executed part, normalized (stored for the record; no critic reads it)."""
        return self.policy.normalizer.normalize("action", chunk[:, : self.act_steps]).flatten(1)

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.policy.predict_chunk(obs, deterministic=deterministic)
        return chunk, self.critic_action_from_chunk(chunk)

    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        """One BC step on chunks of successful episodes."""
        if not bool(batch.success.all()):
            raise RuntimeError("filtered BC was handed a transition of an unsuccessful episode")
        self.policy.train()
        loss, _ = self.policy.loss({"obs": batch.obs, "action": batch.chunk})
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.policy.on_train_step_end()
        self.policy.eval()
        return {"bc_loss": loss.item()}

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])
