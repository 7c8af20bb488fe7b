"""The Camera contract (docs/design.md "Robot and Camera"): timestamped frames and `read_latest(max_age_ms)`.

Modelled on LeRobot's `cameras/camera.py` (`read`, `read_latest`), with diffusion_policy's habit of
stamping every frame with its capture and receive times. Backends run their own capture thread and
publish into a `LatestFrame`; the control loop never waits for a camera, it takes the newest frame
and refuses one that is too old.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from robotft.real_robot.timing import StaleDataError


class StaleFrameError(StaleDataError):
    """The newest frame is older than the caller's `max_age_ms`, or no frame has arrived yet."""


@dataclass
class Frame:
    """One captured image, with the times that let observations be aligned across streams."""

    color: np.ndarray
    """RGB image `[H, W, 3]` uint8."""
    capture_time_s: float
    """When the sensor exposed the frame (s, `time.monotonic()` clock; from device time where known)."""
    receive_time_s: float
    """When the host received the frame (s, `time.monotonic()` clock); >= `capture_time_s`."""
    index: int
    """Frame counter of the stream, increasing by one per captured frame (gaps mean dropped frames)."""
    depth: np.ndarray | None = None
    """Depth `[H, W]` float32 in metres, aligned to `color`; 0 where unknown. None without depth."""

    def __post_init__(self) -> None:
        if self.color.dtype != np.uint8 or self.color.ndim != 3 or self.color.shape[2] != 3:
            raise ValueError(
                f"Frame.color must be uint8 [H, W, 3], got {self.color.dtype} {self.color.shape}"
            )
        if self.depth is not None and (
            self.depth.dtype != np.float32 or self.depth.shape != self.color.shape[:2]
        ):
            raise ValueError(
                f"Frame.depth must be float32 {self.color.shape[:2]} (metres), "
                f"got {self.depth.dtype} {self.depth.shape}"
            )


class LatestFrame:
    """Thread-safe holder of a stream's newest frame: a capture thread `put`s, readers `get` or wait."""

    def __init__(self) -> None:
        self._frame: Frame | None = None
        self._cond = threading.Condition()

    def put(self, frame: Frame) -> None:
        with self._cond:
            self._frame = frame
            self._cond.notify_all()

    def get(self) -> Frame | None:
        with self._cond:
            return self._frame

    def wait_newer(self, after_index: int, timeout_s: float) -> Frame:
        """Block until a frame with `index > after_index` is held; TimeoutError after `timeout_s`."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._frame is not None and self._frame.index > after_index, timeout_s
            ):
                raise TimeoutError(f"no new frame after index {after_index} within {timeout_s:.3f} s")
            return self._frame


class Camera(abc.ABC):
    """A camera stream. `connect()` (or `with camera:`) starts capturing in the background.

    Example:
        with RealSenseCamera(config) as cam:
            frame = cam.read_latest(max_age_ms=100)   # StaleFrameError if the stream stalled
    """

    name: str
    """Stream name, used in observation keys (`rgb/<name>`, `depth/<name>`) and error messages."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        """Monotonic clock (s) used to age frames; injectable for tests."""

    @property
    @abc.abstractmethod
    def is_connected(self) -> bool:
        """True between a successful `connect()` and `disconnect()`."""

    @abc.abstractmethod
    def connect(self) -> None:
        """Open the device and start the capture thread; raise with the serial/name on failure."""

    @abc.abstractmethod
    def disconnect(self) -> None:
        """Stop capturing and release the device; safe to call when not connected."""

    @abc.abstractmethod
    def read(self, timeout_s: float = 1.0) -> Frame:
        """Block until the next frame newer than the last one returned; TimeoutError after `timeout_s`."""

    @abc.abstractmethod
    def latest(self) -> Frame | None:
        """The newest frame received, without waiting; None before the first one."""

    def read_latest(self, max_age_ms: float) -> Frame:
        """The newest frame, never waiting; `StaleFrameError` if it was captured more than `max_age_ms`
        ago (or none has arrived), so a stalled camera cannot feed the policy an old image."""
        frame = self.latest()
        if frame is None:
            raise StaleFrameError(f"camera {self.name!r} has not delivered a frame yet")
        age_ms = (self.clock() - frame.capture_time_s) * 1e3
        if age_ms > max_age_ms:
            raise StaleFrameError(
                f"camera {self.name!r}: newest frame #{frame.index} is {age_ms:.1f} ms old (max {max_age_ms} ms)"
            )
        return frame

    def __enter__(self) -> Camera:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()


class ThreadedCamera(Camera):
    """A camera whose backend captures in its own thread into a `LatestFrame`: the reading half of the
    contract, and the capture thread's failure surfaced on the next read instead of lost."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name, clock=clock)
        self._frames = LatestFrame()
        self._last_read = -1
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        """Set by the capture thread when it dies; raised by the next read."""

    def read(self, timeout_s: float = 1.0) -> Frame:
        self._check()
        frame = self._frames.wait_newer(self._last_read, timeout_s)
        self._last_read = frame.index
        return frame

    def latest(self) -> Frame | None:
        self._check()
        return self._frames.get()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"camera {self.name!r} capture thread failed: {self._error!r}") from self._error

