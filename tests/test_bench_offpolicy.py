"""The off-policy benchmark's thresholds and env-step ratios (`scripts/bench_offpolicy.py`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_offpolicy import thresholds, with_ratios  # noqa: E402


def _curve(successes: list[float]) -> list[dict]:
    return [{"env_steps": 1000 * i, "wall_seconds": 10.0 * i, "success_mean": s} for i, s in enumerate(successes)]


def test_a_bc_above_ninety_percent_of_dppos_final_is_judged_by_dppos_gain():
    summary = {"dppo": {"mean_curve": _curve([0.88, 0.90, 0.94, 0.94])},
               "filtered_bc": {"mean_curve": _curve([0.88, 0.93, 0.94])}}
    targets = thresholds(summary["dppo"]["mean_curve"])
    assert targets[""] == 0.9 * 0.94 and abs(targets["gain_"] - (0.88 + 0.9 * 0.06)) < 1e-12
    with_ratios(summary, targets)
    # Both start above 0.9 x 0.94: that threshold is met before any update and gives no ratio.
    assert summary["filtered_bc"]["env_steps_to_target"] == 0 and summary["filtered_bc"]["env_step_ratio"] is None
    assert summary["dppo"]["gain_env_steps_to_target"] == 2000
    assert summary["filtered_bc"]["gain_env_steps_to_target"] == 2000
    assert summary["filtered_bc"]["gain_env_step_ratio"] == 1.0


def test_ratios_are_env_steps_over_dppos_and_absent_when_dppo_gained_nothing():
    summary = {"dppo": {"mean_curve": _curve([0.5, 0.6, 0.8, 0.9])}, "dsrl": {"mean_curve": _curve([0.5, 0.85])}}
    with_ratios(summary, thresholds(summary["dppo"]["mean_curve"]))
    assert summary["dsrl"]["env_step_ratio"] == 1000 / 3000 and summary["dsrl"]["gain_env_step_ratio"] is None
    flat = {"dppo": {"mean_curve": _curve([0.8, 0.7, 0.75])}, "dsrl": {"mean_curve": _curve([0.8, 0.9])}}
    targets = thresholds(flat["dppo"]["mean_curve"])
    with_ratios(flat, targets)
    assert targets["gain_"] is None and flat["dsrl"]["gain_env_steps_to_target"] is None
