"""Action mapping: a policy's `pd_ee_delta_pose` / `pd_joint_delta_pos` action becomes the absolute target
that ManiSkill's own controller would compute, before the safety layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from robotft.real_robot.actions import ActionMappingConfig, make_mapper
from robotft.real_robot.robot import RobotState


def _state(ee_quat=(0.0, 1.0, 0.0, 0.0)) -> RobotState:
    return RobotState(
        timestamp_s=1.0,
        joint_positions=np.linspace(-0.5, 0.5, 7),
        joint_velocities=np.zeros(7),
        ee_pos=np.array([0.6, 0.05, 0.2]),
        ee_quat=np.asarray(ee_quat, dtype=np.float64) / np.linalg.norm(ee_quat),
        gripper_width=0.04,
    )


def _maniskill_target(action: np.ndarray, state: RobotState) -> tuple[np.ndarray, np.ndarray]:
    """ManiSkill 3.0.1's PDEEPoseController target for a normalized action (its own code and config)."""
    import gymnasium as gym  # noqa: F401
    from mani_skill.agents.controllers.pd_ee_pose import PDEEPoseControllerConfig
    from mani_skill.utils import gym_utils
    from mani_skill.utils.geometry.rotation_conversions import (
        euler_angles_to_matrix,
        matrix_to_quaternion,
        quaternion_multiply,
    )

    cfg = PDEEPoseControllerConfig(
        joint_names=[],
        pos_lower=-0.1,
        pos_upper=0.1,
        rot_lower=-0.1,
        rot_upper=0.1,
        stiffness=1e3,
        damping=1e2,
        ee_link="tcp",
        use_delta=True,
        normalize_action=True,
    )
    a = torch.as_tensor(action[None, :6], dtype=torch.float64)
    # PDEEPoseController._clip_and_scale_action, then compute_target_pose (root_translation:root_aligned_body_rotation).
    pos = gym_utils.clip_and_scale_action(a[:, :3], torch.tensor(cfg.pos_lower), torch.tensor(cfg.pos_upper))
    rot = a[:, 3:].clone()
    norm = torch.linalg.norm(rot, axis=1)
    rot[norm > 1] = torch.mul(rot, 1 / norm[:, None])[norm > 1]
    rot = rot * cfg.rot_lower
    delta_quat = matrix_to_quaternion(euler_angles_to_matrix(rot, "XYZ"))
    quat = quaternion_multiply(delta_quat, torch.as_tensor(state.ee_quat)[None])
    return (torch.as_tensor(state.ee_pos)[None] + pos)[0].numpy(), quat[0].numpy()


@pytest.mark.parametrize("seed", range(5))
def test_ee_delta_pose_matches_maniskill_controller(seed):
    rng = np.random.default_rng(seed)
    action = rng.uniform(-1.5, 1.5, 7)  # beyond the bounds too: both clip the same way
    state = _state(ee_quat=rng.normal(size=4))
    cmd = make_mapper(ActionMappingConfig("pd_ee_delta_pose")).to_command(action, state, 2.0)
    pos, quat = _maniskill_target(action, state)
    assert cmd.control_mode == "ee_pose" and cmd.timestamp_s == 2.0
    np.testing.assert_allclose(cmd.ee_pos, pos, atol=1e-9)
    # q and -q are the same rotation.
    assert min(np.abs(cmd.ee_quat - quat).max(), np.abs(cmd.ee_quat + quat).max()) < 1e-9


def test_gripper_maps_to_finger_width_like_maniskill():
    mapper = make_mapper(ActionMappingConfig("pd_ee_delta_pose"))
    widths = [
        mapper.to_command(np.array([0, 0, 0, 0, 0, 0, g]), _state(), 0.0).gripper_width for g in (-1, 0, 1, 5)
    ]
    # Finger joint target -0.01 .. 0.04 m per finger; the width is two fingers, and "past closed" is closed
    # (a width is never negative, so a good policy's full close is not a safety clip).
    np.testing.assert_allclose(widths, [0.0, 0.03, 0.08, 0.08])
    nan = mapper.to_command(np.array([0, 0, 0, 0, 0, 0, np.nan]), _state(), 0.0).gripper_width
    assert np.isnan(nan)  # left to the safety layer, which holds and counts it


def test_ee_delta_pos_moves_the_tcp_and_keeps_the_measured_orientation():
    mapper = make_mapper(ActionMappingConfig("pd_ee_delta_pos"))
    state = _state(ee_quat=(0.1, 0.9, 0.05, 0.0))
    cmd = mapper.to_command(np.array([0.5, -2.0, 0.1, 1.0]), state, 3.0)
    assert mapper.arm_dim == 3 and cmd.control_mode == "ee_pose" and cmd.timestamp_s == 3.0
    np.testing.assert_allclose(cmd.ee_pos, state.ee_pos + [0.05, -0.1, 0.01])
    np.testing.assert_allclose(cmd.ee_quat, state.ee_quat)
    assert cmd.gripper_width == pytest.approx(0.08)


def test_zero_action_holds_the_measured_pose():
    state = _state()
    cmd = make_mapper(ActionMappingConfig("pd_ee_delta_pose")).to_command(np.zeros(7), state, 0.0)
    np.testing.assert_allclose(cmd.ee_pos, state.ee_pos)
    np.testing.assert_allclose(cmd.ee_quat, state.ee_quat)


def test_non_finite_actions_reach_the_safety_layer_as_non_finite_targets():
    cmd = make_mapper(ActionMappingConfig("pd_ee_delta_pose")).to_command(
        np.array([np.nan, 0, 0, np.inf, 0, 0, 0]), _state(), 0.0
    )
    assert np.isnan(cmd.ee_pos[0]) and np.all(np.isnan(cmd.ee_quat))


def test_joint_delta_pos():
    state = _state()
    action = np.array([1, -1, 0.5, 0, 2, 0, 0, 1.0])
    cmd = make_mapper(ActionMappingConfig("pd_joint_delta_pos", joint_scale_rad=0.1)).to_command(
        action, state, 0.0
    )
    np.testing.assert_allclose(cmd.joint_positions, state.joint_positions + 0.1 * np.clip(action[:7], -1, 1))
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        make_mapper(ActionMappingConfig("pd_joint_delta_pos")).to_command(np.zeros(7), state, 0.0)


def test_unknown_control_mode_is_refused():
    with pytest.raises(ValueError, match="pd_joint_vel"):
        ActionMappingConfig("pd_joint_vel")
