"""Map a device's own clock (a camera's hardware timestamps, the Franka's state time) onto the host's
`time.monotonic()` clock."""

from __future__ import annotations


class DeviceClock:
    """One-way clock-offset estimate: `local = device + min(receive - device)` over all samples so far.

    The sample that travelled fastest bounds the transport delay from below, so the smallest
    `receive - device` difference is the best estimate of the offset between the two clocks (the
    one-way variant of Cristian's algorithm). Mapped times never lie after their receive time. Drift
    between the clocks (ppm) is not modelled: create a new mapper per session.
    """

    def __init__(self) -> None:
        self.offset_s: float | None = None
        """Current estimate of `local - device` (s); None before the first sample."""

    def to_local(self, device_time_s: float, receive_time_s: float) -> float:
        """The local time (s) of a sample stamped `device_time_s` and received at `receive_time_s`."""
        offset = receive_time_s - device_time_s
        if self.offset_s is None or offset < self.offset_s:
            self.offset_s = offset
        return min(device_time_s + self.offset_s, receive_time_s)
