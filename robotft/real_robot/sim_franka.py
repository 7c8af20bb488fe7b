"""A MuJoCo-simulated Franka Panda behind the Robot contract, in real time (rehearsal and tests).

The arm is robosuite's Panda MJCF (`robots/panda/robot.xml`) with its Franka Hand
(`grippers/panda_gripper.xml`), composed with `mujoco.MjSpec` on a table, plus the free-body objects
and fixed visual markers of a `SimSceneConfig` (e.g. ManiSkill PushCube's 2 cm cube and goal disc), so
a deploy rig can rebuild the scene a policy was trained in. The world frame is the robot base frame.

A physics thread steps MuJoCo at `physics_hz` (1 kHz) and sleeps to the wall clock, running a joint
impedance controller on every step, as the Franka's own 1 kHz controller does:

    tau = Kp (q_ref(t) - q) - Kd qdot + qfrc_bias        (gravity and Coriolis compensation)

`q_ref(t)` ramps linearly from the previous reference to each new target, reaching it at the command's
`timestamp_s`. `ee_pose` targets are turned into joint targets by damped-least-squares inverse
kinematics on the MuJoCo Jacobian of the TCP site (Wampler 1986; Buss 2004, "Introduction to inverse
kinematics with Jacobian transpose, pseudoinverse and damped least squares methods"), with a null-space
pull toward the home posture. States are stamped with `time.monotonic()` when they were simulated.

mujoco is imported lazily; `MUJOCO_GL` defaults to `egl`, the offscreen backend that works on these
headless machines (OSMesa is not installed), for the simulated camera that renders this scene.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from robotft.real_robot.robot import NUM_JOINTS, Robot, RobotCommand, RobotState
from robotft.real_robot.sim_fiducials import SimFiducialConfig, add_fiducials

if TYPE_CHECKING:
    from robotft.real_robot.safety import SafetyLayer

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install robotft[robosuite]"

MANISKILL_REST_QPOS = (0.0, math.pi / 8, 0.0, -5 * math.pi / 8, 0.0, 3 * math.pi / 4, math.pi / 4)
"""ManiSkill3's Panda rest keyframe (rad): the TCP about 0.6 m in front of the base, pointing down."""

_ARM_PREFIX = "panda/"
_GRIPPER_PREFIX = "panda/gripper/"
_SCENE_GROUP = 2
"""Geom group of the table, objects and markers (robosuite uses 0 for collision, 1 for visual meshes)."""


def import_mujoco() -> Any:
    """`import mujoco` with `MUJOCO_GL=egl` unless the caller chose a GL backend.

    The GL backend is fixed when mujoco is first imported, so this must run before any other import of
    mujoco in the process for the simulated camera to render headless.
    """
    if "mujoco" not in sys.modules:
        os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        import mujoco
    except ImportError as e:
        raise ImportError(f"the simulated Franka needs mujoco ({e}); {INSTALL_HINT}") from e
    return mujoco


def robosuite_assets() -> Path:
    """robosuite's `models/assets` folder, found without importing robosuite (slow and noisy)."""
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the simulated Franka uses the Panda model shipped with robosuite; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "assets"


# ---- configs -------------------------------------------------------------------------------------------


@dataclass
class SimObjectConfig:
    """A free-floating box on the table (it can be pushed, grasped, knocked over)."""

    name: str
    """Body name; the key of `SimFranka.object_poses()`."""
    half_size: tuple[float, float, float] = (0.02, 0.02, 0.02)
    """Box half-extents (m); ManiSkill PushCube's cube is 0.02."""
    pos: tuple[float, float, float] = (0.6, 0.0, 0.02)
    """Nominal position of the box centre in the robot base frame (m)."""
    quat: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)
    """Nominal orientation `[w, x, y, z]`."""
    rgba: tuple[float, float, float, float] = (0.85, 0.1, 0.1, 1.0)
    """Colour, red/green/blue/alpha in [0, 1]."""
    mass_kg: float = 0.064
    """Mass (kg); 0.064 is a 4 cm cube of density 1000 kg/m^3."""
    randomize_xy: tuple[float, float] = (0.0, 0.0)
    """At reset, uniform noise of +-these half-ranges (m) is added to the nominal x and y."""
    randomize_yaw_rad: float = 0.0
    """At reset, uniform yaw noise of +- this (rad) about the base z axis."""

    def __post_init__(self) -> None:
        _check_size(f"object {self.name!r} half_size", self.half_size, 3)
        if not self.mass_kg > 0:
            raise ValueError(f"object {self.name!r} mass_kg must be > 0, got {self.mass_kg}")


