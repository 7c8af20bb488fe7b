"""Backends by `type`: a rig preset's mappings build the right robot and cameras, and mistakes are named."""

from __future__ import annotations

import pytest
import yaml

from robotft.config import ConfigError
from robotft.real_robot.backends import make_camera, make_robot, parse_camera_config, parse_robot_config
from robotft.real_robot.franka import FrankaConfig, FrankaRobot
from robotft.real_robot.realsense import RealSenseCamera
from robotft.real_robot.safety import SafetyLayer, SafetyLimits
from robotft.real_robot.sim_camera import SimCamera
from robotft.real_robot.sim_franka import SimFranka

RIG = yaml.safe_load(
    """
robot:
  type: sim_franka
  config:
    physics_hz: 1000
    scene:
      objects: [{name: cube, half_size: [0.02, 0.02, 0.02], pos: [0.615, 0.0, 0.02], randomize_xy: [0.1, 0.1]}]
      markers: [{name: goal, size: [0.1, 0.001], pos: [0.2, 0.0, 0.001], relative_to: cube}]
cameras:
  - {name: base, type: sim, config: {width: 32, height: 24, fps: 5, position: [1.2, 0, 0.6], look_at: [0.5, 0, 0]}}
  - {name: wrist, type: realsense, config: {serial: "123456789012", depth_resolution: [640, 480]}}
"""
)


def test_a_rig_mapping_builds_its_backends():
    safety = SafetyLayer(SafetyLimits(), 0.1, cameras=("base", "wrist"))
    robot = make_robot(RIG["robot"]["type"], RIG["robot"]["config"], safety)
    assert isinstance(robot, SimFranka) and robot.safety is safety
    assert robot.config.scene.objects[0].randomize_xy == (0.1, 0.1)
    assert robot.config.scene.markers[0].relative_to == "cube"
    base, wrist = (make_camera(c["name"], c["type"], c["config"], robot) for c in RIG["cameras"])
    assert isinstance(base, SimCamera) and base.name == "base" and base.intrinsics.width == 32
    assert isinstance(wrist, RealSenseCamera) and wrist.config.depth_resolution == (640, 480)
    franka = make_robot("franka", {"host": "10.0.0.2"}, safety)
    assert isinstance(franka, FrankaRobot) and franka.config.host == "10.0.0.2"
    assert parse_robot_config("franka", FrankaConfig()) == FrankaConfig()  # a config object passes through


def test_mistakes_are_named():
    with pytest.raises(
        ConfigError,
        match=r"robot.type: robot type 'ur5' is unknown; available: \['franka', 'sim_franka'\]",
    ):
        parse_robot_config("ur5", {})
    with pytest.raises(ConfigError, match=r"cameras.wrist.config: unknown key\(s\) \['serial_number'\]"):
        parse_camera_config("realsense", {"serial_number": "1"}, where="cameras.wrist")
    with pytest.raises(ConfigError, match="must be `sim_franka`, got FrankaRobot"):
        make_camera("base", "sim", {}, FrankaRobot(FrankaConfig(), SafetyLayer(SafetyLimits(), 0.1)))
