"""Time on a rig: timestamped streams, alignment of observations, and a drift-free fixed-rate ticker.

Following diffusion_policy's real-robot code, every sample carries the time it was *captured* on the
`time.monotonic()` clock. Cameras, robot state and the policy run at their own rates; an observation
for time `t` takes, per stream, the newest sample captured at or before `t`, and says how old it is.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class StaleDataError(RuntimeError):
    """The newest sample of a stream is older than the caller allows (or there is none)."""


class StampedBuffer:
    """A thread-safe ring buffer of `(capture_time_s, value)`, in non-decreasing time order.

    Producers (a camera thread, a robot-state poller) `append`; the control loop reads with `at(t)`.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"StampedBuffer capacity must be >= 1, got {capacity}")
        self._times: deque[float] = deque(maxlen=capacity)
        self._values: deque[Any] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def append(self, capture_time_s: float, value: Any) -> None:
        with self._lock:
            if self._times and capture_time_s < self._times[-1]:
                raise ValueError(
                    f"samples must arrive in time order: {capture_time_s} s after {self._times[-1]} s"
                )
            self._times.append(capture_time_s)
            self._values.append(value)

    def at(self, t: float) -> tuple[float, Any] | None:
        """The newest `(capture_time_s, value)` captured at or before `t`; None if there is none."""
        with self._lock:
            i = bisect.bisect_right(self._times, t)
            return None if i == 0 else (self._times[i - 1], self._values[i - 1])

    def __len__(self) -> int:
        return len(self._times)


@dataclass(frozen=True)
class Aligned:
    """One stream's sample chosen for an observation at time `t`."""

    value: Any
    capture_time_s: float
    """When the sample was captured (s, monotonic clock)."""
    age_s: float
    """`t - capture_time_s` (s, >= 0)."""


def align_by_timestamp(
    streams: Mapping[str, StampedBuffer], t: float, max_age_s: float | None = None
) -> dict[str, Aligned]:
    """Per stream, the newest sample captured at or before `t`, with its age.

    Samples after `t` are never used, so an observation never mixes in the future of another stream.
    Raises `StaleDataError` naming the stream when it has no sample at or before `t`, or when that
    sample is older than `max_age_s` (s).
    """
    out = {}
    for name, buffer in streams.items():
        sample = buffer.at(t)
        if sample is None:
            raise StaleDataError(f"stream {name!r} has no sample captured at or before t={t:.6f} s")
        capture_time, value = sample
        age = t - capture_time
        if max_age_s is not None and age > max_age_s:
            raise StaleDataError(
                f"stream {name!r}: newest sample at or before t is {age * 1e3:.1f} ms old "
                f"(max {max_age_s * 1e3:.1f} ms)"
            )
        out[name] = Aligned(value=value, capture_time_s=capture_time, age_s=age)
    return out


@dataclass
class TickStats:
    """How well a `RateLimiter` kept its deadlines."""

    ticks: int = 0
    """Ticks returned by `wait()`."""
    missed: int = 0
    """Deadlines skipped because the loop overran by at least one whole period."""
    jitter_max_s: float = 0.0
    """Largest lateness of a tick behind its deadline (s)."""
    jitter_sum_s: float = 0.0
    """Sum of lateness over ticks (s), for the mean."""

    @property
    def jitter_mean_s(self) -> float:
        return self.jitter_sum_s / self.ticks if self.ticks else 0.0


class RateLimiter:
    """Fixed-rate ticker on absolute deadlines `t0 + k * period`, so errors never accumulate (no drift).

    `wait()` sleeps until the next deadline and returns it. When the loop overran by whole periods,
    those deadlines are skipped and counted as missed rather than run back to back, which would
    replay stale ticks in a burst.
    """

    def __init__(
        self,
        rate_hz: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate_hz > 0:
            raise ValueError(f"RateLimiter rate_hz must be > 0, got {rate_hz}")
        self.period_s = 1.0 / rate_hz
        self.clock = clock
        self.sleep = sleep
        self.stats = TickStats()
        self._next: float | None = None

    def reset(self) -> None:
        """Start a new schedule: the next `wait()` returns immediately and defines `t0`."""
        self._next = None
        self.stats = TickStats()

    def wait(self) -> float:
        """Sleep until the next deadline; returns that deadline (s, on `clock`)."""
        now = self.clock()
        if self._next is None:
            self._next = now
        elif now > self._next + self.period_s:
            skipped = int((now - self._next) // self.period_s)
            self.stats.missed += skipped
            self._next += skipped * self.period_s
        if now < self._next:
            self.sleep(self._next - now)
            now = self.clock()
        deadline = self._next
        late = max(0.0, now - deadline)
        self.stats.ticks += 1
        self.stats.jitter_sum_s += late
        self.stats.jitter_max_s = max(self.stats.jitter_max_s, late)
        self._next = deadline + self.period_s
        return deadline
