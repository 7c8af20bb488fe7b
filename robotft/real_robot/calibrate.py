"""`robotft calibrate`: a rig camera's extrinsics (`base_from_camera`) by eye-to-hand calibration.

A printed ArUco marker is fixed to the hand (anywhere the camera sees it; its offset need not be known).
The arm visits N TCP poses around a centre, with random translations and rotations; at each, once the
arm is at rest, the robot reports `base_from_gripper` and the camera sees `camera_from_marker`. For a
static camera the unknowns are `base_from_camera` X and `gripper_from_marker` Y, with, for every pose i,

    base_from_gripper_i * Y = X * camera_from_marker_i                              (AX = XB form)

1. `cv2.calibrateHandEye` solves it in closed form (Park & Martin 1994). Eye-to-hand, as OpenCV's
   documentation says, is the eye-in-hand solver fed with the inverse robot poses (`gripper_from_base`);
   its "camera to gripper" result is then `base_from_camera`.
2. With rotations of a few tens of degrees the closed form is poorly conditioned in translation (a few
   cm off), so X and Y are refined together by Levenberg-Marquardt on the reprojection error of every
   marker corner in every view, the quantity the detector actually measures.

The consistency of Y across the views (spread of the per-view estimates, mm and degrees) and the
corners' reprojection RMS are reported with the result. The result is written into the rig preset's
camera entry (`--write`) or printed as YAML to paste.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from robotft.real_robot.transforms import Transform, quat_multiply, quat_to_matrix

if TYPE_CHECKING:
    from robotft.real_robot.camera import Camera
    from robotft.real_robot.fiducial import MarkerDetector
    from robotft.real_robot.robot import Robot

log = logging.getLogger(__name__)


@dataclass
class CalibrationConfig:
    """What to move through and what to look for.

    Example:
        CalibrationConfig(camera="base", marker_id=9, marker_size_m=0.06, poses=15)
    """

    camera: str = "base"
    """The rig camera to calibrate (a static one: eye-to-hand)."""
    marker_id: int = 0
    """Id of the marker on the hand."""
    marker_size_m: float = 0.06
    """Side of its black square as printed (m)."""
    dictionary: str = "DICT_4X4_50"
    """Its OpenCV dictionary."""
    poses: int = 15
    """TCP poses to visit (at least 3 with distinct rotation axes; 10-20 is typical)."""
    centre: tuple[float, ...] = ()
    """Centre of the poses, TCP position in the base frame (m); empty: where the TCP is at the start."""
    pos_range_m: float = 0.08
    """Poses are the centre plus uniform offsets in +- this (m) per axis."""
    rot_range_deg: float = 20.0
    """... and a rotation of the starting orientation by up to this angle (degrees) about a random axis."""
    settle_s: float = 0.5
    """Wait after reaching a pose before measuring (s): the arm must be at rest when the frame is taken."""
    seed: int = 0
    """Seed of the pose sampling."""

    def __post_init__(self) -> None:
        if self.poses < 3 or not self.marker_size_m > 0 or self.settle_s < 0:
            raise ValueError(
                f"calibration needs poses >= 3, marker_size_m > 0, settle_s >= 0; got {self.poses}, "
                f"{self.marker_size_m}, {self.settle_s}"
            )
        if self.centre and len(self.centre) != 3:
            raise ValueError(f"calibration centre must be [x, y, z] (m) or empty, got {self.centre}")


@dataclass
class HandEyeResult:
    """A calibrated `base_from_camera` and how well the views agree with it."""

    base_from_camera: Transform
    """The camera optical frame (x right, y down, z forward) in the robot base frame."""
    gripper_from_marker: Transform
    """Where the marker sits on the hand (a by-product; useful to check against a ruler)."""
    views: int
    """Views used (poses at which the marker was seen)."""
    spread_mm: float
    """RMS distance of the per-view marker positions on the hand from their mean (mm)."""
    spread_deg: float
    """RMS angle of the per-view marker orientations on the hand from their mean (degrees)."""
    reprojection_px: float
    """RMS reprojection error of all marker corners through the result (pixels)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Per view: the TCP pose and the marker's corners (to re-solve or audit offline)."""


