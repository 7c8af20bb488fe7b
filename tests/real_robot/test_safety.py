"""SafetyLayer: no emitted command violates a limit whatever the policy outputs; watchdog, stop, counters."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from robotft.real_robot.robot import RobotCommand, RobotState
from robotft.real_robot.safety import (
    PANDA_JOINT_POS_MAX,
    PANDA_JOINT_POS_MIN,
    SafetyLayer,
    SafetyLimits,
    panda_tcp_position,
)

DT = 0.1
TOL = 1e-9
READY_Q = np.array([0.0, -math.pi / 4, 0.0, -3 * math.pi / 4, 0.0, math.pi / 2, math.pi / 4])
READY_POS = np.array([0.30689, 0.0, 0.48688])  # TCP of READY_Q with the Franka Hand (FK below)
IDENTITY = np.array([1.0, 0.0, 0.0, 0.0])

EXTREMES = [math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, -0.0, 5e-324]
# Mostly plausible values (so the arm actually moves and limits bind), plus garbage of every kind.
wild = st.one_of(
    st.floats(-4.0, 4.0), st.sampled_from(EXTREMES), st.floats(allow_nan=True, allow_infinity=True)
)


def state(q=READY_Q, pos=READY_POS, quat=IDENTITY, width=0.04, t=0.0) -> RobotState:
    return RobotState(t, q, np.zeros(7), pos, quat, width)


def make_layer(limits: SafetyLimits | None = None) -> SafetyLayer:
    return SafetyLayer(limits or SafetyLimits(), control_dt=DT)


def beat(layer: SafetyLayer, now: float) -> None:
    layer.watchdog.heartbeat("policy", now)
    layer.watchdog.heartbeat("camera", now)


def joint_cmd(q, width=0.04, force=20.0, t=0.0) -> RobotCommand:
    return RobotCommand("joint_position", t, width, force, joint_positions=q)


def ee_cmd(pos, quat, width=0.04, force=20.0, t=0.0) -> RobotCommand:
    return RobotCommand("ee_pose", t, width, force, ee_pos=pos, ee_quat=quat)


def quat_angle(a, b) -> float:
    return 2 * math.acos(min(1.0, abs(float(np.dot(a, b)))))


def check_gripper(cmd: RobotCommand, lim: SafetyLimits) -> None:
    assert lim.gripper_width_min <= cmd.gripper_width <= lim.gripper_width_max
    assert 0.0 <= cmd.gripper_force <= lim.gripper_force_max


def test_forward_kinematics_matches_the_panda_ready_pose():
    np.testing.assert_allclose(panda_tcp_position(READY_Q, 0.1034), READY_POS, atol=1e-4)
    np.testing.assert_allclose(panda_tcp_position(np.zeros(7), 0.0), [0.088, 0.0, 0.926], atol=1e-9)


def held(command: st.SearchStrategy) -> st.SearchStrategy:
    """Sequences of commands, each repeated 1-8 times: a held target builds up speed, so the
    velocity, acceleration and braking limits actually bind (fresh random targets rarely do)."""
    return st.lists(st.tuples(command, st.integers(1, 8)), min_size=1, max_size=8).map(
        lambda segments: [c for c, n in segments for _ in range(n)]
    )


joint_commands = held(st.tuples(st.lists(wild, min_size=7, max_size=7), wild, wild))
start_q = st.lists(st.floats(0.0, 1.0), min_size=7, max_size=7).map(
    lambda u: (
        np.array(PANDA_JOINT_POS_MIN)
        + np.array(u) * (np.array(PANDA_JOINT_POS_MAX) - np.array(PANDA_JOINT_POS_MIN))
    )
)


@settings(max_examples=150, deadline=None)
@given(q0=start_q, commands=joint_commands)
def test_joint_targets_respect_position_velocity_and_acceleration_limits(q0, commands):
    # A box the arm cannot leave, so that only the joint limits bind.
    lim = SafetyLimits(workspace_min=(-2.0, -2.0, -2.0), workspace_max=(2.0, 2.0, 2.0))
    layer = make_layer(lim)
    vmax, amax = np.array(lim.joint_vel_max), np.array(lim.joint_acc_max)
    prev_q, prev_v = q0, np.zeros(7)
    for k, (q, width, force) in enumerate(commands):
        now = k * DT
        beat(layer, now)
        safe, _ = layer.filter(joint_cmd(q, width, force, t=now), state(q=q0), now)
        out = safe.joint_positions
        assert np.all(np.isfinite(out))
        assert np.all(out >= np.array(lim.joint_pos_min) - TOL) and np.all(
            out <= np.array(lim.joint_pos_max) + TOL
        )
        v = (out - prev_q) / DT
        assert np.all(np.abs(v) <= vmax + 1e-6), f"velocity {v} at step {k}"
        assert np.all(np.abs(v - prev_v) <= amax * DT + 1e-6), f"acceleration {(v - prev_v) / DT} at step {k}"
        check_gripper(safe, lim)
        prev_q, prev_v = out, v


@settings(max_examples=100, deadline=None)
@given(commands=joint_commands)
def test_joint_targets_keep_the_tcp_in_the_workspace_box(commands):
    lim = SafetyLimits()
    layer = make_layer(lim)
    prev_q = READY_Q
    for k, (q, width, force) in enumerate(commands):
        beat(layer, k * DT)
        safe, _ = layer.filter(joint_cmd(q, width, force), state(), k * DT)
        tcp = panda_tcp_position(safe.joint_positions, lim.flange_to_tcp_m)
        assert np.all(tcp >= np.array(lim.workspace_min) - TOL) and np.all(
            tcp <= np.array(lim.workspace_max) + TOL
        )
        # Position and velocity limits hold even when the box forces a stop.
        assert np.all(np.abs(safe.joint_positions - prev_q) <= np.array(lim.joint_vel_max) * DT + 1e-6)
        prev_q = safe.joint_positions


# Targets near the start pose (within a few steps) as well as anywhere, garbage included.
near = st.lists(st.floats(-0.1, 0.1), min_size=3, max_size=3).map(lambda d: list(READY_POS + np.array(d)))
ee_commands = held(
    st.tuples(
        st.one_of(near, st.lists(wild, min_size=3, max_size=3)),
        st.lists(wild, min_size=4, max_size=4),
        wild,
        wild,
    )
)


@settings(max_examples=150, deadline=None)
@given(commands=ee_commands)
def test_ee_targets_stay_in_the_box_and_respect_step_limits(commands):
    lim = SafetyLimits()
    layer = make_layer(lim)
    prev_pos, prev_quat = READY_POS, IDENTITY
    for k, (pos, quat, width, force) in enumerate(commands):
        beat(layer, k * DT)
        safe, _ = layer.filter(ee_cmd(pos, quat, width, force), state(), k * DT)
        assert np.all(np.isfinite(safe.ee_pos)) and np.all(np.isfinite(safe.ee_quat))
        assert np.all(safe.ee_pos >= np.array(lim.workspace_min) - TOL)
        assert np.all(safe.ee_pos <= np.array(lim.workspace_max) + TOL)
        assert np.linalg.norm(safe.ee_pos - prev_pos) <= lim.max_ee_step_m + TOL
        assert abs(np.linalg.norm(safe.ee_quat) - 1.0) <= 1e-9
        assert quat_angle(safe.ee_quat, prev_quat) <= lim.max_rot_step_rad + 1e-6
        check_gripper(safe, lim)
        prev_pos, prev_quat = safe.ee_pos, safe.ee_quat


def test_nothing_moves_before_the_first_heartbeats():
    layer = make_layer()
    safe, report = layer.filter(ee_cmd(READY_POS + 0.01, IDENTITY), state(), 0.0)
    assert report.halted == ("watchdog_camera", "watchdog_policy")
    np.testing.assert_array_equal(safe.ee_pos, READY_POS)


def test_watchdog_stops_the_arm_when_inference_is_delayed():
    # A box the arm cannot leave: this test is about the watchdog, not the workspace.
    lim = SafetyLimits(policy_timeout_s=0.35, workspace_min=(-2.0, -2.0, -2.0), workspace_max=(2.0, 2.0, 2.0))
    layer = make_layer(lim)
    direction = np.array([1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0])  # a 0.5 rad/s ramp, within the joint limits
    qs, halted = [READY_Q], []
    for k in range(40):
        now = k * DT
        layer.watchdog.heartbeat("camera", now)
        if now < 1.0:  # the policy stalls at t = 1 s
            layer.watchdog.heartbeat("policy", now)
        safe, report = layer.filter(joint_cmd(READY_Q + 0.05 * k * direction, t=now), state(), now)
        qs.append(safe.joint_positions)
        halted.append("watchdog_policy" in report.halted)
    first = halted.index(True)
    assert first == 13  # the first tick more than 0.35 s after the last heartbeat at t = 0.9 s
    assert all(halted[first:]) and not any(halted[:first])
    speeds = np.abs(np.diff(np.stack(qs), axis=0)) / DT
    assert speeds[first - 1].max() > 0.4  # it was moving when the policy stalled
    # Brakes within the acceleration limits, then stands still.
    assert np.all(np.diff(speeds[first - 1 :], axis=0) <= 1e-9)
    assert np.all(speeds[first + 5 :] == 0.0)
    assert layer.counters["watchdog_policy"] == len(halted) - first


def test_stale_camera_halts_until_it_beats_again():
    layer = make_layer(SafetyLimits(camera_timeout_s=0.2))
    beat(layer, 0.0)
    layer.watchdog.heartbeat("policy", 0.5)
    _, report = layer.filter(ee_cmd(READY_POS, IDENTITY), state(), 0.5)
    assert report.halted == ("watchdog_camera",)
    layer.watchdog.heartbeat("camera", 0.55)
    _, report = layer.filter(ee_cmd(READY_POS, IDENTITY), state(), 0.6)
    assert report.halted == ()


def test_software_stop_latches_until_reset():
    layer = make_layer()
    beat(layer, 0.0)
    target = READY_POS + np.array([0.01, 0.0, 0.0])
    layer.trigger_stop()
    for k in range(3):
        beat(layer, k * DT)
        safe, report = layer.filter(ee_cmd(target, IDENTITY), state(), k * DT)
        assert report.halted == ("stopped",) and layer.stopped
        np.testing.assert_array_equal(safe.ee_pos, READY_POS)
    layer.reset()
    assert not layer.stopped
    beat(layer, 1.0)
    safe, report = layer.filter(ee_cmd(target, IDENTITY), state(), 1.0)
    assert report.halted == () and np.allclose(safe.ee_pos, target)
    assert layer.counters == {"stopped": 3}


def test_counters_count_each_reason_once_per_command():
    layer = make_layer()
    beat(layer, 0.0)
    step_x = READY_POS + np.array([SafetyLimits().max_ee_step_m, 0.0, 0.0])  # where the 2nd command ends
    commands = [
        ee_cmd([math.nan, 0.0, 0.3], IDENTITY),  # non_finite -> hold
        ee_cmd([5.0, 0.0, 0.48688], IDENTITY),  # workspace and ee_step
        ee_cmd(step_x, [0.0, 0.0, 0.0, 0.0]),  # bad_quaternion
        ee_cmd(step_x, [0.0, 1.0, 0.0, 0.0], width=1.0, force=-5.0),  # rotation, gripper width, force
        ee_cmd(step_x, IDENTITY, force=math.inf),  # non_finite force
    ]
    reports = [layer.filter(c, state(), 0.01 * i)[1] for i, c in enumerate(commands)]
    assert [r.clipped for r in reports] == [
        ("non_finite",),
        ("workspace", "ee_step"),
        ("bad_quaternion",),
        ("gripper_width", "gripper_force", "rotation_step"),
        ("non_finite",),  # and back to IDENTITY, exactly one rotation step away
    ]
    assert layer.counters == {
        "non_finite": 2,
        "workspace": 1,
        "ee_step": 1,
        "bad_quaternion": 1,
        "gripper_width": 1,
        "gripper_force": 1,
        "rotation_step": 1,
    }


def test_nan_joint_target_holds_the_previous_target():
    layer = make_layer()
    beat(layer, 0.0)
    safe, report = layer.filter(joint_cmd(np.full(7, math.nan)), state(), 0.0)
    np.testing.assert_array_equal(safe.joint_positions, READY_Q)
    assert report.clipped == ("non_finite",)


def test_clips_are_logged_at_a_limited_rate(caplog):
    layer = make_layer()
    beat(layer, 0.0)
    with caplog.at_level(logging.WARNING, logger="robotft.real_robot.safety"):
        for i in range(10):
            beat(layer, 0.05 * i)
            layer.filter(ee_cmd(READY_POS, IDENTITY, width=1.0), state(), 0.05 * i)  # 0 .. 0.45 s
        beat(layer, 1.0)
        layer.filter(ee_cmd(READY_POS, IDENTITY, width=1.0), state(), 1.0)
    lines = [r.getMessage() for r in caplog.records if "gripper_width" in r.getMessage()]
    assert lines == [
        "safety: 1 command(s) clipped for 'gripper_width' since the last report (1 in total)",
        "safety: 10 command(s) clipped for 'gripper_width' since the last report (11 in total)",
    ]
    assert layer.counters["gripper_width"] == 11


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workspace_min": (0.9, -0.5, 0.0)}, r"workspace_min must be below workspace_max.*\[0\]"),
        ({"joint_vel_max": (1.0,) * 6}, r"joint_vel_max must be 7 finite numbers"),
        ({"joint_acc_max": (1.0,) * 6 + (0.0,)}, r"joint_acc_max must be > 0"),
        ({"max_ee_step_m": math.nan}, r"max_ee_step_m must be a finite number > 0"),
        ({"gripper_width_max": -0.1}, r"gripper_width_min < gripper_width_max"),
    ],
)
def test_limits_are_validated_with_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SafetyLimits(**kwargs)
