"""The batched, single-step environment contract every simulator adapter implements.

Adapters do *not* auto-reset: `ChunkedEnv` (robotft.envs.chunked) builds the docs/design.md Env on top
(action chunks, observation history, partial resets that keep the final observation).
"""

from __future__ import annotations

import abc

import torch

from robotft.specs import EnvSpec

Obs = dict[str, torch.Tensor]
"""Observation dict with fixed keys (`state`, `rgb/<camera>`, `depth/<camera>`), each `[B, ...]`."""


class BatchedEnv(abc.ABC):
    """`num_envs` environments stepped together; all tensors live on `self.device`.

    Shapes: observations `[B, *feature_shape]`, actions `[B, act_dim]`, reward/terminated/truncated/
    `info["success"]` `[B]` (float32, bool, bool, bool). `truncated` becomes True when an env reaches
    `max_episode_steps` since its last reset. After an env is done, stepping it again is allowed and its
    outputs are meaningless until it is reset (callers mask them).
    """

    num_envs: int
    device: torch.device
    spec: EnvSpec
    max_episode_steps: int

    @abc.abstractmethod
    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        """Reset all envs (`env_ids=None`) or only `env_ids` (long tensor of indices).

        `seed` seeds the reset deterministically: env i gets seed `seed + i` (for partial resets, the
        envs in `env_ids` get `seed + env_id`). Returns the observations of *all* envs.
        """

    @abc.abstractmethod
    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Apply one action per env. Returns `(obs, reward, terminated, truncated, info)`;
        `info["success"]` is always present."""

    def close(self) -> None:  # noqa: B027 - optional hook, most adapters hold no external resources
        """Release simulator resources (worker processes, renderers)."""

    def render_rgb(self) -> torch.Tensor | None:
        """Optional `[B, H, W, 3]` uint8 frame for videos; None when the adapter cannot render."""
        return None

    def __enter__(self) -> BatchedEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
