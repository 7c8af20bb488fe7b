"""Rigid transforms for rig observations and actions: quaternions `[w, x, y, z]`, positions in metres.

Small numpy helpers (no scipy dependency). Conventions match robot.py: quaternions are unit, scalar
first; a transform `T_ab = (pos, quat)` maps coordinates in frame `b` to frame `a`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def quat_multiply(q1: np.ndarray, q2: np.ndarray) -> np.ndarray:
    """Hamilton product `q1 ⊗ q2` (apply `q2`, then `q1`), both `[w, x, y, z]`."""
    w1, x1, y1, z1 = q1
    w2, x2, y2, z2 = q2
    return np.array(
        [
            w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2,
            w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
            w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
            w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
        ]
    )


def quat_rotate(q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Rotate the vector `v [3]` by the unit quaternion `q`."""
    return quat_to_matrix(q) @ np.asarray(v, dtype=np.float64)


def quat_to_matrix(q: np.ndarray) -> np.ndarray:
    """Rotation matrix `[3, 3]` of a unit quaternion `[w, x, y, z]`."""
    w, x, y, z = q
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def quat_from_euler_xyz(angles: np.ndarray) -> np.ndarray:
    """Quaternion of the intrinsic X-Y-Z Euler rotation `R = Rx(a0) Ry(a1) Rz(a2)` (rad).

    The convention of pytorch3d's `euler_angles_to_matrix(angles, "XYZ")`, which ManiSkill's
    `pd_ee_delta_pose` controller applies to the rotation part of an action.
    """
    a0, a1, a2 = (float(a) for a in angles)
    qx = np.array([np.cos(a0 / 2), np.sin(a0 / 2), 0.0, 0.0])
    qy = np.array([np.cos(a1 / 2), 0.0, np.sin(a1 / 2), 0.0])
    qz = np.array([np.cos(a2 / 2), 0.0, 0.0, np.sin(a2 / 2)])
    return quat_multiply(quat_multiply(qx, qy), qz)


@dataclass(frozen=True)
class Transform:
    """`T_ab`: maps points in frame `b` to frame `a` (`p_a = R p_b + pos`)."""

    pos: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Origin of frame `b` in frame `a` (m)."""
    quat: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)
    """Orientation of frame `b` in frame `a`, `[w, x, y, z]`."""

    def __post_init__(self) -> None:
        if len(self.pos) != 3 or len(self.quat) != 4 or not np.all(np.isfinite([*self.pos, *self.quat])):
            raise ValueError(f"Transform needs pos [3] and quat [4] finite, got {self.pos} and {self.quat}")
        if abs(np.linalg.norm(self.quat) - 1.0) > 1e-3:
            raise ValueError(f"Transform.quat must be a unit quaternion [w, x, y, z], got {self.quat}")

    def point(self, p_b: np.ndarray) -> np.ndarray:
        """A point `[3]` given in frame `b`, expressed in frame `a`."""
        return quat_rotate(np.asarray(self.quat), p_b) + np.asarray(self.pos)

    def orientation(self, q_b: np.ndarray) -> np.ndarray:
        """An orientation `[4]` given in frame `b`, expressed in frame `a`."""
        return quat_multiply(np.asarray(self.quat), np.asarray(q_b, dtype=np.float64))

    def inverse(self) -> Transform:
        """`T_ba`."""
        q_inv = np.array([self.quat[0], -self.quat[1], -self.quat[2], -self.quat[3]])
        pos = -quat_rotate(q_inv, np.asarray(self.pos))
        return Transform(tuple(pos.tolist()), tuple(q_inv.tolist()))
