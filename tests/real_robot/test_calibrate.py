"""`robotft calibrate`: hand-eye calibration recovers the simulated camera's extrinsics from a marker
on the simulated hand, within 5 mm and 1 degree, and writes them into the rig preset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from robotft.cli import main
from robotft.config import find_preset
from robotft.real_robot.calibrate import write_extrinsics
from robotft.real_robot.fiducial import matrix_from_transform, rotation_angle_deg
from robotft.real_robot.rig import load_rig
from robotft.real_robot.sim_camera import look_at_rotation
from robotft.real_robot.transforms import Transform

HAND_MARKER = {
    "name": "hand_marker",
    "body": "panda/right_hand",
    "id": 9,
    "size_m": 0.06,
    # On the front of the hand, tilted 30 degrees up toward the camera (flange frame: z down the fingers).
    "pos": [0.07, 0.0, 0.02],
    "quat": [0.35355, -0.61237, 0.61237, -0.35355],
}
"""A 6 cm marker fixed to the hand (the flange body), facing the rig camera at the home pose."""
POSITION, LOOK_AT = [1.2, 0.0, 0.6], [0.5, 0.0, 0.05]
"""The sim rig's base camera pose (real_robot/sim_franka.yaml)."""


def test_calibrate_recovers_the_camera_extrinsics_within_5_mm_and_1_degree(tmp_path, capsys):
    rig = yaml.safe_load(find_preset("real_robot", "sim_franka").read_text())
    rig["robot"]["config"]["scene"]["fiducials"] = [HAND_MARKER]
    # A RealSense D435 colour stream's size and vertical field of view (1280x720, 42 deg).
    rig["cameras"][0]["config"].update(
        width=1280, height=720, fps=5, fovy_deg=42.0, position=POSITION, look_at=LOOK_AT
    )
    rig["safety"]["camera_timeout_s"] = 2.0  # software rendering at 1280x720 shares 2 cores with the physics
    path = tmp_path / "rig.yaml"
    path.write_text(yaml.safe_dump(rig, sort_keys=False))

    args = [
        "calibrate",
        "--rig",
        str(path),
        "--marker-id",
        "9",
        "--marker-size",
        "0.06",
        "--poses",
        "12",
        "--settle",
        "0.3",
        "--write",
        "--out",
        str(tmp_path / "calib.json"),
    ]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    truth = np.eye(4)
    truth[:3, :3] = look_at_rotation(POSITION, LOOK_AT, (0.0, 0.0, 1.0))
    truth[:3, 3] = POSITION
    written = matrix_from_transform(load_rig(str(path)).cameras[0].base_from_camera)
    pos_err_mm = np.linalg.norm(written[:3, 3] - truth[:3, 3]) * 1e3
    rot_err_deg = rotation_angle_deg(written[:3, :3], truth[:3, :3])
    print(
        f"calibration: {summary['views']} views, error {pos_err_mm:.2f} mm {rot_err_deg:.3f} deg, "
        f"reprojection {summary['reprojection_px']:.3f} px"
    )
    assert summary["views"] >= 10 and summary["reprojection_px"] < 1.0
    assert pos_err_mm <= 5.0 and rot_err_deg <= 1.0
    # The marker's place on the hand comes out too (TCP frame: 0.1034 m below the flange).
    assert np.allclose(summary["gripper_from_marker"]["pos"], [0.07, 0.0, 0.02 - 0.1034], atol=0.005)
    assert len(json.loads((tmp_path / "calib.json").read_text())["samples"]) == 12


def test_the_extrinsics_replace_the_placeholder_and_keep_the_preset_comments(tmp_path):
    preset = find_preset("real_robot", "franka_d435")
    t = Transform((1.1, 0.05, 0.55), (0.0, -0.38268, 0.0, 0.92388))
    text = write_extrinsics(preset, "base", t, "robotft calibrate test")
    original = preset.read_text()
    assert text.count("\n") == original.count("\n")
    assert "# Replace the robot address" in text and "placeholder extrinsics" not in text
    path = tmp_path / "rig.yaml"
    path.write_text(text)
    rig = load_rig(str(path))
    assert rig.cameras[0].base_from_camera == t
    assert rig.cameras[1].base_from_camera == Transform()  # the wrist camera is untouched
    with pytest.raises(ValueError, match="no camera entry `- name: side`"):
        write_extrinsics(preset, "side", t, "")
