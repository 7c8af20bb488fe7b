"""A MuJoCo-simulated Franka Panda behind the Robot contract: real time (rehearsal, tests) or lock-step.

The scene (robosuite's Panda MJCF with its Franka Hand, a table, objects and markers) comes from
robotft.real_robot.sim_scene; TCP kinematics and IK from robotft.real_robot.sim_kinematics.

The arm is driven by a joint-space PD law on every physics step (1 kHz by default):

    tau = clip(Kp (q_ref(t) - q) + qfrc_bias, -tau_max, tau_max) - Kd qdot

`qfrc_bias` compensates gravity and Coriolis forces (ManiSkill disables gravity on the arm's links, which
is the same), and `Kd qdot` is MuJoCo joint damping, integrated implicitly so that stiff gains stay
stable. With `interpolate`, `q_ref(t)` ramps linearly from the previous reference to each new target,
reaching it at the command's `timestamp_s` (a Franka tracking a stream of targets); without, the target
applies at once, as ManiSkill's PD joint drives (stiffness 1000, damping 100, force limit 100) do with the
target of its `pd_ee_delta_pose` controller. `ee_pose` targets become joint targets by IK started from
the measured joints. States are stamped with the robot's clock when they were simulated.

Two ways to run the physics:
- `realtime=True`: a thread steps MuJoCo at `physics_hz`, sleeping to the wall clock (`time.monotonic()`).
- `realtime=False`: nothing runs by itself; `advance(seconds)` steps the physics and the robot's clock is
  the simulated time. Used to compare the rig with the training simulator step for step
  (robotft.real_robot.parity) and to evaluate policies faster than real time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from robotft.real_robot.robot import NUM_JOINTS, Robot, RobotCommand, RobotState
from robotft.real_robot.sim_kinematics import IkConfig, TcpKinematics
from robotft.real_robot.sim_scene import (
    ARM_PREFIX,
    GRIPPER_PREFIX,
    ObjectPose,
    SimSceneConfig,
    build_model,
    check_size,
    import_mujoco,
    sample_scene_poses,
)

if TYPE_CHECKING:
    from robotft.real_robot.safety import SafetyLayer

log = logging.getLogger(__name__)

GRASP_MIN_FORCE_N = 0.5
"""ManiSkill's `Panda.is_grasping` defaults: each finger must be pushed open by the object with at least
this force (N) ..."""
GRASP_MAX_ANGLE_RAD = np.deg2rad(85.0)
"""... at most this far (rad) from the finger's opening direction."""

MANISKILL_REST_QPOS = (0.0, np.pi / 8, 0.0, -5 * np.pi / 8, 0.0, 3 * np.pi / 4, np.pi / 4)
"""ManiSkill3's Panda rest keyframe (rad): the TCP about 0.6 m in front of the base, pointing down."""


