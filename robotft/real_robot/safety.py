"""The safety layer between policy and robot (always on; `Robot.send_action` calls it).

`SafetyLayer.filter(command, state, now)` turns whatever a policy produced (NaN, inf, 1e30 included)
into a command that respects every configured limit, and reports what it changed:

- non-finite targets are replaced by a hold (the previous sent target, at the start the measured state);
- `ee_pose` targets are clipped to the workspace box, then limited to `max_ee_step_m` and
  `max_rot_step_rad` per command relative to the previous *sent* target;
- `joint_position` targets are limited so that the *sequence of sent targets*, one per `control_dt`,
  respects the joint position, velocity and acceleration limits (with braking distance near the
  position limits, see `SafetyLayer._velocity_bounds`), and refused when the TCP would leave the
  workspace box (forward kinematics of the Panda);
- the gripper width and force are clamped;
- a `Watchdog` and a latched software stop replace the command by a hold when the policy or a camera
  stalls, or the operator pressed stop.

Every clip and refusal is counted by reason in `SafetyLayer.counters` and logged (rate-limited).
Time is always an explicit `now` (s, `time.monotonic()` clock), so behaviour is deterministic in tests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from robotft.real_robot.robot import NUM_JOINTS, RobotCommand, RobotState

log = logging.getLogger(__name__)

# Franka Emika Panda limits from the Franka Control Interface documentation ("Robot and interface
# specifications"): joint position (rad), velocity (rad/s) and acceleration (rad/s^2).
PANDA_JOINT_POS_MIN = (-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973)
PANDA_JOINT_POS_MAX = (2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973)
PANDA_JOINT_VEL_MAX = (2.1750, 2.1750, 2.1750, 2.1750, 2.6100, 2.6100, 2.6100)
PANDA_JOINT_ACC_MAX = (15.0, 7.5, 10.0, 12.5, 15.0, 20.0, 20.0)

# Panda kinematics, modified (Craig) Denavit-Hartenberg parameters (a_{i-1} m, d_i m, alpha_{i-1} rad)
# from the same documentation; the last row is the flange.
_PANDA_DH = (
    (0.0, 0.333, 0.0),
    (0.0, 0.0, -math.pi / 2),
    (0.0, 0.316, math.pi / 2),
    (0.0825, 0.0, math.pi / 2),
    (-0.0825, 0.384, -math.pi / 2),
    (0.0, 0.0, math.pi / 2),
    (0.088, 0.0, math.pi / 2),
    (0.0, 0.107, 0.0),
)


def panda_tcp_position(q: np.ndarray, flange_to_tcp_m: float) -> np.ndarray:
    """TCP position `[3]` (m, base frame) of a Panda at joint angles `q [7]` (rad).

    Forward kinematics with the modified DH convention: `T_i = RotX(alpha) TransX(a) RotZ(q_i) TransZ(d)`;
    the TCP sits `flange_to_tcp_m` along the flange z axis.
    """
    pose = np.eye(4)
    for (a, d, alpha), theta in zip(_PANDA_DH, (*q, 0.0), strict=True):
        ct, st, ca, sa = math.cos(theta), math.sin(theta), math.cos(alpha), math.sin(alpha)
        pose = pose @ np.array(
            [
                [ct, -st, 0.0, a],
                [st * ca, ct * ca, -sa, -sa * d],
                [st * sa, ct * sa, ca, ca * d],
                [0.0, 0.0, 0.0, 1.0],
            ]
        )
    return pose[:3, 3] + flange_to_tcp_m * pose[:3, 2]


@dataclass
class SafetyLimits:
    """Every limit the safety layer enforces. Defaults: a Franka Panda on a table; rig presets override.

    Example (YAML in a rig preset):
        safety: {workspace_min: [0.3, -0.3, 0.02], workspace_max: [0.7, 0.3, 0.4], max_ee_step_m: 0.01}
    """

    workspace_min: tuple[float, float, float] = (0.2, -0.5, 0.02)
    """Lower corner of the box the TCP must stay in (m, robot base frame)."""
    workspace_max: tuple[float, float, float] = (0.8, 0.5, 0.7)
    """Upper corner of the TCP box (m, robot base frame)."""
    joint_pos_min: tuple[float, ...] = PANDA_JOINT_POS_MIN
    """Lower joint limits (rad), one per joint."""
    joint_pos_max: tuple[float, ...] = PANDA_JOINT_POS_MAX
    """Upper joint limits (rad), one per joint."""
    joint_vel_max: tuple[float, ...] = PANDA_JOINT_VEL_MAX
    """Largest joint speed between consecutive sent targets (rad/s), one per joint."""
    joint_acc_max: tuple[float, ...] = PANDA_JOINT_ACC_MAX
    """Largest change of joint speed between consecutive sent targets (rad/s^2), one per joint."""
    max_ee_step_m: float = 0.02
    """Largest TCP translation between consecutive sent `ee_pose` targets (m)."""
    max_rot_step_rad: float = 0.1
    """Largest TCP rotation angle between consecutive sent `ee_pose` targets (rad)."""
    gripper_width_min: float = 0.0
    """Smallest gripper width target (m)."""
    gripper_width_max: float = 0.08
    """Largest gripper width target (m); 0.08 for the Franka Hand."""
    gripper_force_max: float = 70.0
    """Largest grasp force (N); 70 N is the Franka Hand's continuous force."""
    policy_timeout_s: float = 0.5
    """Hold the arm when the policy has not produced an action for this long (s)."""
    camera_timeout_s: float = 0.2
    """Hold the arm when a watched camera has not delivered a fresh frame for this long (s)."""
    flange_to_tcp_m: float = 0.1034
    """TCP offset along the flange z axis (m) used for the workspace check of joint targets
    (0.1034 for the Franka Hand); must match the TCP the robot reports as `ee_pos`."""

    def __post_init__(self) -> None:
        for name, size in (
            ("workspace_min", 3),
            ("workspace_max", 3),
            ("joint_pos_min", NUM_JOINTS),
            ("joint_pos_max", NUM_JOINTS),
            ("joint_vel_max", NUM_JOINTS),
            ("joint_acc_max", NUM_JOINTS),
        ):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != size or not all(math.isfinite(v) for v in value):
                raise ValueError(f"SafetyLimits.{name} must be {size} finite numbers, got {value}")
            setattr(self, name, value)
        for low, high in (("workspace_min", "workspace_max"), ("joint_pos_min", "joint_pos_max")):
            bad = [
                i
                for i, (lo, hi) in enumerate(zip(getattr(self, low), getattr(self, high), strict=True))
                if not lo < hi
            ]
            if bad:
                raise ValueError(
                    f"SafetyLimits.{low} must be below {high} in every entry; not at indices {bad}"
                )
        for name in ("joint_vel_max", "joint_acc_max"):
            if not all(v > 0 for v in getattr(self, name)):
                raise ValueError(
                    f"SafetyLimits.{name} must be > 0 for every joint, got {getattr(self, name)}"
                )
        for name in (
            "max_ee_step_m",
            "max_rot_step_rad",
            "gripper_force_max",
            "policy_timeout_s",
            "camera_timeout_s",
        ):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(
                    f"SafetyLimits.{name} must be a finite number > 0, got {getattr(self, name)}"
                )
        if not 0 <= self.gripper_width_min < self.gripper_width_max:
            raise ValueError(
                "SafetyLimits needs 0 <= gripper_width_min < gripper_width_max, "
                f"got {self.gripper_width_min} and {self.gripper_width_max}"
            )
        if not (math.isfinite(self.flange_to_tcp_m) and self.flange_to_tcp_m >= 0):
            raise ValueError(
                f"SafetyLimits.flange_to_tcp_m must be a finite number >= 0, got {self.flange_to_tcp_m}"
            )


