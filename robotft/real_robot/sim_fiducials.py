"""Printed fiducial markers in the simulated scene: ArUco textures on thin plates fixed to a body.

A `SimFiducialConfig` in a `SimSceneConfig.fiducials` list adds a visual-only plate (no contacts, no
mass) to a body of the `SimFranka` scene (an object such as the cube, or a robot link such as the hand
`panda/right_hand`), textured with the marker OpenCV would print (`cv2.aruco.generateImageMarker`)
inside a white quiet zone. The simulated camera then sees what a RealSense sees of a printed marker
glued to an object, and the ground truth (the body's pose times the configured offset) tests the
fiducial pose source (robotft.real_robot.fiducial) and the hand-eye calibration
(robotft.real_robot.calibrate).

The marker frame is OpenCV's (`SOLVEPNP_IPPE_SQUARE`): origin at the marker centre, x to the right of
the printed image, y up the image, z out of the printed face toward the viewer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_PLATE_THICKNESS_M = 0.0002
"""Paper thickness: the plate lies behind the marker surface (a marker `pos` on a box face must stand
this far out of the face, as a printed sticker does, or the two surfaces fight for the same pixels)."""
_PIXELS_PER_BIT = 32
"""Texture resolution: pixels per marker cell (sharp edges at the camera's resolution)."""
_SCENE_GROUP = 2
"""Geom group of scene geoms, rendered by the simulated camera (see sim_scene)."""


@dataclass
class SimFiducialConfig:
    """One printed ArUco marker fixed to a body of the simulated scene.

    Example (YAML, a marker on top of the 4 cm PushCube cube and one on the hand):
        fiducials:
          - {name: cube_top, body: cube, id: 0, size_m: 0.03, pos: [0, 0, 0.02]}
          - {name: hand, body: panda/right_hand, id: 9, size_m: 0.05, pos: [0.06, 0, 0.03], quat: [...]}
    """

    name: str
    """Geom name of the plate."""
    body: str
    """Body the plate is fixed to: a scene object's name, a robot body (`panda/right_hand`), or `world`."""
    id: int = 0
    """Marker id in `dictionary`."""
    size_m: float = 0.03
    """Side of the black square (m), the size the detector is told."""
    dictionary: str = "DICT_4X4_50"
    """OpenCV predefined dictionary name (`cv2.aruco.<name>`)."""
    quiet_zone_bits: int = 1
    """Width of the white border around the black square, in marker cells (detection needs one)."""
    pos: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Marker centre in the body frame (m), on the printed surface."""
    quat: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)
    """Marker frame orientation in the body frame `[w, x, y, z]` (z out of the printed face)."""

    def __post_init__(self) -> None:
        if not self.size_m > 0 or self.quiet_zone_bits < 1 or self.id < 0:
            raise ValueError(
                f"fiducial {self.name!r}: needs size_m > 0, quiet_zone_bits >= 1 and id >= 0, got "
                f"{self.size_m}, {self.quiet_zone_bits}, {self.id}"
            )


def marker_texture(dictionary: str, marker_id: int, quiet_zone_bits: int) -> tuple[np.ndarray, float]:
    """The printed sheet: RGB `[S, S, 3]` uint8 of the marker inside its white quiet zone, and the ratio
    of the sheet's side to the black square's side."""
    from robotft.real_robot.fiducial import aruco_dictionary

    aruco = aruco_dictionary(dictionary)
    bits = aruco.markerSize + 2  # data bits plus the black border
    import cv2

    marker = cv2.aruco.generateImageMarker(aruco, marker_id, bits * _PIXELS_PER_BIT, borderBits=1)
    pad = quiet_zone_bits * _PIXELS_PER_BIT
    sheet = np.pad(marker, pad, constant_values=255)
    return np.repeat(sheet[:, :, None], 3, axis=2), (bits + 2 * quiet_zone_bits) / bits


def add_fiducials(spec: Any, fiducials: list[SimFiducialConfig]) -> None:
    """Add each marker plate to the (uncompiled) `mujoco.MjSpec` of the scene.

    MuJoCo maps a 2D texture on each face of a box with the image upright when the face is seen from
    outside with the body's +y up: the +z face of a plate whose frame is the marker frame shows the
    marker as printed.
    """
    import mujoco

    for fid in fiducials:
        body = spec.worldbody if fid.body == "world" else spec.body(fid.body)
        if body is None:
            raise ValueError(f"fiducial {fid.name!r}: body {fid.body!r} is not in the scene")
        image, ratio = marker_texture(fid.dictionary, fid.id, fid.quiet_zone_bits)
        tex = spec.add_texture(
            name=f"{fid.name}_tex",
            type=mujoco.mjtTexture.mjTEXTURE_2D,
            width=image.shape[1],
            height=image.shape[0],
            nchannel=3,
        )
        tex.data = image.tobytes()
        material = spec.add_material(name=f"{fid.name}_mat")
        textures = [""] * int(mujoco.mjtTextureRole.mjNTEXROLE)
        textures[int(mujoco.mjtTextureRole.mjTEXROLE_RGB)] = tex.name
        material.textures = textures
        rot = np.zeros(9)
        mujoco.mju_quat2Mat(rot, np.asarray(fid.quat, dtype=np.float64) / np.linalg.norm(fid.quat))
        centre = np.asarray(fid.pos) - rot.reshape(3, 3)[:, 2] * _PLATE_THICKNESS_M / 2
        half = fid.size_m * ratio / 2
        body.add_geom(
            name=fid.name,
            type=mujoco.mjtGeom.mjGEOM_BOX,
            size=[half, half, _PLATE_THICKNESS_M / 2],
            pos=centre.tolist(),
            quat=list(fid.quat),
            material=material.name,
            rgba=[1.0, 1.0, 1.0, 1.0],
            contype=0,
            conaffinity=0,
            mass=0.0,
            group=_SCENE_GROUP,
        )
