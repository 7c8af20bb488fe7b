"""The policy's input on a rig: the observation history, and the plan anchors a closed-loop policy reads.

A rig runs one episode at a time, so its observations are a history of dicts (oldest first) that the runner keeps.
Most policies read only that. A closed-loop residual (`plan_every` K > 0, `residual_ppo_step`) also reads what
`ChunkedEnv` adds in simulation: `plan/<key>`, the history at the step where its base's current plan was made (the
episode's first step, then every K steps), and `plan_step`, the index of the current step in that plan. Such a
policy executes one action per call, so here the calls since the episode started are its step count, and the
anchors follow ChunkedEnv's rule exactly: a zero residual on the rig replays its base as the base runs there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from robotft.envs.chunked import PLAN_PREFIX, PLAN_STEP_KEY


class PolicyInput:
    """Builds the policy's observation `{key: [1, obs_steps, *shape]}` from a history, one call per policy query.

    Example:
        inputs = PolicyInput.for_policy(policy, "cpu")
        inputs.reset()                      # each episode
        chunk = policy.predict_chunk(inputs(history), deterministic=True)
    """

    def __init__(self, obs_keys: Sequence[str], obs_steps: int, plan_every: int, device: str | torch.device) -> None:
        self.obs_keys = list(obs_keys)
        self.obs_steps = obs_steps
        self.plan_every = plan_every
        """Steps between plan anchors (the policy config's `plan_every`); 0: the policy reads none."""
        self.device = device
        self._steps = 0
        self._anchor: dict[str, torch.Tensor] = {}

    @classmethod
    def for_policy(cls, policy: Any, device: str | torch.device) -> PolicyInput:
        config = policy.config
        return cls(config.obs_keys, int(config.obs_steps), int(getattr(config, "plan_every", 0)), device)

    def reset(self) -> None:
        """A new episode, or control handed back after a take-over: the next call starts a new plan."""
        self._steps = 0
        self._anchor = {}

    def __call__(self, history: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """The observation for one query from `history` (`obs_steps` dicts, oldest first); with plan anchors, the
        query counts as one executed step."""
        if len(history) != self.obs_steps:
            raise ValueError(f"the policy reads a history of {self.obs_steps} observations, got {len(history)}")
        obs = {k: torch.as_tensor(np.stack([h[k] for h in history]))[None].to(self.device) for k in self.obs_keys}
        if not self.plan_every:
            return obs
        step = self._steps % self.plan_every
        if step == 0:
            self._anchor = {k: v.clone() for k, v in obs.items()}
        obs.update({PLAN_PREFIX + k: v for k, v in self._anchor.items()})
        obs[PLAN_STEP_KEY] = torch.full((1, self.obs_steps, 1), float(step), device=self.device)
        self._steps += 1
        return obs