@dataclass
class SimMarkerConfig:
    """A fixed visual marker (e.g. a goal disc): seen by cameras, not touched by anything."""

    name: str
    """Body name; the key of `SimFranka.object_poses()`."""
    shape: str = "cylinder"
    """`cylinder`, `box` or `sphere`."""
    size: tuple[float, ...] = (0.05, 0.001)
    """MuJoCo geom size (m): cylinder `(radius, half_height)`, box half-extents, sphere `(radius,)`."""
    pos: tuple[float, float, float] = (0.8, 0.0, 0.001)
    """Nominal position in the robot base frame (m), or an offset from `relative_to`'s position."""
    quat: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)
    """Orientation `[w, x, y, z]`."""
    rgba: tuple[float, float, float, float] = (0.1, 0.8, 0.1, 1.0)
    """Colour, red/green/blue/alpha in [0, 1]."""
    relative_to: str | None = None
    """An object name: `pos` is then an offset (x, y only; z stays absolute) from that object's position
    after its randomisation, as ManiSkill PushCube places its goal 0.2 m in front of the cube."""
    randomize_xy: tuple[float, float] = (0.0, 0.0)
    """At reset, uniform noise of +-these half-ranges (m) is added to x and y."""

    def __post_init__(self) -> None:
        sizes = {"cylinder": 2, "box": 3, "sphere": 1}
        if self.shape not in sizes:
            raise ValueError(f"marker {self.name!r} shape must be one of {sorted(sizes)}, got {self.shape!r}")
        _check_size(f"marker {self.name!r} size", self.size, sizes[self.shape])


@dataclass
class SimSceneConfig:
    """What stands around the robot: a table, objects and markers, all in the robot base frame.

    Example (YAML in a rig preset, ManiSkill PushCube):
        scene:
          objects: [{name: cube, half_size: [0.02, 0.02, 0.02], pos: [0.615, 0.0, 0.02],
                     randomize_xy: [0.1, 0.1]}]
          markers: [{name: goal, shape: cylinder, size: [0.1, 0.001], pos: [0.2, 0.0, 0.001],
                     relative_to: cube, rgba: [0.9, 0.1, 0.1, 1]}]
    """

    table_top_z: float = 0.0
    """Height of the table surface (m); 0 puts the robot base on the table, as in ManiSkill."""
    table_center_xy: tuple[float, float] = (0.45, 0.0)
    """Centre of the table top (m)."""
    table_half_size: tuple[float, float] = (0.6, 0.7)
    """Half-extents of the table top in x and y (m)."""
    objects: list[SimObjectConfig] = field(default_factory=list)
    """Free-body boxes."""
    markers: list[SimMarkerConfig] = field(default_factory=list)
    """Fixed visual markers."""
    fiducials: list[SimFiducialConfig] = field(default_factory=list)
    """Printed ArUco markers on objects or robot links (robotft.real_robot.sim_fiducials)."""

    def __post_init__(self) -> None:
        names = [o.name for o in self.objects] + [m.name for m in self.markers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"scene object/marker names must be unique, repeated: {duplicates}")
        objects = {o.name for o in self.objects}
        for m in self.markers:
            if m.relative_to is not None and m.relative_to not in objects:
                raise ValueError(
                    f"marker {m.name!r} relative_to {m.relative_to!r} is not an object; objects: {sorted(objects)}"
                )


