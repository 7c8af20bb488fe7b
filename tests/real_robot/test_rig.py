"""Rig presets: loading, the sim-to-real check (what a checkpoint needs that a rig cannot give), and the
observation builder (segments, frames, units)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from robotft.config import ConfigError
from robotft.real_robot.rig import ObservationBuilder, check_rig, load_rig
from robotft.real_robot.robot import RobotState
from robotft.real_robot.sim_scene import ObjectPose
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

PUSH_CUBE_NAMES = tuple(
    [f"agent/qpos/{i}" for i in range(9)]
    + [f"agent/qvel/{i}" for i in range(9)]
    + [f"extra/tcp_pose/{i}" for i in range(7)]
    + [f"extra/goal_pos/{i}" for i in range(3)]
    + [f"extra/obj_pose/{i}" for i in range(7)]
)
"""ManiSkill PushCube-v1's `state` names (robotft.envs.maniskill; checked against the env below)."""


def push_cube_spec(names=PUSH_CUBE_NAMES, control_mode="pd_ee_delta_pose", hz=20.0, extra=None) -> EnvSpec:
    obs = {"state": FeatureSpec("state", (len(names),), "float32", unit="mixed", frame="world", names=names)}
    obs.update(extra or {})
    dim = 7 if control_mode == "pd_ee_delta_pose" else 8
    return EnvSpec(obs, ActionSpec(control_mode, dim, (-1.0,) * dim, (1.0,) * dim, hz, "robot_base"))


def test_presets_load_by_name():
    sim, real = load_rig("sim_franka"), load_rig("franka_d435")
    assert sim.simulated and not real.simulated
    assert sim.world_from_base.pos == (-0.615, 0.0, 0.0)
    assert [c.name for c in real.cameras] == ["base", "wrist"]
    with pytest.raises(ConfigError, match="no real_robot preset named 'nope'"):
        load_rig("nope")


def test_sim_rig_provides_push_cube_state():
    assert check_rig(load_rig("sim_franka"), push_cube_spec(), ["state"]) == []


def test_hardware_rig_names_what_it_cannot_provide():
    problems = check_rig(load_rig("franka_d435"), push_cube_spec(), ["state"])
    assert len(problems) == 1 and "extra/obj_pose" in problems[0] and "'cube'" in problems[0]


def test_missing_keys_segments_modes_and_rates_are_all_listed():
    spec = push_cube_spec(
        names=(*PUSH_CUBE_NAMES, "extra/peg_pose/0", "extra/peg_pose/1"),
        control_mode="pd_joint_delta_pos",
        hz=10.0,
        extra={"rgb/wrist": FeatureSpec("rgb/wrist", (128, 128, 3), "uint8", unit="rgb8")},
    )
    rig = load_rig("sim_franka")
    rig = dataclasses.replace(rig, actions=[a for a in rig.actions if a.control_mode == "pd_ee_delta_pose"])
    text = "\n".join(check_rig(rig, spec, ["state", "rgb/wrist"]))
    assert "state: no rig source for extra/peg_pose (2 dims)" in text
    assert "rgb/wrist: the rig has no source" in text
    assert "control mode 'pd_joint_delta_pos' is not executable" in text


def test_wrong_rate_size_unit_and_image_shape_are_refused():
    spec = push_cube_spec(
        hz=10.0, extra={"rgb/base": FeatureSpec("rgb/base", (96, 96, 3), "uint8", unit="rgb8")}
    )
    spec.observations["state"] = dataclasses.replace(spec.observations["state"], unit="m")
    text = "\n".join(check_rig(load_rig("franka_d435"), spec, ["state", "rgb/base"]))
    assert "trained at 10 Hz, the rig runs at 20 Hz" in text
    assert "the checkpoint's unit is 'm', the rig provides 'mixed'" in text
    assert "expects 96x96 images, camera 'base' gives 480x640" in text


def test_unnamed_state_is_checked_by_size():
    rig = load_rig("sim_franka")
    ok = push_cube_spec()
    ok.observations["state"] = dataclasses.replace(ok.observations["state"], names=())
    assert check_rig(rig, ok, ["state"]) == []
    short = EnvSpec({"state": FeatureSpec("state", (30,), "float32", unit="mixed", frame="world")}, ok.action)
    assert "30 (unnamed) dims, the rig's sources give 35" in check_rig(rig, short, ["state"])[0]


def test_observation_builder_segments_and_frames():
    rig = load_rig("sim_franka")
    builder = ObservationBuilder(rig, push_cube_spec(), ["state"])
    assert builder.stream_names == ["object/cube", "object/goal", "robot"]
    state = RobotState(
        timestamp_s=0.0,
        joint_positions=np.arange(7) * 0.1,
        joint_velocities=np.arange(7) * -0.1,
        ee_pos=[0.6, 0.1, 0.2],
        ee_quat=[0.0, -1.0, 0.0, 0.0],  # a downward TCP with the other sign: quat_nonneg x flips it
        gripper_width=0.06,
    )
    samples = {
        "robot": state,
        "object/cube": ObjectPose(0.0, np.array([0.7, -0.05, 0.02]), np.array([-1.0, 0.0, 0.0, 0.0])),
        "object/goal": ObjectPose(0.0, np.array([0.9, -0.05, 0.001]), np.array([1.0, 0.0, 0.0, 0.0])),
    }
    s = builder.build(samples)["state"]
    assert s.dtype == np.float32 and s.shape == (35,)
    np.testing.assert_allclose(s[:9], [*state.joint_positions, 0.03, 0.03], atol=1e-6)
    np.testing.assert_allclose(s[9:18], [*state.joint_velocities, 0, 0], atol=1e-6)
    # World frame: ManiSkill puts the robot base at x = -0.615.
    np.testing.assert_allclose(s[18:25], [-0.015, 0.1, 0.2, 0, 1, 0, 0], atol=1e-6)
    np.testing.assert_allclose(s[25:28], [0.285, -0.05, 0.001], atol=1e-6)
    np.testing.assert_allclose(s[28:35], [0.085, -0.05, 0.02, 1, 0, 0, 0], atol=1e-6)