# ---- math ------------------------------------------------------------------------------------------------


def _matrix(pos: np.ndarray, quat: np.ndarray) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = quat_to_matrix(np.asarray(quat, dtype=np.float64))
    out[:3, 3] = pos
    return out


def average_pose(poses: list[np.ndarray]) -> np.ndarray:
    """Mean of rigid transforms `[4, 4]`: mean translation, and the rotation nearest (Frobenius) to the
    mean rotation matrix (projection by SVD; Moakher 2002's chordal L2 mean)."""
    mean_r = np.mean([p[:3, :3] for p in poses], axis=0)
    u, _, vt = np.linalg.svd(mean_r)
    r = u @ np.diag([1.0, 1.0, np.linalg.det(u @ vt)]) @ vt
    out = np.eye(4)
    out[:3, :3] = r
    out[:3, 3] = np.mean([p[:3, 3] for p in poses], axis=0)
    return out


def _spread(poses: list[np.ndarray], mean: np.ndarray) -> tuple[float, float]:
    from robotft.real_robot.fiducial import rotation_angle_deg

    d = [np.linalg.norm(p[:3, 3] - mean[:3, 3]) for p in poses]
    a = [rotation_angle_deg(p[:3, :3], mean[:3, :3]) for p in poses]
    return float(np.sqrt(np.mean(np.square(d))) * 1e3), float(np.sqrt(np.mean(np.square(a))))


def solve_hand_eye(
    base_from_gripper: list[np.ndarray],
    corners: list[np.ndarray],
    detector: MarkerDetector,
    marker_size_m: float,
    iterations: int = 50,
) -> HandEyeResult:
    """`base_from_camera` from N views: TCP poses `[4, 4]` and the marker's corners `[4, 2]` (pixels).

    Park & Martin's closed form (`cv2.calibrateHandEye`), then Levenberg-Marquardt on the corners'
    reprojection error over both unknowns (up to `iterations` steps).
    """
    from robotft.real_robot.fiducial import import_cv2, transform_from_matrix

    cv2 = import_cv2()
    if len(base_from_gripper) < 3:
        raise ValueError(
            f"hand-eye calibration needs the marker in at least 3 views, got {len(base_from_gripper)}"
        )
    cam_from_marker = [detector.marker_pose(c, marker_size_m)[0] for c in corners]
    gripper_from_base = [np.linalg.inv(t) for t in base_from_gripper]
    r, t = cv2.calibrateHandEye(
        [g[:3, :3] for g in gripper_from_base],
        [g[:3, 3] for g in gripper_from_base],
        [c[:3, :3] for c in cam_from_marker],
        [c[:3, 3] for c in cam_from_marker],
        method=cv2.CALIB_HAND_EYE_PARK,
    )
    base_from_camera = np.eye(4)
    base_from_camera[:3, :3], base_from_camera[:3, 3] = r, np.ravel(t)
    per_view = [g @ base_from_camera @ c for g, c in zip(gripper_from_base, cam_from_marker, strict=True)]
    problem = _ReprojectionProblem(cv2, detector, base_from_gripper, corners, marker_size_m)
    base_from_camera, gripper_from_marker = problem.solve(
        base_from_camera, average_pose(per_view), iterations
    )
    per_view = [g @ base_from_camera @ c for g, c in zip(gripper_from_base, cam_from_marker, strict=True)]
    spread_mm, spread_deg = _spread(per_view, gripper_from_marker)
    rms = float(
        np.sqrt(np.mean(np.square(problem.residuals(base_from_camera, gripper_from_marker)))) * np.sqrt(2)
    )
    return HandEyeResult(
        transform_from_matrix(base_from_camera),
        transform_from_matrix(gripper_from_marker),
        len(corners),
        spread_mm,
        spread_deg,
        rms,
    )


