"""`robotft calibrate`: hand-eye calibration recovers the simulated camera's extrinsics from a marker
on the simulated hand, within 5 mm and 1 degree, and writes them into the rig preset."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from robotft.real_robot.calibrate import (
    CalibrationConfig,
    average_pose,
    calibrate_camera,
    write_extrinsics,
)
from robotft.real_robot.fiducial import matrix_from_transform, rotation_angle_deg
from robotft.real_robot.rig import load_rig
from robotft.real_robot.safety import SafetyLayer
from robotft.real_robot.sim_camera import SimCamera, SimCameraConfig
from robotft.real_robot.sim_fiducials import SimFiducialConfig
from robotft.real_robot.sim_franka import SimFranka, SimFrankaConfig, SimSceneConfig
from robotft.real_robot.transforms import Transform

HAND_MARKER = SimFiducialConfig(
    name="hand_marker",
    body="panda/right_hand",
    id=9,
    size_m=0.06,
    # On the front of the hand, tilted 30 degrees up toward the camera (flange frame: z down the fingers).
    pos=(0.07, 0.0, 0.02),
    quat=(0.35355, -0.61237, 0.61237, -0.35355),
)
"""A 6 cm marker fixed to the hand (the flange body), facing the rig camera at the home pose."""
CAMERA = SimCameraConfig(
    width=1280, height=720, fps=5.0, fovy_deg=42.0, position=(1.2, 0.0, 0.6), look_at=(0.5, 0.0, 0.05)
)
"""The rig's base camera (sim_franka.yaml's pose) at a RealSense D435 colour stream's 1280x720, 42 deg."""


def test_hand_eye_recovers_the_camera_extrinsics_within_5_mm_and_1_degree(caplog):
    rig = load_rig("sim_franka")
    robot = SimFranka(
        SimFrankaConfig(scene=SimSceneConfig(fiducials=[HAND_MARKER])),
        SafetyLayer(rig.safety, 1.0 / rig.control_hz, cameras=["base"]),
    )
    camera = SimCamera("base", CAMERA, robot)
    truth = camera.camera_to_base()
    config = CalibrationConfig(marker_id=9, marker_size_m=0.06, poses=12, settle_s=0.3, seed=0)
    with caplog.at_level(logging.INFO), robot, camera:
        result = calibrate_camera(robot, camera, config, rig.control_hz)
    est = matrix_from_transform(result.base_from_camera)
    pos_err_mm = np.linalg.norm(est[:3, 3] - truth[:3, 3]) * 1e3
    rot_err_deg = rotation_angle_deg(est[:3, :3], truth[:3, :3])
    print(
        f"calibration: {result.views} views, error {pos_err_mm:.2f} mm {rot_err_deg:.3f} deg, "
        f"spread {result.spread_mm:.2f} mm {result.spread_deg:.2f} deg, reprojection {result.reprojection_px:.3f} px"
    )
    assert result.views >= 10
    assert pos_err_mm <= 5.0 and rot_err_deg <= 1.0
    # The marker's place on the hand comes out too (flange frame).
    assert np.linalg.norm(np.array(result.gripper_from_marker.pos) - [0.07, 0.0, 0.02 - 0.1034]) < 0.005
