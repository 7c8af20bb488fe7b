"""The latency report after a deployment run: inference time, observation age, loop jitter, safety counts.

The runner records raw timings into a `LatencyLog` while it runs (appends only, cheap at the control
rate); `write_report` turns them into `latency.json` (percentiles p50/p90/p99/max, in milliseconds) and
`latency.png` (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class LatencyLog:
    """Raw timings of one run (all seconds, `time.monotonic()` clock)."""

    tick_deadline_s: list[float] = field(default_factory=list)
    """Scheduled time of each control tick."""
    tick_start_s: list[float] = field(default_factory=list)
    """When each tick actually started (>= its deadline)."""
    inference_s: list[float] = field(default_factory=list)
    """Duration of each policy call (observation in, chunk out)."""
    obs_age_s: dict[str, list[float]] = field(default_factory=dict)
    """Per stream, the age of the sample used at each tick (tick time - capture time)."""
    episode_starts: list[int] = field(default_factory=list)
    """Index of each episode's first tick (periods and rates are measured within episodes)."""
    missed_ticks: int = 0
    """Deadlines skipped because the loop overran a whole period."""
    commands_sent: int = 0
    """Commands that went through the safety layer to the robot."""
    safety_counters: dict[str, int] = field(default_factory=dict)
    """Safety layer reason -> commands clipped or refused for it during the run."""
    executor: dict[str, int] = field(default_factory=dict)
    """Executor counters (e.g. the async executor's skipped and dropped actions)."""

    def add_tick(self, deadline: float, start: float) -> None:
        self.tick_deadline_s.append(deadline)
        self.tick_start_s.append(start)

    def add_ages(self, ages: dict[str, float]) -> None:
        for name, age in ages.items():
            self.obs_age_s.setdefault(name, []).append(age)


def percentiles_ms(values_s: list[float]) -> dict[str, float | int]:
    """`{"count", "p50", "p90", "p99", "max", "mean"}` of durations given in seconds, in milliseconds."""
    if not values_s:
        return {"count": 0}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, float | int] = {"count": int(ms.size)}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    out["max"] = float(ms.max())
    out["mean"] = float(ms.mean())
    return out


def summarize(log: LatencyLog, control_hz: float) -> dict[str, Any]:
    """The JSON report: percentiles of inference time, observation age per stream, tick lateness
    (jitter: start - deadline) and tick period, plus the achieved rate and the safety counters."""
    starts = np.asarray(log.tick_start_s)
    jitter = (starts - np.asarray(log.tick_deadline_s)).tolist()
    bounds = [*(log.episode_starts or [0]), len(starts)]
    episodes = [starts[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b - a > 1]
    periods = [float(p) for ep in episodes for p in np.diff(ep)]
    span = sum(float(ep[-1] - ep[0]) for ep in episodes)
    clipped = {k: v for k, v in log.safety_counters.items() if not _is_refusal(k)}
    refused = {k: v for k, v in log.safety_counters.items() if _is_refusal(k)}
    return {
        "control_hz": control_hz,
        "ticks": len(starts),
        "achieved_hz": len(periods) / span if span > 0 else 0.0,
        "missed_ticks": log.missed_ticks,
        "inference_ms": percentiles_ms(log.inference_s),
        "obs_age_ms": {name: percentiles_ms(ages) for name, ages in sorted(log.obs_age_s.items())},
        "loop_jitter_ms": percentiles_ms(jitter),
        "loop_period_ms": percentiles_ms(periods),
        "commands_sent": log.commands_sent,
        "commands_clipped": clipped,
        "commands_refused": refused,
        "executor": dict(log.executor),
    }


def _is_refusal(reason: str) -> bool:
    """Safety reasons that replace a command by a hold (see SafetyReport.halted)."""
    return reason == "stopped" or reason.startswith("watchdog_")


def write_report(log: LatencyLog, control_hz: float, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `latency.json` and `latency.png` into `out_dir`; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = summarize(log, control_hz)
    json_path = out / "latency.json"
    atomic_write(json_path, json.dumps(report, indent=2).encode())
    png_path = out / "latency.png"
    _plot(log, report, png_path)
    return json_path, png_path


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plot(log: LatencyLog, report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    starts = np.asarray(log.tick_start_s)
    t = starts - starts[0] if len(starts) else starts
    ax = axes[0, 0]
    ax.plot(t, (starts - np.asarray(log.tick_deadline_s)) * 1e3, lw=0.8)
    ax.set(
        title=f"control loop lateness (p99 {report['loop_jitter_ms'].get('p99', 0):.2f} ms)",
        xlabel="time (s)",
        ylabel="ms",
    )
    ax = axes[0, 1]
    if log.inference_s:
        ax.hist(np.asarray(log.inference_s) * 1e3, bins=30)
    ax.set(
        title=f"policy inference (p50 {report['inference_ms'].get('p50', 0):.1f} ms)",
        xlabel="ms",
        ylabel="calls",
    )
    ax = axes[1, 0]
    for name, ages in sorted(log.obs_age_s.items()):
        ax.plot(np.asarray(ages) * 1e3, lw=0.8, label=name)
    ax.set(title="observation age at each tick", xlabel="tick", ylabel="ms")
    if log.obs_age_s:
        ax.legend(fontsize=8)
    ax = axes[1, 1]
    counts = {"sent": log.commands_sent, **log.safety_counters}
    ax.bar(range(len(counts)), list(counts.values()))
    ax.set_xticks(range(len(counts)), list(counts), rotation=30, ha="right", fontsize=8)
    ax.set(title="commands: sent, clipped and refused by reason")
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=80)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
