"""A simulated camera: renders the `SimFranka` scene with MuJoCo at a fixed rate in its own thread.

The pose is either a camera of the MuJoCo model (`model_camera`, e.g. robosuite's wrist camera
`panda/eye_in_hand`, which moves with the hand) or a fixed pose in the robot base frame given by
`position`, `look_at` and `fovy_deg`, as a rig preset gives a real camera's extrinsics. A fixed pose is
rendered by overriding the OpenGL camera of the MuJoCo scene after `mjv_updateScene`, so cameras are
configured without rebuilding the model.

Rendering is software OpenGL through EGL on machines without a GPU (`MUJOCO_GL=egl`, set by
`robotft.real_robot.sim_scene.import_mujoco`); the OpenGL context belongs to the capture thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from robotft.real_robot.camera import Frame, ThreadedCamera
from robotft.real_robot.intrinsics import CameraIntrinsics
from robotft.real_robot.sim_franka import SimFranka
from robotft.real_robot.sim_scene import import_mujoco
from robotft.real_robot.timing import RateLimiter

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
"""How long `connect()` waits for the first frame (creating an EGL context and the first software
render take a few seconds on a loaded machine)."""


@dataclass
class SimCameraConfig:
    """One simulated camera stream.

    Example (YAML in a rig preset):
        cameras:
          base: {type: sim, width: 128, height: 128, fps: 10, position: [1.2, 0.0, 0.6], look_at: [0.5, 0, 0]}
          wrist: {type: sim, model_camera: panda/eye_in_hand}
    """

    width: int = 128
    """Image width (pixels)."""
    height: int = 128
    """Image height (pixels)."""
    fps: float = 10.0
    """Frames rendered per second (software rendering on CPU manages a few tens at 128x128)."""
    depth: bool = False
    """Also render depth (metres, float32) aligned to the colour image."""
    model_camera: str | None = None
    """Name of a camera in the MuJoCo model (e.g. `panda/eye_in_hand`, `panda/robotview`); when set,
    `position`, `look_at`, `up` and `fovy_deg` are ignored."""
    position: tuple[float, float, float] = (1.2, 0.0, 0.6)
    """Camera position in the robot base frame (m)."""
    look_at: tuple[float, float, float] = (0.5, 0.0, 0.05)
    """Point the optical axis goes through, in the robot base frame (m)."""
    up: tuple[float, float, float] = (0.0, 0.0, 1.0)
    """Direction that appears upward in the image (base frame); must not be parallel to the view."""
    fovy_deg: float = 45.0
    """Vertical field of view (degrees)."""
    nice: int = 10
    """Scheduling niceness added to the render thread (Linux; 0 to leave it): software rendering then
    yields the CPU to the 1 kHz physics, as a real camera never slows the robot down."""

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1 or not self.fps > 0:
            raise ValueError(
                f"SimCameraConfig needs width, height >= 1 and fps > 0, got {self.width}x{self.height} @ {self.fps}"
            )
        if not 0 < self.fovy_deg < 180:
            raise ValueError(f"SimCameraConfig.fovy_deg must be in (0, 180), got {self.fovy_deg}")
        if self.model_camera is None:
            forward = np.subtract(self.look_at, self.position)
            if np.linalg.norm(forward) < 1e-9 or np.linalg.norm(np.cross(forward, self.up)) < 1e-9:
                raise ValueError(
                    f"SimCameraConfig: look_at {self.look_at} must differ from position {self.position} "
                    f"and the view direction must not be parallel to up {self.up}"
                )


def look_at_rotation(position, look_at, up) -> np.ndarray:
    """Rotation `[3, 3]` whose columns are the camera's x (right), y (down), z (forward) axes in the
    base frame (OpenCV convention), for a camera at `position` looking at `look_at`."""
    forward = np.subtract(look_at, position).astype(np.float64)
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, up)
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    return np.stack([right, down, forward], axis=1)


class SimCamera(ThreadedCamera):
    """Renders `robot`'s scene at `config.fps` in a background thread.

    `capture_time_s` is the time of the simulated state the frame shows; `receive_time_s` is when the
    render finished. Frames are RGB uint8 `[H, W, 3]`, with depth `[H, W]` float32 in metres when
    `config.depth` is set.

    Example:
        with SimFranka(robot_cfg, safety) as robot, SimCamera("base", SimCameraConfig(), robot) as cam:
            frame = cam.read_latest(max_age_ms=200)
    """

    def __init__(
        self,
        name: str,
        config: SimCameraConfig,
        robot: SimFranka,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name, clock=clock)
        self.config = config
        self.robot = robot
        self._mj = import_mujoco()
        model = robot.model
        if config.model_camera is not None:
            cam_id = self._mj.mj_name2id(model, self._mj.mjtObj.mjOBJ_CAMERA, config.model_camera)
            if cam_id < 0:
                names = [model.cam(i).name for i in range(model.ncam)]
                raise ValueError(
                    f"camera {name!r}: model_camera {config.model_camera!r} not in the model; has {names}"
                )
            self._cam_id = cam_id
            fovy = float(model.cam_fovy[cam_id])
        else:
            self._cam_id = -1
            fovy = config.fovy_deg
        self.intrinsics = CameraIntrinsics.from_fovy(config.width, config.height, fovy)
        # The offscreen framebuffer (640x480 by default) must hold the image: RealSense sizes are larger.
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, config.width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, config.height)
        """Pinhole intrinsics of the colour (and depth) image."""
        self.render_stats_s: list[float] = []
        """Seconds each of the last 100 frames took to render (capture to receive)."""
        self._snapshot_renderer: Any = None
        self._snapshots = 0

    # ---- Camera contract -----------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def connect(self) -> None:
        """Start rendering; returns after the first frame, or raises what stopped the thread."""
        if self.is_connected:
            raise RuntimeError(f"camera {self.name!r} is already connected")
        self._stop.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name=f"robotft-sim-camera-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while self._frames.get() is None:
            self._check()
            if time.monotonic() > deadline or not self._thread.is_alive():
                self._check()
                raise TimeoutError(f"camera {self.name!r}: no frame rendered within {_START_TIMEOUT_S} s")
            time.sleep(0.01)

    def disconnect(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self._thread = None

    def camera_to_base(self) -> np.ndarray:
        """Pose `[4, 4]` of the camera (OpenCV axes: x right, y down, z forward) in the robot base frame,
        now (a model camera on the wrist moves with the arm)."""
        pose = np.eye(4)
        if self._cam_id < 0:
            pose[:3, :3] = look_at_rotation(self.config.position, self.config.look_at, self.config.up)
            pose[:3, 3] = self.config.position
        else:
            pos, mat = self.robot.camera_pose(self._cam_id)
            # MuJoCo cameras look along -z with y up: flip y and z for the OpenCV axes.
            pose[:3, :3] = mat @ np.diag([1.0, -1.0, -1.0])
            pose[:3, 3] = pos
        return pose

    # ---- the capture thread --------------------------------------------------------------------------

    def _scene_option(self) -> Any:
        """Show the robot's visual meshes (geom group 1) and the scene (group 2); hide collision
        meshes (group 0) and all sites, as robosuite's cameras do."""
        option = self._mj.MjvOption()
        option.geomgroup[:] = 0
        option.geomgroup[1] = option.geomgroup[2] = 1
        option.sitegroup[:] = 0
        return option

    def _override_gl_camera(self, scene: Any) -> None:
        """Point the scene's OpenGL cameras along the configured pose, keeping near/far clipping planes
        (the depth conversion of `mujoco.Renderer` assumes the model's)."""
        rot = look_at_rotation(self.config.position, self.config.look_at, self.config.up)
        top = math.tan(math.radians(self.config.fovy_deg) / 2)
        for gl in scene.camera:
            gl.pos[:] = self.config.position
            gl.forward[:] = rot[:, 2]
            gl.up[:] = -rot[:, 1]
            gl.frustum_center = 0.0
            gl.frustum_width = 0.0
            gl.frustum_top = gl.frustum_near * top
            gl.frustum_bottom = -gl.frustum_near * top
            gl.orthographic = 0

    def _render(self, renderer: Any, option: Any, index: int) -> Frame:
        """Render the scene as simulated now into a `Frame` (in the thread that owns `renderer`)."""
        capture = self.robot.update_scene(renderer, self._cam_id, option)
        if self._cam_id < 0:
            self._override_gl_camera(renderer.scene)
        renderer.disable_depth_rendering()
        color = renderer.render().copy()
        depth = None
        if self.config.depth:
            renderer.enable_depth_rendering()
            depth = renderer.render().copy()
        receive = self.clock()
        return Frame(color, capture, max(receive, capture), index, depth)

    def snapshot(self) -> Frame:
        """Render one frame now, in the calling thread, while the camera is not streaming: the same image
        the stream would show of the current scene, without its timing (tests, scripted calibration).
        The OpenGL context is created on the first call and belongs to the calling thread."""
        if self.is_connected:
            raise RuntimeError(f"camera {self.name!r} is streaming; read its frames instead of snapshot()")
        if self._snapshot_renderer is None:
            self._snapshot_renderer = self._mj.Renderer(
                self.robot.model, height=self.config.height, width=self.config.width
            )
        self._snapshots += 1
        return self._render(self._snapshot_renderer, self._scene_option(), self._snapshots - 1)

    def close_snapshots(self) -> None:
        """Release the OpenGL context of `snapshot()` (call from the thread that took them)."""
        if self._snapshot_renderer is not None:
            self._snapshot_renderer.close()
            self._snapshot_renderer = None

    def _run(self) -> None:
        cfg = self.config
        renderer = None
        try:
            if cfg.nice and hasattr(os, "setpriority"):
                # Before the renderer exists, so that the rasterizer's worker threads inherit it.
                os.setpriority(
                    os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + cfg.nice
                )
            renderer = self._mj.Renderer(self.robot.model, height=cfg.height, width=cfg.width)
            option = self._scene_option()
            ticker = RateLimiter(cfg.fps, clock=self.clock)
            index = 0
            while not self._stop.is_set():
                ticker.wait()
                frame = self._render(renderer, option, index)
                self._frames.put(frame)
                age = frame.receive_time_s - frame.capture_time_s
                self.render_stats_s = [*self.render_stats_s[-99:], age]
                index += 1
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller by _check()
            log.error("camera %r capture thread failed: %r", self.name, e)
            self._error = e
        finally:
            if renderer is not None:
                renderer.close()
