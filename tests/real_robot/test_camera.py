"""Camera contract: timestamped frames, read() waits for a new frame, read_latest refuses stale ones."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from robotft.real_robot.camera import Camera, Frame, LatestFrame, StaleFrameError


class FakeCamera(Camera):
    """Frames are pushed by the test (standing in for a capture thread) into a `LatestFrame`."""

    def __init__(self, clock) -> None:
        super().__init__("wrist", clock=clock)
        self.frames = LatestFrame()
        self._connected = False
        self._last_index = -1

    @property
    def is_connected(self) -> bool:
        return self._connected

    def connect(self) -> None:
        self._connected = True

    def disconnect(self) -> None:
        self._connected = False

    def read(self, timeout_s: float = 1.0) -> Frame:
        frame = self.frames.wait_newer(self._last_index, timeout_s)
        self._last_index = frame.index
        return frame

    def latest(self) -> Frame | None:
        return self.frames.get()


def frame(index: int, t: float) -> Frame:
    return Frame(np.zeros((4, 6, 3), np.uint8), capture_time_s=t, receive_time_s=t + 0.005, index=index)


def test_read_latest_returns_fresh_frames_and_refuses_stale_ones():
    now = [10.0]
    with FakeCamera(clock=lambda: now[0]) as cam:
        assert cam.is_connected
        with pytest.raises(StaleFrameError, match="'wrist' has not delivered a frame yet"):
            cam.read_latest(max_age_ms=100)
        cam.frames.put(frame(0, 9.95))
        assert cam.read_latest(max_age_ms=100).index == 0
        now[0] = 10.2
        with pytest.raises(StaleFrameError, match=r"frame #0 is 250.0 ms old \(max 100 ms\)"):
            cam.read_latest(max_age_ms=100)
    assert not cam.is_connected


def test_read_waits_for_a_frame_newer_than_the_last_one():
    cam = FakeCamera(clock=lambda: 0.0)
    cam.frames.put(frame(0, 0.0))
    assert cam.read().index == 0
    with pytest.raises(TimeoutError, match="after index 0"):
        cam.read(timeout_s=0.01)
    producer = threading.Timer(0.02, lambda: cam.frames.put(frame(1, 0.033)))
    producer.start()
    assert cam.read(timeout_s=2.0).index == 1
    producer.join()


def test_frame_checks_dtypes_and_shapes():
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        Frame(np.zeros((4, 6, 3), np.float32), 0.0, 0.0, 0)
    with pytest.raises(ValueError, match=r"float32 \(4, 6\) \(metres\)"):
        Frame(np.zeros((4, 6, 3), np.uint8), 0.0, 0.0, 0, depth=np.zeros((4, 5), np.float32))
