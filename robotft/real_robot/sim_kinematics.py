"""Kinematics of the simulated Panda: TCP forward kinematics and damped-least-squares inverse kinematics.

Both run on a private `MjData` of the rig's MuJoCo model, so they never disturb the simulation.
IK is damped least squares on the MuJoCo Jacobian of the TCP site (Wampler 1986; Buss 2004,
"Introduction to inverse kinematics with Jacobian transpose, pseudoinverse and damped least squares
methods"):

    dq = J^T (J J^T + lambda^2 I)^-1 e  +  (I - J^+ J) k (q_home - q)

with `e` the position and rotation error of the TCP, iterated from a seed posture and clipped to the
joint limits. The optional null-space term pulls the redundant joint toward a home posture; ManiSkill's
IK (sapien's pinocchio solver, started from the measured joints) has none, so a rig that must reproduce
ManiSkill sets its gain to 0.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from robotft.real_robot.robot import NUM_JOINTS


@dataclass
class IkConfig:
    """Damped least-squares IK settings."""

    damping: float = 0.05
    """Damping lambda (m or rad); larger is smoother near singularities."""
    max_iters: int = 50
    """Iterations per target, started from the seed posture."""
    nullspace_gain: float = 0.1
    """Pull toward the home posture in the Jacobian null space, per iteration (0: none, as ManiSkill)."""
    tol_pos_m: float = 1e-5
    """Stop when the position error is below this (m) ..."""
    tol_rot_rad: float = 1e-4
    """... and the rotation error below this (rad)."""

    def __post_init__(self) -> None:
        if not (self.damping >= 0 and self.max_iters >= 1 and self.nullspace_gain >= 0):
            raise ValueError(
                "IkConfig needs damping >= 0, max_iters >= 1, nullspace_gain >= 0; got "
                f"{self.damping}, {self.max_iters}, {self.nullspace_gain}"
            )


class TcpKinematics:
    """FK and IK of a TCP site over the arm joints of a MuJoCo model (thread-safe)."""

    def __init__(
        self,
        model: Any,
        tcp_site: int,
        arm_qpos: np.ndarray,
        arm_dof: np.ndarray,
        home: np.ndarray,
        config: IkConfig,
    ) -> None:
        import mujoco

        self._mj = mujoco
        self.model = model
        self.config = config
        self._data = mujoco.MjData(model)
        self._tcp = tcp_site
        self._qpos = np.asarray(arm_qpos)
        self._dof = np.asarray(arm_dof)
        joints = [int(np.nonzero(model.jnt_qposadr == a)[0][0]) for a in self._qpos]
        self.q_min = model.jnt_range[joints, 0].copy()
        """Lower joint limits (rad)."""
        self.q_max = model.jnt_range[joints, 1].copy()
        """Upper joint limits (rad)."""
        self.home = np.clip(np.asarray(home, dtype=np.float64), self.q_min, self.q_max)
        """The posture the null-space term pulls toward (rad)."""
        self._lock = threading.Lock()

    def tcp_pose(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """TCP position `[3]` (m) and quaternion `[4]` (wxyz) at joint angles `q [7]` (rad)."""
        with self._lock:
            d = self._data
            d.qpos[self._qpos] = q
            self._mj.mj_kinematics(self.model, d)
            quat = np.zeros(4)
            self._mj.mju_mat2Quat(quat, d.site_xmat[self._tcp])
            return d.site_xpos[self._tcp].copy(), quat

    def inverse(self, pos: np.ndarray, quat: np.ndarray, seed_q: np.ndarray) -> np.ndarray:
        """Joint angles `[7]` (rad) that put the TCP at `pos [3]` (m) with orientation `quat [4]` (wxyz),
        iterated from `seed_q`. Returns the best effort when the target is out of reach; `tcp_pose(q)`
        tells how close it got."""
        mj, m, cfg = self._mj, self.model, self.config
        target_pos = np.asarray(pos, dtype=np.float64)
        target_quat = np.asarray(quat, dtype=np.float64) / np.linalg.norm(quat)
        q = np.asarray(seed_q, dtype=np.float64).copy()
        jacp, jacr = np.zeros((3, m.nv)), np.zeros((3, m.nv))
        cur_quat, neg, diff, rot_err = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(3)
        lam2 = cfg.damping**2
        with self._lock:
            d = self._data
            for _ in range(cfg.max_iters):
                d.qpos[self._qpos] = q
                mj.mj_kinematics(m, d)
                mj.mj_comPos(m, d)
                pos_err = target_pos - d.site_xpos[self._tcp]
                mj.mju_mat2Quat(cur_quat, d.site_xmat[self._tcp])
                mj.mju_negQuat(neg, cur_quat)
                mj.mju_mulQuat(diff, target_quat, neg)
                mj.mju_quat2Vel(rot_err, diff, 1.0)  # world-frame rotation taking current to target
                if np.linalg.norm(pos_err) < cfg.tol_pos_m and np.linalg.norm(rot_err) < cfg.tol_rot_rad:
                    break
                mj.mj_jacSite(m, d, jacp, jacr, self._tcp)
                jac = np.vstack([jacp[:, self._dof], jacr[:, self._dof]])
                jjt = jac @ jac.T + lam2 * np.eye(6)
                dq = jac.T @ np.linalg.solve(jjt, np.concatenate([pos_err, rot_err]))
                if cfg.nullspace_gain > 0:
                    # The exact projector: the damped one would leak the posture pull into the task.
                    null = np.eye(NUM_JOINTS) - np.linalg.pinv(jac) @ jac
                    dq += null @ (cfg.nullspace_gain * (self.home - q))
                q = np.clip(q + dq, self.q_min, self.q_max)
        return q