class Watchdog:
    """Stall detector: each source must `heartbeat` more often than its timeout.

    A source that has never beaten since `reset()` counts as stalled: the arm does not move before the
    policy and the cameras have shown they are alive.
    """

    def __init__(self, timeouts_s: Mapping[str, float]) -> None:
        if not timeouts_s:
            raise ValueError("Watchdog needs at least one source")
        self.timeouts_s = dict(timeouts_s)
        """Source name -> largest allowed time between heartbeats (s)."""
        self._last: dict[str, float] = {}

    def heartbeat(self, source: str, now: float) -> None:
        """Record that `source` was alive at `now` (s)."""
        if source not in self.timeouts_s:
            raise KeyError(f"unknown watchdog source {source!r}; watched: {sorted(self.timeouts_s)}")
        self._last[source] = now

    def check(self, now: float) -> list[str]:
        """Sources (sorted) whose last heartbeat is older than their timeout at `now`, or missing."""
        return sorted(
            s
            for s, timeout in self.timeouts_s.items()
            if s not in self._last or now - self._last[s] > timeout
        )

    def reset(self) -> None:
        """Forget all heartbeats (every source is stalled until it beats again)."""
        self._last.clear()


@dataclass(frozen=True)
class SafetyReport:
    """What `SafetyLayer.filter` did to one command."""

    clipped: tuple[str, ...] = ()
    """Reasons the command was changed (each at most once), e.g. `workspace`, `joint_velocity`."""
    halted: tuple[str, ...] = ()
    """Why the command was refused and replaced by a hold: `stopped`, `watchdog_<source>`."""

    @property
    def modified(self) -> bool:
        return bool(self.clipped or self.halted)