@dataclass
class SimFrankaConfig:
    """The simulated Franka: scene, home pose, joint controller, IK and physics rate."""

    scene: SimSceneConfig = field(default_factory=SimSceneConfig)
    """Table, objects and markers."""
    home_joint_positions: tuple[float, ...] = MANISKILL_REST_QPOS
    """Joint angles (rad) the arm starts at and returns to at `reset_episode`."""
    home_noise_rad: float = 0.0
    """At `reset_episode`, Gaussian noise of this std (rad) is added to each home joint angle (ManiSkill's
    table-top tasks use `robot_init_qpos_noise = 0.02`)."""
    stiffness: tuple[float, ...] = (600.0, 600.0, 600.0, 600.0, 250.0, 150.0, 50.0)
    """Joint stiffness Kp (Nm/rad); default: the gains of libfranka's joint impedance example."""
    damping: tuple[float, ...] | None = None
    """Joint damping Kd (Nms/rad); None: critical damping `2 sqrt(Kp M_ii)` from the model's joint-space
    inertia at the home pose (as franky's impedance controllers default to)."""
    torque_limit_nm: tuple[float, ...] | None = None
    """Largest joint torque (Nm), one per joint; None: the model's actuator limits (robosuite: 80 and 12)."""
    interpolate: bool = True
    """True: the joint reference ramps to each target by the command's timestamp; False: it jumps to the
    target when the command arrives (ManiSkill's delta controllers)."""
    physics_hz: float = 1000.0
    """Physics and controller rate (Hz); the Franka's controller runs at 1 kHz."""
    flange_to_tcp_m: float = 0.1034
    """TCP offset along the flange z axis (m): the Franka Hand's, which franky reports as the EE (and
    ManiSkill's `panda_hand_tcp` link)."""
    gripper_min_force_n: float = 5.0
    """Finger force (N) used to move the fingers when a command asks for less: a motor with no force
    limit cannot move them at all."""
    finger_force_n: float | None = None
    """Force limit (N) of each finger's drive whatever force a command asks for (ManiSkill's Panda: 100,
    which closes the fingers in about 0.1 s); None: the command's grasp force."""
    finger_armature: float | None = None
    """Armature (kg) of each finger joint; None: robosuite's 1.0, which slows the 15 g fingers as a 1 kg
    mass would (ManiSkill's fingers have none)."""
    finger_friction_loss_n: float | None = None
    """Dry friction (N) of each finger joint; None: robosuite's 1.0 (ManiSkill's fingers have none)."""
    finger_contact_solref: tuple[float, float] | None = None
    """MuJoCo contact time constant (s) and damping ratio of each finger's collision geoms (finger and pad);
    None: robosuite's, whose pads are under-damped (0.01 s at ratio 0.5). A cube squeezed between
    under-damped pads bounces (the measured opening swings by 1 cm from one control step to the next) and slips
    out while it is carried: a PickCube policy at 100% in ManiSkill dropped the cube in 14 of 100 lock-step
    episodes, and in 1 with MuJoCo's default contact, 0.02 s critically damped (`[0.02, 1.0]`)."""
    finger_closed_target_m: float = 0.0
    """Finger joint target (m) for a gripper width command of 0; targets for widths up to 0.08 m are linear
    from it to 0.04. ManiSkill's Panda drives the fingers to -0.01 (past closed) on a full close, so that
    they squeeze thin objects and close as fast as in ManiSkill."""
    ik: IkConfig = field(default_factory=IkConfig)
    """IK of `ee_pose` targets."""
    realtime: bool = True
    """True: a thread runs the physics at the wall clock; False: `advance()` does (see the module doc)."""
    max_lag_s: float = 0.1
    """When physics falls this far behind the wall clock (s), the lost time is skipped instead of
    replayed in a burst; skips lower the measured real-time factor."""
    seed: int | None = None
    """Seed of the scene randomisation at `reset_episode` (None: from the OS)."""

    def __post_init__(self) -> None:
        for name in ("home_joint_positions", "stiffness", "damping", "torque_limit_nm"):
            if getattr(self, name) is not None:
                check_size(name, getattr(self, name), NUM_JOINTS, allow_zero=name == "home_joint_positions")
        if not self.physics_hz > 0 or not self.max_lag_s > 0 or not self.home_noise_rad >= 0:
            raise ValueError(
                "SimFrankaConfig needs physics_hz > 0, max_lag_s > 0, home_noise_rad >= 0; got "
                f"{self.physics_hz}, {self.max_lag_s}, {self.home_noise_rad}"
            )
        for name in ("finger_force_n", "finger_armature", "finger_friction_loss_n"):
            value = getattr(self, name)
            if value is not None and not (value > 0 or (value == 0 and name != "finger_force_n")):
                raise ValueError(f"{name} must be None or >= 0 (force: > 0), got {value}")
        if self.finger_contact_solref is not None and not (
            len(self.finger_contact_solref) == 2 and all(v > 0 for v in self.finger_contact_solref)
        ):
            raise ValueError(
                f"finger_contact_solref must be None or [time constant > 0, damping ratio > 0], "
                f"got {self.finger_contact_solref}"
            )
        if not -0.04 <= self.finger_closed_target_m < 0.04:
            raise ValueError(
                f"finger_closed_target_m must be in [-0.04, 0.04), got {self.finger_closed_target_m}"
            )


