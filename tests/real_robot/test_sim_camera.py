"""SimCamera: timestamped RGB-D frames of the SimFranka scene, where the intrinsics say things are,
that change when the arm moves."""

from __future__ import annotations

import time

import numpy as np
import pytest

from robotft.real_robot.camera import StaleFrameError
from robotft.real_robot.robot import RobotCommand
from robotft.real_robot.safety import SafetyLayer, SafetyLimits
from robotft.real_robot.sim_camera import SimCamera, SimCameraConfig
from robotft.real_robot.sim_franka import SimFranka, SimFrankaConfig
from robotft.real_robot.sim_scene import SimObjectConfig, SimSceneConfig

CUBE = np.array([0.55, 0.15, 0.02])


@pytest.fixture(scope="module")
def robot():
    scene = SimSceneConfig(objects=[SimObjectConfig("cube", pos=tuple(CUBE), rgba=(0.9, 0.05, 0.05, 1.0))])
    return SimFranka(SimFrankaConfig(scene=scene), SafetyLayer(SafetyLimits(), 0.1, cameras=()))


def test_frames_are_timestamped_rgb_d_images_consistent_with_the_intrinsics(robot):
    # Software rendering shares the CPU with the 1 kHz physics: small images at a low rate.
    cfg = SimCameraConfig(
        width=96, height=72, fps=5.0, depth=True, position=(1.1, 0.3, 0.5), look_at=(0.5, 0.0, 0.1)
    )
    with robot, SimCamera("base", cfg, robot) as cam:
        first = cam.read(timeout_s=10.0)
        second = cam.read(timeout_s=10.0)
        assert first.color.shape == (72, 96, 3) and first.color.dtype == np.uint8
        assert first.depth.shape == (72, 96) and first.depth.dtype == np.float32
        assert second.index > first.index and second.capture_time_s > first.capture_time_s
        assert second.capture_time_s <= second.receive_time_s <= time.monotonic()
        assert cam.read_latest(max_age_ms=5000).index >= second.index

        # The cube's centre projects onto red pixels at the depth of its front face.
        to_cam = np.linalg.inv(cam.camera_to_base())
        centre = (to_cam @ [*CUBE, 1.0])[:3]
        u, v = np.round(cam.intrinsics.project(centre[None])[0]).astype(int)
        r, g, b = second.color[v, u].astype(int)
        assert r > 2 * g and r > 2 * b, f"expected the red cube at pixel ({u}, {v}), got {(r, g, b)}"
        assert centre[2] - 0.04 < second.depth[v, u] < centre[2]
    assert not cam.is_connected
    with pytest.raises(StaleFrameError):
        cam.read_latest(max_age_ms=1.0)


def frame_after(cam: SimCamera, t: float, timeout_s: float = 10.0):
    """The first frame showing the scene at or after time `t` (the render thread may lag on a busy CPU)."""
    deadline = time.monotonic() + timeout_s
    while True:
        frame = cam.read(timeout_s=max(0.0, deadline - time.monotonic()))
        if frame.capture_time_s >= t:
            return frame


def test_the_image_changes_when_the_arm_moves(robot):
    cfg = SimCameraConfig(width=64, height=64, fps=5.0, position=(1.2, 0.0, 0.6), look_at=(0.5, 0.0, 0.2))
    with robot, SimCamera("base", cfg, robot) as cam:
        robot.reset_episode()
        before = frame_after(cam, time.monotonic())
        q = robot.get_observation().joint_positions + np.array([0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        for _ in range(8):
            now = time.monotonic()
            robot.safety.watchdog.heartbeat("policy", now)
            robot.send_action(RobotCommand("joint_position", now + 0.1, 0.08, joint_positions=q))
            time.sleep(0.1)
        after = frame_after(cam, time.monotonic())
        changed = np.abs(after.color.astype(int) - before.color.astype(int)).max(axis=2) > 30
        assert changed.mean() > 0.02, f"only {changed.mean():.1%} of the pixels changed"


def test_a_model_camera_moves_with_the_hand_and_unknown_names_are_refused(robot):
    with pytest.raises(ValueError, match="model_camera 'nope' not in the model"):
        SimCamera("wrist", SimCameraConfig(model_camera="nope"), robot)
    wrist = SimCamera("wrist", SimCameraConfig(width=32, height=32, model_camera="panda/eye_in_hand"), robot)
    assert wrist.intrinsics.fy == pytest.approx(16 / np.tan(np.radians(75) / 2))  # the model's fovy
    with robot:
        robot.reset_episode()
        pose = wrist.camera_to_base()
        # The wrist camera looks down (OpenCV z axis) from near the TCP.
        assert pose[2, 2] < -0.9
        assert np.linalg.norm(pose[:3, 3] - robot.get_observation().ee_pos) < 0.2


def test_the_table_colour_is_what_the_camera_renders():
    """`scene.table_rgba` sets the table a camera policy sees (a rig's stand-in for the training scene's table)."""
    cfg = SimCameraConfig(width=32, height=24, position=(1.2, 0.0, 0.6), look_at=(0.5, 0.0, 0.0))
    means = []
    for rgba in ((0.9, 0.1, 0.1, 1.0), (0.1, 0.1, 0.9, 1.0)):
        scene = SimSceneConfig(table_rgba=rgba)
        robot = SimFranka(SimFrankaConfig(scene=scene, realtime=False), SafetyLayer(SafetyLimits(), 0.1, cameras=()))
        with robot:
            camera = SimCamera("base", cfg, robot)
            means.append(camera.snapshot().color[18:, :].reshape(-1, 3).mean(0))  # the table in front
            camera.close_snapshots()
    assert means[0][0] > means[0][2] + 50 and means[1][2] > means[1][0] + 50, means
    with pytest.raises(ValueError, match="table_rgba"):
        SimSceneConfig(table_rgba=(1.2, 0.0, 0.0, 1.0))
