"""Teleoperated evaluation: keyboard events through a real pipe, the scene's success predicate for
`--no-operator`, and the tally with its Wilson interval."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from robotft.evaluation import wilson_interval
from robotft.real_robot.operator import KeyboardOperator, SceneJudge, Tally
from robotft.real_robot.rig import SuccessConfig
from robotft.real_robot.sim_scene import ObjectPose


@pytest.fixture
def keyboard():
    read_fd, write_fd = os.pipe()
    stream = os.fdopen(read_fd, "rb", buffering=0)
    operator = KeyboardOperator(stream, out=io.StringIO(), spacemouse=False)
    yield operator, write_fd
    operator.close()
    os.close(write_fd)
    stream.close()


def test_keyboard_events(keyboard):
    operator, keys = keyboard
    assert operator.poll() == []  # nothing typed: returns at once
    resets = []
    os.write(keys, b"zrg")
    assert operator.wait_start(0, lambda: resets.append(1))
    assert resets == [1]
    os.write(keys, b"t s\n")
    assert operator.poll() == ["takeover", "stop", "success", "start"]
    os.write(keys, b"xf")
    assert operator.label_timeout() == "failure"
    os.write(keys, b"q")
    assert not operator.wait_start(1, lambda: None)


def test_keys_typed_with_start_or_an_outcome_are_not_lost(keyboard):
    """`g` then space typed quickly arrive in one read: the stop must still reach the episode (it once was dropped,
    and an episode ran on after its stop key)."""
    operator, keys = keyboard
    os.write(keys, b"gx")
    assert operator.wait_start(0, lambda: None)
    assert operator.poll() == ["stop"] and operator.poll() == []
    os.write(keys, b"sg")
    assert operator.label_timeout() == "success"
    assert operator.wait_start(1, lambda: None)  # the g typed with the label starts the next episode


def test_keyboard_input_closed_is_an_error():
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    with os.fdopen(read_fd, "rb", buffering=0) as stream:
        operator = KeyboardOperator(stream, out=io.StringIO(), spacemouse=False)
        with pytest.raises(EOFError, match="operator input closed"):
            operator.poll()


def test_scene_judge_success_predicate():
    judge = SceneJudge(SuccessConfig(object="cube", goal="goal", radius_m=0.1, axes="xy"))
    pose = lambda x, z=0.02: ObjectPose(0.0, np.array([x, 0.0, z]), np.array([1.0, 0, 0, 0]))  # noqa: E731
    assert judge.wait_start(0, lambda: None) and judge.poll() == []
    assert judge.judge({"cube": pose(0.6), "goal": pose(0.8)}) is None
    assert judge.judge({"cube": pose(0.75, z=0.3), "goal": pose(0.8)}) == "success"  # xy only
    assert judge.label_timeout() == "timeout"
    with pytest.raises(KeyError, match="no object 'goal'"):
        judge.judge({"cube": pose(0.6)})


def test_scene_judge_3d_radius_and_static_arm():
    """ManiSkill PickCube: the cube within 0.025 m of the goal in 3-D, and no arm joint faster than 0.2 rad/s."""
    from robotft.real_robot.robot import RobotState

    judge = SceneJudge(SuccessConfig(radius_m=0.025, axes="xyz", max_joint_speed_rad_s=0.2))
    goal = ObjectPose(0.0, np.array([0.6, 0.0, 0.2]), np.array([1.0, 0, 0, 0]))
    cube = lambda dz: ObjectPose(0.0, np.array([0.6, 0.01, 0.2 + dz]), np.array([1.0, 0, 0, 0]))  # noqa: E731
    arm = lambda speed: RobotState(0.0, np.zeros(7), np.r_[np.zeros(6), speed], np.zeros(3), np.r_[1.0, 0, 0, 0], 0.04)  # noqa: E731
    assert judge.judge({"cube": cube(0.02), "goal": goal}, arm(0.0)) == "success"
    assert judge.judge({"cube": cube(0.03), "goal": goal}, arm(0.0)) is None  # xy within, 3-D not
    assert judge.judge({"cube": cube(0.02), "goal": goal}, arm(-0.25)) is None  # one joint too fast
    with pytest.raises(ValueError, match="no robot state"):
        judge.judge({"cube": cube(0.0), "goal": goal})
    with pytest.raises(ValueError, match="max_joint_speed_rad_s"):
        SuccessConfig(max_joint_speed_rad_s=0.0)


def test_tally_scores_successes_failures_and_timeouts_only():
    tally = Tally()
    for outcome in ["success", "failure", "timeout", "abort", "success", "stopped", "success"]:
        tally.add(outcome)
    assert tally.scored == 5 and tally.successes == 3
    assert tally.success_rate == pytest.approx(0.6)
    assert tally.ci95 == wilson_interval(3, 5)
    d = tally.to_dict()
    assert d["counts"] == {"success": 3, "failure": 1, "timeout": 1, "abort": 1, "stopped": 1}
    with pytest.raises(ValueError, match="unknown outcome"):
        tally.add("maybe")


def test_spacemouse_needs_pyspacemouse_and_says_so():
    from robotft.real_robot.operator import SpaceMouse

    if SpaceMouse.available():
        pytest.skip("pyspacemouse is installed here")
    with pytest.raises(ImportError, match="pip install pyspacemouse"):
        SpaceMouse()