def _fatal_warnings(mujoco: Any) -> tuple[Any, ...]:
    w = mujoco.mjtWarning
    return (w.mjWARN_BADCTRL, w.mjWARN_BADQPOS, w.mjWARN_BADQVEL, w.mjWARN_BADQACC)


def _collision_geoms(model: Any, body: int) -> frozenset[int]:
    """The colliding geoms of `body` and its descendants."""
    inside = {body}
    for b in range(body + 1, model.nbody):  # MuJoCo numbers a child after its parent
        if model.body_parentid[b] in inside:
            inside.add(b)
    return frozenset(
        g
        for g in range(model.ngeom)
        if model.geom_bodyid[g] in inside and (model.geom_contype[g] or model.geom_conaffinity[g])
    )


class SimulationError(RuntimeError):
    """The physics thread failed (e.g. the simulation diverged); raised on the next call into SimFranka."""


class SimFranka(Robot):
    """A simulated Franka Panda with a Franka Hand.

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
        super().__init__(safety, clock=clock if config.realtime else self._sim_clock)
        self.config = config
        mujoco = import_mujoco()
        self._mj = mujoco
        self._fatal = _fatal_warnings(mujoco)
        self.model = build_model(config.scene, config.physics_hz, config.flange_to_tcp_m)
        """The compiled `mujoco.MjModel` (read-only for callers; cameras render it)."""
        self._data = mujoco.MjData(self.model)
        m = self.model
        joint_ids = [m.joint(f"{ARM_PREFIX}joint{i + 1}").id for i in range(NUM_JOINTS)]
        self._arm_qpos = np.array([m.jnt_qposadr[j] for j in joint_ids])
        self._arm_dof = np.array([m.jnt_dofadr[j] for j in joint_ids])
        self._arm_act = np.array([m.actuator(f"{ARM_PREFIX}torq_j{i + 1}").id for i in range(NUM_JOINTS)])
        if config.torque_limit_nm is not None:
            limit = np.array(config.torque_limit_nm)
            m.actuator_ctrlrange[self._arm_act] = np.stack([-limit, limit], axis=1)
        self._tau_max = m.actuator_ctrlrange[self._arm_act, 1].copy()
        fingers = [m.joint(f"{GRIPPER_PREFIX}finger_joint{i}").id for i in (1, 2)]
        self._finger_qpos = np.array([m.jnt_qposadr[j] for j in fingers])
        self._finger_act = np.array(
            [m.actuator(f"{GRIPPER_PREFIX}gripper_finger_joint{i}").id for i in (1, 2)]
        )
        # Each finger's collision geoms (finger and pad) and its joint, whose axis (times +-1) opens it.
        self._finger_geoms = [
            _collision_geoms(m, m.body(f"{GRIPPER_PREFIX}{name}").id) for name in ("leftfinger", "rightfinger")
        ]
        self._finger_joints = fingers
        finger_dofs = [m.jnt_dofadr[j] for j in fingers]
        if config.finger_armature is not None:
            m.dof_armature[finger_dofs] = config.finger_armature
        if config.finger_friction_loss_n is not None:
            m.dof_frictionloss[finger_dofs] = config.finger_friction_loss_n
        if config.finger_contact_solref is not None:
            m.geom_solref[sorted(self._finger_geoms[0] | self._finger_geoms[1])] = config.finger_contact_solref
        closed = config.finger_closed_target_m
        # Let the finger position servos aim past closed (their joints still stop at 0).
        m.actuator_ctrlrange[self._finger_act] = [(min(0.0, closed), 0.04), (-0.04, max(0.0, -closed))]
        self._tcp = m.site(f"{ARM_PREFIX}tcp").id
        self._objects = {o.name: m.body(o.name).id for o in config.scene.objects}
        self._object_qpos = {
            o.name: m.jnt_qposadr[m.joint(f"{o.name}_joint").id] for o in config.scene.objects
        }
        self._object_geoms = {o.name: _collision_geoms(m, m.body(o.name).id) for o in config.scene.objects}
        self._markers = {mk.name: m.body(mk.name).mocapid[0] for mk in config.scene.markers}
        self._marker_bodies = {mk.name: m.body(mk.name).id for mk in config.scene.markers}
        self._kp = np.array(config.stiffness)
        self.kinematics = TcpKinematics(
            m, self._tcp, self._arm_qpos, self._arm_dof, np.array(config.home_joint_positions), config.ik
        )
        """TCP forward and inverse kinematics of this model."""
        self._home = self.kinematics.home.copy()
        self._rng = np.random.default_rng(config.seed)

        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._connected = False
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
        self._sim_steps = 0
        self._sim_time_run = 0.0
        self._wall_time_run = 0.0
        self._skipped_s = 0.0
        self._place_scene(sample_scene_poses(config.scene, None), self._home)
        if config.damping is not None:
            kd = np.array(config.damping)
        else:
            inertia = np.zeros((m.nv, m.nv))
            mujoco.mj_fullM(m, inertia, self._data.qM)
            kd = 2.0 * np.sqrt(self._kp * np.diag(inertia)[self._arm_dof])
        m.dof_damping[self._arm_dof] = kd

    def _sim_clock(self) -> float:
        """The simulated time (s) in lock-step mode: physics steps taken since construction."""
        return self._sim_steps / self.config.physics_hz

    # ---- lifecycle -----------------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        """True from `connect()` to `disconnect()`, also after the physics thread failed, so that calls
        raise its error rather than a misleading "not connected"."""
        return self._connected

    def _connect(self) -> None:
        # A new session holds the arm where it is; after a failure, the scene starts over.
        d = self._data
        if self._error is not None or not np.all(np.isfinite(d.qpos)):
            self._place_scene(sample_scene_poses(self.config.scene, None), self._home)
        for warning in self._fatal:
            d.warning[warning].number = 0
        self._ref_from = self._ref_to = d.qpos[self._arm_qpos].copy()
        self._ref_t0 = self._ref_t1 = 0.0
        self._stop_event.clear()
        self._error = None
        self._connected = True
        if self.config.realtime:
            self._thread = threading.Thread(target=self._run, name="robotft-sim-franka", daemon=True)
            self._thread.start()

    def _disconnect(self) -> None:
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._thread = None
        self._connected = False

    def disconnect(self) -> None:
        """Stop the arm and the physics thread; also after the thread failed (then without `stop`)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
            self._connected = False
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
            target = np.clip(command.joint_positions, self.kinematics.q_min, self.kinematics.q_max)
        else:
            target = self.inverse_kinematics(command.ee_pos, command.ee_quat)
        now = self.clock()
        with self._lock:
            self._ref_from = self._reference(now)
            self._ref_to = target
            self._ref_t0 = now
            self._ref_t1 = max(now, command.timestamp_s) if self.config.interpolate else now
            self._gripper_width = command.gripper_width
            # Each finger pushes with at most `force`, so an object between them is squeezed with
            # `force`, like the Franka Hand's grasp force.
            force = self.config.finger_force_n or max(command.gripper_force, self.config.gripper_min_force_n)
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
        self,
        seed: int | None = None,
        object_poses: dict[str, tuple[Any, Any]] | None = None,
        joint_positions: np.ndarray | None = None,
    ) -> dict[str, ObjectPose]:
        """Teleport the arm home with open fingers, place objects and markers, reset the safety layer.

        Objects and markers go to `object_poses[name] = (pos [3], quat [4] wxyz)` where given, else to
        their configured pose plus the configured random noise (drawn from `seed` when given); the arm to
        `joint_positions [7]` when given, else home plus `home_noise_rad` noise. Returns the poses after
        the reset, as placed.
        """
        self._check()
        rng = self._rng if seed is None else np.random.default_rng(seed)
        unknown = sorted(set(object_poses or {}) - set(self._objects) - set(self._markers))
        if unknown:
            raise KeyError(
                f"reset_episode: unknown object(s) {unknown}; scene has {sorted([*self._objects, *self._markers])}"
            )
        poses = sample_scene_poses(self.config.scene, rng, object_poses)
        if joint_positions is not None:
            q = np.asarray(joint_positions, dtype=np.float64)
            if q.shape != (NUM_JOINTS,):
                raise ValueError(
                    f"reset_episode joint_positions must have shape ({NUM_JOINTS},), got {q.shape}"
                )
        else:
            q = self._home + rng.normal(0.0, self.config.home_noise_rad, NUM_JOINTS)
        with self._lock:
            self._place_scene(poses, np.clip(q, self.kinematics.q_min, self.kinematics.q_max))
            # Read under the same lock: the real-time physics thread may step (and catch up) right after it.
            placed = self._poses()
        self.safety.reset()
        return placed

    def _place_scene(self, poses: dict[str, tuple[np.ndarray, np.ndarray]], q: np.ndarray) -> None:
        """Reset the physics state: the arm at rest at `q`, objects and markers at `poses`.
        Call with the lock held (or before the physics thread exists)."""
        d = self._data
        self._mj.mj_resetData(self.model, d)
        for name, adr in self._object_qpos.items():
            pos, quat = poses[name]
            d.qpos[adr : adr + 3] = pos
            d.qpos[adr + 3 : adr + 7] = np.asarray(quat, dtype=np.float64) / np.linalg.norm(quat)
        for name, mocap in self._markers.items():
            d.mocap_pos[mocap], d.mocap_quat[mocap] = poses[name]
        d.qpos[self._arm_qpos] = q
        d.qpos[self._finger_qpos] = (0.04, -0.04)
        self._ref_from, self._ref_to = q.copy(), q.copy()
        self._ref_t0 = self._ref_t1 = 0.0
        self._gripper_width = 0.08
        self._mj.mj_forward(self.model, d)
        self._snapshot(self.clock())

    def object_poses(self) -> dict[str, ObjectPose]:
        """Pose of every object and marker (base frame), as simulated with the latest robot state; objects
        say whether the gripper grasps them (`is_grasping`)."""
        self._check()
        with self._lock:
            return self._poses()

    def _poses(self) -> dict[str, ObjectPose]:
        """`object_poses` with the lock held."""
        d, t = self._data, self._state_time
        poses = {
            name: ObjectPose(t, d.xpos[b].copy(), d.xquat[b].copy(), self._grasping(name))
            for name, b in self._objects.items()
        }
        for name, b in self._marker_bodies.items():
            poses[name] = ObjectPose(t, d.xpos[b].copy(), d.xquat[b].copy())
        return poses

    def is_grasping(self, name: str) -> bool:
        """Whether the fingers hold object `name`, as ManiSkill's `Panda.is_grasping` decides: the object
        pushes each finger with at least `GRASP_MIN_FORCE_N`, within `GRASP_MAX_ANGLE_RAD` of the
        direction that opens it."""
        self._check()
        with self._lock:
            return self._grasping(name)

    def _grasping(self, name: str) -> bool:
        """`is_grasping` with the lock held, from the contacts of the last physics step."""
        mj, m, d = self._mj, self.model, self._data
        obj = self._object_geoms[name]
        forces = np.zeros((2, 3))
        wrench = np.zeros(6)
        for i in range(d.ncon):
            contact = d.contact[i]
            for k, finger in enumerate(self._finger_geoms):
                # The contact frame's normal points from geom1 to geom2; the force acts on geom2 along it.
                if contact.geom1 in obj and contact.geom2 in finger:
                    sign = 1.0
                elif contact.geom2 in obj and contact.geom1 in finger:
                    sign = -1.0
                else:
                    continue
                mj.mj_contactForce(m, d, i, wrench)
                forces[k] += sign * contact.frame.reshape(3, 3).T @ wrench[:3]
        for k, (joint, opens) in enumerate(zip(self._finger_joints, (1.0, -1.0), strict=True)):
            norm = float(np.linalg.norm(forces[k]))
            if norm < GRASP_MIN_FORCE_N:
                return False
            cos = float(np.dot(forces[k], opens * d.xaxis[joint])) / norm
            if cos < np.cos(GRASP_MAX_ANGLE_RAD):
                return False
        return True

    def inverse_kinematics(
        self, pos: np.ndarray, quat: np.ndarray, seed_q: np.ndarray | None = None
    ) -> np.ndarray:
        """Joint angles `[7]` (rad) that put the TCP at `pos [3]` (m) with orientation `quat [4]` (wxyz),
        by `TcpKinematics.inverse` started from `seed_q` (default: the measured joints, as ManiSkill's
        controllers start their IK)."""
        if seed_q is None:
            with self._lock:
                seed_q = self._data.qpos[self._arm_qpos].copy()
        return self.kinematics.inverse(pos, quat, seed_q)

    def tcp_pose(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward kinematics: TCP position `[3]` (m) and quaternion `[4]` (wxyz) at joint angles `q`."""
        return self.kinematics.tcp_pose(q)

    def advance(self, seconds: float) -> None:
        """Lock-step mode (`realtime=False`): simulate `seconds` of physics now (rounded to whole steps)."""
        if self.config.realtime:
            raise RuntimeError("SimFranka.advance is for realtime=False; a real-time rig steps by itself")
        if not self._connected:
            raise RuntimeError("SimFranka.advance called before connect()")
        self._check()
        with self._lock:
            for _ in range(max(1, round(seconds * self.config.physics_hz))):
                self._step()
                self._sim_steps += 1

    def update_scene(self, renderer: Any, camera: int | str, option: Any = None) -> float:
        """`renderer.update_scene(data, camera, option)` under the physics lock, so a frame never shows a
        half-stepped scene; returns the time (s, the robot's clock) of the simulated state it shows."""
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

    # ---- the physics ---------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise SimulationError(f"SimFranka physics thread failed: {self._error!r}") from self._error

    def _reference(self, now: float) -> np.ndarray:
        """The joint reference at time `now` on the current ramp (call with the lock held)."""
        if now >= self._ref_t1:
            return self._ref_to.copy()
        frac = max(0.0, (now - self._ref_t0) / (self._ref_t1 - self._ref_t0))
        return self._ref_from + frac * (self._ref_to - self._ref_from)

    def _finger_target(self) -> float:
        """Position target (m) of one finger for the commanded gripper width."""
        closed = self.config.finger_closed_target_m
        return closed + (0.04 - closed) * float(np.clip(self._gripper_width / 0.08, 0.0, 1.0))

    def _snapshot(self, now: float) -> None:
        d, n, snap = self._data, NUM_JOINTS, self._snap
        snap[:n] = d.qpos[self._arm_qpos]
        snap[n : 2 * n] = d.qvel[self._arm_dof]
        snap[2 * n : 2 * n + 3] = d.site_xpos[self._tcp]
        snap[2 * n + 3 : 2 * n + 12] = d.site_xmat[self._tcp]
        snap[-2:] = d.qpos[self._finger_qpos]
        self._state_time = now

    def _step(self) -> None:
        """One physics step (lock held): kinematics, PD torques, state snapshot, integration."""
        mj, m, d = self._mj, self.model, self._data
        mj.mj_step1(m, d)
        now = self.clock()
        q = d.qpos[self._arm_qpos]
        tau = self._kp * (self._reference(now) - q) + d.qfrc_bias[self._arm_dof]
        d.ctrl[self._arm_act] = np.clip(tau, -self._tau_max, self._tau_max)
        finger = self._finger_target()
        d.ctrl[self._finger_act] = (finger, -finger)
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
