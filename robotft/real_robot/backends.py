"""Robot and camera backends by name, so a rig preset (YAML) can build them.

A rig preset names each backend with `type:` and fills that backend's config dataclass with a mapping:

    robot: {type: sim_franka, config: {scene: {objects: [{name: cube}]}}}   # SimFrankaConfig
    # robot: {type: franka, config: {host: 172.16.0.2}}                     # FrankaConfig
    cameras:
      - {name: base, type: sim, config: {width: 128, position: [1.2, 0, 0.6], look_at: [0.5, 0, 0]}}
      - {name: wrist, type: realsense, config: {serial: "123456789012"}}    # RealSenseConfig

    robot = make_robot("sim_franka", {"scene": ...}, safety)
    camera = make_camera("base", "sim", {"width": 128}, robot)

Object poses come from a source named by the rig's `object_poses.type` (`OBJECT_POSE_SOURCES`): `scene` (the simulated robot's own
`object_poses()`) or `fiducial` (ArUco markers seen by one of the rig's cameras):

    source = make_object_pose_source(rig, robot, cameras)   # has object_poses() -> {name: ObjectPose}

Each backend's heavy dependency (mujoco, franky, pyrealsense2, cv2) is imported only when it is built. A new
robot or camera backend is a config dataclass and a builder registered with `@register_robot` /
`@register_camera`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from robotft.config import ConfigError, from_dict
from robotft.real_robot.fiducial import FiducialConfig
from robotft.real_robot.franka import FrankaConfig
from robotft.real_robot.realsense import RealSenseConfig
from robotft.real_robot.sim_camera import SimCameraConfig
from robotft.real_robot.sim_franka import SimFrankaConfig

if TYPE_CHECKING:
    from robotft.real_robot.camera import Camera
    from robotft.real_robot.rig import RigConfig
    from robotft.real_robot.robot import Robot
    from robotft.real_robot.safety import SafetyLayer

RobotConfig = SimFrankaConfig | FrankaConfig
CameraConfig = SimCameraConfig | RealSenseConfig


@dataclass(frozen=True)
class Backend:
    """A registered robot or camera backend: its config dataclass and the function that builds it."""

    config_cls: type
    """The dataclass a rig's `config:` mapping fills."""
    build: Callable[..., Any]
    """Robots: `(config, safety, clock) -> Robot`; cameras: `(name, config, robot, clock) -> Camera`."""


ROBOTS: dict[str, Backend] = {}
"""Robot type (a rig's `robot.type`) -> Backend."""
CAMERAS: dict[str, Backend] = {}
"""Camera type (a rig's `cameras[].type`) -> Backend."""


def register_robot(name: str, config_cls: type) -> Callable[[Callable[..., Robot]], Callable[..., Robot]]:
    """Register a robot backend: decorate its builder `(config, safety, clock) -> Robot`."""

    def deco(build: Callable[..., Robot]) -> Callable[..., Robot]:
        ROBOTS[name] = Backend(config_cls, build)
        return build

    return deco


def register_camera(name: str, config_cls: type) -> Callable[[Callable[..., Camera]], Callable[..., Camera]]:
    """Register a camera backend: decorate its builder `(name, config, robot, clock) -> Camera`."""

    def deco(build: Callable[..., Camera]) -> Callable[..., Camera]:
        CAMERAS[name] = Backend(config_cls, build)
        return build

    return deco


@register_robot("sim_franka", SimFrankaConfig)
def _sim_franka(cfg: SimFrankaConfig, safety: SafetyLayer, clock: Callable[[], float]) -> Robot:
    from robotft.real_robot.sim_franka import SimFranka

    return SimFranka(cfg, safety, clock=clock)


@register_robot("franka", FrankaConfig)
def _franka(cfg: FrankaConfig, safety: SafetyLayer, clock: Callable[[], float]) -> Robot:
    from robotft.real_robot.franka import FrankaRobot

    return FrankaRobot(cfg, safety, clock=clock)


@register_camera("sim", SimCameraConfig)
def _sim_camera(name: str, cfg: SimCameraConfig, robot: Robot | None, clock: Callable[[], float]) -> Camera:
    from robotft.real_robot.sim_camera import SimCamera
    from robotft.real_robot.sim_franka import SimFranka

    if not isinstance(robot, SimFranka):
        raise ConfigError(
            f"cameras.{name}: a `sim` camera renders the simulated robot's scene, so the rig's robot "
            f"must be `sim_franka`, got {type(robot).__name__}"
        )
    return SimCamera(name, cfg, robot, clock=clock)


@register_camera("realsense", RealSenseConfig)
def _realsense(name: str, cfg: RealSenseConfig, robot: Robot | None, clock: Callable[[], float]) -> Camera:
    from robotft.real_robot.realsense import RealSenseCamera

    return RealSenseCamera(name, cfg, clock=clock)


def _parse(kind: str, configs: dict[str, type], type_name: str, data: Any, where: str) -> Any:
    """`configs[type_name]` filled from a rig mapping (or a config object, passed through)."""
    if type_name not in configs:
        raise ConfigError(f"{where}.type: {kind} type {type_name!r} is unknown; available: {sorted(configs)}")
    config_cls = configs[type_name]
    if isinstance(data, config_cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}.config: expected a mapping of {config_cls.__name__} fields, got {data!r}")
    return from_dict(config_cls, dict(data), where=f"{where}.config")


