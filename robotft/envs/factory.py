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


def _make_isaacgym(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.isaacgym import FurnitureSimEnv

    return FurnitureSimEnv(cfg, device)


def _make_mujoco(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    return MujocoLocomotionEnv(cfg, device)


BACKENDS: dict[str, Callable[[EnvConfig, str], BatchedEnv]] = {"toy": _make_toy, "maniskill": _make_maniskill}
"""env.backend name -> constructor."""
BACKENDS["mujoco"] = _make_mujoco
BACKENDS["isaacgym"] = _make_isaacgym


def _make_robosuite(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.robosuite import RobosuiteEnv

    return RobosuiteEnv(cfg, device)


BACKENDS["robosuite"] = _make_robosuite

RANDOMIZES: dict[str, tuple[str, ...]] = {
    "mujoco": ("friction_scale", "mass_scale", "camera_fov_range", "light_scale"),
    "maniskill": ("friction_scale", "mass_scale", "object_pos_range", "object_yaw_range", "camera_pos_range",
                  "camera_fov_range", "light_scale", "color_jitter"),
    "isaacgym": ("friction_scale", "mass_scale"),
}
"""env.backend name -> the physical `env.randomization` fields its adapter implements (none if absent)."""


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """The BatchedEnv that `cfg.backend` names, with `cfg.num_envs` envs whose tensors live on `device`."""
    try:
        make = BACKENDS[cfg.backend]
    except KeyError:
        raise ValueError(
            f"env.backend {cfg.backend!r} is unknown; available backends: {sorted(BACKENDS)}"
        ) from None
    unsupported = sorted(set(cfg.randomization.active_physical()) - set(RANDOMIZES.get(cfg.backend, ())))
    if unsupported:
        raise ValueError(
            f"env.randomization sets {unsupported}, which the {cfg.backend!r} backend does not implement; it "
            f"randomizes {list(RANDOMIZES.get(cfg.backend, ()))} (plus obs/action noise and action latency)"
        )
    env = make(cfg, device)
    if cfg.randomization.generic_active:
        from robotft.envs.randomization import RandomizedEnv

        env = RandomizedEnv(env, cfg.randomization)
    return env