class _ReprojectionProblem:
    """Corners' reprojection residuals as a function of `base_from_camera` X and `gripper_from_marker`
    Y, minimized by Levenberg-Marquardt (Marquardt 1963) with a central-difference Jacobian over the 12
    parameters (rotation vector and translation of each)."""

    def __init__(self, cv2: Any, detector: MarkerDetector, base_from_gripper, corners, marker_size_m: float):
        from robotft.real_robot.fiducial import marker_corners

        self.cv2 = cv2
        self.k, self.dist = detector.intrinsics.matrix, detector.dist
        self.base_from_gripper = base_from_gripper
        self.pixels = np.concatenate(corners)
        self.square = np.c_[marker_corners(marker_size_m), np.ones(4)].T  # [4, 4] homogeneous columns

    def _pose(self, x: np.ndarray) -> np.ndarray:
        out = np.eye(4)
        out[:3, :3], _ = self.cv2.Rodrigues(x[:3])
        out[:3, 3] = x[3:]
        return out

    def _params(self, pose: np.ndarray) -> np.ndarray:
        rvec, _ = self.cv2.Rodrigues(pose[:3, :3])
        return np.concatenate([rvec.ravel(), pose[:3, 3]])

    def residuals(self, base_from_camera: np.ndarray, gripper_from_marker: np.ndarray) -> np.ndarray:
        camera_from_base = np.linalg.inv(base_from_camera)
        points = np.concatenate(
            [(b @ gripper_from_marker @ self.square)[:3].T for b in self.base_from_gripper]
        )
        rvec, _ = self.cv2.Rodrigues(camera_from_base[:3, :3])
        proj, _ = self.cv2.projectPoints(points, rvec, camera_from_base[:3, 3], self.k, self.dist)
        return (proj.reshape(-1, 2) - self.pixels).ravel()

    def solve(self, x0: np.ndarray, y0: np.ndarray, iterations: int) -> tuple[np.ndarray, np.ndarray]:
        def res(p: np.ndarray) -> np.ndarray:
            return self.residuals(self._pose(p[:6]), self._pose(p[6:]))

        p = np.concatenate([self._params(x0), self._params(y0)])
        r = res(p)
        lam, eps = 1e-3, 1e-7
        for _ in range(iterations):
            jac = np.stack([(res(p + eps * e) - res(p - eps * e)) / (2 * eps) for e in np.eye(12)], axis=1)
            jtj, g = jac.T @ jac, jac.T @ r
            while lam < 1e8:
                step = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj)), -g)
                r_new = res(p + step)
                if r_new @ r_new < r @ r:
                    p, r, lam = p + step, r_new, max(lam / 10, 1e-9)
                    break
                lam *= 10
            else:
                break
            if np.linalg.norm(step) < 1e-10:
                break
        return self._pose(p[:6]), self._pose(p[6:])


