"""Intel RealSense cameras through pyrealsense2: colour + depth aligned to colour, on the monotonic clock.

`RealSenseFrameProcessor` turns one librealsense frameset into a `Frame`: depth aligned to the colour
stream (`rs.align`), depth units applied (metres, float32), colour as RGB, and the device timestamp
converted onto the `time.monotonic()` clock. `RealSenseCamera` opens a device (selected by serial
number) or a recording (`.bag` / `.db3`) with `rs.pipeline`, and keeps the newest frame from a
background thread.

Timestamps: librealsense stamps frames in milliseconds in one of three domains. `system_time` and
`global_time` are on the host's wall clock (global time is the device clock mapped onto it by
librealsense), so they are shifted by the wall-to-monotonic offset. `hardware_clock` is the device's own
clock: it is mapped with the smallest `receive - device_time` seen so far (`DeviceClock`). A
recording is always re-timed that way, so that it plays back as if it were live.

pyrealsense2 is imported lazily, with an error naming the `realsense` extra.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from robotft.optional import require
from robotft.real_robot.camera import Frame, ThreadedCamera
from robotft.real_robot.device_clock import DeviceClock
from robotft.real_robot.intrinsics import CameraIntrinsics

log = logging.getLogger(__name__)


def import_realsense() -> Any:
    return require("pyrealsense2", "realsense", "RealSense cameras")


@dataclass
class RealSenseConfig:
    """One RealSense camera (or a recording of one).

    Example (YAML in a rig preset, as in `real_robot/franka_d435.yaml`):
        cameras:
          - name: base
            type: realsense
            config: {serial: "123456789012", width: 640, height: 480, fps: 30}
    """

    serial: str | None = None
    """Serial number of the device; None: the only one connected. For a recording: checked if given."""
    width: int = 640
    """Colour image width (pixels); depth is aligned to it."""
    height: int = 480
    """Colour image height (pixels)."""
    fps: int = 30
    """Frame rate of both streams (a rate the device supports: 6, 15, 30, 60, 90)."""
    depth: bool = True
    """Stream depth too, aligned to colour, in metres."""
    depth_resolution: tuple[int, int] | None = None
    """Depth stream `(width, height)`; None: the colour resolution (D4xx cameras support 640x480)."""
    hardware_reset: bool = False
    """Reset the device before opening it (recovers a camera left in a bad state by a crashed process)."""
    playback_file: str | None = None
    """Play this recording (`.bag`, or `.db3` from librealsense >= 2.58) instead of opening a device."""
    playback_realtime: bool = True
    """Play a recording at its recorded rate; False: as fast as it is read."""
    timeout_s: float = 5.0
    """How long `connect()` waits for the first frame, and the capture thread for each frame (s)."""

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1 or self.fps < 1 or not self.timeout_s > 0:
            raise ValueError(
                "RealSenseConfig needs width, height, fps >= 1 and timeout_s > 0, got "
                f"{self.width}x{self.height} @ {self.fps}, timeout {self.timeout_s}"
            )


def intrinsics_from_rs(intr: Any) -> CameraIntrinsics:
    """librealsense `rs.intrinsics` -> `CameraIntrinsics`."""
    model = str(intr.model).rsplit(".", 1)[-1]
    return CameraIntrinsics(
        intr.width, intr.height, intr.fx, intr.fy, intr.ppx, intr.ppy, model, tuple(intr.coeffs)
    )


class RealSenseFrameProcessor:
    """Frameset -> `Frame`: alignment, depth units, RGB order, monotonic timestamps, intrinsics.

    `process` returns None for a frameset that adds nothing: one without colour (or without depth when
    depth is expected; a syncer's first sets are often partial), or one repeating the last colour frame
    (playback re-emits a set whenever any of its streams advances).
    """

    def __init__(
        self,
        with_depth: bool = True,
        retime: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._rs = import_realsense()
        self.with_depth = with_depth
        self.retime = retime
        """Map every domain like `hardware_clock` (recordings: their wall-clock stamps are old)."""
        self.clock = clock
        self.wall_clock = wall_clock
        self._align = self._rs.align(self._rs.stream.color)
        self._device_clock = DeviceClock()
        self._last_index: int | None = None
        self.intrinsics: CameraIntrinsics | None = None
        """Of the colour stream (and of depth, aligned to it), from the last frame processed."""

    def process(self, frameset: Any, receive_time_s: float | None = None) -> Frame | None:
        receive = self.clock() if receive_time_s is None else receive_time_s
        color = frameset.get_color_frame()
        if not color or color.get_frame_number() == self._last_index:
            return None
        depth_m = None
        if self.with_depth:
            if not frameset.get_depth_frame():
                return None
            aligned = self._align.process(frameset)
            color, depth = aligned.get_color_frame(), aligned.get_depth_frame()
            depth_m = np.asanyarray(depth.get_data()).astype(np.float32) * np.float32(depth.get_units())
        self._last_index = index = color.get_frame_number()
        rgb = self._to_rgb(color)
        if self.intrinsics is None:
            self.intrinsics = intrinsics_from_rs(color.profile.as_video_stream_profile().get_intrinsics())
        capture = self._capture_time(color, receive)
        return Frame(rgb, capture_time_s=capture, receive_time_s=receive, index=index, depth=depth_m)

    def _to_rgb(self, color: Any) -> np.ndarray:
        fmt = color.profile.format()
        image = np.asanyarray(color.get_data())
        rs = self._rs
        if fmt == rs.format.rgb8:
            return image.copy()
        if fmt == rs.format.bgr8:
            return np.ascontiguousarray(image[..., ::-1])
        if fmt == rs.format.rgba8:
            return np.ascontiguousarray(image[..., :3])
        if fmt == rs.format.bgra8:
            return np.ascontiguousarray(image[..., 2::-1])
        raise ValueError(f"RealSense colour format {fmt} is not supported; stream rgb8, bgr8, rgba8 or bgra8")

    def _capture_time(self, frame: Any, receive: float) -> float:
        """The frame's device timestamp on the monotonic clock, never after `receive`."""
        stamp_s = frame.get_timestamp() / 1e3
        domain = frame.get_frame_timestamp_domain()
        rs = self._rs
        if not self.retime and domain in (rs.timestamp_domain.system_time, rs.timestamp_domain.global_time):
            capture = stamp_s - (self.wall_clock() - self.clock())
            return min(capture, receive)
        return self._device_clock.to_local(stamp_s, receive)


class RealSenseCamera(ThreadedCamera):
    """A RealSense camera (D4xx) streaming colour and aligned depth in a background thread.

    Example:
        with RealSenseCamera("wrist", RealSenseConfig(serial="123456789012")) as cam:
            frame = cam.read_latest(max_age_ms=100)
            K = cam.intrinsics.matrix
    """

    def __init__(
        self, name: str, config: RealSenseConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(name, clock=clock)
        self.config = config
        self._rs = import_realsense()
        self._pipeline: Any = None
        self._processor: RealSenseFrameProcessor | None = None
        self.finished = False
        """True once a recording has played to its end (no more frames will come)."""
        self.serial: str | None = None
        """Serial number of the opened device (or of the recorded one)."""

    @property
    def intrinsics(self) -> CameraIntrinsics:
        """Intrinsics of the colour image (and of the aligned depth); known after `connect()`."""
        if self._processor is None or self._processor.intrinsics is None:
            raise RuntimeError(f"camera {self.name!r}: intrinsics are known only after connect()")
        return self._processor.intrinsics

    @property
    def is_connected(self) -> bool:
        return self._pipeline is not None

    def connect(self) -> None:
        """Open the device or recording, start streaming, and wait for the first frame."""
        if self.is_connected:
            raise RuntimeError(f"camera {self.name!r} is already connected")
        rs, cfg = self._rs, self.config
        rs_config = rs.config()
        if cfg.playback_file is not None:
            if not Path(cfg.playback_file).is_file():
                raise FileNotFoundError(f"camera {self.name!r}: recording {cfg.playback_file} does not exist")
            rs_config.enable_device_from_file(str(cfg.playback_file), repeat_playback=False)
        else:
            self.serial = self._select_device()
            rs_config.enable_device(self.serial)
            rs_config.enable_stream(rs.stream.color, cfg.width, cfg.height, rs.format.rgb8, cfg.fps)
            if cfg.depth:
                dw, dh = cfg.depth_resolution or (cfg.width, cfg.height)
                rs_config.enable_stream(rs.stream.depth, dw, dh, rs.format.z16, cfg.fps)
        pipeline = rs.pipeline()
        source = cfg.playback_file or f"serial {self.serial}"
        try:
            if cfg.playback_file is not None:
                # The recording's serial is checked before streaming starts: stopping a playback
                # pipeline moments after its start races its reader thread (librealsense issue 9148).
                self._check_recorded_serial(rs_config.resolve(rs.pipeline_wrapper(pipeline)).get_device())
            profile = pipeline.start(rs_config)
        except RuntimeError as e:
            raise RuntimeError(f"camera {self.name!r}: could not start RealSense {source}: {e}") from e
        if cfg.playback_file is not None:
            profile.get_device().as_playback().set_real_time(cfg.playback_realtime)
        self._pipeline = pipeline
        self._processor = RealSenseFrameProcessor(
            with_depth=cfg.depth, retime=cfg.playback_file is not None, clock=self.clock
        )
        self._stop.clear()
        self._error = None
        self.finished = False
        self._thread = threading.Thread(target=self._run, name=f"robotft-realsense-{self.name}", daemon=True)
        self._thread.start()
        try:
            self._frames.wait_newer(-1, cfg.timeout_s)
        except TimeoutError:
            self.disconnect()
            self._check()
            raise TimeoutError(
                f"camera {self.name!r} (serial {self.serial}): no frame within {cfg.timeout_s} s"
            ) from None

    def _check_recorded_serial(self, device: Any) -> None:
        """Set `serial` from the recording's device; a configured serial must match it."""
        rs, cfg = self._rs, self.config
        self.serial = (
            device.get_info(rs.camera_info.serial_number)
            if device.supports(rs.camera_info.serial_number)
            else None
        )
        if cfg.serial is not None and self.serial != cfg.serial:
            raise ValueError(
                f"camera {self.name!r}: recording {cfg.playback_file} is of serial {self.serial!r}, not {cfg.serial!r}"
            )

    def _select_device(self) -> str:
        """The serial to open: the configured one if connected, else the only device connected."""
        rs = self._rs
        devices = rs.context().query_devices()
        serials = [d.get_info(rs.camera_info.serial_number) for d in devices]
        wanted = self.config.serial
        if wanted is None:
            if len(serials) != 1:
                raise RuntimeError(
                    f"camera {self.name!r}: set `serial`; {len(serials)} RealSense cameras are connected: {serials}"
                )
            wanted = serials[0]
        elif wanted not in serials:
            raise RuntimeError(
                f"camera {self.name!r}: no RealSense camera with serial {wanted!r} is connected; connected: {serials}"
            )
        if self.config.hardware_reset:
            devices[serials.index(wanted)].hardware_reset()
            self._wait_for_device(wanted)
        return wanted

    def _wait_for_device(self, serial: str, timeout_s: float = 15.0) -> None:
        """After a hardware reset the device drops off the bus and comes back a few seconds later."""
        rs = self._rs
        time.sleep(1.0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if serial in [d.get_info(rs.camera_info.serial_number) for d in rs.context().query_devices()]:
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"camera {self.name!r}: RealSense {serial} did not come back within {timeout_s} s of a reset"
        )

    def disconnect(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 1.0)
        self._thread = None
        if self._pipeline is not None:
            try:
                self._pipeline.stop()
            except RuntimeError as e:  # already stopped by the end of a recording
                log.debug("camera %r: pipeline.stop(): %s", self.name, e)
            self._pipeline = None

    def _run(self) -> None:
        timeout_ms = int(self.config.timeout_s * 1e3)
        playback = self.config.playback_file is not None
        try:
            while not self._stop.is_set():
                ok, frameset = self._pipeline.try_wait_for_frames(timeout_ms)
                if not ok:
                    if playback:
                        self.finished = True
                        return
                    log.warning("camera %r: no frame for %.1f s", self.name, self.config.timeout_s)
                    continue
                frame = self._processor.process(frameset)
                if frame is not None:
                    self._frames.put(frame)
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller by _check()
            log.error("camera %r capture thread failed: %r", self.name, e)
            self._error = e
