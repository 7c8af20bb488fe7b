"""The Robot contract (docs/design.md "Robot and Camera"): state, commands and the abstract backend.

Modelled on LeRobot's `robots/robot.py`: a small abstract class whose docstrings are the contract,
with `send_action` returning the command actually sent. Unlike LeRobot, the safety layer is not
optional: `Robot.send_action` is a template method that always passes the command through the
robot's `SafetyLayer` before the backend sees it, so no backend can forget it.

Units everywhere: metres, radians, seconds (`time.monotonic()` clock), newtons. Cartesian
quantities are in the robot base frame; quaternions are `[w, x, y, z]`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from robotft.real_robot.safety import SafetyLayer, SafetyReport

NUM_JOINTS = 7
"""Arm joints of a Franka Panda / FR3."""

CONTROL_MODES = ("joint_position", "ee_pose")
"""`joint_position`: absolute joint targets `[7]` rad; `ee_pose`: absolute TCP pose targets in the base
frame (`ee_pos [3]` m, `ee_quat [4]` wxyz). Delta actions of a policy are turned into these absolute
targets before the safety layer, so that limits are checked on what the arm will actually track."""


def _vector(name: str, value: object, size: int) -> np.ndarray:
    """`value` as a float64 vector of `size` entries, or a ValueError naming the field."""
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {arr.shape}")
    return arr


@dataclass
class RobotState:
    """One reading of the arm and gripper."""

    timestamp_s: float
    """Capture time on the `time.monotonic()` clock (s), not the time it was read by the caller."""
    joint_positions: np.ndarray
    """Measured joint angles `[7]` (rad)."""
    joint_velocities: np.ndarray
    """Measured joint velocities `[7]` (rad/s)."""
    ee_pos: np.ndarray
    """TCP position `[3]` in the robot base frame (m)."""
    ee_quat: np.ndarray
    """TCP orientation `[4]` as a unit quaternion `[w, x, y, z]` in the robot base frame."""
    gripper_width: float
    """Distance between the gripper fingers (m)."""

    def __post_init__(self) -> None:
        self.joint_positions = _vector("RobotState.joint_positions", self.joint_positions, NUM_JOINTS)
        self.joint_velocities = _vector("RobotState.joint_velocities", self.joint_velocities, NUM_JOINTS)
        self.ee_pos = _vector("RobotState.ee_pos", self.ee_pos, 3)
        self.ee_quat = _vector("RobotState.ee_quat", self.ee_quat, 4)
        self.timestamp_s = float(self.timestamp_s)
        self.gripper_width = float(self.gripper_width)


@dataclass
class RobotCommand:
    """One target for the arm's own controller, plus a gripper target.

    Values may be anything a policy produced (NaN and inf included): `SafetyLayer.filter` makes them
    safe, and only its output reaches a backend. Shapes are checked here, since a wrong shape is a bug
    in the caller, not a value to clip.
    """

    control_mode: str
    """One of `CONTROL_MODES`; says which target fields are used."""
    timestamp_s: float
    """Time (s, `time.monotonic()` clock) at which the arm should be at this target."""
    gripper_width: float
    """Target finger distance (m)."""
    gripper_force: float = 20.0
    """Grasp force (N) used when the fingers close on an object."""
    joint_positions: np.ndarray | None = None
    """Joint targets `[7]` (rad); required for `joint_position`."""
    ee_pos: np.ndarray | None = None
    """TCP position target `[3]` in the base frame (m); required for `ee_pose`."""
    ee_quat: np.ndarray | None = None
    """TCP orientation target `[4]` `[w, x, y, z]` in the base frame; required for `ee_pose`."""

    def __post_init__(self) -> None:
        if self.control_mode not in CONTROL_MODES:
            raise ValueError(
                f"RobotCommand.control_mode must be one of {CONTROL_MODES}, got {self.control_mode!r}"
            )
        if self.control_mode == "joint_position":
            if self.joint_positions is None:
                raise ValueError("RobotCommand in joint_position mode needs joint_positions [7]")
            self.joint_positions = _vector("RobotCommand.joint_positions", self.joint_positions, NUM_JOINTS)
        else:
            if self.ee_pos is None or self.ee_quat is None:
                raise ValueError("RobotCommand in ee_pose mode needs ee_pos [3] and ee_quat [4]")
            self.ee_pos = _vector("RobotCommand.ee_pos", self.ee_pos, 3)
            self.ee_quat = _vector("RobotCommand.ee_quat", self.ee_quat, 4)
        self.timestamp_s = float(self.timestamp_s)
        self.gripper_width = float(self.gripper_width)
        self.gripper_force = float(self.gripper_force)


class Robot(abc.ABC):
    """An arm with a gripper, driven by absolute targets at the control rate.

    Lifecycle: `connect()` (or `with robot:`), then per control tick `get_observation()` and
    `send_action(command)`, then `disconnect()`, which stops the arm first. Backends implement the
    underscored methods; the public ones add the connection checks and the safety layer.

    Example:
        with FrankaRobot(config, SafetyLayer(limits, control_dt=0.1)) as robot:
            state = robot.get_observation()
            sent = robot.send_action(command)   # what the arm was actually told to do
    """

    def __init__(self, safety: SafetyLayer, clock: Callable[[], float] = time.monotonic) -> None:
        self.safety = safety
        """Filters every command; its watchdog receives the runner's heartbeats."""
        self.clock = clock
        """Monotonic clock (s) used for the safety layer's `now`; injectable for tests."""
        self.last_report: SafetyReport | None = None
        """What the safety layer changed in the last command sent."""

    @property
    @abc.abstractmethod
    def is_connected(self) -> bool:
        """True between a successful `connect()` and `disconnect()`."""

    @abc.abstractmethod
    def _connect(self) -> None:
        """Open the connection and start the arm's controller; raise with a clear message on failure."""

    @abc.abstractmethod
    def _disconnect(self) -> None:
        """Release the connection; the arm has already been stopped."""

    @abc.abstractmethod
    def get_observation(self) -> RobotState:
        """The latest arm and gripper state, stamped with its capture time."""

    @abc.abstractmethod
    def _send_command(self, command: RobotCommand) -> None:
        """Hand an already safe command to the arm's controller without blocking the control loop."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Bring the arm to rest with its own controller and hold it there; safe to call repeatedly."""

    def connect(self) -> None:
        """Connect and reset the safety layer (a new session starts from the measured state)."""
        if self.is_connected:
            raise RuntimeError(f"{type(self).__name__} is already connected")
        self._connect()
        self.safety.reset()

    def disconnect(self) -> None:
        """Stop the arm, then release the connection. Does nothing when not connected."""
        if not self.is_connected:
            return
        try:
            self.stop()
        finally:
            self._disconnect()

    def send_action(self, command: RobotCommand) -> RobotCommand:
        """Filter `command` through the safety layer, send the result, and return it.

        The returned command is what the arm was told to track, which is what a recorder should store.
        What was clipped or refused is in `self.last_report` and the safety layer's counters.
        """
        if not self.is_connected:
            raise RuntimeError(f"{type(self).__name__}.send_action called before connect()")
        safe, self.last_report = self.safety.filter(command, self.get_observation(), self.clock())
        self._send_command(safe)
        return safe

    def __enter__(self) -> Robot:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()
