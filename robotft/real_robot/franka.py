"""A real Franka (Panda / FR3) through franky (`franky-control` >= 2.0), no ROS.

Each control mode of `robot.py` is tracked by one of franky's long-lived impedance trackers, which run
libfranka's 1 kHz torque loop and take a new target whenever the runner sends one:

- `joint_position` -> `franky.JointImpedanceTracker` (joint stiffness, critical damping by default,
  Coriolis compensation);
- `ee_pose` -> `franky.CartesianImpedanceTracker` (translational / rotational stiffness).

Switching modes stops one tracker (franky ramps it down with a `TorqueStopMotion`) and starts the other.
The gripper (Franka Hand, `franky.Gripper`) moves asynchronously: closing is a grasp with the commanded
force, opening a move; a command is issued only when the target changes by more than a dead band and no
gripper command is running, so the control loop never waits for the fingers.

Errors: a reflex (collision, joint limit, ...) stops libfranka's loop with a `ControlException`. With
`auto_recover`, the next command calls `recover_from_errors()` and restarts the tracker from the measured
state, counting it in `recoveries`; otherwise the error is raised to the runner.

The TCP is franky's end effector (`O_T_EE`): the flange plus the EE transform set in Desk (0.1034 m for
the Franka Hand), which must match `SafetyLimits.flange_to_tcp_m`.

franky is imported lazily, with an error naming the `franka` extra.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from robotft.optional import require
from robotft.real_robot.device_clock import DeviceClock
from robotft.real_robot.robot import NUM_JOINTS, Robot, RobotCommand, RobotState

if TYPE_CHECKING:
    from robotft.real_robot.safety import SafetyLayer

log = logging.getLogger(__name__)


FRANKA_READY_QPOS = (0.0, -math.pi / 4, 0.0, -3 * math.pi / 4, 0.0, math.pi / 2, math.pi / 4)
"""libfranka's "ready" pose (rad)."""


def import_franky() -> Any:
    return require("franky", "franka", "the Franka backend")


@dataclass
class FrankaConfig:
    """A Franka arm with a Franka Hand, reached over FCI.

    Example (YAML in a rig preset, as in `real_robot/franka_d435.yaml`):
        robot:
          type: franka
          config: {host: 172.16.0.2, translational_stiffness: 800}
    """

    host: str = "172.16.0.2"
    """IP address or hostname of the robot's control unit (FCI)."""
    joint_stiffness: tuple[float, ...] = (600.0, 600.0, 600.0, 600.0, 250.0, 150.0, 50.0)
    """Joint impedance stiffness (Nm/rad) in `joint_position` mode (libfranka's example gains)."""
    joint_damping: tuple[float, ...] | None = None
    """Joint damping (Nms/rad); None: critical damping, tracked by franky."""
    translational_stiffness: float = 500.0
    """Cartesian stiffness (N/m) in `ee_pose` mode."""
    rotational_stiffness: float = 50.0
    """Cartesian rotational stiffness (Nm/rad) in `ee_pose` mode."""
    collision_torque_thresholds: tuple[float, ...] = (20.0, 20.0, 18.0, 18.0, 16.0, 14.0, 12.0)
    """Joint torque (Nm) above which the robot's collision reflex stops the arm, per joint."""
    collision_force_thresholds: tuple[float, ...] = (20.0, 20.0, 20.0, 25.0, 25.0, 25.0)
    """TCP force/torque (N, Nm; x y z rx ry rz) above which the collision reflex stops the arm."""
    relative_dynamics_factor: float = 0.1
    """Scale (0, 1] of velocity/acceleration/jerk for franky's own motions (moving home)."""
    home_joint_positions: tuple[float, ...] = FRANKA_READY_QPOS
    """Joint angles (rad) `reset_episode` moves to."""
    gripper_speed: float = 0.1
    """Finger speed (m/s) of gripper moves and grasps."""
    gripper_deadband_m: float = 0.005
    """Gripper targets closer than this to the last one issued are ignored (m)."""
    auto_recover: bool = True
    """Recover from reflex errors automatically (and restart the tracker) instead of raising."""
    enforce_realtime: bool = True
    """Require a real-time kernel (libfranka's default); False for testing on a normal kernel."""

    def __post_init__(self) -> None:
        for name, size in (
            ("joint_stiffness", NUM_JOINTS),
            ("collision_torque_thresholds", NUM_JOINTS),
            ("collision_force_thresholds", 6),
            ("home_joint_positions", NUM_JOINTS),
        ):
            if len(getattr(self, name)) != size:
                raise ValueError(f"FrankaConfig.{name} must have {size} entries, got {getattr(self, name)}")
        if self.joint_damping is not None and len(self.joint_damping) != NUM_JOINTS:
            raise ValueError(f"FrankaConfig.joint_damping must have {NUM_JOINTS} entries or be null")
        if not 0 < self.relative_dynamics_factor <= 1:
            raise ValueError(
                f"FrankaConfig.relative_dynamics_factor must be in (0, 1], got {self.relative_dynamics_factor}"
            )


