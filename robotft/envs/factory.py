"""Build a BatchedEnv from an EnvConfig; simulator packages are imported only for the chosen backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from robotft.config import EnvConfig
from robotft.envs.base import BatchedEnv
from robotft.optional import require


@dataclass(frozen=True)
class EnvBackend:
    """A registered simulator adapter."""

    build: Callable[[EnvConfig, str], BatchedEnv]
    """`(env config, device) -> BatchedEnv`; imports the simulator only when called."""
    randomizes: tuple[str, ...]
    """The physical `env.randomization` fields its adapter implements."""


BACKENDS: dict[str, EnvBackend] = {}
"""env.backend name -> EnvBackend."""


def register_env_backend(name: str, randomizes: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register `(cfg, device) -> BatchedEnv` as env backend `name` (a new simulator is one such function plus
    its adapter module)."""

    def deco(build: Callable[[EnvConfig, str], BatchedEnv]) -> Callable[[EnvConfig, str], BatchedEnv]:
        BACKENDS[name] = EnvBackend(build, randomizes)
        return build

    return deco


@register_env_backend("toy")
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


@register_env_backend("maniskill", randomizes=("friction_scale", "mass_scale", "object_pos_range",
                                                "object_yaw_range", "camera_pos_range", "camera_fov_range",
                                                "light_scale", "color_jitter"))
def _make_maniskill(cfg: EnvConfig, device: str) -> BatchedEnv:
    require("mani_skill", "maniskill", "env backend 'maniskill'")  # fails early, before any worker starts
    from robotft.envs.maniskill import ManiSkillEnv

    return ManiSkillEnv(cfg, device)


@register_env_backend("isaacgym", randomizes=("friction_scale", "mass_scale"))
def _make_isaacgym(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.isaacgym import FurnitureSimEnv

    return FurnitureSimEnv(cfg, device)


@register_env_backend("mujoco", randomizes=("friction_scale", "mass_scale", "camera_fov_range", "light_scale"))
def _make_mujoco(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    return MujocoLocomotionEnv(cfg, device)


@register_env_backend("robosuite")
def _make_robosuite(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.robosuite import RobosuiteEnv

    return RobosuiteEnv(cfg, device)


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """The BatchedEnv that `cfg.backend` names, with `cfg.num_envs` envs whose tensors live on `device`."""
    try:
        backend = BACKENDS[cfg.backend]
    except KeyError:
        raise ValueError(
            f"env.backend {cfg.backend!r} is unknown; available backends: {sorted(BACKENDS)}"
        ) from None
    unsupported = sorted(set(cfg.randomization.active_physical()) - set(backend.randomizes))
    if unsupported:
        raise ValueError(
            f"env.randomization sets {unsupported}, which the {cfg.backend!r} backend does not implement; it "
            f"randomizes {list(backend.randomizes)} (plus obs/action noise and action latency)"
        )
    env = backend.build(cfg, device)
    if cfg.randomization.generic_active:
        from robotft.envs.randomization import RandomizedEnv

        env = RandomizedEnv(env, cfg.randomization)
    return env