@dataclass
class SimFrankaConfig:
    """The simulated Franka: scene, home pose, controller gains and physics rate."""

    scene: SimSceneConfig = field(default_factory=SimSceneConfig)
    """Table, objects and markers."""
    home_joint_positions: tuple[float, ...] = MANISKILL_REST_QPOS
    """Joint angles (rad) the arm starts at and returns to at `reset_episode`."""
    stiffness: tuple[float, ...] = (600.0, 600.0, 600.0, 600.0, 250.0, 150.0, 50.0)
    """Joint impedance stiffness Kp (Nm/rad); the gains of libfranka's joint impedance example."""
    damping: tuple[float, ...] | None = None
    """Joint impedance damping Kd (Nms/rad); None: critical damping `2 sqrt(Kp M_ii)` from the model's
    joint-space inertia at the home pose (as franky's impedance controllers default to)."""
    physics_hz: float = 1000.0
    """Physics and controller rate (Hz); the Franka's controller runs at 1 kHz."""
    flange_to_tcp_m: float = 0.1034
    """TCP offset along the flange z axis (m): the Franka Hand's, which franky reports as the EE."""
    gripper_min_force_n: float = 5.0
    """Finger force (N) used to move the fingers when a command asks for less: a motor with no force
    limit cannot move them at all."""
    ik_damping: float = 0.05
    """Damping lambda of the least-squares IK (m or rad); larger is smoother near singularities."""
    ik_max_iters: int = 50
    """IK iterations per `ee_pose` target, started from the previous joint target."""
    ik_nullspace_gain: float = 0.1
    """Pull toward `home_joint_positions` in the Jacobian null space, per IK iteration."""
    max_lag_s: float = 0.1
    """When physics falls this far behind the wall clock (s), the lost time is skipped instead of
    replayed in a burst; skips lower the measured real-time factor."""
    seed: int | None = None
    """Seed of the object randomisation at `reset_episode` (None: from the OS)."""

    def __post_init__(self) -> None:
        for name in ("home_joint_positions", "stiffness", "damping"):
            if getattr(self, name) is not None:
                _check_size(name, getattr(self, name), NUM_JOINTS, allow_zero=name == "home_joint_positions")
        if not self.physics_hz > 0 or not self.max_lag_s > 0 or not self.ik_max_iters >= 1:
            raise ValueError(
                "SimFrankaConfig needs physics_hz > 0, max_lag_s > 0, ik_max_iters >= 1; got "
                f"{self.physics_hz}, {self.max_lag_s}, {self.ik_max_iters}"
            )


def _check_size(name: str, value: tuple[float, ...], size: int, allow_zero: bool = False) -> None:
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (size,) or not np.all(np.isfinite(arr)) or (not allow_zero and np.any(arr <= 0)):
        what = "finite numbers" if allow_zero else "numbers > 0"
        raise ValueError(f"{name} must be {size} {what}, got {value}")


# ---- the scene -----------------------------------------------------------------------------------------