class FrankaRobot(Robot):
    """A real Franka behind the Robot contract (see the module docstring).

    Example:
        with FrankaRobot(FrankaConfig(host="172.16.0.2"), SafetyLayer(limits, control_dt=0.1)) as robot:
            robot.reset_episode()                     # recover errors, open the gripper, move home
            state = robot.get_observation()
            sent = robot.send_action(command)
    """

    def __init__(
        self, config: FrankaConfig, safety: SafetyLayer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(safety, clock=clock)
        self.config = config
        self._franky = import_franky()
        self._robot: Any = None
        self._gripper: Any = None
        self._tracker: Any = None
        self._mode: str | None = None
        self._gripper_future: Any = None
        self._gripper_target: float | None = None
        self._gripper_width = 0.0
        self._robot_clock = DeviceClock()
        self.recoveries = 0
        """Reflex errors recovered from automatically since `connect()`."""

    # ---- lifecycle -----------------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self._robot is not None

    def _connect(self) -> None:
        franky, cfg = self._franky, self.config
        realtime = franky.RealtimeConfig.Enforce if cfg.enforce_realtime else franky.RealtimeConfig.Ignore
        try:
            robot = franky.Robot(cfg.host, realtime_config=realtime)
            gripper = franky.Gripper(cfg.host)
        except franky.Exception as e:
            raise ConnectionError(
                f"cannot connect to the Franka at {cfg.host!r} ({type(e).__name__}: {e}); check the address, "
                "that the robot is unlocked and FCI is enabled in Desk"
            ) from e
        robot.relative_dynamics_factor = cfg.relative_dynamics_factor
        robot.set_collision_behavior(
            list(cfg.collision_torque_thresholds), list(cfg.collision_force_thresholds)
        )
        if robot.has_errors:
            robot.recover_from_errors()
        self._robot, self._gripper = robot, gripper
        self._gripper_width = float(gripper.width)
        self._robot_clock = DeviceClock()
        self.recoveries = 0

    def _disconnect(self) -> None:
        self._robot = self._gripper = self._tracker = self._mode = None
        self._gripper_future = self._gripper_target = None

    def stop(self) -> None:
        """Ramp the active tracker down (franky's TorqueStopMotion) and stop the gripper."""
        if self._tracker is not None:
            try:
                self._tracker.stop()
            except self._franky.ControlException as e:
                log.warning("Franka: stopping the tracker raised %s", e)
            self._tracker, self._mode = None, None
        if self._gripper_future is not None and not self._gripper_future.wait(0.0):
            self._gripper.stop()
        self._gripper_future = None

    # ---- Robot contract ------------------------------------------------------------------------------

    def get_observation(self) -> RobotState:
        if self._robot is None:
            raise RuntimeError("FrankaRobot.get_observation called before connect()")
        state = self._robot.state
        receive = self.clock()
        pose = state.O_T_EE
        x, y, z, w = np.asarray(pose.quaternion, dtype=np.float64)
        self._poll_gripper()
        return RobotState(
            timestamp_s=self._robot_clock.to_local(state.time.to_sec(), receive),
            joint_positions=np.asarray(state.q, dtype=np.float64),
            joint_velocities=np.asarray(state.dq, dtype=np.float64),
            ee_pos=np.asarray(pose.translation, dtype=np.float64),
            ee_quat=np.array([w, x, y, z]),
            gripper_width=self._gripper_width,
        )

    def _send_command(self, command: RobotCommand) -> None:
        self._recover_if_needed()
        if command.control_mode != self._mode:
            self._start_tracker(command.control_mode)
        if command.control_mode == "joint_position":
            self._tracker.set_target(np.asarray(command.joint_positions, dtype=np.float64))
        else:
            w, x, y, z = command.ee_quat
            self._tracker.set_target(self._franky.Affine(np.asarray(command.ee_pos), np.array([x, y, z, w])))
        self._command_gripper(command.gripper_width, command.gripper_force)

    # ---- episode reset -------------------------------------------------------------------------------

    def reset_episode(self, seed: int | None = None) -> None:
        """Between episodes: stop tracking, recover from errors, open the gripper, move home (blocking,
        at `relative_dynamics_factor`), and reset the safety layer. `seed` is accepted for the same call
        as `SimFranka.reset_episode` and unused: a person resets the real scene."""
        if self._robot is None:
            raise RuntimeError("FrankaRobot.reset_episode called before connect()")
        self.stop()
        if self._robot.has_errors:
            self._robot.recover_from_errors()
        self._gripper.open(self.config.gripper_speed)
        self._gripper_width = float(self._gripper.width)
        self._gripper_target = None
        self._robot.move(self._franky.JointMotion(list(self.config.home_joint_positions)))
        self.safety.reset()

    # ---- internals -----------------------------------------------------------------------------------

    def _start_tracker(self, mode: str) -> None:
        franky, cfg = self._franky, self.config
        if self._tracker is not None:
            self._tracker.stop()
        if mode == "joint_position":
            damping = None if cfg.joint_damping is None else np.asarray(cfg.joint_damping)
            self._tracker = franky.JointImpedanceTracker(
                self._robot, stiffness=np.asarray(cfg.joint_stiffness), damping=damping
            )
        else:
            self._tracker = franky.CartesianImpedanceTracker(
                self._robot,
                translational_stiffness=cfg.translational_stiffness,
                rotational_stiffness=cfg.rotational_stiffness,
            )
        self._mode = mode

    def _recover_if_needed(self) -> None:
        """After a reflex the tracker has stopped: recover and let the next target restart it."""
        if self._tracker is None or self._tracker.is_running:
            return
        try:
            self._robot.join_motion(0.0)  # raises the ControlException that ended the motion, if any
            error = None
        except self._franky.ControlException as e:
            error = e
        self._tracker, self._mode = None, None
        if error is None:
            return
        if not self.config.auto_recover:
            raise RuntimeError(f"Franka at {self.config.host!r} stopped: {error}") from error
        log.warning("Franka stopped (%s); recovering automatically", error)
        if not self._robot.recover_from_errors():
            raise RuntimeError(
                f"Franka at {self.config.host!r}: automatic error recovery failed after {error}"
            )
        self.recoveries += 1
        self.safety.reset()  # restart from the measured state, at rest

    def _command_gripper(self, width: float, force: float) -> None:
        self._poll_gripper()
        if self._gripper_future is not None:
            return
        if (
            self._gripper_target is not None
            and abs(width - self._gripper_target) < self.config.gripper_deadband_m
        ):
            return
        speed = self.config.gripper_speed
        if width < self._gripper_width - self.config.gripper_deadband_m:
            # Grasp with wide tolerances: succeeds on whatever object width the fingers close on.
            self._gripper_future = self._gripper.grasp_async(width, speed, force, 0.1, 0.1)
        else:
            self._gripper_future = self._gripper.move_async(width, speed)
        self._gripper_target = width

    def _poll_gripper(self) -> None:
        """Refresh the cached finger width once a gripper command has finished (reading it is a network
        round trip that would stall the control loop while the gripper is busy)."""
        if self._gripper_future is not None and self._gripper_future.wait(0.0):
            self._gripper_future = None
            self._gripper_width = float(self._gripper.width)
