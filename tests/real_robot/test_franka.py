"""FrankaRobot through franky: with no robot at the address, connecting fails at once with an error
that names the address (franky's real NetworkException, no mocks)."""

from __future__ import annotations

import time

import pytest

from robotft.real_robot.franka import FrankaConfig, FrankaRobot
from robotft.real_robot.safety import SafetyLayer, SafetyLimits

pytest.importorskip("franky")


def test_connecting_without_a_robot_fails_fast_and_names_the_address():
    robot = FrankaRobot(
        FrankaConfig(host="127.0.0.1", enforce_realtime=False), SafetyLayer(SafetyLimits(), 0.1)
    )
    start = time.monotonic()
    with pytest.raises(
        ConnectionError, match=r"cannot connect to the Franka at '127\.0\.0\.1' \(NetworkException"
    ):
        robot.connect()
    assert time.monotonic() - start < 5.0
    assert not robot.is_connected
    robot.disconnect()  # safe when not connected
    with pytest.raises(RuntimeError, match="before connect"):
        robot.get_observation()


def test_config_checks_sizes():
    with pytest.raises(ValueError, match="collision_force_thresholds must have 6 entries"):
        FrankaConfig(collision_force_thresholds=(20.0,) * 7)
    with pytest.raises(ValueError, match=r"relative_dynamics_factor must be in \(0, 1\]"):
        FrankaConfig(relative_dynamics_factor=2.0)
