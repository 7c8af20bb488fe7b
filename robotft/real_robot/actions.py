"""Policy actions (the checkpoint's control mode, env units) → absolute robot targets (robot.py CONTROL_MODES).

A policy trained in simulation speaks its simulator's control mode, e.g. ManiSkill's `pd_ee_delta_pose`:
a normalized delta of the TCP pose per control step plus a normalized gripper target. The rig turns each
action into the absolute target the arm's controller tracks, *before* the safety layer, so that the
safety limits are checked on what the arm will actually do (robot.py `CONTROL_MODES`).

The mapping reproduces the simulator's controller exactly (ManiSkill 3.0.1
`mani_skill/agents/controllers/pd_ee_pose.py`, `PDEEPoseController` with `use_delta=True`,
`use_target=False`, `normalize_action=True`, frame `root_translation:root_aligned_body_rotation`):

    dp = pos_scale_m * clip(a[0:3], -1, 1)                       target_pos  = ee_pos + dp   (base frame)
    r  = a[3:6] / max(1, |a[3:6]|) * rot_scale_rad               target_quat = q_xyz(r) ⊗ ee_quat
    finger = mid + half_range * clip(a[-1], -1, 1)               gripper_width = clip(2 * finger, 0, 2 * finger_open_m)

with `q_xyz` the intrinsic X-Y-Z Euler rotation. ManiSkill multiplies the rotation by the *lower* bound
of its rotation range (`rot_lower = -0.1` for the Panda), hence the default `rot_scale_rad = -0.1`.
Deltas are relative to the *measured* pose (`use_target=False`), like the simulator. `pd_ee_delta_pos`
(`PDEEPosController`) is the same without the rotation: the target keeps the measured orientation.

ManiSkill drives each finger to `finger_closed_m = -0.01` on a full close (past the closed position, so
that the fingers squeeze thin objects). A width cannot be negative, so the width is clipped to
`[0, 2 finger_open_m]`: "closed", with the grasp force; the simulated rig drives its fingers past closed
itself (`SimFrankaConfig.finger_closed_target_m`).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import numpy as np

from robotft.real_robot.robot import NUM_JOINTS, RobotCommand, RobotState
from robotft.real_robot.transforms import quat_from_euler_xyz, quat_multiply


@dataclass
class ActionMappingConfig:
    """How the rig executes one policy control mode; rig presets list one per supported mode."""

    control_mode: str = "pd_ee_delta_pose"
    """The checkpoint's control mode this mapping implements: `pd_ee_delta_pose`, `pd_ee_delta_pos` or
    `pd_joint_delta_pos`."""
    pos_scale_m: float = 0.1
    """`pd_ee_delta_pose`, `pd_ee_delta_pos`: TCP translation (m) of a position action of 1 (ManiSkill
    Panda: 0.1)."""
    rot_scale_rad: float = -0.1
    """`pd_ee_delta_pose`: factor (rad) on the norm-clipped rotation action; ManiSkill 3.0.1 uses its
    `rot_lower` bound, -0.1 for the Panda."""
    joint_scale_rad: float = 0.1
    """`pd_joint_delta_pos`: joint motion (rad) of an action of 1 (ManiSkill Panda: 0.1)."""
    finger_closed_m: float = -0.01
    """Finger joint target (m, one finger) for a gripper action of -1 (ManiSkill Panda: -0.01)."""
    finger_open_m: float = 0.04
    """Finger joint target (m, one finger) for a gripper action of +1 (ManiSkill Panda: 0.04)."""
    gripper_force_n: float = 20.0
    """Grasp force (N) sent with every command."""

    def __post_init__(self) -> None:
        if self.control_mode not in MAPPINGS:
            raise ValueError(
                f"action mapping control_mode {self.control_mode!r} is not supported; supported: {sorted(MAPPINGS)}"
            )
        for name in ("pos_scale_m", "rot_scale_rad", "joint_scale_rad", "finger_closed_m", "finger_open_m"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"action mapping {name} must be finite, got {getattr(self, name)}")
        if not self.finger_closed_m < self.finger_open_m:
            raise ValueError(
                f"action mapping needs finger_closed_m < finger_open_m, got {self.finger_closed_m} "
                f"and {self.finger_open_m}"
            )

    @property
    def action_dim(self) -> int:
        """Dimension of one action of this control mode (arm + 1 gripper)."""
        return MAPPINGS[self.control_mode].arm_dim + 1


class ActionMapper(abc.ABC):
    """Turns one policy action `[A]` (env units) into an absolute `RobotCommand`."""

    arm_dim: int
    """Arm action dimensions (the gripper adds one)."""
    robot_mode: str
    """The robot control mode (robot.py `CONTROL_MODES`) of the commands this mapper produces."""

    def __init__(self, config: ActionMappingConfig) -> None:
        self.config = config

    def to_command(self, action: np.ndarray, state: RobotState, timestamp_s: float) -> RobotCommand:
        """The command for `action`, relative to the measured `state`, due at `timestamp_s`.

        Non-finite values pass through: the safety layer replaces them by a hold and counts them.
        """
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (self.arm_dim + 1,):
            raise ValueError(
                f"{self.config.control_mode} action must have shape ({self.arm_dim + 1},), got {a.shape}"
            )
        c = self.config
        finger = 0.5 * (c.finger_open_m + c.finger_closed_m) + 0.5 * (
            c.finger_open_m - c.finger_closed_m
        ) * np.clip(a[-1], -1.0, 1.0)
        width = float(np.clip(2.0 * finger, 0.0, 2.0 * c.finger_open_m)) if np.isfinite(finger) else float(finger)
        return self._arm_command(a[:-1], state, timestamp_s, width)

    @abc.abstractmethod
    def _arm_command(
        self, arm: np.ndarray, state: RobotState, timestamp_s: float, width: float
    ) -> RobotCommand:
        """The command for the arm part of an action, with the gripper width already mapped."""


class EeDeltaPoseMapper(ActionMapper):
    """ManiSkill `pd_ee_delta_pose` (see the module docstring for the formula)."""

    arm_dim = 6
    robot_mode = "ee_pose"

    def _arm_command(
        self, arm: np.ndarray, state: RobotState, timestamp_s: float, width: float
    ) -> RobotCommand:
        c = self.config
        pos = state.ee_pos + c.pos_scale_m * np.clip(arm[:3], -1.0, 1.0)
        rot = arm[3:6]
        if np.all(np.isfinite(rot)):
            norm = float(np.linalg.norm(rot))
            if norm > 1.0:  # ManiSkill clips the rotation by its norm, not per component
                rot = rot / norm
            quat = quat_multiply(quat_from_euler_xyz(rot * c.rot_scale_rad), state.ee_quat)
        else:
            quat = np.full(4, np.nan)
        return RobotCommand("ee_pose", timestamp_s, width, c.gripper_force_n, ee_pos=pos, ee_quat=quat)


class EeDeltaPosMapper(ActionMapper):
    """ManiSkill `pd_ee_delta_pos`: `target_pos = ee_pos + pos_scale_m * clip(a[:3], -1, 1)`, orientation
    held at the measured one (ManiSkill solves the IK for the full pose, rotation unchanged)."""

    arm_dim = 3
    robot_mode = "ee_pose"

    def _arm_command(
        self, arm: np.ndarray, state: RobotState, timestamp_s: float, width: float
    ) -> RobotCommand:
        c = self.config
        pos = state.ee_pos + c.pos_scale_m * np.clip(arm, -1.0, 1.0)
        return RobotCommand("ee_pose", timestamp_s, width, c.gripper_force_n, ee_pos=pos, ee_quat=state.ee_quat)


class JointDeltaPosMapper(ActionMapper):
    """ManiSkill `pd_joint_delta_pos`: `q_target = q_measured + joint_scale_rad * clip(a[:7], -1, 1)`."""

    arm_dim = NUM_JOINTS
    robot_mode = "joint_position"

    def _arm_command(
        self, arm: np.ndarray, state: RobotState, timestamp_s: float, width: float
    ) -> RobotCommand:
        q = state.joint_positions + self.config.joint_scale_rad * np.clip(arm, -1.0, 1.0)
        return RobotCommand(
            "joint_position", timestamp_s, width, self.config.gripper_force_n, joint_positions=q
        )


MAPPINGS: dict[str, type[ActionMapper]] = {
    "pd_ee_delta_pose": EeDeltaPoseMapper,
    "pd_ee_delta_pos": EeDeltaPosMapper,
    "pd_joint_delta_pos": JointDeltaPosMapper,
}
"""Checkpoint control mode -> mapper class."""


def make_mapper(config: ActionMappingConfig) -> ActionMapper:
    return MAPPINGS[config.control_mode](config)
