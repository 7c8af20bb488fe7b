"""Object poses from printed ArUco markers seen by a rig camera (the `fiducial` object-pose source).

Each tracked object carries one or more markers at measured offsets (`object_from_marker`). For every
new frame of the configured camera:

1. `cv2.aruco.ArucoDetector` finds the markers; each corner is then re-estimated as the intersection
   of two sides of the black square, lines fitted to sub-pixel edge points (`refine_corners`).
2. Per object, each visible marker gives `camera_from_marker` by `SOLVEPNP_IPPE_SQUARE` (Collins &
   Bartoli 2014, "Infinitesimal Plane-Based Pose Estimation"); markers that reproject poorly or are
   seen nearly edge-on are left out. With one marker, the lower-error one of IPPE's two solutions is the
   pose; with several, all their corners (non-coplanar on a cube) in the object frame are fitted jointly
   by Levenberg-Marquardt (`solvePnPRefineLM`), started from every single-marker solution.
3. `base_from_object = base_from_camera * camera_from_object`, with the rig camera's extrinsics
   (`robotft calibrate` measures them, robotft.real_robot.calibrate).

A marker missing from a frame (occluded by the gripper, motion blur) does not stop the arm at once: the
object's last pose is held, reported as fresh as the newest frame, for `max_hold_s`. After that the pose
keeps the capture time of the frame that last saw it, so it ages like a stalled camera's frame and the
runner holds the arm (`max_age_s`, as for camera frames) until the marker is seen again.

cv2 is imported lazily (opencv-python >= 4.7 ships the `cv2.aruco` module in the main package).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from robotft.optional import require
from robotft.real_robot.sim_scene import ObjectPose
from robotft.real_robot.transforms import Transform

if TYPE_CHECKING:
    from robotft.real_robot.camera import Camera, Frame
    from robotft.real_robot.intrinsics import CameraIntrinsics

log = logging.getLogger(__name__)


def import_cv2() -> Any:
    """`import cv2`, checking that it has the ArUco module (opencv-python >= 4.7)."""
    cv2 = require("cv2", None, "fiducial markers", what="OpenCV", install="pip install 'opencv-python<4.12'")
    if not hasattr(cv2, "aruco") or not hasattr(cv2.aruco, "ArucoDetector"):
        raise ImportError(
            f"OpenCV {cv2.__version__} has no cv2.aruco.ArucoDetector; install opencv-python>=4.7,<4.12"
        )
    return cv2


def aruco_dictionary(name: str) -> Any:
    """The predefined dictionary `cv2.aruco.<name>` (e.g. `DICT_4X4_50`, `DICT_APRILTAG_36h11`)."""
    cv2 = import_cv2()
    if not name.startswith("DICT_") or not hasattr(cv2.aruco, name):
        names = sorted(n for n in dir(cv2.aruco) if n.startswith("DICT_"))
        raise ValueError(f"ArUco dictionary {name!r} is unknown; OpenCV has {names}")
    return cv2.aruco.getPredefinedDictionary(getattr(cv2.aruco, name))


def marker_corners(size_m: float) -> np.ndarray:
    """Corners `[4, 3]` of a square marker of side `size_m` in its own frame, in the detector's order
    (top-left, top-right, bottom-right, bottom-left of the printed image; x right, y up, z out)."""
    h = size_m / 2
    return np.array([[-h, h, 0.0], [h, h, 0.0], [h, -h, 0.0], [-h, -h, 0.0]])


def matrix_from_transform(t: Transform) -> np.ndarray:
    """Homogeneous `[4, 4]` matrix of a `Transform`."""
    from robotft.real_robot.transforms import quat_to_matrix

    out = np.eye(4)
    out[:3, :3] = quat_to_matrix(np.asarray(t.quat))
    out[:3, 3] = t.pos
    return out


def transform_from_matrix(m: np.ndarray) -> Transform:
    """`Transform` of a homogeneous `[4, 4]` matrix (rotation part orthonormal)."""
    return Transform(tuple(float(x) for x in m[:3, 3]), tuple(float(x) for x in quat_from_matrix(m[:3, :3])))


def quat_from_matrix(r: np.ndarray) -> np.ndarray:
    """Unit quaternion `[w, x, y, z]` (w >= 0) of a rotation matrix `[3, 3]` (Shepperd's method)."""
    r = np.asarray(r, dtype=np.float64)
    tr = np.trace(r)
    candidates = np.array([tr, r[0, 0], r[1, 1], r[2, 2]])
    i = int(np.argmax(candidates))
    if i == 0:
        s = 2.0 * np.sqrt(1.0 + tr)
        q = [s / 4, (r[2, 1] - r[1, 2]) / s, (r[0, 2] - r[2, 0]) / s, (r[1, 0] - r[0, 1]) / s]
    else:
        j, k = (i % 3) + 1, ((i + 1) % 3) + 1
        a, b, c = i - 1, j - 1, k - 1
        s = 2.0 * np.sqrt(1.0 + r[a, a] - r[b, b] - r[c, c])
        q = [0.0] * 4
        q[0] = (r[c, b] - r[b, c]) / s
        q[i] = s / 4
        q[j] = (r[b, a] + r[a, b]) / s
        q[k] = (r[c, a] + r[a, c]) / s
    q = np.asarray(q)
    q /= np.linalg.norm(q)
    return q if q[0] >= 0 else -q


def rotation_angle_deg(r1: np.ndarray, r2: np.ndarray) -> float:
    """Angle (degrees) of the rotation taking `r1 [3, 3]` to `r2 [3, 3]`."""
    cos = (np.trace(np.asarray(r1).T @ np.asarray(r2)) - 1.0) / 2.0
    return float(np.degrees(np.arccos(np.clip(cos, -1.0, 1.0))))


# ---- configs -------------------------------------------------------------------------------------------


@dataclass
class MarkerConfig:
    """One printed marker on an object."""

    object: str
    """The object it is glued to (a name in the rig's `objects`)."""
    id: int
    """Marker id in the dictionary."""
    size_m: float
    """Side of the black square as printed (m); measure it on the print, printers rescale."""
    object_from_marker: Transform = field(default_factory=Transform)
    """The marker frame (centre; x right, y up the printed image, z out of the face) in the object
    frame, e.g. `{pos: [0, 0, 0.02]}` for a marker centred on top of a 4 cm cube."""

    def __post_init__(self) -> None:
        if not self.size_m > 0 or self.id < 0:
            raise ValueError(
                f"marker {self.id} on {self.object!r}: needs size_m > 0 and id >= 0, got {self.size_m}"
            )


@dataclass
class FiducialConfig:
    """The `fiducial` object-pose source: markers on objects, seen by one rig camera.

    Example (YAML in a rig preset):
        object_poses:
          type: fiducial
          config:
            camera: base
            dictionary: DICT_4X4_50
            markers:
              - {object: cube, id: 0, size_m: 0.03, object_from_marker: {pos: [0.0, 0.0, 0.02]}}
    """

    camera: str = "base"
    """The rig camera whose frames are searched; its `base_from_camera` places the poses."""
    dictionary: str = "DICT_4X4_50"
    """OpenCV predefined dictionary of the printed markers (`DICT_APRILTAG_36h11` for AprilTags)."""
    markers: list[MarkerConfig] = field(default_factory=list)
    """The markers; an object may carry several (their corners are solved together)."""
    max_hold_s: float = 0.3
    """An object whose markers are not seen keeps its last pose this long (s), then goes stale."""
    max_age_s: float = 0.15
    """A pose older than this (s) at a control tick holds the arm, like a stale camera frame."""
    max_reprojection_px: float = 0.5
    """A marker whose corners reproject farther than this (pixels, RMS) from its fitted square is left
    out (a misread id, a partly hidden marker)."""
    max_view_angle_deg: float = 60.0
    """Markers seen more obliquely than this (degrees from head-on) are left out: foreshortened to a few
    pixels across, they pull the pose off."""

    def __post_init__(self) -> None:
        if not self.markers:
            raise ValueError("fiducial source: `markers` must list at least one {object, id, size_m}")
        ids = [m.id for m in self.markers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"fiducial source: marker ids must be unique, got {ids}")
        for name in ("max_hold_s", "max_age_s", "max_reprojection_px", "max_view_angle_deg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fiducial source: {name} must be > 0, got {getattr(self, name)}")

    @property
    def objects(self) -> list[str]:
        """The objects the markers are on, in first-listed order."""
        return list(dict.fromkeys(m.object for m in self.markers))


# ---- detection and pose ----------------------------------------------------------------------------------


class MarkerDetector:
    """ArUco detection and per-object PnP in one camera's images (no state between frames)."""

    def __init__(self, dictionary: str, intrinsics: CameraIntrinsics) -> None:
        cv2 = self._cv2 = import_cv2()
        params = cv2.aruco.DetectorParameters()
        params.cornerRefinementMethod = cv2.aruco.CORNER_REFINE_SUBPIX
        self._detector = cv2.aruco.ArucoDetector(aruco_dictionary(dictionary), params)
        self.intrinsics = intrinsics
        self.dist = distortion_coefficients(intrinsics)
        """OpenCV distortion coefficients of the stream."""

    def detect(self, rgb: np.ndarray) -> dict[int, np.ndarray]:
        """Corners `[4, 2]` (pixels, detector order) of each marker id found in an RGB image, refined by
        `refine_corners`."""
        gray = self._cv2.cvtColor(np.ascontiguousarray(rgb), self._cv2.COLOR_RGB2GRAY)
        corners, ids, _ = self._detector.detectMarkers(gray)
        if ids is None:
            return {}
        gray_f = gray.astype(np.float32)
        return {
            int(i): refine_corners(self._cv2, gray_f, c.reshape(4, 2).astype(np.float64))
            for i, c in zip(ids.ravel(), corners, strict=True)
        }

    def marker_pose(self, corners: np.ndarray, size_m: float) -> tuple[np.ndarray, float]:
        """`camera_from_marker [4, 4]` of one square marker and its RMS reprojection error (pixels): the
        better of IPPE's two solutions."""
        return min(self.marker_poses(corners, size_m), key=lambda s: s[1])

    def marker_poses(self, corners: np.ndarray, size_m: float) -> list[tuple[np.ndarray, float]]:
        """Both IPPE solutions `(camera_from_marker, RMS px)`: a small or distant square is ambiguous
        (the two reproject almost equally well), so either may be the true one."""
        cv2 = self._cv2
        n, rvecs, tvecs, errors = cv2.solvePnPGeneric(
            marker_corners(size_m), corners, self.intrinsics.matrix, self.dist, flags=cv2.SOLVEPNP_IPPE_SQUARE
        )
        return [(_pose(cv2, rvecs[i], tvecs[i]), float(np.ravel(errors)[i])) for i in range(n)]

    def object_pose(
        self, points_obj: np.ndarray, pixels: np.ndarray, guess: np.ndarray
    ) -> tuple[np.ndarray, float]:
        """`camera_from_object [4, 4]` refined by Levenberg-Marquardt over all corners of an object's
        visible markers (`points_obj [N, 3]` in the object frame, `pixels [N, 2]`) from `guess`."""
        cv2 = self._cv2
        rvec, _ = cv2.Rodrigues(guess[:3, :3])
        rvec, tvec = cv2.solvePnPRefineLM(
            points_obj, pixels, self.intrinsics.matrix, self.dist, rvec, guess[:3, 3].copy()
        )
        pose = _pose(cv2, rvec, tvec)
        return pose, self.reprojection_rms(points_obj, pixels, pose)

    def reprojection_rms(
        self, points: np.ndarray, pixels: np.ndarray, camera_from_points: np.ndarray
    ) -> float:
        """RMS distance (pixels) between `pixels` and `points` projected through `camera_from_points`."""
        rvec, _ = self._cv2.Rodrigues(camera_from_points[:3, :3])
        proj, _ = self._cv2.projectPoints(
            points, rvec, camera_from_points[:3, 3], self.intrinsics.matrix, self.dist
        )
        return float(np.sqrt(np.mean(np.sum((proj.reshape(-1, 2) - pixels) ** 2, axis=1))))


_EDGE_SAMPLES = 24
"""Points sampled along each side of the marker's black square."""
_EDGE_INLIER_PX = 0.3
"""Edge points farther than this (pixels) from the first line fit are left out of the second."""
_PROFILE = np.linspace(-2.5, 2.5, 21)
"""Offsets (pixels) along a side's normal at which the intensity profile is read."""


def refine_corners(cv2: Any, gray: np.ndarray, corners: np.ndarray) -> np.ndarray:
    """Corners `[4, 2]` re-estimated as intersections of the black square's four sides, each a line
    fitted to the sub-pixel edge points along it.

    Corner-window refinement (`cornerSubPix`) pulls the corners of a small marker a few tenths of a
    pixel inward (the data cells next to a corner add edges to its window), which at 30-50 pixels per
    marker is a 1-2 % scale error, i.e. 10-20 mm of depth at 0.8 m. A side instead has tens of edge
    points against the white quiet zone: along the normal of each sampled point the edge is the peak of
    the intensity gradient (parabolic interpolation); a least-squares line through them is accurate to a
    few hundredths of a pixel. Returns the input where a side is too short or an edge is not found.
    """
    lines = []
    for k in range(4):
        a, b = corners[k], corners[(k + 1) % 4]
        length = np.linalg.norm(b - a)
        if length < 8:
            return corners
        direction = (b - a) / length
        normal = np.array([-direction[1], direction[0]])
        ts = np.linspace(0.15, 0.85, _EDGE_SAMPLES)
        base = a[None] + ts[:, None] * (b - a)[None]
        pts = base[:, None, :] + _PROFILE[None, :, None] * normal[None, None, :]
        xy = pts.reshape(-1, 2).astype(np.float32)
        prof = cv2.remap(gray, xy[:, 0].reshape(1, -1), xy[:, 1].reshape(1, -1), cv2.INTER_LINEAR)
        # The detector lists corners clockwise in the image, so `normal` points into the square: across
        # the outer edge the intensity falls (white quiet zone to black border). The border's inner edge
        # (black to a white data cell) rises, and is ignored.
        grad = np.maximum(-np.diff(prof.reshape(_EDGE_SAMPLES, -1), axis=1), 0.0)
        i = np.clip(np.argmax(grad, axis=1), 1, grad.shape[1] - 2)
        rows = np.arange(_EDGE_SAMPLES)
        g0, g1, g2 = grad[rows, i - 1], grad[rows, i], grad[rows, i + 1]
        denom = g0 - 2 * g1 + g2
        offset = np.where(np.abs(denom) > 1e-9, 0.5 * (g0 - g2) / np.where(denom == 0, 1, denom), 0.0)
        step = _PROFILE[1] - _PROFILE[0]
        # diff() puts the gradient between samples i and i+1: its position is the midpoint.
        along_normal = _PROFILE[0] + (i + 0.5 + offset) * step
        ok = g1 > 0.25 * g1.max()
        if ok.sum() < _EDGE_SAMPLES // 2:
            return corners
        edge = base[ok] + along_normal[ok, None] * normal[None]
        n, c = _fit_line(edge)
        inliers = np.abs(edge @ n - c) < _EDGE_INLIER_PX  # e.g. a point where a neighbour's edge is near
        if inliers.sum() < _EDGE_SAMPLES // 2:
            return corners
        lines.append(_fit_line(edge[inliers]))
    return np.array([_intersect(lines[(k - 1) % 4], lines[k]) for k in range(4)])


def _fit_line(points: np.ndarray) -> tuple[np.ndarray, float]:
    """Total-least-squares line `n . p = c` through `points [N, 2]`: `(n [2], c)`."""
    centre = points.mean(axis=0)
    _, _, vt = np.linalg.svd(points - centre)
    n = vt[1]
    return n, float(n @ centre)


def _intersect(l1: tuple[np.ndarray, float], l2: tuple[np.ndarray, float]) -> np.ndarray:
    return np.linalg.solve(np.stack([l1[0], l2[0]]), np.array([l1[1], l2[1]]))


def _pose(cv2: Any, rvec: np.ndarray, tvec: np.ndarray) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3], _ = cv2.Rodrigues(np.asarray(rvec, dtype=np.float64))
    out[:3, 3] = np.ravel(tvec)
    return out