@dataclass
class _JointRef:
    q: np.ndarray
    """Last sent joint target (rad)."""
    v: np.ndarray
    """Its implied velocity `(q_k - q_{k-1}) / dt` (rad/s)."""


@dataclass
class _EeRef:
    pos: np.ndarray
    quat: np.ndarray


@dataclass
class _Gripper:
    width: float
    force: float


@dataclass
class _LogState:
    pending: int = 0
    """Occurrences since the last log line."""
    last_log: float = -math.inf


class SafetyLayer:
    """Makes commands safe; one instance per robot, `reset()` at the start of each episode.

    Commands must be filtered once per `control_dt` (the runner's tick): the velocity and acceleration
    limits are enforced between consecutive sent targets assuming that period. The first command after
    `reset()` starts from the measured state, at rest.

    Example:
        layer = SafetyLayer(SafetyLimits(), control_dt=0.1, cameras=("wrist", "base"))
        layer.watchdog.heartbeat("policy", now); layer.watchdog.heartbeat("wrist", now); ...
        safe, report = layer.filter(command, robot_state, now)
    """

    def __init__(
        self,
        limits: SafetyLimits,
        control_dt: float,
        cameras: Sequence[str] = ("camera",),
        log_interval_s: float = 1.0,
    ) -> None:
        if not (math.isfinite(control_dt) and control_dt > 0):
            raise ValueError(f"SafetyLayer control_dt must be a finite number > 0 (s), got {control_dt}")
        if "policy" in cameras:
            raise ValueError("SafetyLayer: 'policy' is reserved for the policy's watchdog source")
        self.limits = limits
        self.control_dt = control_dt
        self.watchdog = Watchdog(
            {"policy": limits.policy_timeout_s, **{c: limits.camera_timeout_s for c in cameras}}
        )
        self.log_interval_s = log_interval_s
        """Each reason is logged at most once per this interval (s), with the count since the last log."""
        self.counters: dict[str, int] = {}
        """Reason -> number of commands clipped or refused for it since construction."""
        self._q_min = np.array(limits.joint_pos_min)
        self._q_max = np.array(limits.joint_pos_max)
        self._v_max = np.array(limits.joint_vel_max)
        self._a_max = np.array(limits.joint_acc_max)
        self._box_min = np.array(limits.workspace_min)
        self._box_max = np.array(limits.workspace_max)
        self._log: dict[str, _LogState] = {}
        self._stopped = False
        self.reset()

    # ---- stop and episode lifecycle ----------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """True from `trigger_stop()` until `reset()`: every command is refused and the arm held."""
        return self._stopped

    def trigger_stop(self) -> None:
        """Software stop (the stop key): latch until `reset()`."""
        if not self._stopped:
            log.warning("software stop triggered: holding the arm until reset()")
        self._stopped = True

    def reset(self) -> None:
        """Start over from the measured state: clear the stop latch, heartbeats and previous targets."""
        self._stopped = False
        self.watchdog.reset()
        self._mode: str | None = None
        self._joint: _JointRef | None = None
        self._ee: _EeRef | None = None
        self._gripper: _Gripper | None = None

    # ---- the filter --------------------------------------------------------------------------------

    def filter(
        self, command: RobotCommand, state: RobotState, now: float
    ) -> tuple[RobotCommand, SafetyReport]:
        """The safe version of `command` given the measured `state` at time `now` (s), and a report."""
        halted = (["stopped"] if self._stopped else []) + [f"watchdog_{s}" for s in self.watchdog.check(now)]
        hold = bool(halted)
        clipped: list[str] = []
        if command.control_mode != self._mode:
            # A new control mode starts from the measured state: the previous targets mean nothing in it.
            self._mode, self._joint, self._ee = command.control_mode, None, None
        timestamp = command.timestamp_s
        if not math.isfinite(timestamp):
            clipped.append("non_finite")
            timestamp = now
        width, force = self._gripper_target(command, state, hold, clipped)
        if command.control_mode == "joint_position":
            q = self._joint_target(command.joint_positions, state, hold, clipped)
            safe = RobotCommand("joint_position", timestamp, width, force, joint_positions=q)
        else:
            pos, quat = self._ee_target(command.ee_pos, command.ee_quat, state, hold, clipped)
            safe = RobotCommand("ee_pose", timestamp, width, force, ee_pos=pos, ee_quat=quat)
        report = SafetyReport(clipped=tuple(dict.fromkeys(clipped)), halted=tuple(halted))
        self._count(report, now)
        return safe, report

    def _gripper_target(
        self, command: RobotCommand, state: RobotState, hold: bool, clipped: list[str]
    ) -> tuple[float, float]:
        lim = self.limits
        if self._gripper is None:
            start = state.gripper_width if math.isfinite(state.gripper_width) else lim.gripper_width_min
            self._gripper = _Gripper(float(np.clip(start, lim.gripper_width_min, lim.gripper_width_max)), 0.0)
        prev = self._gripper
        width, force = (prev.width, prev.force) if hold else (command.gripper_width, command.gripper_force)
        if not (math.isfinite(width) and math.isfinite(force)):
            clipped.append("non_finite")
            width = width if math.isfinite(width) else prev.width
            force = force if math.isfinite(force) else prev.force
        if not lim.gripper_width_min <= width <= lim.gripper_width_max:
            clipped.append("gripper_width")
            width = min(max(width, lim.gripper_width_min), lim.gripper_width_max)
        if not 0.0 <= force <= lim.gripper_force_max:
            clipped.append("gripper_force")
            force = min(max(force, 0.0), lim.gripper_force_max)
        self._gripper = _Gripper(width, force)
        return width, force

    def _joint_target(
        self, target: np.ndarray, state: RobotState, hold: bool, clipped: list[str]
    ) -> np.ndarray:
        if self._joint is None:
            if not np.all(np.isfinite(state.joint_positions)):
                raise ValueError(f"robot state has non-finite joint positions {state.joint_positions}")
            self._joint = _JointRef(
                np.clip(state.joint_positions, self._q_min, self._q_max), np.zeros(NUM_JOINTS)
            )
        ref, dt = self._joint, self.control_dt
        if not hold and not np.all(np.isfinite(target)):
            clipped.append("non_finite")
            hold = True
        if not hold and (np.any(target < self._q_min) or np.any(target > self._q_max)):
            clipped.append("joint_position")
        # Clipping first also keeps 1e308 targets from overflowing the velocity below.
        desired = ref.q if hold else np.clip(target, self._q_min, self._q_max)
        v_des = (desired - ref.q) / dt
        lo, hi = self._velocity_bounds(ref.q, ref.v)
        if not hold:
            if np.any(np.abs(v_des) > self._v_max):
                clipped.append("joint_velocity")
            if np.any(np.abs(v_des - ref.v) > self._a_max * dt):
                clipped.append("joint_acceleration")
            if np.any(v_des < lo) or np.any(v_des > hi):
                clipped.append("joint_position")  # too close to a limit to stop in time at this speed
        q = np.clip(ref.q + np.clip(v_des, lo, hi) * dt, self._q_min, self._q_max)
        if not self._in_box(q):
            # Refused: brake as hard as the limits allow; if even that leaves the box, stop at the last
            # target (the box wins over the acceleration limit: it guards against collisions).
            clipped.append("workspace")
            q = np.clip(ref.q + np.clip(np.zeros(NUM_JOINTS), lo, hi) * dt, self._q_min, self._q_max)
            if not self._in_box(q):
                q = ref.q.copy()
        self._joint = _JointRef(q, (q - ref.q) / dt)
        return q

    def _velocity_bounds(self, q: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-joint interval of velocities `v'` allowed for the next target `q + v' dt`.

        Besides `|v'| <= v_max` and `|v' - v| <= a_max dt`, the next target must leave room to brake
        before the position limit: `q + v' dt + v'^2 / (2 a_max) <= q_max`, i.e.
        `v' <= -a dt + sqrt((a dt)^2 + 2 a (q_max - q))` (and symmetrically below). Since the previous
        step satisfied the same condition, braking at `v - a dt` always does too, so the interval is
        never empty and position, velocity and acceleration limits hold together on every step.
        """
        a, dt = self._a_max, self.control_dt
        room_up = np.maximum(self._q_max - q, 0.0)
        room_down = np.maximum(q - self._q_min, 0.0)
        brake_up = -a * dt + np.sqrt((a * dt) ** 2 + 2 * a * room_up)
        brake_down = -a * dt + np.sqrt((a * dt) ** 2 + 2 * a * room_down)
        hi = np.minimum.reduce([self._v_max, v + a * dt, brake_up])
        lo = np.maximum.reduce([-self._v_max, v - a * dt, -brake_down])
        return lo, hi

    def _in_box(self, q: np.ndarray) -> bool:
        p = panda_tcp_position(q, self.limits.flange_to_tcp_m)
        return bool(np.all(p >= self._box_min) and np.all(p <= self._box_max))

    def _ee_target(
        self, pos: np.ndarray, quat: np.ndarray, state: RobotState, hold: bool, clipped: list[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        lim = self.limits
        if self._ee is None:
            start_quat = _unit_quat(state.ee_quat)
            if not np.all(np.isfinite(state.ee_pos)) or start_quat is None:
                raise ValueError(f"robot state has an invalid TCP pose {state.ee_pos}, {state.ee_quat}")
            start = np.clip(state.ee_pos, self._box_min, self._box_max)
            if not np.array_equal(start, state.ee_pos):
                # The arm starts outside the box: the first target pulls it in (operator should home it).
                clipped.append("state_outside_workspace")
            self._ee = _EeRef(start, start_quat)
        ref = self._ee
        if hold:
            pos, quat = ref.pos, ref.quat
        else:
            if not np.all(np.isfinite(pos)):
                clipped.append("non_finite")
                pos = ref.pos
            unit = _unit_quat(quat)
            if unit is None:
                clipped.append("non_finite" if not np.all(np.isfinite(quat)) else "bad_quaternion")
                unit = ref.quat
            quat = unit
        box_pos = np.clip(pos, self._box_min, self._box_max)
        if not np.array_equal(box_pos, pos):
            clipped.append("workspace")
        step = box_pos - ref.pos
        dist = float(np.linalg.norm(step))
        if dist > lim.max_ee_step_m:
            clipped.append("ee_step")
            # Both ends lie in the (convex) box, so every point between them does; the clip only
            # removes rounding error.
            box_pos = np.clip(ref.pos + step * (lim.max_ee_step_m / dist), self._box_min, self._box_max)
        angle = _quat_angle(ref.quat, quat)
        if angle > lim.max_rot_step_rad:
            clipped.append("rotation_step")
            quat = _slerp(ref.quat, quat, lim.max_rot_step_rad / angle)
        self._ee = _EeRef(box_pos, quat)
        return box_pos.copy(), quat.copy()

    # ---- bookkeeping -------------------------------------------------------------------------------

    def _count(self, report: SafetyReport, now: float) -> None:
        for reason in (*report.clipped, *report.halted):
            self.counters[reason] = self.counters.get(reason, 0) + 1
            entry = self._log.setdefault(reason, _LogState())
            entry.pending += 1
            # Rate-limited: at 10-1000 Hz a persistent clip would otherwise flood the log.
            if now - entry.last_log >= self.log_interval_s:
                verb = "refused" if reason in report.halted else "clipped"
                log.warning(
                    "safety: %d command(s) %s for %r since the last report (%d in total)",
                    entry.pending,
                    verb,
                    reason,
                    self.counters[reason],
                )
                entry.pending, entry.last_log = 0, now


def _unit_quat(quat: np.ndarray) -> np.ndarray | None:
    """`quat` normalized, or None when it is not finite or (numerically) zero."""
    if not np.all(np.isfinite(quat)):
        return None
    scale = float(np.max(np.abs(quat)))
    if scale == 0.0:
        return None
    q = quat / scale  # rescale first so that huge entries (1e300) do not overflow the norm
    return q / np.linalg.norm(q)


def _quat_angle(q0: np.ndarray, q1: np.ndarray) -> float:
    """Rotation angle (rad, in [0, pi]) between two unit quaternions: `2 arccos |<q0, q1>|`."""
    return 2.0 * math.acos(min(1.0, abs(float(np.dot(q0, q1)))))


def _slerp(q0: np.ndarray, q1: np.ndarray, fraction: float) -> np.ndarray:
    """Spherical linear interpolation (Shoemake 1985) along the shorter arc, `fraction` in [0, 1]."""
    if np.dot(q0, q1) < 0:
        q1 = -q1
    half = math.acos(min(1.0, float(np.dot(q0, q1))))
    out = (math.sin((1 - fraction) * half) * q0 + math.sin(fraction * half) * q1) / math.sin(half)
    return out / np.linalg.norm(out)