def parse_robot_config(
    robot_type: str, data: Mapping[str, Any] | RobotConfig | None = None, where: str = "robot"
) -> RobotConfig:
    """The config dataclass of robot type `robot_type` from its rig mapping (or a config object, passed through)."""
    return _parse("robot", {k: v.config_cls for k, v in ROBOTS.items()}, robot_type, data or {}, where)


def parse_camera_config(
    camera_type: str, data: Mapping[str, Any] | CameraConfig | None = None, where: str = "camera"
) -> CameraConfig:
    """The config dataclass of camera type `camera_type` from its rig mapping (or a config object, passed
    through)."""
    return _parse("camera", {k: v.config_cls for k, v in CAMERAS.items()}, camera_type, data or {}, where)


def make_robot(
    robot_type: str,
    config: Mapping[str, Any] | RobotConfig | None,
    safety: SafetyLayer,
    clock: Callable[[], float] = time.monotonic,
) -> Robot:
    """The (unconnected) robot of type `robot_type` (one of ROBOTS) built from `config`, filtering its commands
    through `safety`."""
    return ROBOTS[robot_type].build(parse_robot_config(robot_type, config), safety, clock)


def make_camera(
    name: str,
    camera_type: str,
    config: Mapping[str, Any] | CameraConfig | None = None,
    robot: Robot | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Camera:
    """The (unconnected) camera of type `camera_type` (one of CAMERAS) built from `config`, streaming as `name`.
    A simulated camera renders `robot`'s scene, so it needs the rig's `SimFranka`."""
    config = parse_camera_config(camera_type, config, where=f"cameras.{name}")
    return CAMERAS[camera_type].build(name, config, robot, clock)


# ---- object-pose sources ---------------------------------------------------------------------------------


@dataclass
class ScenePosesConfig:
    """The `scene` source has no settings: the robot backend reports its scene's poses (`SimFranka`)."""


def _scene_objects(config: ScenePosesConfig, rig: RigConfig) -> tuple[list[str], list[str]]:
    if rig.robot.type != "sim_franka" and rig.objects:
        return [], [
            f"object_poses: the `scene` source reads the simulated scene, but the robot is "
            f"{rig.robot.type!r}; configure a pose source such as `fiducial` for objects {rig.objects}"
        ]
    return list(rig.objects), []


def _fiducial_objects(config: FiducialConfig, rig: RigConfig) -> tuple[list[str], list[str]]:
    if config.camera not in {c.name for c in rig.cameras}:
        return [], [
            f"object_poses.config.camera: {config.camera!r} is not one of the rig's cameras "
            f"{[c.name for c in rig.cameras]}"
        ]
    return config.objects, []


def _scene_source(
    config: ScenePosesConfig, rig: RigConfig, robot: Robot, cameras: Mapping[str, Camera]
) -> Any:
    if not hasattr(robot, "object_poses"):
        raise ConfigError(
            f"object_poses: robot backend {type(robot).__name__} has no scene to read poses from"
        )
    return robot


def _fiducial_source(
    config: FiducialConfig, rig: RigConfig, robot: Robot, cameras: Mapping[str, Camera]
) -> Any:
    from robotft.real_robot.fiducial import FiducialPoseSource

    camera = next(c for c in rig.cameras if c.name == config.camera)
    return FiducialPoseSource(config, cameras[config.camera], camera.base_from_camera)


@dataclass(frozen=True)
class PoseSourceBackend:
    """A registered object-pose source (a rig's `object_poses.type`)."""

    config: type
    """Its config dataclass (filled from the rig's `object_poses.config`)."""
    objects: Callable[..., tuple[list[str], list[str]]]
    """`(config, rig) -> (objects it provides, problems with the rig)`."""
    build: Callable[..., Any]
    """`(config, rig, robot, cameras) -> source` with `object_poses()`, optionally `connect`/`disconnect`
    (a context manager) and `max_age_s` (pose age that holds the arm)."""


OBJECT_POSE_SOURCES: dict[str, PoseSourceBackend] = {
    "scene": PoseSourceBackend(ScenePosesConfig, _scene_objects, _scene_source),
    "fiducial": PoseSourceBackend(FiducialConfig, _fiducial_objects, _fiducial_source),
}
"""Object-pose source type (a rig's `object_poses.type`) -> PoseSourceBackend."""


def parse_object_pose_config(rig: RigConfig) -> Any:
    """The config dataclass of the rig's object-pose source."""
    return _parse(
        "object-pose source",
        {k: v.config for k, v in OBJECT_POSE_SOURCES.items()},
        rig.object_poses.type,
        rig.object_poses.config,
        "object_poses",
    )


def object_pose_source_problems(rig: RigConfig) -> list[str]:
    """Why the rig's object-pose source cannot provide each of `rig.objects` (empty: it can)."""
    try:
        config = parse_object_pose_config(rig)
    except (ConfigError, ValueError) as e:
        return [f"object_poses: {e}"]
    provided, problems = OBJECT_POSE_SOURCES[rig.object_poses.type].objects(config, rig)
    missing = [o for o in rig.objects if o not in provided]
    if missing and not problems:
        problems.append(
            f"object_poses: the {rig.object_poses.type!r} source does not track objects {missing} "
            f"(it tracks {provided})"
        )
    return problems


def make_object_pose_source(rig: RigConfig, robot: Robot, cameras: Mapping[str, Camera]) -> Any:
    """The rig's object-pose source (for `scene`, the robot itself), not yet connected."""
    problems = object_pose_source_problems(rig)
    if problems:
        raise ConfigError("; ".join(problems))
    config = parse_object_pose_config(rig)
    return OBJECT_POSE_SOURCES[rig.object_poses.type].build(config, rig, robot, cameras)
