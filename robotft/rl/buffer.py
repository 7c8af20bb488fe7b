"""Rollout storage over action chunks and generalized advantage estimation.

One transition is one *chunk*: the policy sees an observation history, samples a chunk, the env executes
`act_steps` of it and returns the summed reward. Tensors stay on the env's device (ManiSkill GPU style).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from robotft.distributed import DistContext
from robotft.envs.base import Obs


@dataclass
class RolloutBuffer:
    """`num_steps` chunks from `num_envs` envs. Filled with `add`, read flattened with `flat`."""

    num_steps: int
    num_envs: int
    device: torch.device
    obs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per key `[T, B, obs_steps, ...]`."""
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    """Whatever the algorithm needs to re-score an action (e.g. the denoising chain), `[T, B, ...]`."""
    logprobs: torch.Tensor | None = None
    """`[T, B, K]` log-probabilities at sampling time of each of the K scored transitions."""
    rewards: torch.Tensor = None  # type: ignore[assignment]
    """`[T, B]` (scaled) chunk rewards, with the truncation bootstrap folded in."""
    dones: torch.Tensor = None  # type: ignore[assignment]
    """`[T, B]` 1.0 where the episode ended with this chunk (terminated or truncated)."""
    values: torch.Tensor = None  # type: ignore[assignment]
    """`[T, B]` critic values V(s_t) at sampling time."""
    start_seeds: torch.Tensor | None = None
    """`[T, B]` long: the start state (seed) of the episode that ended with each chunk, -1 elsewhere; recorded
    for group-relative advantages per start state (`rl.group_size`)."""
    step: int = 0

    def __post_init__(self) -> None:
        shape = (self.num_steps, self.num_envs)
        self.rewards = torch.zeros(shape, device=self.device)
        self.dones = torch.zeros(shape, device=self.device)
        self.values = torch.zeros(shape, device=self.device)

    def add(
        self,
        obs: Obs,
        sample: dict[str, torch.Tensor],
        logprob: torch.Tensor,
        value: torch.Tensor,
        reward: torch.Tensor,
        done: torch.Tensor,
    ) -> None:
        t = self.step
        if t >= self.num_steps:
            raise IndexError(f"rollout buffer is full ({self.num_steps} steps)")
        if t == 0:
            self.obs = {k: self._alloc(v) for k, v in obs.items()}
            self.samples = {k: self._alloc(v) for k, v in sample.items()}
            self.logprobs = self._alloc(logprob)
        for k, v in obs.items():
            self.obs[k][t] = v
        for k, v in sample.items():
            self.samples[k][t] = v
        self.logprobs[t] = logprob
        self.values[t] = value
        self.rewards[t] = reward
        self.dones[t] = done.float()
        self.step += 1

    def _alloc(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros((self.num_steps, *like.shape), dtype=like.dtype, device=self.device)

    def flat(self) -> dict[str, object]:
        """Everything flattened over `[T, B]` → `[N]` for minibatching."""

        def f(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, *x.shape[2:])

        return {
            "obs": {k: f(v) for k, v in self.obs.items()},
            "samples": {k: f(v) for k, v in self.samples.items()},
            "logprobs": f(self.logprobs),
            "values": f(self.values),
        }


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16).

    δ_t = r_t + γ V(s_{t+1}) (1 - d_t) - V(s_t),  A_t = δ_t + γ λ (1 - d_t) A_{t+1}.
    `rewards, values, dones`: `[T, B]`; `next_value`: `[B]`, the value of the observation after the last
    chunk. Truncated episodes are handled by the caller folding γ V(final_obs) into the reward.
    Returns `(advantages, returns)`, each `[T, B]`.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last_adv = torch.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        next_v = next_value if t == num_steps - 1 else values[t + 1]
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_v * nonterminal - values[t]
        last_adv = delta + gamma * gae_lambda * nonterminal * last_adv
        advantages[t] = last_adv
    return advantages, advantages + values


class RunningRewardScaler:
    """Divide rewards by the running std of the discounted return (as in DPPO/CleanRL's
    `NormalizeReward`), so the critic sees returns of order one whatever the task's reward scale.
    Under torchrun (`dist`) the statistics are of every rank's returns, so all ranks scale alike."""

    def __init__(self, num_envs: int, gamma: float, device: torch.device, eps: float = 1e-8,
                 dist: DistContext | None = None) -> None:
        self.gamma = gamma
        self.eps = eps
        self.dist = dist or DistContext()
        self.ret = torch.zeros(num_envs, device=device, dtype=torch.float64)
        self.count = torch.tensor(1e-4, dtype=torch.float64)
        self.mean = torch.tensor(0.0, dtype=torch.float64)
        self.var = torch.tensor(1.0, dtype=torch.float64)

    def __call__(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        self.ret = self.ret * self.gamma + reward.double()
        self._update(self.ret.cpu())
        self.ret = self.ret * (1.0 - done.double())
        return (reward.double() / torch.sqrt(self.var + self.eps)).to(reward.dtype)

    def _update(self, x: torch.Tensor) -> None:
        # Chan et al.'s parallel variance update of the running mean/var with a batch of returns.
        batch_mean, batch_var, n = self.dist.moments(x)
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"ret": self.ret, "count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.ret = state["ret"].to(self.ret.device)
        self.count, self.mean, self.var = state["count"], state["mean"], state["var"]
