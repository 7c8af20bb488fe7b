"""RealSense: frames injected into pyrealsense2's software device, and a recording of them played back
through RealSenseCamera, come out aligned to colour, in metres, as RGB, on the monotonic clock."""

from __future__ import annotations

import time

import numpy as np
import pytest

from robotft.real_robot.realsense import RealSenseCamera, RealSenseConfig, RealSenseFrameProcessor

rs = pytest.importorskip("pyrealsense2")

COLOR_W, COLOR_H, COLOR_F = 64, 48, 50.0
DEPTH_W, DEPTH_H, DEPTH_F = 32, 24, 25.0  # half the resolution, same field of view
DEPTH_UNITS = 1e-4  # metres per z16 unit (D4xx default is 1e-3)
SERIAL = "000123"
PERIOD_MS = 1000 / 30


def depth_image() -> np.ndarray:
    """1.0 m everywhere except a 0.5 m block covering the central quarter."""
    raw = np.full((DEPTH_H, DEPTH_W), 10000, np.uint16)
    raw[DEPTH_H // 4 : 3 * DEPTH_H // 4, DEPTH_W // 4 : 3 * DEPTH_W // 4] = 5000
    return raw


def color_image(i: int) -> np.ndarray:
    """RGB: red channel encodes the frame number, green 20, blue 200."""
    img = np.empty((COLOR_H, COLOR_W, 3), np.uint8)
    img[...] = (i, 20, 200)
    return img


def intrinsics(w: int, h: int, f: float):
    intr = rs.intrinsics()
    intr.width, intr.height, intr.fx, intr.fy = w, h, f, f
    intr.ppx, intr.ppy = (w - 1) / 2, (h - 1) / 2
    intr.model, intr.coeffs = rs.distortion.none, [0.0] * 5
    return intr


class SoftwareCamera:
    """A RealSense made of pyrealsense2's software device: a z16 depth sensor and a colour sensor
    (`color_format` bgr8 or rgb8), identity extrinsics, depth units `DEPTH_UNITS`."""

    def __init__(self, color_format) -> None:
        self.device = rs.software_device()
        self.device.register_info(rs.camera_info.serial_number, SERIAL)
        self.depth_sensor = self.device.add_sensor("Depth")
        self.color_sensor = self.device.add_sensor("Color")
        self.depth_sensor.add_read_only_option(rs.option.depth_units, DEPTH_UNITS)
        self.depth_profile = self._add(
            self.depth_sensor, rs.stream.depth, 0, DEPTH_W, DEPTH_H, DEPTH_F, 2, rs.format.z16
        )
        self.color_profile = self._add(
            self.color_sensor, rs.stream.color, 1, COLOR_W, COLOR_H, COLOR_F, 3, color_format
        )
        self.color_format = color_format
        identity = rs.extrinsics()
        identity.rotation, identity.translation = [1, 0, 0, 0, 1, 0, 0, 0, 1], [0, 0, 0]
        self.depth_profile.register_extrinsics_to(self.color_profile, identity)
        self.device.create_matcher(rs.matchers.default)

    @staticmethod
    def _add(sensor, stream, uid, w, h, f, bpp, fmt):
        vs = rs.video_stream()
        vs.type, vs.index, vs.uid, vs.fps = stream, 0, uid, 30
        vs.width, vs.height, vs.bpp, vs.fmt = w, h, bpp, fmt
        vs.intrinsics = intrinsics(w, h, f)
        return sensor.add_video_stream(vs)

    def inject(self, i: int, timestamp_ms: float, domain) -> None:
        color = color_image(i)
        if self.color_format == rs.format.bgr8:
            color = np.ascontiguousarray(color[..., ::-1])
        for sensor, profile, pixels, bpp in (
            (self.depth_sensor, self.depth_profile, depth_image(), 2),
            (self.color_sensor, self.color_profile, color, 3),
        ):
            frame = rs.software_video_frame()
            frame.pixels, frame.stride, frame.bpp = pixels, pixels.shape[1] * bpp, bpp
            frame.timestamp, frame.domain, frame.frame_number = timestamp_ms, domain, i
            frame.profile = profile.as_video_stream_profile()
            if sensor is self.depth_sensor:
                frame.depth_units = DEPTH_UNITS
            sensor.on_video_frame(frame)


def check_image(frame, i: int) -> None:
    assert frame.color.shape == (COLOR_H, COLOR_W, 3) and frame.color.dtype == np.uint8
    assert tuple(frame.color[0, 0]) == (i, 20, 200)  # RGB order, whatever the stream's format
    # Depth aligned to colour: colour resolution, metres, the near block still covers the central quarter.
    assert frame.depth.shape == (COLOR_H, COLOR_W) and frame.depth.dtype == np.float32
    assert frame.depth[COLOR_H // 2, COLOR_W // 2] == pytest.approx(0.5, abs=1e-6)
    assert frame.depth[COLOR_H // 2, 3] == pytest.approx(1.0, abs=1e-6)
    near = np.isclose(frame.depth, 0.5)
    assert abs(near.mean() - 0.25) < 0.05


@pytest.mark.parametrize("domain", ["system_time", "hardware_clock"])
def test_software_device_frames_come_out_aligned_scaled_and_on_the_monotonic_clock(domain):
    cam = SoftwareCamera(rs.format.bgr8)
    sync = rs.syncer()
    for sensor, profile in ((cam.depth_sensor, cam.depth_profile), (cam.color_sensor, cam.color_profile)):
        sensor.open(profile)
        sensor.start(sync)
    processor = RealSenseFrameProcessor(with_depth=True)
    frames = []
    # A device clock 10 s behind the host's (librealsense's syncer drops frames stamped days away
    # from the host clock, so the simulated device clock cannot start at zero).
    device_start_ms = time.time() * 1e3 - 10_000.0
    try:
        for i in range(1, 8):
            if domain == "system_time":  # host wall clock, exposed 40 ms before it is injected
                stamp = time.time() * 1e3 - 40.0
            else:  # the device's own clock, unrelated to the host's
                stamp = device_start_ms + i * PERIOD_MS
            cam.inject(i, stamp, getattr(rs.timestamp_domain, domain))
            ok, frameset = sync.try_wait_for_frames(2000)
            assert ok
            frame = processor.process(frameset)
            if frame is not None:  # the syncer's first set may hold colour only
                frames.append(frame)
            time.sleep(PERIOD_MS / 1e3)
    finally:
        for sensor in (cam.depth_sensor, cam.color_sensor):
            sensor.stop()
            sensor.close()
    assert len(frames) >= 5
    for frame in frames:
        check_image(frame, frame.index)
        assert frame.capture_time_s <= frame.receive_time_s
    assert [f.index for f in frames] == list(range(frames[0].index, frames[0].index + len(frames)))
    if domain == "system_time":
        ages = [f.receive_time_s - f.capture_time_s for f in frames]
        assert all(0.035 < age < 0.2 for age in ages), ages
    else:
        gaps = np.diff([f.capture_time_s for f in frames])
        assert np.all(gaps > 0) and np.all(np.abs(gaps - PERIOD_MS / 1e3) < 0.02), gaps
    intr = processor.intrinsics
    assert (intr.width, intr.height, intr.fx, intr.fy) == (COLOR_W, COLOR_H, COLOR_F, COLOR_F)


def record(path_stem, n_frames: int) -> str:
    """Record `n_frames` injected RGB-D frames to a file; returns its path (.db3 on librealsense >= 2.58,
    .bag before)."""
    cam = SoftwareCamera(rs.format.rgb8)
    try:
        path = f"{path_stem}.db3"
        recorder = rs.recorder(path, cam.device)
    except RuntimeError:
        path = f"{path_stem}.bag"
        recorder = rs.recorder(path, cam.device)
    sensors = recorder.query_sensors()
    sync = rs.syncer()
    for sensor in sensors:
        sensor.open(sensor.get_stream_profiles()[0])
        sensor.start(sync)
    for i in range(1, n_frames + 1):
        cam.inject(i, 1_000.0 + i * PERIOD_MS, rs.timestamp_domain.hardware_clock)
        time.sleep(PERIOD_MS / 1e3)
    for sensor in sensors:
        sensor.stop()
        sensor.close()
    del sensors, recorder  # closes the file
    return path


def test_a_recording_plays_back_through_the_camera_backend(tmp_path):
    path = record(tmp_path / "rec", n_frames=10)
    with pytest.raises(ValueError, match=f"is of serial '{SERIAL}', not '999'"):
        RealSenseCamera("base", RealSenseConfig(serial="999", playback_file=path)).connect()

    cfg = RealSenseConfig(serial=SERIAL, playback_file=path, timeout_s=2.0)
    with RealSenseCamera("base", cfg) as cam:
        assert cam.serial == SERIAL
        assert (cam.intrinsics.width, cam.intrinsics.fx) == (COLOR_W, COLOR_F)
        frames = []
        while not cam.finished:
            try:
                frames.append(cam.read(timeout_s=0.5))
            except TimeoutError:
                continue
        fresh = cam.read_latest(max_age_ms=1e4)  # re-timed: a recording plays back as if live
    indexes = [f.index for f in frames]
    assert len(indexes) >= 8 and indexes == sorted(set(indexes))
    for frame in frames:
        check_image(frame, frame.index)
    captures = [f.capture_time_s for f in frames]
    assert np.all(np.diff(captures) > 0) and fresh.capture_time_s <= time.monotonic()


def test_missing_devices_and_files_are_named():
    with pytest.raises(
        RuntimeError, match="no RealSense camera with serial '4242' is connected; connected: "
    ):
        RealSenseCamera("wrist", RealSenseConfig(serial="4242")).connect()
    with pytest.raises(FileNotFoundError, match="nope.db3 does not exist"):
        RealSenseCamera("wrist", RealSenseConfig(playback_file="nope.db3")).connect()
