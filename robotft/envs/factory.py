"""Build a BatchedEnv from an EnvConfig; simulator packages are imported only for the chosen backend."""

from __future__ import annotations

from collections.abc import Callable

from robotft.config import EnvConfig
from robotft.envs.base import BatchedEnv


def _make_toy(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.toy import ToyNavEnv

    return ToyNavEnv(
        cfg.num_envs,
        task=cfg.task,
        max_episode_steps=cfg.max_episode_steps,
        reward_mode=cfg.reward_mode,
        device=device,
        **cfg.kwargs,
    )


def _make_maniskill(cfg: EnvConfig, device: str) -> BatchedEnv:
    try:
        import mani_skill  # noqa: F401 - only to fail early with the install hint
    except ImportError as e:
        raise ImportError(
            f"env backend 'maniskill' needs mani_skill ({e}); pip install robotft[maniskill]"
        ) from e
    from robotft.envs.maniskill import ManiSkillEnv

    return ManiSkillEnv(cfg, device)


BACKENDS: dict[str, Callable[[EnvConfig, str], BatchedEnv]] = {"toy": _make_toy, "maniskill": _make_maniskill}
"""env.backend name -> constructor."""


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """The BatchedEnv that `cfg.backend` names, with `cfg.num_envs` envs whose tensors live on `device`."""
    try:
        make = BACKENDS[cfg.backend]
    except KeyError:
        raise ValueError(
            f"env.backend {cfg.backend!r} is unknown; available backends: {sorted(BACKENDS)}"
        ) from None
    return make(cfg, device)
