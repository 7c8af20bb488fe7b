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

MILESTONE_PREFIX = "milestone/"
"""Prefix of the optional `info` entries `milestone/<name>` (bool `[B]`): whether each env's state at this step
has reached one of its task's stages on the way to success (PickCube: `grasped`, `at_goal`), in task order."""


def repeat_obs(obs: Obs, n: int) -> Obs:
    """Each observation of a batch repeated `n` times in place: row b·n + i is observation b."""
    return {k: v.repeat_interleave(n, dim=0) for k, v in obs.items()}


class BatchedEnv(abc.ABC):
    """`num_envs` environments stepped together; all tensors live on `self.device`.

    Shapes: observations `[B, *feature_shape]`, actions `[B, act_dim]`, reward/terminated/truncated/
    `info["success"]` `[B]` (float32, bool, bool, bool). `truncated` becomes True when an env reaches
    `max_episode_steps` since its last reset. After an env is done, stepping it again is allowed and its
    outputs are meaningless until it is reset (callers mask them).

    Adapters that know their task's stages also report `info["milestone/<name>"]` for each, in the order a
    successful episode passes them (MILESTONE_PREFIX): evaluations then say how far the failed episodes got.
    """

    num_envs: int
    device: torch.device
    spec: EnvSpec
    max_episode_steps: int

    @abc.abstractmethod
    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        """Reset all envs (`env_ids=None`) or only `env_ids` (long tensor of indices).

        Seeding rule, the same for every adapter and for CPU worker processes and ManiSkill's GPU backend
        alike: a reset of all envs with a `seed` is reproducible (same seed, backend and `num_envs`, same
        initial states); partial resets are not re-seeded (`ChunkedEnv` passes `seed=None`): each env's
        next episode continues a random stream that the last seeded reset determined, so a whole run is
        reproducible from one seed without the cost of re-seeding on every auto-reset. How the seed maps
        to envs is the simulator's: adapters that hold one env per process or per simulator instance give
        env i the seed `seed + i`; ManiSkill's GPU backend seeds the whole batch from `seed`. A run on CPU
        workers and one on the GPU backend are therefore each reproducible, with equally distributed but
        not identical initial states. Returns the observations of *all* envs.
        """

    @abc.abstractmethod
    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Apply one action per env. Returns `(obs, reward, terminated, truncated, info)`;
        `info["success"]` is always present."""

    def step_chunk(self, actions: torch.Tensor) -> list[tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
        """`step` for each of `actions[:, t]` (`[B, T, act_dim]`), in order; the list of the T results.
        Adapters whose steps cost a round trip (worker processes) override it to make one per chunk."""
        return [self.step(actions[:, t]) for t in range(actions.shape[1])]

    def close(self) -> None:  # noqa: B027 - optional hook, most adapters hold no external resources
        """Release simulator resources (worker processes, renderers)."""

    def render_rgb(self) -> torch.Tensor | None:
        """Optional `[B, H, W, 3]` uint8 frame for videos; None when the adapter cannot render."""
        return None

    def render_env(self, i: int) -> torch.Tensor | None:
        """`[H, W, 3]` uint8 frame of env `i` (videos record one env); None when the adapter cannot render.
        Adapters that can render one env alone (one process per env) override this to skip the others."""
        frame = self.render_rgb()
        return None if frame is None else frame[i]

    def __enter__(self) -> BatchedEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