def distortion_coefficients(intrinsics: CameraIntrinsics) -> np.ndarray:
    """OpenCV distortion coefficients `(k1, k2, p1, p2, k3)` of a stream.

    RealSense colour streams report `inverse_brown_conrady` or `brown_conrady` with zero coefficients
    (the images are rectified on the device); OpenCV's model is Brown-Conrady, so only that one, or
    all-zero coefficients, can be used as they are.
    """
    coeffs = np.asarray(intrinsics.coeffs, dtype=np.float64)
    if intrinsics.model in ("none", "brown_conrady") or not np.any(coeffs):
        return coeffs if intrinsics.model == "brown_conrady" else np.zeros(5)
    raise ValueError(
        f"camera distortion model {intrinsics.model!r} with coefficients {list(coeffs)} is not OpenCV's "
        "Brown-Conrady model; stream a rectified colour image (RealSense colour streams are)"
    )


def estimate_object_poses(
    detector: MarkerDetector,
    corners: dict[int, np.ndarray],
    markers: Sequence[MarkerConfig],
    max_rms_px: float,
    max_view_angle_deg: float,
) -> dict[str, np.ndarray]:
    """`{object: camera_from_object [4, 4]}` for each object with a usable marker.

    Each visible marker gives a pose by IPPE; markers that reproject worse than `max_rms_px` (a misread
    id, a partly hidden marker) or are seen more obliquely than `max_view_angle_deg` (few pixels across,
    poorly conditioned) are left out. With one usable marker its better IPPE solution is the pose; with
    several, a joint fit over all their corners, kept when it reprojects within `max_rms_px`.
    """
    usable: dict[str, list[tuple[float, MarkerConfig, list[np.ndarray]]]] = {}
    for m in markers:
        if m.id not in corners:
            continue
        solutions = sorted(detector.marker_poses(corners[m.id], m.size_m), key=lambda s: s[1])
        cam_from_marker, rms = solutions[0]
        angle = view_angle_deg(cam_from_marker)
        if rms > max_rms_px or angle > max_view_angle_deg:
            log.debug(
                "marker %d on %r left out: RMS %.2f px, view angle %.0f deg", m.id, m.object, rms, angle
            )
            continue
        marker_from_object = np.linalg.inv(matrix_from_transform(m.object_from_marker))
        usable.setdefault(m.object, []).append((rms, m, [p @ marker_from_object for p, _ in solutions]))
    out = {}
    for obj, seen in usable.items():
        out[obj] = min(seen, key=lambda s: s[0])[2][0]
        if len(seen) > 1:
            # Every IPPE solution of every marker seeds the joint fit: one marker's better-reprojecting
            # solution can be the mirrored one, and a fit started there stays in the wrong minimum.
            points = np.concatenate([_corners_in_object(m) for _, m, _ in seen])
            pixels = np.concatenate([corners[m.id] for _, m, _ in seen])
            fits = [detector.object_pose(points, pixels, seed) for _, _, seeds in seen for seed in seeds]
            joint, joint_rms = min(fits, key=lambda f: f[1])
            if joint_rms <= max_rms_px:
                out[obj] = joint
    return out