def sample_tcp_poses(
    centre: np.ndarray, quat: np.ndarray, config: CalibrationConfig
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`config.poses` TCP targets: the centre plus uniform offsets, the orientation `quat` rotated about
    a random axis by up to `rot_range_deg` (distinct axes make the hand-eye problem well posed)."""
    rng = np.random.default_rng(config.seed)
    out = []
    for _ in range(config.poses):
        pos = centre + rng.uniform(-1.0, 1.0, 3) * config.pos_range_m
        axis = rng.normal(size=3)
        axis /= np.linalg.norm(axis)
        angle = math.radians(config.rot_range_deg) * rng.uniform(0.3, 1.0)
        dq = np.array([math.cos(angle / 2), *(math.sin(angle / 2) * axis)])
        out.append((pos, quat_multiply(dq, quat)))
    return out


# ---- moving the arm and measuring --------------------------------------------------------------------------


def _slerp(q0: np.ndarray, q1: np.ndarray, f: float) -> np.ndarray:
    d = float(np.dot(q0, q1))
    if d < 0:
        q1, d = -q1, -d
    if d > 0.9995:
        q = q0 + f * (q1 - q0)
        return q / np.linalg.norm(q)
    theta = math.acos(d)
    return (math.sin((1 - f) * theta) * q0 + math.sin(f * theta) * q1) / math.sin(theta)


def move_to(robot: Robot, camera: Camera, pos: np.ndarray, quat: np.ndarray, control_hz: float) -> None:
    """Move the TCP to `(pos, quat)` in steps within the safety layer's per-command limits, at
    `control_hz`, keeping the watchdog fed (this script is the "policy"; the camera's frames its own)."""
    limits = robot.safety.limits
    state = robot.get_observation()
    start_pos, start_quat = state.ee_pos, state.ee_quat
    if np.dot(start_quat, quat) < 0:
        quat = -quat
    angle = 2 * math.acos(min(1.0, abs(float(np.dot(start_quat, quat)))))
    steps = max(
        1,
        math.ceil(np.linalg.norm(pos - start_pos) / (0.8 * limits.max_ee_step_m)),
        math.ceil(angle / (0.8 * limits.max_rot_step_rad)),
    )
    dt = 1.0 / control_hz
    for k in range(1, steps + 1):
        f = k / steps
        now = time.monotonic()
        robot.safety.watchdog.heartbeat("policy", now)
        frame = camera.latest()
        if frame is not None and camera.name in robot.safety.watchdog.timeouts_s:
            robot.safety.watchdog.heartbeat(camera.name, frame.capture_time_s)
        target_pos = start_pos + f * (pos - start_pos)
        target_quat = _slerp(start_quat, quat, f)
        robot.send_action(_ee_command(now + dt, state.gripper_width, target_pos, target_quat))
        time.sleep(max(0.0, now + dt - time.monotonic()))


def _ee_command(timestamp: float, width: float, pos: np.ndarray, quat: np.ndarray) -> Any:
    from robotft.real_robot.robot import RobotCommand

    return RobotCommand("ee_pose", timestamp, width, ee_pos=pos, ee_quat=quat)


_STILL_MM = 0.05
"""The TCP moved less than this (mm) from before to after the frame: the view shows the measured pose."""


def still_view(robot: Robot, camera: Camera, timeout_s: float = 10.0) -> tuple[Any, Any]:
    """A robot state and a camera frame of the arm at rest: the frame is captured after the state was
    read, and the TCP has not moved (`_STILL_MM`) between that state and one read after the frame."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = robot.get_observation()
        frame = camera.read(timeout_s=5.0)
        while frame.capture_time_s < state.timestamp_s:
            frame = camera.read(timeout_s=5.0)
        after = robot.get_observation()
        if np.linalg.norm(after.ee_pos - state.ee_pos) * 1e3 < _STILL_MM:
            return after, frame
        if time.monotonic() > deadline:
            raise TimeoutError(f"the arm did not come to rest within {timeout_s} s")


def collect_views(
    robot: Robot, camera: Camera, config: CalibrationConfig, control_hz: float
) -> tuple[list[np.ndarray], list[np.ndarray], list[dict[str, Any]]]:
    """Visit the poses; returns `base_from_gripper [4, 4]` and marker corners `[4, 2]` per view in which
    the marker was seen, and a record of every pose (seen or not)."""
    from robotft.real_robot.fiducial import MarkerDetector

    detector = MarkerDetector(config.dictionary, camera.intrinsics)  # type: ignore[attr-defined]
    start = robot.get_observation()
    centre = np.asarray(config.centre, dtype=np.float64) if config.centre else start.ee_pos.copy()
    targets = sample_tcp_poses(centre, start.ee_quat, config)
    poses, corners, record = [], [], []
    for i, (pos, quat) in enumerate(targets):
        move_to(robot, camera, pos, quat, control_hz)
        time.sleep(config.settle_s)
        state, frame = still_view(robot, camera)
        found = detector.detect(frame.color).get(config.marker_id)
        record.append(
            {
                "pose": i,
                "ee_pos": state.ee_pos.tolist(),
                "ee_quat": state.ee_quat.tolist(),
                "corners": None if found is None else found.tolist(),
            }
        )
        if found is None:
            log.warning("pose %d/%d: marker %d not seen", i + 1, len(targets), config.marker_id)
            continue
        poses.append(_matrix(state.ee_pos, state.ee_quat))
        corners.append(found)
        log.info("pose %d/%d: marker seen", i + 1, len(targets))
    move_to(robot, camera, start.ee_pos, start.ee_quat, control_hz)
    return poses, corners, record


def calibrate_camera(
    robot: Robot, camera: Camera, config: CalibrationConfig, control_hz: float = 20.0
) -> HandEyeResult:
    """Move the connected `robot` through the poses, watching the hand's marker with the connected
    `camera`, and solve for the camera's `base_from_camera`."""
    from robotft.real_robot.fiducial import MarkerDetector

    robot.safety.reset()
    poses, corners, record = collect_views(robot, camera, config, control_hz)
    if len(poses) < 3:
        raise RuntimeError(
            f"marker {config.marker_id} was seen in {len(poses)} of {config.poses} poses (3 needed): check that "
            f"camera {camera.name!r} sees the hand, the marker id/dictionary ({config.dictionary}) and lighting"
        )
    detector = MarkerDetector(config.dictionary, camera.intrinsics)  # type: ignore[attr-defined]
    result = solve_hand_eye(poses, corners, detector, config.marker_size_m)
    result.samples = record
    return result


# ---- the rig preset --------------------------------------------------------------------------------------


def extrinsics_yaml(t: Transform) -> str:
    """`{pos: [...], quat: [...]}` (flow YAML, 0.1 mm and 1e-5 resolution)."""
    pos = ", ".join(f"{v:.4f}" for v in t.pos)
    quat = ", ".join(f"{v:.5f}" for v in t.quat)
    return f"{{pos: [{pos}], quat: [{quat}]}}"


def write_extrinsics(preset: Path, camera: str, t: Transform, note: str) -> str:
    """The preset's text with camera `camera`'s `base_from_camera` replaced (or added) by `t`, comments
    and layout kept. Raises ValueError when the camera entry is not found."""
    lines = preset.read_text().splitlines(keepends=True)
    start = next(
        (
            i
            for i, line in enumerate(lines)
            if re.match(rf"^(\s*)-\s+name:\s*['\"]?{re.escape(camera)}['\"]?\s*(#.*)?$", line)
        ),
        None,
    )
    if start is None:
        raise ValueError(
            f"{preset}: no camera entry `- name: {camera}` (cameras are listed as `- name: ...`)"
        )
    indent = len(lines[start]) - len(lines[start].lstrip()) + 2
    value = f"{' ' * indent}base_from_camera: {extrinsics_yaml(t)}   # {note}\n"
    end = start + 1
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) >= indent
    ):
        if re.match(rf"^\s{{{indent}}}base_from_camera:", lines[end]):
            lines[end] = value
            return "".join(lines)
        end += 1
    lines.insert(start + 1, value)
    return "".join(lines)