def build_model(cfg: SimFrankaConfig) -> Any:
    """Compile the MuJoCo model: Panda + Franka Hand at the origin, a `tcp` site, table, objects, markers."""
    mujoco = import_mujoco()
    assets = robosuite_assets()
    arm = mujoco.MjSpec.from_file(str(assets / "robots" / "panda" / "robot.xml"))
    hand = mujoco.MjSpec.from_file(str(assets / "grippers" / "panda_gripper.xml"))
    flange = arm.body("right_hand")  # robosuite's flange frame, already turned -45 deg like the Hand
    flange.add_site(name="tcp", pos=[0.0, 0.0, cfg.flange_to_tcp_m], size=[0.005, 0.005, 0.005], group=3)
    flange.add_frame().attach_body(hand.body("right_gripper"), "gripper/", "")

    spec = mujoco.MjSpec()
    spec.modelname = "robotft_sim_franka"
    spec.option.timestep = 1.0 / cfg.physics_hz
    spec.visual.headlight.ambient = [0.3, 0.3, 0.3]
    spec.worldbody.add_light(
        pos=[0.5, 0.0, 2.5], dir=[0.0, 0.0, -1.0], type=mujoco.mjtLightType.mjLIGHT_DIRECTIONAL, castshadow=0
    )
    scene = cfg.scene
    table_h = 0.02
    spec.worldbody.add_geom(
        name="table",
        type=mujoco.mjtGeom.mjGEOM_BOX,
        size=[*scene.table_half_size, table_h],
        pos=[*scene.table_center_xy, scene.table_top_z - table_h],
        rgba=[0.55, 0.45, 0.35, 1.0],
        group=_SCENE_GROUP,
    )
    spec.worldbody.add_geom(
        name="floor",
        type=mujoco.mjtGeom.mjGEOM_PLANE,
        size=[3.0, 3.0, 0.1],
        pos=[0.0, 0.0, scene.table_top_z - 0.75],
        rgba=[0.35, 0.35, 0.38, 1.0],
        group=_SCENE_GROUP,
    )
    spec.worldbody.add_frame().attach_body(arm.body("base"), _ARM_PREFIX, "")
    for obj in scene.objects:
        body = spec.worldbody.add_body(name=obj.name, pos=list(obj.pos), quat=list(obj.quat))
        body.add_freejoint(name=f"{obj.name}_joint")
        body.add_geom(
            type=mujoco.mjtGeom.mjGEOM_BOX,
            size=list(obj.half_size),
            rgba=list(obj.rgba),
            mass=obj.mass_kg,
            condim=4,
            friction=[1.0, 0.005, 0.0001],
            group=_SCENE_GROUP,
        )
    geom_types = {
        "cylinder": mujoco.mjtGeom.mjGEOM_CYLINDER,
        "box": mujoco.mjtGeom.mjGEOM_BOX,
        "sphere": mujoco.mjtGeom.mjGEOM_SPHERE,
    }
    for marker in scene.markers:
        body = spec.worldbody.add_body(
            name=marker.name, pos=list(marker.pos), quat=list(marker.quat), mocap=True
        )
        body.add_geom(
            type=geom_types[marker.shape],
            size=[*marker.size, *[0.0] * (3 - len(marker.size))],
            rgba=list(marker.rgba),
            contype=0,
            conaffinity=0,
            group=_SCENE_GROUP,
        )
    add_fiducials(spec, scene.fiducials)
    return spec.compile()


# ---- the robot -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectPose:
    """Pose of a scene object or marker in the robot base frame."""

    timestamp_s: float
    """When the pose was simulated (s, `time.monotonic()` clock)."""
    pos: np.ndarray
    """Position `[3]` (m)."""
    quat: np.ndarray
    """Orientation `[4]` `[w, x, y, z]`."""


def _fatal_warnings(mujoco: Any) -> tuple[Any, ...]:
    w = mujoco.mjtWarning
    return (w.mjWARN_BADCTRL, w.mjWARN_BADQPOS, w.mjWARN_BADQVEL, w.mjWARN_BADQACC)


class SimulationError(RuntimeError):
    """The physics thread failed (e.g. the simulation diverged); raised on the next call into SimFranka."""