def _maniskill_first_state(preset: str) -> tuple[np.ndarray, EnvSpec]:
    """The `state` of env 0 after `reset(seed=0)` of a ManiSkill env preset (CPU physics), and the env's spec."""
    from robotft.config import load_env_config
    from robotft.envs.factory import make_env

    env = make_env(dataclasses.replace(load_env_config(preset), sim_backend="physx_cpu"))
    try:
        return env.reset(seed=0)["state"][0].numpy(), env.spec
    finally:
        env.close()


@pytest.mark.maniskill
def test_maniskill_push_cube_names_its_state_and_the_sim_rig_accepts_it():
    obs, spec = _maniskill_first_state("maniskill/push_cube")
    assert spec.observations["state"].names == PUSH_CUBE_NAMES
    assert check_rig(load_rig("sim_franka"), spec, ["state"]) == []
    # The TCP pose segment is the tcp in ManiSkill's world frame: a downward gripper (|x| ~ 1) in front of x=0.
    tcp = obs[18:25]
    assert abs(tcp[4]) > 0.9 and -0.2 < tcp[0] < 0.2


PICK_CUBE_NAMES = tuple(
    [f"agent/qpos/{i}" for i in range(9)]
    + [f"agent/qvel/{i}" for i in range(9)]
    + ["extra/is_grasped"]
    + [f"extra/tcp_pose/{i}" for i in range(7)]
    + [f"extra/goal_pos/{i}" for i in range(3)]
    + [f"extra/obj_pose/{i}" for i in range(7)]
    + [f"extra/tcp_to_obj_pos/{i}" for i in range(3)]
    + [f"extra/obj_to_goal_pos/{i}" for i in range(3)]
)
"""ManiSkill PickCube-v1's `state` names (checked against the env below)."""


def test_pick_cube_rig_builds_grasp_flag_and_relative_positions():
    rig = load_rig("sim_franka_pick_cube")
    spec = push_cube_spec(PICK_CUBE_NAMES)
    spec = EnvSpec(spec.observations, ActionSpec("pd_ee_delta_pos", 4, (-1.0,) * 4, (1.0,) * 4, 20.0, "robot_base"))
    assert check_rig(rig, spec, ["state"]) == []
    builder = ObservationBuilder(rig, spec, ["state"])
    state = RobotState(0.0, np.zeros(7), np.zeros(7), [0.6, 0.1, 0.2], [0.0, 1.0, 0.0, 0.0], 0.04)
    cube = ObjectPose(0.0, np.array([0.7, -0.05, 0.02]), np.array([1.0, 0.0, 0.0, 0.0]), grasped=True)
    goal = ObjectPose(0.0, np.array([0.65, 0.05, 0.25]), np.array([1.0, 0.0, 0.0, 0.0]))
    s = builder.build({"robot": state, "object/cube": cube, "object/goal": goal})["state"]
    assert s.shape == (42,) and s[18] == 1.0
    np.testing.assert_allclose(s[26:29], [0.035, 0.05, 0.25], atol=1e-6)  # goal, world frame
    np.testing.assert_allclose(s[36:39], [0.1, -0.15, -0.18], atol=1e-6)  # cube - tcp
    np.testing.assert_allclose(s[39:42], [-0.05, 0.1, 0.23], atol=1e-6)  # goal - cube
    released = dataclasses.replace(cube, grasped=False)
    assert builder.build({"robot": state, "object/cube": released, "object/goal": goal})["state"][18] == 0.0
    # Only a simulated scene tells grasps: on hardware (fiducial poses) the flag is refused.
    hardware = dataclasses.replace(rig, simulated=False)
    assert any("grasps 'cube'" in p for p in check_rig(hardware, spec, ["state"]))


@pytest.mark.maniskill
def test_maniskill_pick_cube_names_its_state_and_the_pick_rig_accepts_it():
    obs, spec = _maniskill_first_state("maniskill/pick_cube")
    assert spec.observations["state"].names == PICK_CUBE_NAMES
    assert check_rig(load_rig("sim_franka_pick_cube"), spec, ["state"]) == []
    # tcp_to_obj_pos = obj - tcp and obj_to_goal_pos = goal - obj, all in the world frame.
    np.testing.assert_allclose(obs[36:39], obs[29:32] - obs[19:22], atol=1e-5)
    np.testing.assert_allclose(obs[39:42], obs[26:29] - obs[29:32], atol=1e-5)