# ---- the command line ------------------------------------------------------------------------------------


def add_cli(sub: Any) -> None:
    """Register `robotft calibrate` on the CLI's subparsers."""
    p = sub.add_parser(
        "calibrate", help="hand-eye calibration of a rig camera's base_from_camera (marker on the hand)"
    )
    p.add_argument("--rig", required=True, help="rig preset, e.g. real_robot/franka_d435.yaml")
    p.add_argument("--camera", default="base", help="the (static) rig camera to calibrate")
    p.add_argument("--marker-id", type=int, default=0, help="id of the ArUco marker fixed to the hand")
    p.add_argument("--marker-size", type=float, required=True, help="side of its black square as printed (m)")
    p.add_argument("--dictionary", default="DICT_4X4_50", help="its OpenCV dictionary")
    p.add_argument("--poses", type=int, default=15, help="TCP poses to visit")
    p.add_argument("--pos-range", type=float, default=0.08, help="+- offsets of the poses per axis (m)")
    p.add_argument("--rot-range", type=float, default=20.0, help="rotations of the poses up to (degrees)")
    p.add_argument("--settle", type=float, default=0.5, help="wait at each pose before measuring (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", action="store_true", help="write the result into the rig preset file")
    p.add_argument("--out", default=None, help="also save the views and the result as JSON here")
    p.add_argument("--yes", action="store_true", help="on a real robot, start moving without asking first")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.config import ConfigError, find_preset
    from robotft.real_robot.deploy import make_devices
    from robotft.real_robot.latency import atomic_write
    from robotft.real_robot.rig import load_rig
    from robotft.real_robot.safety import SafetyLayer

    if extra:
        raise ConfigError(f"calibrate: unexpected arguments {extra}")
    rig = load_rig(args.rig)
    if args.camera not in {c.name for c in rig.cameras}:
        raise ConfigError(
            f"calibrate: camera {args.camera!r} is not one of {[c.name for c in rig.cameras]} in {args.rig}"
        )
    config = CalibrationConfig(
        camera=args.camera,
        marker_id=args.marker_id,
        marker_size_m=args.marker_size,
        dictionary=args.dictionary,
        poses=args.poses,
        pos_range_m=args.pos_range,
        rot_range_deg=args.rot_range,
        settle_s=args.settle,
        seed=args.seed,
    )
    if not rig.simulated and not args.yes:
        # The arm moves on its own: a person must be at the stop button and see the space is clear.
        input(
            f"the arm will visit {config.poses} poses within +-{config.pos_range_m} m and {config.rot_range_deg} deg "
            "of where its TCP is now; clear the space, hold the stop button, press Enter to start"
        )
    rig.cameras = [c for c in rig.cameras if c.name == args.camera]
    safety = SafetyLayer(rig.safety, 1.0 / rig.control_hz, cameras=[args.camera])
    robot, cameras = make_devices(rig, safety)
    with robot, cameras[args.camera] as camera:
        result = calibrate_camera(robot, camera, config, rig.control_hz)
    summary = {
        "base_from_camera": {
            "pos": list(result.base_from_camera.pos),
            "quat": list(result.base_from_camera.quat),
        },
        "gripper_from_marker": {
            "pos": list(result.gripper_from_marker.pos),
            "quat": list(result.gripper_from_marker.quat),
        },
        "views": result.views,
        "spread_mm": result.spread_mm,
        "spread_deg": result.spread_deg,
        "reprojection_px": result.reprojection_px,
    }
    print(f"base_from_camera: {extrinsics_yaml(result.base_from_camera)}", file=sys.stderr)
    print(
        f"{result.views}/{config.poses} views; marker-on-hand spread {result.spread_mm:.2f} mm / "
        f"{result.spread_deg:.2f} deg; reprojection {result.reprojection_px:.3f} px",
        file=sys.stderr,
    )
    if args.write:
        path = Path(args.rig) if Path(args.rig).is_file() else find_preset("real_robot", args.rig)
        note = f"robotft calibrate {datetime.date.today()}: {result.views} views, {result.reprojection_px:.2f} px"
        atomic_write(path, write_extrinsics(path, args.camera, result.base_from_camera, note).encode())
        print(f"wrote base_from_camera of camera {args.camera!r} into {path}", file=sys.stderr)
    if args.out:
        atomic_write(Path(args.out), json.dumps({**summary, "samples": result.samples}, indent=2).encode())
    print(json.dumps(summary))
    return 0