class SimFranka(Robot):
    """A simulated Franka Panda with a Franka Hand, stepped in real time in a background thread.

    Example:
        cfg = SimFrankaConfig(scene=SimSceneConfig(objects=[SimObjectConfig("cube")]))
        with SimFranka(cfg, SafetyLayer(SafetyLimits(), control_dt=0.1)) as robot:
            robot.reset_episode(seed=0)
            state = robot.get_observation()
            robot.send_action(RobotCommand("ee_pose", now + 0.1, 0.08, ee_pos=..., ee_quat=...))
            cube = robot.object_poses()["cube"].pos

    All public methods are thread-safe. An exception in the physics thread is re-raised, as a
    `SimulationError`, by the next call to any of them, and the thread stops.
    """

    def __init__(
        self, config: SimFrankaConfig, safety: SafetyLayer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(safety, clock=clock)
        self.config = config
        mujoco = import_mujoco()
        self._mj = mujoco
        self._fatal = _fatal_warnings(mujoco)
        self.model = build_model(config)
        """The compiled `mujoco.MjModel` (read-only for callers; cameras render it)."""
        self._data = mujoco.MjData(self.model)
        self._ik_data = mujoco.MjData(self.model)
        m = self.model
        joint_ids = [m.joint(f"{_ARM_PREFIX}joint{i + 1}").id for i in range(NUM_JOINTS)]
        self._arm_qpos = np.array([m.jnt_qposadr[j] for j in joint_ids])
        self._arm_dof = np.array([m.jnt_dofadr[j] for j in joint_ids])
        self._arm_act = np.array([m.actuator(f"{_ARM_PREFIX}torq_j{i + 1}").id for i in range(NUM_JOINTS)])
        self._q_min = m.jnt_range[joint_ids, 0].copy()
        self._q_max = m.jnt_range[joint_ids, 1].copy()
        fingers = [m.joint(f"{_GRIPPER_PREFIX}finger_joint{i}").id for i in (1, 2)]
        self._finger_qpos = np.array([m.jnt_qposadr[j] for j in fingers])
        self._finger_act = np.array(
            [m.actuator(f"{_GRIPPER_PREFIX}gripper_finger_joint{i}").id for i in (1, 2)]
        )
        self._tcp = m.site(f"{_ARM_PREFIX}tcp").id
        self._objects = {o.name: m.body(o.name).id for o in config.scene.objects}
        self._object_qpos = {
            o.name: m.jnt_qposadr[m.joint(f"{o.name}_joint").id] for o in config.scene.objects
        }
        self._markers = {mk.name: m.body(mk.name).mocapid[0] for mk in config.scene.markers}
        self._marker_bodies = {mk.name: m.body(mk.name).id for mk in config.scene.markers}
        self._kp = np.array(config.stiffness)
        self._kd = np.array(config.damping) if config.damping is not None else None
        self._home = np.clip(np.array(config.home_joint_positions), self._q_min, self._q_max)
        self._rng = np.random.default_rng(config.seed)

        self._lock = threading.Lock()
        self._ik_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._error: BaseException | None = None
        # Reference ramp: q_ref(t) goes from _ref_from at _ref_t0 to _ref_to at _ref_t1.
        self._ref_from = self._home.copy()
        self._ref_to = self._home.copy()
        self._ref_t0 = self._ref_t1 = 0.0
        self._gripper_width = 0.08
        # Raw copies of the last simulated state (q, qdot, TCP pos, TCP rotation matrix, fingers); the
        # RobotState is built on read, which keeps the 1 kHz loop light.
        self._snap = np.zeros(2 * NUM_JOINTS + 3 + 9 + 2)
        self._state_time = 0.0
        self._sim_time_run = 0.0
        self._wall_time_run = 0.0
        self._skipped_s = 0.0
        self._place_scene({}, None)
        if self._kd is None:
            inertia = np.zeros((m.nv, m.nv))
            mujoco.mj_fullM(m, inertia, self._data.qM)
            self._kd = 2.0 * np.sqrt(self._kp * np.diag(inertia)[self._arm_dof])

    # ---- lifecycle -----------------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        """True from `connect()` to `disconnect()`, also after the physics thread failed, so that calls
        raise its error rather than a misleading "not connected"."""
        return self._thread is not None

    def _connect(self) -> None:
        # A new session holds the arm where it is; after a failure, the scene starts over.
        d = self._data
        if self._error is not None or not np.all(np.isfinite(d.qpos)):
            self._place_scene({}, None)
        for warning in self._fatal:
            d.warning[warning].number = 0
        self._ref_from = self._ref_to = d.qpos[self._arm_qpos].copy()
        self._ref_t0 = self._ref_t1 = 0.0
        self._stop_event.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="robotft-sim-franka", daemon=True)
        self._thread.start()

    def _disconnect(self) -> None:
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._thread = None

    def disconnect(self) -> None:
        """Stop the arm and the physics thread; also after the thread failed (then without `stop`)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
            return
        super().disconnect()

    # ---- Robot contract ------------------------------------------------------------------------------

    def get_observation(self) -> RobotState:
        """The state simulated most recently (at most one physics step, ~1 ms, old)."""
        self._check()
        with self._lock:
            snap, t = self._snap.copy(), self._state_time
        n = NUM_JOINTS
        quat = np.zeros(4)
        self._mj.mju_mat2Quat(quat, snap[2 * n + 3 : 2 * n + 12])
        return RobotState(
            timestamp_s=t,
            joint_positions=snap[:n],
            joint_velocities=snap[n : 2 * n],
            ee_pos=snap[2 * n : 2 * n + 3],
            ee_quat=quat,
            gripper_width=float(snap[-2] - snap[-1]),
        )

    def _send_command(self, command: RobotCommand) -> None:
        self._check()
        if command.control_mode == "joint_position":
            target = np.clip(command.joint_positions, self._q_min, self._q_max)
        else:
            target = self.inverse_kinematics(command.ee_pos, command.ee_quat)
        now = self.clock()
        with self._lock:
            self._ref_from = self._reference(now)
            self._ref_to = target
            self._ref_t0, self._ref_t1 = now, max(now, command.timestamp_s)
            self._gripper_width = command.gripper_width
            # Each finger pushes with at most `force`, so an object between them is squeezed with
            # `force`, like the Franka Hand's grasp force.
            force = max(command.gripper_force, self.config.gripper_min_force_n)
            self.model.actuator_forcerange[self._finger_act] = (-force, force)

    def stop(self) -> None:
        """Hold the measured joint positions (and the current gripper target)."""
        self._check()
        with self._lock:
            q = self._data.qpos[self._arm_qpos].copy()
            self._ref_from = self._ref_to = q
            self._ref_t0 = self._ref_t1 = self.clock()

    # ---- simulation-only API -------------------------------------------------------------------------

    def reset_episode(
        self, seed: int | None = None, object_poses: dict[str, tuple[Any, Any]] | None = None
    ) -> dict[str, ObjectPose]:
        """Teleport the arm home with open fingers, place objects and markers, reset the safety layer.

        Objects and markers go to `object_poses[name] = (pos [3], quat [4] wxyz)` where given, else to
        their configured pose plus the configured random noise (drawn from `seed` when given).
        Returns the poses after the reset.
        """
        self._check()
        rng = self._rng if seed is None else np.random.default_rng(seed)
        object_poses = dict(object_poses or {})
        unknown = sorted(set(object_poses) - set(self._objects) - set(self._markers))
        if unknown:
            raise KeyError(
                f"reset_episode: unknown object(s) {unknown}; scene has {sorted([*self._objects, *self._markers])}"
            )
        with self._lock:
            self._place_scene(object_poses, rng)
        self.safety.reset()
        return self.object_poses()

    def _place_scene(self, object_poses: dict[str, tuple[Any, Any]], rng: np.random.Generator | None) -> None:
        """Reset the physics state: arm home, objects and markers placed (no noise when `rng` is None).
        Call with the lock held (or before the physics thread exists)."""
        d = self._data
        self._mj.mj_resetData(self.model, d)
        placed: dict[str, np.ndarray] = {}
        for obj in self.config.scene.objects:
            pos, quat = object_poses.get(obj.name) or _randomized(obj, rng)
            adr = self._object_qpos[obj.name]
            d.qpos[adr : adr + 3] = pos
            d.qpos[adr + 3 : adr + 7] = np.asarray(quat, dtype=np.float64) / np.linalg.norm(quat)
            placed[obj.name] = np.asarray(pos, dtype=np.float64)
        for mk in self.config.scene.markers:
            if mk.name in object_poses:
                pos, quat = object_poses[mk.name]
            else:
                pos = np.array(mk.pos, dtype=np.float64)
                if mk.relative_to is not None:
                    pos[:2] += placed[mk.relative_to][:2]
                if rng is not None:
                    pos[:2] += rng.uniform(-1.0, 1.0, 2) * np.array(mk.randomize_xy)
                quat = mk.quat
            d.mocap_pos[self._markers[mk.name]] = pos
            d.mocap_quat[self._markers[mk.name]] = quat
        self._set_home_state(self._home)

    def object_poses(self) -> dict[str, ObjectPose]:
        """Pose of every object and marker (base frame), as simulated with the latest robot state."""
        self._check()
        with self._lock:
            d, t = self._data, self._state_time
            bodies = {**self._objects, **self._marker_bodies}
            return {name: ObjectPose(t, d.xpos[b].copy(), d.xquat[b].copy()) for name, b in bodies.items()}

    def inverse_kinematics(
        self, pos: np.ndarray, quat: np.ndarray, seed_q: np.ndarray | None = None
    ) -> np.ndarray:
        """Joint angles `[7]` (rad) that put the TCP at `pos [3]` (m) with orientation `quat [4]` (wxyz).

        Damped least squares, `dq = J^T (J J^T + lambda^2 I)^-1 e` with `e` the position and rotation
        error, plus a null-space pull toward the home posture, clipped to the joint limits; started from
        `seed_q` (default: the current joint target). Returns the best effort when the target is out of
        reach; `tcp_pose(q)` tells how close it got.
        """
        mj, m = self._mj, self.model
        cfg = self.config
        target_quat = np.asarray(quat, dtype=np.float64) / np.linalg.norm(quat)
        if seed_q is None:
            with self._lock:
                seed_q = self._ref_to.copy()
        q = np.asarray(seed_q, dtype=np.float64).copy()
        jacp, jacr = np.zeros((3, m.nv)), np.zeros((3, m.nv))
        cur_quat, neg, diff, rot_err = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(3)
        lam2 = cfg.ik_damping**2
        with self._ik_lock:
            d = self._ik_data
            for _ in range(cfg.ik_max_iters):
                d.qpos[self._arm_qpos] = q
                mj.mj_kinematics(m, d)
                mj.mj_comPos(m, d)
                pos_err = np.asarray(pos, dtype=np.float64) - d.site_xpos[self._tcp]
                mj.mju_mat2Quat(cur_quat, d.site_xmat[self._tcp])
                mj.mju_negQuat(neg, cur_quat)
                mj.mju_mulQuat(diff, target_quat, neg)
                mj.mju_quat2Vel(rot_err, diff, 1.0)  # world-frame rotation taking current to target
                if np.linalg.norm(pos_err) < 1e-5 and np.linalg.norm(rot_err) < 1e-4:
                    break
                mj.mj_jacSite(m, d, jacp, jacr, self._tcp)
                jac = np.vstack([jacp[:, self._arm_dof], jacr[:, self._arm_dof]])
                jjt = jac @ jac.T + lam2 * np.eye(6)
                dq = jac.T @ np.linalg.solve(jjt, np.concatenate([pos_err, rot_err]))
                # The exact projector: the damped one would leak the posture pull into the task.
                null = np.eye(NUM_JOINTS) - np.linalg.pinv(jac) @ jac
                dq += null @ (cfg.ik_nullspace_gain * (self._home - q))
                q = np.clip(q + dq, self._q_min, self._q_max)
        return q

    def tcp_pose(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward kinematics: TCP position `[3]` (m) and quaternion `[4]` (wxyz) at joint angles `q`."""
        with self._ik_lock:
            d = self._ik_data
            d.qpos[self._arm_qpos] = q
            self._mj.mj_kinematics(self.model, d)
            quat = np.zeros(4)
            self._mj.mju_mat2Quat(quat, d.site_xmat[self._tcp])
            return d.site_xpos[self._tcp].copy(), quat

    def update_scene(self, renderer: Any, camera: int | str, option: Any = None) -> float:
        """`renderer.update_scene(data, camera, option)` under the physics lock, so a frame never shows a
        half-stepped scene; returns the time (s, monotonic clock) of the simulated state it shows."""
        self._check()
        with self._lock:
            renderer.update_scene(self._data, camera, option)
            return self._state_time

    def camera_pose(self, camera: int | str) -> tuple[np.ndarray, np.ndarray]:
        """Position `[3]` (m) and rotation `[3, 3]` of a model camera in the base frame (MuJoCo axes:
        looking along -z, y up), as last simulated."""
        self._check()
        cam = self.model.camera(camera).id
        with self._lock:
            return self._data.cam_xpos[cam].copy(), self._data.cam_xmat[cam].reshape(3, 3).copy()

    @property
    def realtime_factor(self) -> float:
        """Simulated time / wall-clock time since `connect()` (1.0: exactly real time)."""
        with self._lock:
            return self._sim_time_run / self._wall_time_run if self._wall_time_run > 0 else 0.0

    @property
    def skipped_s(self) -> float:
        """Wall-clock time (s) the physics skipped because it fell more than `max_lag_s` behind."""
        with self._lock:
            return self._skipped_s

    # ---- the physics thread --------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise SimulationError(f"SimFranka physics thread failed: {self._error!r}") from self._error

    def _reference(self, now: float) -> np.ndarray:
        """The joint reference at time `now` on the current ramp (call with the lock held)."""
        if now >= self._ref_t1:
            return self._ref_to.copy()
        frac = max(0.0, (now - self._ref_t0) / (self._ref_t1 - self._ref_t0))
        return self._ref_from + frac * (self._ref_to - self._ref_from)

    def _set_home_state(self, q: np.ndarray) -> None:
        """Put the arm at rest at `q` with open fingers and make it the reference (lock held or unshared)."""
        d = self._data
        d.qpos[self._arm_qpos] = q
        d.qvel[:] = 0.0
        d.qpos[self._finger_qpos] = (0.04, -0.04)
        self._ref_from, self._ref_to = q.copy(), q.copy()
        self._ref_t0 = self._ref_t1 = 0.0
        self._gripper_width = 0.08
        self._mj.mj_forward(self.model, d)
        self._snapshot(self.clock())

    def _snapshot(self, now: float) -> None:
        d, n, snap = self._data, NUM_JOINTS, self._snap
        snap[:n] = d.qpos[self._arm_qpos]
        snap[n : 2 * n] = d.qvel[self._arm_dof]
        snap[2 * n : 2 * n + 3] = d.site_xpos[self._tcp]
        snap[2 * n + 3 : 2 * n + 12] = d.site_xmat[self._tcp]
        snap[-2:] = d.qpos[self._finger_qpos]
        self._state_time = now

    def _step(self) -> None:
        """One physics step (lock held): kinematics, impedance torques, state snapshot, integration."""
        mj, m, d = self._mj, self.model, self._data
        mj.mj_step1(m, d)
        now = self.clock()
        q = d.qpos[self._arm_qpos]
        tau = self._kp * (self._reference(now) - q) - self._kd * d.qvel[self._arm_dof]
        d.ctrl[self._arm_act] = tau + d.qfrc_bias[self._arm_dof]
        half = self._gripper_width / 2
        d.ctrl[self._finger_act] = (half, -half)
        self._snapshot(now)
        mj.mj_step2(m, d)
        for warning in self._fatal:
            if d.warning[warning].number:
                raise SimulationError(
                    f"physics failed at sim time {d.time:.3f} s: MuJoCo {warning.name} "
                    "(a non-finite control, position, velocity or acceleration)"
                )

    def _run(self) -> None:
        dt = self.model.opt.timestep
        start = self.clock()
        deadline = start
        sim_steps = 0
        skipped = 0.0
        try:
            while not self._stop_event.is_set():
                now = self.clock()
                if now < deadline:
                    time.sleep(deadline - now)
                elif now - deadline > self.config.max_lag_s:
                    skipped += now - deadline
                    deadline = now
                with self._lock:
                    self._step()
                    sim_steps += 1
                    self._sim_time_run = sim_steps * dt
                    self._wall_time_run = self.clock() - start
                    self._skipped_s = skipped
                deadline += dt
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller by _check()
            log.error("SimFranka physics thread failed: %r", e)
            self._error = e


def _randomized(obj: SimObjectConfig, rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """The object's nominal pose plus uniform xy and yaw noise (none when `rng` is None)."""
    pos = np.array(obj.pos, dtype=np.float64)
    quat = np.array(obj.quat, dtype=np.float64)
    if rng is None:
        return pos, quat
    pos[:2] += rng.uniform(-1.0, 1.0, 2) * np.array(obj.randomize_xy)
    yaw = rng.uniform(-1.0, 1.0) * obj.randomize_yaw_rad
    w0, z0 = math.cos(yaw / 2), math.sin(yaw / 2)  # rotation about the base z axis, applied first
    w1, x1, y1, z1 = quat
    return pos, np.array([w0 * w1 - z0 * z1, w0 * x1 - z0 * y1, w0 * y1 + z0 * x1, w0 * z1 + z0 * w1])
