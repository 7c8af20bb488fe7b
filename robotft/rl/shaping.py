"""Potential-based reward shaping of a sparse success reward with the env's dense reward as the potential.

Ng, Harada & Russell (1999), "Policy invariance under reward transformations: theory and application to reward
shaping", Theorem 1: adding F(s, s') = γ Φ(s') − Φ(s) to every reward leaves the optimal policies unchanged for any
potential Φ over states. Here the transition is one executed chunk (the PPO core's MDP), the reward shaped is the
sparse success and Φ(s) is the env's dense reward at the last env step that reached s (robosuite's staged reward,
ManiSkill's `dense` or `normalized_dense`: progress towards success measured on the state):

    r'_k = 1[chunk k ends the episode in success] + γ Φ(s_{k+1}) − Φ(s_k),

with Φ = 0 at an episode's first state (no step reached it) and at a state that ends it (terminal). Over an episode
that ends at chunk T the shaping terms telescope, Σ_k γ^k (γ Φ(s_{k+1}) − Φ(s_k)) = γ^T Φ(s_T) − Φ(s_0) = 0, so the
return is the sparse one: the dense reward only moves credit to the chunks that made progress (reaching, grasping,
lifting) or lost it, which the critic and GAE see at once. Unlike the dense reward itself, it never pays the policy
to linger near the goal. At a time limit the episode is cut, not ended: Φ(s_T) stays, and the PPO core bootstraps.

A dense reward that is not a function of the state reached (locomotion's reward per unit of forward motion, the toy
suite's progress per step) is not a potential; shaping with it is refused (`check_shaping_env`).
"""

from __future__ import annotations

import torch

from robotft.config import EnvConfig


class PotentialShaping:
    """Per env, Φ of the state the envs are in; turns each chunk's env reward into r'_k."""

    def __init__(self, num_envs: int, gamma: float, device: torch.device | str) -> None:
        self.gamma = gamma
        self.potential = torch.zeros(num_envs, device=device)
        """Φ(s_k) for each env's current state (0 at an episode's first state)."""

    def restart(self) -> None:
        """Every env starts a new episode (a reset outside the rollout, e.g. after an evaluation)."""
        self.potential.zero_()

    def __call__(self, info: dict, terminated: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """r'_k `[B]` for the chunk ChunkedEnv.step just returned `info`, `terminated`, `truncated` for."""
        ended_in_success = (terminated & info["success"]).float()
        reached = torch.where(terminated, 0.0, info["last_reward"].float())  # Φ(s_{k+1}); 0 when terminal
        shaped = ended_in_success + self.gamma * reached - self.potential
        self.potential = torch.where(terminated | truncated, 0.0, reached)  # done envs restart at s_0
        return shaped


POTENTIAL_REWARDS = {"maniskill": ("dense", "normalized_dense"), "robosuite": ("dense",), "toy": ("normalized_dense",)}
"""Env type → its reward modes measured on the state reached (robosuite's dense reward is its staged one). The toy
suite's `dense` pays per metre moved and MuJoCo locomotion's per unit of forward motion: not potentials."""


def check_shaping_env(env: EnvConfig) -> None:
    """Refuse `rl.potential_shaping` for an env whose reward cannot serve as Φ, naming the modes that can."""
    modes = POTENTIAL_REWARDS.get(env.type, ())
    if env.reward_mode not in modes:
        usable = f"set env.reward_mode to {' or '.join(modes)}" if modes else f"none of {env.type}'s reward modes is"
        raise ValueError(f"rl.potential_shaping takes the env's dense reward measured on the state as the potential; "
                         f"{env.type} {env.task}'s reward_mode {env.reward_mode!r} is not one ({usable})")
