"""The latency report: percentiles of inference time, observation age and loop jitter, per-episode rates,
safety counts split into clipped and refused; written as JSON and a PNG."""

from __future__ import annotations

import json

import numpy as np
import pytest

from robotft.real_robot.latency import LatencyLog, summarize, write_report


def _log() -> LatencyLog:
    log = LatencyLog()
    for episode_start in (0.0, 100.0):  # two episodes of 11 ticks at 10 Hz, a long pause between them
        log.episode_starts.append(len(log.tick_start_s))
        for k in range(11):
            deadline = episode_start + 0.1 * k
            log.add_tick(deadline, deadline + 0.001 * k)
            log.add_ages({"robot": 0.002, "camera/base": 0.03 + 0.001 * k})
    log.inference_s = list(np.linspace(0.01, 0.1, 10))
    log.commands_sent = 22
    log.safety_counters = {"ee_step": 5, "watchdog_policy": 2, "stopped": 1}
    return log


def test_summary_percentiles_rates_and_counters():
    report = summarize(_log(), control_hz=10.0)
    assert report["ticks"] == 22
    assert report["achieved_hz"] == pytest.approx(10 / 1.01)  # the pause between episodes is not a period
    assert report["loop_period_ms"]["max"] == pytest.approx(101.0)
    assert report["loop_jitter_ms"]["max"] == pytest.approx(10.0)
    assert report["inference_ms"]["p50"] == pytest.approx(55.0)
    assert report["inference_ms"]["max"] == pytest.approx(100.0)
    assert report["obs_age_ms"]["camera/base"]["max"] == pytest.approx(40.0)
    assert report["commands_clipped"] == {"ee_step": 5}
    assert report["commands_refused"] == {"watchdog_policy": 2, "stopped": 1}


def test_report_files(tmp_path):
    json_path, png_path = write_report(_log(), 10.0, tmp_path / "report")
    assert json.loads(json_path.read_text())["commands_sent"] == 22
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["latency.json", "latency.png"]