def view_angle_deg(camera_from_marker: np.ndarray) -> float:
    """Angle (degrees) between a marker's face normal and the line of sight to its centre (0: head-on)."""
    centre = camera_from_marker[:3, 3]
    cos = -camera_from_marker[:3, 2] @ centre / np.linalg.norm(centre)
    return float(np.degrees(np.arccos(np.clip(cos, -1.0, 1.0))))


def _corners_in_object(m: MarkerConfig) -> np.ndarray:
    t = matrix_from_transform(m.object_from_marker)
    return marker_corners(m.size_m) @ t[:3, :3].T + t[:3, 3]


# ---- the pose source -------------------------------------------------------------------------------------


class FiducialPoseSource:
    """Object poses (robot base frame) from markers in one camera's frames; an `object_poses()` source
    for the runner, like the simulated scene's.

    `connect()` starts a thread that processes every new frame of `camera`; `update(frame)` processes
    one frame synchronously (tests, calibration scripts).

    Example:
        source = FiducialPoseSource(cfg, camera, base_from_camera)
        with camera, source:
            cube = source.object_poses()["cube"]        # ObjectPose(timestamp_s, pos, quat)
    """

    def __init__(
        self,
        config: FiducialConfig,
        camera: Camera,
        base_from_camera: Transform,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.camera = camera
        self.base_from_camera = matrix_from_transform(base_from_camera)
        self.clock = clock
        self.max_age_s = config.max_age_s
        """Age (s) beyond which a pose at a control tick holds the arm."""
        self._detector: MarkerDetector | None = None
        self._seen: dict[str, ObjectPose] = {}
        """Last measured pose per object (base frame), stamped with the capture time of its frame."""
        self._last_frame_time = -np.inf
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    @property
    def objects(self) -> list[str]:
        return self.config.objects

    def update(self, frame: Frame) -> dict[str, ObjectPose]:
        """Detect the markers in `frame` and update the tracks; returns the poses measured in it."""
        if self._detector is None:
            # The camera's intrinsics are known once it streams (a RealSense reports them on connect).
            self._detector = MarkerDetector(self.config.dictionary, self.camera.intrinsics)  # type: ignore[attr-defined]
        corners = self._detector.detect(frame.color)
        cfg = self.config
        found = estimate_object_poses(
            self._detector, corners, cfg.markers, cfg.max_reprojection_px, cfg.max_view_angle_deg
        )
        measured = {}
        for obj, cam_from_obj in found.items():
            base_from_obj = self.base_from_camera @ cam_from_obj
            measured[obj] = ObjectPose(
                frame.capture_time_s, base_from_obj[:3, 3].copy(), quat_from_matrix(base_from_obj[:3, :3])
            )
        with self._lock:
            self._last_frame_time = max(self._last_frame_time, frame.capture_time_s)
            for obj, pose in measured.items():
                self._seen[obj] = pose
        return measured

    def object_poses(self) -> dict[str, ObjectPose]:
        """The newest pose of every tracked object that has been seen at least once.

        A pose seen within `max_hold_s` of the newest frame is stamped with that frame's capture time
        (held); an older one keeps the time it was seen, so the runner finds it stale.
        """
        self._check()
        with self._lock:
            out = {}
            for obj, pose in self._seen.items():
                held = self._last_frame_time - pose.timestamp_s <= self.config.max_hold_s
                t = self._last_frame_time if held else pose.timestamp_s
                out[obj] = ObjectPose(t, pose.pos, pose.quat)
            missing = [o for o in self.objects if o not in out]
        for obj in missing:
            # Never seen: a pose infinitely old (stale at every tick) rather than a KeyError in the poller.
            out[obj] = ObjectPose(-np.inf, np.full(3, np.nan), np.array([1.0, 0.0, 0.0, 0.0]))
        return out

    # ---- lifecycle -----------------------------------------------------------------------------------

    def connect(self) -> None:
        """Start processing the camera's frames in a background thread (the camera must stream)."""
        if self._thread is not None:
            raise RuntimeError("fiducial pose source is already connected")
        self._stop.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="robotft-fiducial", daemon=True)
        self._thread.start()

    def disconnect(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._thread = None

    def __enter__(self) -> FiducialPoseSource:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"fiducial pose source failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frame = self.camera.read(timeout_s=0.5)
                except TimeoutError:
                    continue  # a stalled camera: the poses age and the runner holds the arm
                self.update(frame)
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller by _check()
            log.error("fiducial pose source failed: %r", e)
            self._error = e
