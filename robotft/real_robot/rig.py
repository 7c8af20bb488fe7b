"""Rig presets: what a deployment rig is made of and how it feeds a policy (docs/design.md "The sim-to-real contract").

A rig preset is a YAML file in the top-level `real_robot/` folder, found by name like the env and policy
presets (`--rig sim_franka` finds `real_robot/sim_franka.yaml`). It names the robot's `type` and its
config, the cameras, the safety limits, the control rate, the chunk executor, how each of the policy's
actions is executed (robotft.real_robot.actions), and where each observation comes from:

    observations:
      - key: state                      # the checkpoint's observation key
        unit: mixed                     # the unit and frame the checkpoint must declare for it
        frame: world
        sources:                        # one per named segment of the flat vector
          - {segment: agent/qpos, source: robot, fields: [joint_positions, finger_positions]}
          - {segment: extra/tcp_pose, source: robot, fields: [ee_pose], frame: world}
          - {segment: extra/goal_pos, source: object, object: goal, fields: [pos], frame: world}

A segment covers the checkpoint's per-dimension names equal to it or starting with `segment/`
(ManiSkill's `state` is named `agent/qpos/0`, ..., `extra/obj_pose/6`, see robotft.envs.maniskill).
A source's `source:` says where its values come from inside the rig (it picks no registered implementation):
`robot` (a `RobotState` field), `object` (a pose from the rig's object-pose source: the simulated scene, or a
pose estimator on hardware), `constant` (e.g. a fixed goal), `camera` (`rgb/<name>` keys). Positions and
orientations are in the robot base frame unless a source says `frame: world`, which applies `world_from_base`
(ManiSkill's world has the robot base at x = -0.615). An `object` source may give a position `relative_to`
another object or the TCP (ManiSkill PickCube's `tcp_to_obj_pos`, `obj_to_goal_pos`), or the `grasped` flag
(its `is_grasped`, simulated scenes only).

Where object poses come from is the rig's `object_poses` source, named by its `type`
(robotft.real_robot.backends `OBJECT_POSE_SOURCES`): `scene` (the default: the robot backend's `object_poses()`,
the simulated scene) or `fiducial` (printed markers on the objects, seen by a rig camera;
robotft.real_robot.fiducial):

    objects: [cube]
    object_poses:
      type: fiducial
      config: {camera: base, markers: [{object: cube, id: 0, size_m: 0.03, object_from_marker: {pos: [0, 0, 0.0202]}}]}

`check_rig` lists everything a checkpoint needs that the rig cannot provide; `robotft deploy` refuses
such a checkpoint with that list.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from robotft.config import from_dict, load_preset
from robotft.real_robot.actions import ActionMappingConfig
from robotft.real_robot.executors import EXECUTORS
from robotft.real_robot.safety import SafetyLimits
from robotft.real_robot.transforms import Transform
from robotft.specs import EnvSpec, FeatureSpec

log = logging.getLogger(__name__)

ROBOT_FIELDS: dict[str, int] = {
    "joint_positions": 7,
    "joint_velocities": 7,
    "finger_positions": 2,
    "finger_velocities": 2,
    "ee_pos": 3,
    "ee_quat": 4,
    "ee_pose": 7,
    "gripper_width": 1,
}
"""Robot source fields and their sizes. `finger_positions` is `[w/2, w/2]` for gripper width `w` (the two
finger joints of ManiSkill's Panda); `finger_velocities` is zero (no backend measures it; the fingers
are at rest most of the time). `ee_pose` is `ee_pos` followed by `ee_quat`."""
OBJECT_FIELDS: dict[str, int] = {"pos": 3, "quat": 4, "pose": 7, "grasped": 1}
"""Object source fields: position (m), orientation `[w, x, y, z]`, both (pos then quat), and 1.0 while the
gripper grasps the object, else 0.0 (ManiSkill's `is_grasped`; only a simulated scene can tell)."""
TCP = "tcp"
"""`relative_to` value naming the robot's TCP rather than an object."""
SOURCES = ("robot", "object", "constant", "camera")
FRAMES = ("base", "world")


class RigMismatchError(ValueError):
    """The rig cannot provide what a checkpoint needs; the message lists every missing piece."""


@dataclass
class DeviceConfig:
    """A registered robot or camera backend by name (`type`) and its config (the backend's own dataclass, see
    robotft.real_robot.backends)."""

    OLD_TYPE_KEY = "backend"
    """What `type` was called in rig presets before (robotft.config.migrate_type_key)."""

    type: str = "sim_franka"
    """Registered backend: robots `sim_franka` or `franka`; cameras `sim` or `realsense`."""
    config: dict[str, Any] = field(default_factory=dict)
    """Fields of the backend's config dataclass."""


@dataclass
class CameraConfig(DeviceConfig):
    """A camera of the rig; its frames feed `rgb/<name>` observations and the watchdog."""

    name: str = "camera"
    """Stream name: `rgb/<name>` observation key and watchdog source."""
    type: str = "sim"
    """`sim` (renders the simulated scene) or `realsense`."""
    base_from_camera: Transform = field(default_factory=Transform)
    """Extrinsics: the camera optical frame in the robot base frame (recorded with each dataset)."""
    max_age_s: float = 0.1
    """A frame older than this (s) is stale: the policy is not fed and the watchdog holds the arm."""


@dataclass
class ObjectPoseSourceConfig:
    """Where the poses of the rig's `objects` come from: a registered source by name (`type`) and its config."""

    OLD_TYPE_KEY = "backend"
    """What `type` was called in rig presets before (robotft.config.migrate_type_key)."""

    type: str = "scene"
    """`scene` (the robot backend's `object_poses()`: the simulated scene) or `fiducial` (ArUco markers
    seen by a rig camera); see robotft.real_robot.backends.OBJECT_POSE_SOURCES."""
    config: dict[str, Any] = field(default_factory=dict)
    """Fields of the source's config dataclass (`fiducial`: robotft.real_robot.fiducial.FiducialConfig)."""


@dataclass
class SourceConfig:
    """Where one segment of an observation comes from."""

    segment: str = ""
    """Name prefix of the dimensions this source fills (`agent/qpos`); empty: the whole key."""
    source: str = "robot"
    """`robot`, `object`, `constant` or `camera`."""
    fields: list[str] = field(default_factory=list)
    """`robot`: `ROBOT_FIELDS` names; `object`: `OBJECT_FIELDS` names; concatenated in order."""
    object: str = ""
    """`object`: the object's name in the rig's `objects`."""
    value: list[float] = field(default_factory=list)
    """`constant`: the values (positions in `frame`)."""
    camera: str = ""
    """`camera`: the camera's name."""
    frame: str = "base"
    """Frame of positions and orientations: `base` (robot base) or `world` (through `world_from_base`)."""
    quat_nonneg: str = ""
    """Quaternion component (`w`, `x`, `y`, `z`) kept >= 0 (q and -q are one rotation; a policy saw one
    sign in training, e.g. ManiSkill reports a downward TCP with x > 0); empty: as measured."""
    relative_to: str = ""
    """`object` with fields `[pos]`: the object's position minus this one's, an object of the rig or
    `tcp` (ManiSkill PickCube's `tcp_to_obj_pos` is the cube's relative to the TCP); empty: absolute."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r} must be one of {SOURCES}")
        if self.frame not in FRAMES:
            raise ValueError(f"source frame {self.frame!r} must be one of {FRAMES}")
        if self.quat_nonneg not in ("", "w", "x", "y", "z"):
            raise ValueError(f"quat_nonneg must be empty or one of w, x, y, z, got {self.quat_nonneg!r}")
        allowed = ROBOT_FIELDS if self.source == "robot" else OBJECT_FIELDS if self.source == "object" else {}
        bad = [f for f in self.fields if f not in allowed]
        if bad or (allowed and not self.fields):
            raise ValueError(
                f"{self.source} source {self.segment!r}: fields {self.fields} must be a non-empty list of {sorted(allowed)}"
            )
        if self.source == "object" and not self.object:
            raise ValueError(f"object source {self.segment!r} needs `object` (the object's name)")
        if self.relative_to and (self.source != "object" or self.fields != ["pos"]):
            raise ValueError(
                f"source {self.segment!r}: relative_to needs an object source with fields [pos], got "
                f"{self.source} {self.fields}"
            )
        if self.source == "constant" and not self.value:
            raise ValueError(f"constant source {self.segment!r} needs `value`")
        if self.source == "camera" and not self.camera:
            raise ValueError(f"camera source {self.segment!r} needs `camera` (the camera's name)")

    @property
    def size(self) -> int | None:
        """Values this source produces (None for a camera: an image)."""
        if self.source == "robot":
            return sum(ROBOT_FIELDS[f] for f in self.fields)
        if self.source == "object":
            return sum(OBJECT_FIELDS[f] for f in self.fields)
        if self.source == "constant":
            return len(self.value)
        return None


@dataclass
class ObservationConfig:
    """How the rig provides one policy observation key."""

    key: str = "state"
    """The checkpoint's observation key (`state`, `rgb/<camera>`)."""
    unit: str = ""
    """Unit the checkpoint must declare for this key (empty: not checked)."""
    frame: str = ""
    """Frame the checkpoint must declare for this key (empty: not checked)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """Segments in any order; together they must cover every dimension of the key."""


@dataclass
class ExecutorConfig:
    """The chunk executor (robotft.real_robot.executors) and its parameters."""

    type: str = "receding_horizon"
    """`receding_horizon`, `temporal_ensemble` or `async`."""
    act_steps: int = 0
    """Actions executed per chunk (`receding_horizon`, `async`); 0: the policy's `act_steps`."""
    ensemble_m: float = 0.01
    """`temporal_ensemble`: weight decay m of w_i = exp(-m i) (ACT)."""
    latency_window: int = 10
    """`async`: measured latencies whose maximum predicts the next one."""

    def __post_init__(self) -> None:
        if self.type not in EXECUTORS:
            raise ValueError(f"executor type {self.type!r} must be one of {sorted(EXECUTORS)}")
        if self.act_steps < 0:
            raise ValueError(f"executor act_steps must be >= 0, got {self.act_steps}")


@dataclass
class SuccessConfig:
    """Success predicate on the simulated scene (`--no-operator`): an object within a goal radius, and
    optionally the arm at rest (ManiSkill PickCube's `is_robot_static`)."""

    object: str = "cube"
    """Object that must reach the goal."""
    goal: str = "goal"
    """Object or marker marking the goal."""
    radius_m: float = 0.1
    """Success when the distance is below this (m); ManiSkill PushCube's `goal_radius` is 0.1."""
    axes: str = "xy"
    """Axes of the distance: `xy` (on the table) or `xyz`."""
    max_joint_speed_rad_s: float | None = None
    """Also require every arm joint's speed (rad/s) at most this: ManiSkill's `is_static(0.2)` (the
    largest |qvel| of the 7 arm joints); None: the arm may move."""

    def __post_init__(self) -> None:
        if self.axes not in ("xy", "xyz") or not self.radius_m > 0:
            raise ValueError(
                f"success needs axes xy or xyz and radius_m > 0, got {self.axes!r}, {self.radius_m}"
            )
        if self.max_joint_speed_rad_s is not None and not self.max_joint_speed_rad_s > 0:
            raise ValueError(f"success max_joint_speed_rad_s must be > 0, got {self.max_joint_speed_rad_s}")


@dataclass
class RigConfig:
    """A deployment rig (robot, cameras, limits, timing, observation sources, action execution)."""

    name: str = ""
    """Human-readable rig name (recorded with datasets)."""
    task: str = ""
    """Task string written with each recorded episode."""
    simulated: bool = False
    """True for a simulated robot: `--no-operator` is allowed only then (outcomes come from the scene)."""
    robot: DeviceConfig = field(default_factory=DeviceConfig)
    """The robot: its registered `type` and its config."""
    cameras: list[CameraConfig] = field(default_factory=list)
    """Cameras; each is watched by the safety watchdog."""
    objects: list[str] = field(default_factory=list)
    """Objects whose pose the robot backend's `object_poses()` provides (the simulated scene's bodies, or
    a pose estimator on hardware); empty when the rig cannot observe objects."""
    object_poses: ObjectPoseSourceConfig = field(default_factory=ObjectPoseSourceConfig)
    """The source of the `objects`' poses (default: the simulated scene)."""
    world_from_base: Transform = field(default_factory=Transform)
    """The robot base in the policy's world frame (ManiSkill: pos [-0.615, 0, 0])."""
    control_hz: float = 20.0
    """Control rate (commands per second); must equal the checkpoint's."""
    state_hz: float = 200.0
    """Rate at which robot state, object poses and camera frames are polled into timestamped buffers."""
    max_state_age_s: float = 0.05
    """Robot state and object poses older than this (s) at a tick are stale (the tick holds the arm)."""
    episode_time_s: float = 0.0
    """Episode time limit (s); 0: the checkpoint env's `max_episode_steps / control_hz`."""
    start_timeout_s: float = 10.0
    """At each episode start, how long (s) to wait for every stream's first sample after the reset."""
    safety: SafetyLimits = field(default_factory=SafetyLimits)
    """Safety limits (always on)."""
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    """Chunk executor."""
    actions: list[ActionMappingConfig] = field(default_factory=list)
    """Supported policy control modes and how each is executed."""
    observations: list[ObservationConfig] = field(default_factory=list)
    """Sources of the policy observation keys this rig can provide."""
    success: SuccessConfig | None = None
    """Success predicate on the simulated scene; needed for `--no-operator`."""

    def __post_init__(self) -> None:
        for name in ("control_hz", "state_hz", "max_state_age_s", "start_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"rig {name} must be a finite number > 0, got {getattr(self, name)}")
        names = [c.name for c in self.cameras]
        if len(set(names)) != len(names) or "policy" in names:
            raise ValueError(f"rig camera names must be unique and not 'policy', got {names}")

    def action_mapping(self, control_mode: str) -> ActionMappingConfig | None:
        return next((a for a in self.actions if a.control_mode == control_mode), None)

    def observation(self, key: str) -> ObservationConfig | None:
        return next((o for o in self.observations if o.key == key), None)


def load_rig(name_or_path: str) -> RigConfig:
    """Load `real_robot/<name>.yaml` (or a YAML path; `base:` resolved) into a RigConfig. `real_robot/<name>.yaml`
    that is not a file relative to the cwd is looked up as the preset `<name>`."""
    name = name_or_path
    if not Path(name).is_file():
        name = name.removeprefix("real_robot/").removesuffix(".yaml").removesuffix(".yml")
    path, data = load_preset("real_robot", name)
    return from_dict(RigConfig, data, where=str(path))


# ---- the sim-to-real check -----------------------------------------------------------------------------


def _segments(
    names: Sequence[str], sources: Sequence[SourceConfig]
) -> tuple[list[tuple[SourceConfig, slice]], list[str]]:
    """Match the named dimensions to sources: `[(source, slice)]` and the names no source covers."""

    def covers(src: SourceConfig, name: str) -> bool:
        return name == src.segment or name.startswith(src.segment + "/")

    matched, uncovered = [], []
    i = 0
    while i < len(names):
        src = next((s for s in sources if s.segment and covers(s, names[i])), None)
        if src is None:
            uncovered.append(names[i])
            i += 1
            continue
        j = i
        while j < len(names) and covers(src, names[j]):
            j += 1
        matched.append((src, slice(i, j)))
        i = j
    return matched, uncovered


def _group(names: Sequence[str]) -> list[str]:
    """`['extra/obj_pose/0', ..., 'extra/obj_pose/6']` -> `['extra/obj_pose (7 dims)']`."""
    groups: dict[str, int] = {}
    for n in names:
        head, _, tail = n.rpartition("/")
        key = head if tail.isdigit() and head else n
        groups[key] = groups.get(key, 0) + 1
    return [f"{k} ({v} dim{'s' if v > 1 else ''})" for k, v in groups.items()]


def _source_problems(rig: RigConfig, key: str, src: SourceConfig, size: int | None) -> list[str]:
    problems = []
    where = f"{key}[{src.segment}]" if src.segment else key
    needed = [src.object] if src.source == "object" else []
    if src.relative_to and src.relative_to != TCP:
        needed.append(src.relative_to)
    for name in needed:
        if name not in rig.objects:
            problems.append(
                f"{where}: needs the pose of object {name!r}, which this rig cannot observe "
                f"(rig objects: {rig.objects}; on hardware add a pose source, e.g. `object_poses: "
                "{type: fiducial}` with a marker on the object, docs/calibration.md)"
            )
    if "grasped" in src.fields and not (rig.simulated and rig.object_poses.type == "scene"):
        problems.append(
            f"{where}: needs whether the gripper grasps {src.object!r}, which only a simulated scene "
            "(`object_poses: {type: scene}` on a simulated rig) tells"
        )
    if src.source == "camera" and src.camera not in {c.name for c in rig.cameras}:
        problems.append(
            f"{where}: camera {src.camera!r} is not one of the rig's cameras {[c.name for c in rig.cameras]}"
        )
    if size is not None and src.size is not None and src.size != size:
        problems.append(f"{where}: the checkpoint has {size} dims here, the rig's source gives {src.size}")
    return problems


def check_rig(rig: RigConfig, spec: EnvSpec, obs_keys: Sequence[str]) -> list[str]:
    """Everything the checkpoint (its `spec`, the policy's `obs_keys`) needs that `rig` cannot provide.

    Empty when the rig can deploy the checkpoint. A vector without per-dimension names can only be
    checked by its total size (logged as a warning).
    """
    problems: list[str] = []
    for key in obs_keys:
        feature = spec.observations.get(key)
        if feature is None:
            problems.append(f"{key}: the checkpoint lists it as a policy input but has no spec for it")
            continue
        obs = rig.observation(key)
        if obs is None:
            problems.append(f"{key}: the rig has no source for this observation key")
            continue
        for attr in ("unit", "frame"):
            want = getattr(obs, attr)
            if want and getattr(feature, attr) != want:
                problems.append(
                    f"{key}: the checkpoint's {attr} is {getattr(feature, attr)!r}, the rig provides {want!r}"
                )
        problems += _key_problems(rig, key, feature, obs)
    problems += _action_problems(rig, spec)
    return problems + object_pose_problems(rig)


def object_pose_problems(rig: RigConfig) -> list[str]:
    """What keeps the rig's `object_poses` source from providing every one of the rig's `objects`."""
    from robotft.real_robot.backends import object_pose_source_problems

    return object_pose_source_problems(rig)


def _key_problems(rig: RigConfig, key: str, feature: FeatureSpec, obs: ObservationConfig) -> list[str]:
    if key.startswith(("rgb/", "depth/")):
        cams = [s for s in obs.sources if s.source == "camera"]
        if len(cams) != 1:
            return [f"{key}: needs exactly one camera source, the rig lists {len(cams)}"]
        problems = _source_problems(rig, key, cams[0], None)
        cam = next((c for c in rig.cameras if c.name == cams[0].camera), None)
        size = None if cam is None else (cam.config.get("height"), cam.config.get("width"))
        if size is not None and None not in size and tuple(size) != tuple(feature.shape[:2]):
            problems.append(
                f"{key}: the checkpoint expects {feature.shape[0]}x{feature.shape[1]} images, camera "
                f"{cam.name!r} gives {size[0]}x{size[1]}"
            )
        return problems
    if len(feature.shape) != 1:
        return [f"{key}: shape {feature.shape}; the rig provides vectors and camera images only"]
    dim = feature.shape[0]
    if not feature.names:
        # No names (older checkpoints): only the sizes can be checked, in the rig's order.
        log.warning(
            "%s: the checkpoint does not name its %d dims; matching the rig's sources by size only", key, dim
        )
        sizes = [s.size or 0 for s in obs.sources]
        problems = [p for s in obs.sources for p in _source_problems(rig, key, s, None)]
        if sum(sizes) != dim:
            problems.append(
                f"{key}: the checkpoint has {dim} (unnamed) dims, the rig's sources give {sum(sizes)}"
            )
        return problems
    if len(feature.names) != dim:
        return [f"{key}: the checkpoint names {len(feature.names)} dims but its shape is {feature.shape}"]
    matched, uncovered = _segments(feature.names, obs.sources)
    problems = [f"{key}: no rig source for {g}" for g in _group(uncovered)]
    for src, sl in matched:
        problems += _source_problems(rig, key, src, sl.stop - sl.start)
    return problems


def _action_problems(rig: RigConfig, spec: EnvSpec) -> list[str]:
    action = spec.action
    if action is None:
        return ["action: the checkpoint has no action spec (control mode unknown)"]
    mapping = rig.action_mapping(action.control_mode)
    if mapping is None:
        return [
            f"action: control mode {action.control_mode!r} is not executable on this rig "
            f"(supported: {[a.control_mode for a in rig.actions]})"
        ]
    problems = []
    if action.dim != mapping.action_dim:
        problems.append(
            f"action: the checkpoint has dim {action.dim}, {action.control_mode} on this rig has {mapping.action_dim}"
        )
    elif not (np.allclose(action.low, -1.0) and np.allclose(action.high, 1.0)):
        problems.append(
            f"action: bounds low={list(action.low)} high={list(action.high)}; the rig executes normalized "
            "actions in [-1, 1]"
        )
    if action.control_hz and abs(action.control_hz - rig.control_hz) > 1e-6 * rig.control_hz:
        problems.append(f"action: trained at {action.control_hz:g} Hz, the rig runs at {rig.control_hz:g} Hz")
    return problems


def describe_mapping(rig: RigConfig, spec: EnvSpec, obs_keys: Sequence[str]) -> list[str]:
    """Human-readable lines: where each policy observation comes from on `rig` and how its actions run."""
    lines = []
    for key in obs_keys:
        feature, obs = spec.observations.get(key), rig.observation(key)
        shape = "?" if feature is None else "x".join(str(s) for s in feature.shape)
        if obs is None:
            lines.append(f"observation {key} [{shape}]: NO SOURCE on this rig")
            continue
        lines.append(f"observation {key} [{shape}]:")
        parts: list[tuple[SourceConfig, str]] = []
        if feature is not None and feature.names and not key.startswith(("rgb/", "depth/")):
            matched, uncovered = _segments(feature.names, obs.sources)
            parts = [(src, f"{sl.stop - sl.start} dims") for src, sl in matched]
            lines += [f"  {g}: NO SOURCE" for g in _group(uncovered)]
        else:
            parts = [(src, "") for src in obs.sources]
        for src, dims in parts:
            what = {
                "robot": lambda s: f"robot {'+'.join(s.fields)}",
                "object": lambda s: f"object {s.object!r} {'+'.join(s.fields)}"
                + (f" relative to {s.relative_to!r}" if s.relative_to else "")
                + ("" if s.object in rig.objects else " (NOT OBSERVABLE on this rig)"),
                "constant": lambda s: f"constant {s.value}",
                "camera": lambda s: f"camera {s.camera!r}",
            }[src.source](src)
            frame = f", {src.frame} frame" if src.source in ("robot", "object", "constant") else ""
            sign = f", quat {src.quat_nonneg} >= 0" if src.quat_nonneg else ""
            lines.append(f"  {src.segment or key} ({dims or 'all'}): {what}{frame}{sign}")
    action = spec.action
    mapping = None if action is None else rig.action_mapping(action.control_mode)
    if action is None:
        lines.append("action: NO ACTION SPEC in the checkpoint")
    elif mapping is None:
        lines.append(f"action {action.control_mode} [{action.dim}]: NOT EXECUTABLE on this rig")
    else:
        from robotft.real_robot.actions import MAPPINGS

        mapper = MAPPINGS[mapping.control_mode]
        lines.append(
            f"action {action.control_mode} [{action.dim}] at {action.control_hz:g} Hz -> robot "
            f"{mapper.robot_mode} targets at {rig.control_hz:g} Hz: {mapping}"
        )
    return lines


def require_compatible(
    rig: RigConfig, spec: EnvSpec, obs_keys: Sequence[str], checkpoint: str | Path = ""
) -> None:
    """Raise `RigMismatchError` listing every problem `check_rig` finds."""
    problems = check_rig(rig, spec, obs_keys)
    if problems:
        name = rig.name or "the rig"
        raise RigMismatchError(f"{name} cannot deploy checkpoint {checkpoint}: " + "; ".join(problems))


# ---- observations at run time --------------------------------------------------------------------------


class ObservationBuilder:
    """Assembles the policy's observation dict from aligned samples of the rig's streams.

    Streams (see `stream_names`): `robot` (RobotState), `object/<name>` (a pose with `pos`, `quat`),
    `camera/<name>` (a camera `Frame`). Call only for a rig that passed `check_rig`.
    """

    def __init__(self, rig: RigConfig, spec: EnvSpec, obs_keys: Sequence[str]) -> None:
        self.rig = rig
        self.world_from_base = rig.world_from_base
        self._plan: list[tuple[str, FeatureSpec, list[tuple[SourceConfig, slice]]]] = []
        for key in obs_keys:
            feature = spec.observations[key]
            obs = rig.observation(key)
            assert obs is not None, f"{key}: check_rig first"
            if key.startswith(("rgb/", "depth/")):
                self._plan.append((key, feature, [(obs.sources[0], slice(None))]))
            elif feature.names:
                self._plan.append((key, feature, _segments(feature.names, obs.sources)[0]))
            else:
                offsets = np.cumsum([0] + [s.size or 0 for s in obs.sources])
                self._plan.append(
                    (
                        key,
                        feature,
                        [
                            (s, slice(int(a), int(b)))
                            for s, a, b in zip(obs.sources, offsets, offsets[1:], strict=False)
                        ],
                    )
                )

    @property
    def stream_names(self) -> list[str]:
        """The streams the observations are built from (`robot` always)."""
        names = {"robot"}
        for _, _, parts in self._plan:
            for src, _ in parts:
                if src.source == "object":
                    names.add(f"object/{src.object}")
                    if src.relative_to and src.relative_to != TCP:
                        names.add(f"object/{src.relative_to}")
                elif src.source == "camera":
                    names.add(f"camera/{src.camera}")
        return sorted(names)

    def build(self, samples: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One observation (per key, the feature's shape and dtype) from one sample per stream."""
        out = {}
        for key, feature, parts in self._plan:
            if key.startswith(("rgb/", "depth/")):
                frame = samples[f"camera/{parts[0][0].camera}"]
                image = frame.color if key.startswith("rgb/") else frame.depth
                if image is None or tuple(image.shape) != feature.shape:
                    raise ValueError(
                        f"{key}: camera {parts[0][0].camera!r} gives {None if image is None else image.shape}, "
                        f"the checkpoint expects {feature.shape}"
                    )
                out[key] = np.asarray(image, dtype=feature.dtype)
                continue
            vec = np.zeros(feature.shape, dtype=np.float64)
            for src, sl in parts:
                vec[sl] = self._values(src, samples)
            out[key] = vec.astype(feature.dtype)
        return out

    def _values(self, src: SourceConfig, samples: Mapping[str, Any]) -> np.ndarray:
        if src.source == "constant":
            return np.asarray(src.value, dtype=np.float64)
        if src.source == "robot":
            state = samples["robot"]
            pos, quat = self._frame(src, state.ee_pos, state.ee_quat)
            half = state.gripper_width / 2
            values = {
                "joint_positions": state.joint_positions,
                "joint_velocities": state.joint_velocities,
                "finger_positions": [half, half],
                "finger_velocities": [0.0, 0.0],
                "ee_pos": pos,
                "ee_quat": quat,
                "ee_pose": np.concatenate([pos, quat]),
                "gripper_width": [state.gripper_width],
            }
        else:
            pose = samples[f"object/{src.object}"]
            pos, quat = self._frame(src, pose.pos, pose.quat)
            if src.relative_to:
                pos = pos - self._origin(src, samples)
            values = {
                "pos": pos,
                "quat": quat,
                "pose": np.concatenate([pos, quat]),
                "grasped": [float(bool(pose.grasped))],
            }
        return np.concatenate([np.asarray(values[f], dtype=np.float64).ravel() for f in src.fields])

    def _origin(self, src: SourceConfig, samples: Mapping[str, Any]) -> np.ndarray:
        """The position `src.relative_to` names (the TCP or an object), in `src.frame`."""
        ref = samples["robot"] if src.relative_to == TCP else samples[f"object/{src.relative_to}"]
        ref_pos, ref_quat = (ref.ee_pos, ref.ee_quat) if src.relative_to == TCP else (ref.pos, ref.quat)
        return self._frame(src, ref_pos, ref_quat)[0]

    def _frame(self, src: SourceConfig, pos: np.ndarray, quat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if src.frame == "world":
            pos, quat = self.world_from_base.point(pos), self.world_from_base.orientation(quat)
        quat = np.asarray(quat, dtype=np.float64)
        if src.quat_nonneg and quat["wxyz".index(src.quat_nonneg)] < 0:
            quat = -quat
        return np.asarray(pos, dtype=np.float64), quat
