"""Build a BatchedEnv from an EnvConfig; simulator packages are imported only for the chosen env type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from robotft.config import EnvConfig
from robotft.envs.base import BatchedEnv
from robotft.optional import require


@dataclass(frozen=True)
class RegisteredEnv:
    """A registered simulator adapter: an env type."""

    build: Callable[[EnvConfig, str], BatchedEnv]
    """`(env config, device) -> BatchedEnv`; imports the simulator only when called."""
    randomizes: tuple[str, ...]
    """The physical `env.randomization` fields its adapter implements."""


ENV_TYPES: dict[str, RegisteredEnv] = {}
"""Env type (an env preset's `type:`, `--env.type`) -> RegisteredEnv."""


def register_env(name: str, randomizes: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register `(cfg, device) -> BatchedEnv` as env type `name` (a new simulator is one such function plus
    its adapter module)."""

    def deco(build: Callable[[EnvConfig, str], BatchedEnv]) -> Callable[[EnvConfig, str], BatchedEnv]:
        ENV_TYPES[name] = RegisteredEnv(build, randomizes)
        return build

    return deco


@register_env("toy")
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


@register_env("maniskill", randomizes=("friction_scale", "mass_scale", "object_pos_range", "object_yaw_range",
                                        "camera_pos_range", "camera_fov_range", "light_scale", "color_jitter",
                                        "texture_swap_prob"))
def _make_maniskill(cfg: EnvConfig, device: str) -> BatchedEnv:
    require("mani_skill", "maniskill", "env type 'maniskill'")  # fails early, before any worker starts
    from robotft.envs.maniskill import ManiSkillEnv

    return ManiSkillEnv(cfg, device)


@register_env("isaacgym", randomizes=("friction_scale", "mass_scale"))
def _make_isaacgym(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.isaacgym import FurnitureSimEnv

    return FurnitureSimEnv(cfg, device)


@register_env("mujoco", randomizes=("friction_scale", "mass_scale", "camera_fov_range", "light_scale"))
def _make_mujoco(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    return MujocoLocomotionEnv(cfg, device)


@register_env("robosuite")
def _make_robosuite(cfg: EnvConfig, device: str) -> BatchedEnv:
    from robotft.envs.robosuite import RobosuiteEnv

    return RobosuiteEnv(cfg, device)


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """The BatchedEnv that `cfg.type` names, with `cfg.num_envs` envs whose tensors live on `device`."""
    try:
        registered = ENV_TYPES[cfg.type]
    except KeyError:
        raise ValueError(f"env.type {cfg.type!r} is unknown; available: {sorted(ENV_TYPES)}") from None
    unsupported = sorted(set(cfg.randomization.active_physical()) - set(registered.randomizes))
    if unsupported:
        raise ValueError(
            f"env.randomization sets {unsupported}, which env type {cfg.type!r} does not implement; it "
            f"randomizes {list(registered.randomizes)} (plus obs/action noise and action latency)"
        )
    env = registered.build(cfg, device)
    if cfg.randomization.generic_active:
        from robotft.envs.randomization import RandomizedEnv

        env = RandomizedEnv(env, cfg.randomization)
    return env
