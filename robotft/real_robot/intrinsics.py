"""Pinhole camera intrinsics shared by the camera backends (RealSense, simulated)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CameraIntrinsics:
    """Pinhole model of a colour stream (and of depth aligned to it), OpenCV pixel convention:
    `u = fx * x / z + ppx`, `v = fy * y / z + ppy`, with `x` right, `y` down, `z` forward (camera
    frame) and pixel centres at integer coordinates."""

    width: int
    """Image width (pixels)."""
    height: int
    """Image height (pixels)."""
    fx: float
    """Focal length along x (pixels)."""
    fy: float
    """Focal length along y (pixels)."""
    ppx: float
    """Principal point x (pixels)."""
    ppy: float
    """Principal point y (pixels)."""
    model: str = "none"
    """Distortion model name (`none`, or librealsense's, e.g. `inverse_brown_conrady`)."""
    coeffs: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0)
    """Distortion coefficients of `model`."""

    @classmethod
    def from_fovy(cls, width: int, height: int, fovy_deg: float) -> CameraIntrinsics:
        """An ideal pinhole with square pixels and vertical field of view `fovy_deg` (as MuJoCo renders)."""
        f = (height / 2) / math.tan(math.radians(fovy_deg) / 2)
        return cls(width, height, f, f, (width - 1) / 2, (height - 1) / 2)

    @property
    def matrix(self) -> np.ndarray:
        """The 3x3 camera matrix `K`."""
        return np.array([[self.fx, 0.0, self.ppx], [0.0, self.fy, self.ppy], [0.0, 0.0, 1.0]])

    def project(self, points: np.ndarray) -> np.ndarray:
        """Pixel coordinates `[N, 2]` of points `[N, 3]` in the camera frame (m), ignoring distortion."""
        p = np.asarray(points, dtype=np.float64)
        return np.stack(
            [self.fx * p[:, 0] / p[:, 2] + self.ppx, self.fy * p[:, 1] / p[:, 2] + self.ppy], axis=1
        )
