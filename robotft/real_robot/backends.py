"""Robot and camera backends by name, so a rig preset (YAML) can build them.

A rig preset names each backend and fills that backend's config dataclass with a mapping:

    robot: {backend: sim_franka, config: {scene: {objects: [{name: cube}]}}}   # SimFrankaConfig
    # robot: {backend: franka, config: {host: 172.16.0.2}}                     # FrankaConfig
    cameras:
      - {name: base, backend: sim, config: {width: 128, position: [1.2, 0, 0.6], look_at: [0.5, 0, 0]}}
      - {name: wrist, backend: realsense, config: {serial: "123456789012"}}    # RealSenseConfig

    robot = make_robot("sim_franka", {"scene": ...}, safety)
    camera = make_camera("base", "sim", {"width": 128}, robot)

Each backend's heavy dependency (mujoco, franky, pyrealsense2) is imported only when it is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from robotft.config import ConfigError, from_dict
from robotft.real_robot.franka import FrankaConfig
from robotft.real_robot.realsense import RealSenseConfig
from robotft.real_robot.sim_camera import SimCameraConfig
from robotft.real_robot.sim_franka import SimFrankaConfig

if TYPE_CHECKING:
    from robotft.real_robot.camera import Camera
    from robotft.real_robot.robot import Robot
    from robotft.real_robot.safety import SafetyLayer

RobotConfig = SimFrankaConfig | FrankaConfig
CameraConfig = SimCameraConfig | RealSenseConfig

ROBOT_CONFIGS: dict[str, type] = {"sim_franka": SimFrankaConfig, "franka": FrankaConfig}
"""Robot backend name -> its config dataclass."""
CAMERA_CONFIGS: dict[str, type] = {"sim": SimCameraConfig, "realsense": RealSenseConfig}
"""Camera backend name -> its config dataclass."""


def _parse(kind: str, registry: dict[str, type], backend: str, data: Any, where: str) -> Any:
    if backend not in registry:
        raise ConfigError(
            f"{where}.backend: {kind} backend {backend!r} is unknown; available: {sorted(registry)}"
        )
    if isinstance(data, registry[backend]):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}.config: expected a mapping of {registry[backend].__name__} fields, got {data!r}"
        )
    return from_dict(registry[backend], dict(data), where=f"{where}.config")


def parse_robot_config(
    backend: str, data: Mapping[str, Any] | RobotConfig | None = None, where: str = "robot"
) -> RobotConfig:
    """The config dataclass of robot `backend` from its rig mapping (or a config object, passed through)."""
    return _parse("robot", ROBOT_CONFIGS, backend, data or {}, where)


def parse_camera_config(
    backend: str, data: Mapping[str, Any] | CameraConfig | None = None, where: str = "camera"
) -> CameraConfig:
    """The config dataclass of camera `backend` from its rig mapping (or a config object, passed through)."""
    return _parse("camera", CAMERA_CONFIGS, backend, data or {}, where)


def make_robot(
    backend: str,
    config: Mapping[str, Any] | RobotConfig | None,
    safety: SafetyLayer,
    clock: Callable[[], float] = time.monotonic,
) -> Robot:
    """The (unconnected) robot `backend` (`sim_franka` or `franka`) built from `config`, filtering its
    commands through `safety`."""
    cfg = parse_robot_config(backend, config)
    if isinstance(cfg, SimFrankaConfig):
        from robotft.real_robot.sim_franka import SimFranka

        return SimFranka(cfg, safety, clock=clock)
    from robotft.real_robot.franka import FrankaRobot

    return FrankaRobot(cfg, safety, clock=clock)


def make_camera(
    name: str,
    backend: str,
    config: Mapping[str, Any] | CameraConfig | None = None,
    robot: Robot | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Camera:
    """The (unconnected) camera `backend` (`sim` or `realsense`) built from `config`, streaming as
    `name`. A simulated camera renders `robot`'s scene, so it needs the rig's `SimFranka`."""
    cfg = parse_camera_config(backend, config, where=f"cameras.{name}")
    if isinstance(cfg, SimCameraConfig):
        from robotft.real_robot.sim_camera import SimCamera
        from robotft.real_robot.sim_franka import SimFranka

        if not isinstance(robot, SimFranka):
            raise ConfigError(
                f"cameras.{name}: a `sim` camera renders the simulated robot's scene, so the rig's robot "
                f"must be `sim_franka`, got {type(robot).__name__}"
            )
        return SimCamera(name, cfg, robot, clock=clock)
    from robotft.real_robot.realsense import RealSenseCamera

    return RealSenseCamera(name, cfg, clock=clock)
