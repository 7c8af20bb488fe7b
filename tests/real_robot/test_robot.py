"""Robot contract: context manager, send_action always goes through the safety layer and returns what was sent."""

from __future__ import annotations

import math

import numpy as np
import pytest

from robotft.real_robot.robot import Robot, RobotCommand, RobotState
from robotft.real_robot.safety import SafetyLayer, SafetyLimits

READY_POS = np.array([0.4, 0.0, 0.4])


class FakeRobot(Robot):
    """Records what the backend was told; its state never changes."""

    def __init__(self, safety: SafetyLayer) -> None:
        super().__init__(safety, clock=lambda: 0.0)
        self.connected = False
        self.sent: list[RobotCommand] = []
        self.stops = 0

    @property
    def is_connected(self) -> bool:
        return self.connected

    def _connect(self) -> None:
        self.connected = True

    def _disconnect(self) -> None:
        self.connected = False

    def get_observation(self) -> RobotState:
        return RobotState(0.0, np.zeros(7), np.zeros(7), READY_POS, [1.0, 0.0, 0.0, 0.0], 0.04)

    def _send_command(self, command: RobotCommand) -> None:
        self.sent.append(command)

    def stop(self) -> None:
        self.stops += 1


def test_send_action_returns_the_filtered_command_the_backend_received():
    robot = FakeRobot(SafetyLayer(SafetyLimits(), control_dt=0.1))
    with pytest.raises(RuntimeError, match="before connect"):
        robot.send_action(RobotCommand("ee_pose", 0.0, 0.04, ee_pos=READY_POS, ee_quat=[1, 0, 0, 0]))
    with robot:
        robot.safety.watchdog.heartbeat("policy", 0.0)
        robot.safety.watchdog.heartbeat("camera", 0.0)
        wild = RobotCommand(
            "ee_pose", 0.0, math.inf, 1e30, ee_pos=[1e30, -math.inf, 0.4], ee_quat=[1, 0, 0, 0]
        )
        sent = robot.send_action(wild)
        assert robot.sent == [sent]
        np.testing.assert_allclose(sent.ee_pos, READY_POS)  # non-finite position: hold
        assert sent.gripper_width == 0.04 and sent.gripper_force == SafetyLimits().gripper_force_max
        assert robot.last_report.clipped == ("non_finite", "gripper_force")
    assert not robot.is_connected and robot.stops == 1


def test_commands_check_their_shapes_and_mode():
    with pytest.raises(ValueError, match="one of"):
        RobotCommand("torque", 0.0, 0.04)
    with pytest.raises(ValueError, match=r"joint_positions must have shape \(7,\)"):
        RobotCommand("joint_position", 0.0, 0.04, joint_positions=np.zeros(6))
    with pytest.raises(ValueError, match="needs ee_pos"):
        RobotCommand("ee_pose", 0.0, 0.04, ee_pos=np.zeros(3))
