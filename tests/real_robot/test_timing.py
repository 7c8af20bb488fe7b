"""Timestamp alignment across streams and the drift-free fixed-rate ticker."""

from __future__ import annotations

import pytest

from robotft.real_robot.timing import RateLimiter, StaleDataError, StampedBuffer, align_by_timestamp


def buffer(times, capacity=100) -> StampedBuffer:
    buf = StampedBuffer(capacity)
    for t in times:
        buf.append(t, f"sample@{t}")
    return buf


def test_alignment_picks_the_newest_sample_at_or_before_t_per_stream():
    streams = {
        "camera": buffer([0.000, 0.033, 0.066, 0.100]),  # 30 Hz
        "robot": buffer([0.000, 0.002, 0.004, 0.064, 0.066, 0.068]),  # fast, with a gap
    }
    out = align_by_timestamp(streams, t=0.067)
    assert out["camera"].value == "sample@0.066" and out["camera"].age_s == pytest.approx(0.001)
    assert out["robot"].value == "sample@0.066" and out["robot"].capture_time_s == 0.066
    # A sample exactly at t is used; a later one never is.
    assert align_by_timestamp(streams, t=0.1)["camera"].value == "sample@0.1"
    assert align_by_timestamp(streams, t=0.0999)["camera"].value == "sample@0.066"


def test_alignment_names_the_stream_that_is_missing_or_too_old():
    streams = {"robot": buffer([0.0, 0.5]), "wrist": buffer([0.2])}
    with pytest.raises(StaleDataError, match="'wrist' has no sample"):
        align_by_timestamp(streams, t=0.1)
    with pytest.raises(StaleDataError, match=r"'wrist'.*300.0 ms old \(max 100.0 ms\)"):
        align_by_timestamp(streams, t=0.5, max_age_s=0.1)


def test_buffer_keeps_order_and_capacity():
    buf = buffer([0.0, 1.0, 2.0], capacity=2)
    assert len(buf) == 2 and buf.at(0.5) is None and buf.at(1.5) == (1.0, "sample@1.0")
    with pytest.raises(ValueError, match="time order"):
        buf.append(1.5, "late")


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + 0.001  # the OS always wakes us 1 ms late


def test_rate_limiter_ticks_on_absolute_deadlines_without_drift():
    fake = FakeTime()
    rate = RateLimiter(10.0, clock=fake.clock, sleep=fake.sleep)
    deadlines = []
    for k in range(50):
        deadlines.append(rate.wait())
        fake.now += 0.03 if k % 2 else 0.06  # uneven work inside the loop
    assert deadlines == pytest.approx([100.0 + 0.1 * k for k in range(50)], abs=1e-9)
    assert rate.stats.ticks == 50 and rate.stats.missed == 0
    assert rate.stats.jitter_max_s == pytest.approx(0.001) and rate.stats.jitter_mean_s == pytest.approx(
        49 * 0.001 / 50
    )  # the first tick is on time


def test_rate_limiter_skips_deadlines_after_an_overrun():
    fake = FakeTime()
    rate = RateLimiter(10.0, clock=fake.clock, sleep=fake.sleep)
    assert rate.wait() == 100.0
    fake.now += 0.35  # one loop iteration took 3.5 periods
    assert rate.wait() == pytest.approx(100.3)  # the current period's deadline, not a burst of old ones
    assert rate.stats.missed == 2
    assert rate.wait() == pytest.approx(100.4)
