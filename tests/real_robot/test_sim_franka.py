"""SimFranka: the MuJoCo Panda tracks joint and TCP targets in real time, grips, resets its scene,
and a failure of its physics thread reaches the caller."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from robotft.real_robot.robot import RobotCommand
from robotft.real_robot.safety import SafetyLayer, SafetyLimits, panda_tcp_position
from robotft.real_robot.sim_franka import SimFranka, SimFrankaConfig, SimulationError
from robotft.real_robot.sim_scene import SimMarkerConfig, SimObjectConfig, SimSceneConfig

CONTROL_DT = 0.1

# ManiSkill PushCube in the robot base frame: a 2 cm half-size cube 0.615 m in front of the base,
# randomised +-0.1 m, and a goal disc 0.2 m further along x.
PUSH_CUBE = SimSceneConfig(
    objects=[SimObjectConfig("cube", pos=(0.615, 0.0, 0.02), randomize_xy=(0.1, 0.1))],
    markers=[SimMarkerConfig("goal", size=(0.1, 0.001), pos=(0.2, 0.0, 0.001), relative_to="cube")],
)


@pytest.fixture(scope="module")
def robot():
    """One compiled model for the module (compiling the meshes takes seconds)."""
    return SimFranka(
        SimFrankaConfig(scene=PUSH_CUBE, seed=0), SafetyLayer(SafetyLimits(), CONTROL_DT, cameras=())
    )


def drive(robot: SimFranka, command: dict, seconds: float) -> list:
    """Send `command` at the control rate for `seconds`, as the runner would; returns the states read."""
    states = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        robot.safety.watchdog.heartbeat("policy", now)
        states.append(robot.get_observation())
        robot.send_action(RobotCommand(timestamp_s=now + CONTROL_DT, **command))
        time.sleep(CONTROL_DT)
    return states


def angle_between(q0: np.ndarray, q1: np.ndarray) -> float:
    return 2 * math.acos(min(1.0, abs(float(np.dot(q0, q1)))))


def test_tracks_joint_and_tcp_targets_and_closes_the_gripper_in_real_time(robot):
    with robot:
        robot.reset_episode(seed=1)
        start = time.monotonic()
        home = robot.get_observation()
        # The reported TCP is the one the safety layer's kinematics checks (within robosuite's 0.5 mm).
        np.testing.assert_allclose(home.ee_pos, panda_tcp_position(home.joint_positions, 0.1034), atol=1e-3)
        assert home.gripper_width == pytest.approx(0.08, abs=1e-3)

        q_target = home.joint_positions + np.array([0.15, 0.1, -0.1, -0.15, 0.1, 0.1, 0.2])
        states = drive(
            robot,
            dict(
                control_mode="joint_position", gripper_width=0.0, gripper_force=20.0, joint_positions=q_target
            ),
            0.8,
        )
        reached = robot.get_observation()
        assert np.abs(reached.joint_positions - q_target).max() < 0.01
        assert reached.gripper_width < 0.005  # closed on nothing

        pos_target = reached.ee_pos + np.array([0.04, -0.03, 0.05])
        quat_target = home.ee_quat
        states += drive(
            robot,
            dict(control_mode="ee_pose", gripper_width=0.08, ee_pos=pos_target, ee_quat=quat_target),
            1.0,
        )
        reached = robot.get_observation()
        assert np.linalg.norm(reached.ee_pos - pos_target) < 0.005
        assert angle_between(reached.ee_quat, quat_target) < 0.02
        assert reached.gripper_width > 0.07

        stamps = [s.timestamp_s for s in states]
        assert all(b > a for a, b in zip(stamps, stamps[1:], strict=False))
        # A state is stamped when its physics tick ran: the first one read may predate `start` by < 1 tick.
        assert start - 1e-3 <= stamps[0] and stamps[-1] <= time.monotonic()
        # Real time: simulated time tracks the wall clock (loosely: the machine is shared).
        assert 0.5 < robot.realtime_factor < 1.5


def test_reset_places_objects_and_markers_and_they_rest_on_the_table(robot):
    with robot:
        poses = robot.reset_episode(seed=3)
        cube, goal = poses["cube"].pos, poses["goal"].pos
        assert np.all(np.abs(cube[:2] - [0.615, 0.0]) <= 0.1) and not np.allclose(cube[:2], [0.615, 0.0])
        np.testing.assert_allclose(goal[:2], cube[:2] + [0.2, 0.0])
        assert robot.reset_episode(seed=3)["cube"].pos == pytest.approx(cube)  # seeded: reproducible

        poses = robot.reset_episode(object_poses={"cube": ([0.5, 0.1, 0.05], [1, 0, 0, 0])})
        assert poses["cube"].pos == pytest.approx([0.5, 0.1, 0.05])
        time.sleep(0.5)
        settled = robot.object_poses()["cube"]
        assert settled.pos == pytest.approx([0.5, 0.1, 0.02], abs=2e-3)  # fell 3 cm onto the table
        assert settled.timestamp_s > time.monotonic() - 0.25  # simulated just now
        with pytest.raises(KeyError, match="unknown object"):
            robot.reset_episode(object_poses={"ball": ([0, 0, 0], [1, 0, 0, 0])})


def test_a_failure_in_the_physics_thread_surfaces_on_the_next_call(robot, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MuJoCo writes its warning to MUJOCO_LOG.TXT in the working directory
    with robot:
        robot.reset_episode()
        state = robot.get_observation()
        # Bypass the safety layer on purpose: a NaN target makes MuJoCo refuse the control.
        robot._send_command(RobotCommand("joint_position", 0.0, 0.04, joint_positions=[math.nan] * 7))
        time.sleep(0.1)
        with pytest.raises(SimulationError, match="mjWARN_BADCTRL"):
            robot.get_observation()
        with pytest.raises(SimulationError):
            robot.send_action(
                RobotCommand("joint_position", 0.0, 0.04, joint_positions=state.joint_positions)
            )
    assert not robot.is_connected
    with robot:  # a new session starts clean
        robot.reset_episode()
        assert robot.get_observation().joint_positions == pytest.approx(state.joint_positions)


def test_configs_name_what_is_wrong():
    with pytest.raises(ValueError, match="relative_to 'box' is not an object"):
        SimSceneConfig(markers=[SimMarkerConfig("goal", relative_to="box")])
    with pytest.raises(ValueError, match="repeated"):
        SimSceneConfig(objects=[SimObjectConfig("a")], markers=[SimMarkerConfig("a")])
    with pytest.raises(ValueError, match="stiffness must be 7 numbers > 0"):
        SimFrankaConfig(stiffness=(1.0,) * 6)
    with pytest.raises(ValueError, match="shape must be one of"):
        SimMarkerConfig("goal", shape="cone")
    with pytest.raises(ValueError, match=r"finger_contact_solref must be .*got \(0.02, 0.0\)"):
        SimFrankaConfig(finger_contact_solref=(0.02, 0.0))


def test_the_scene_sets_mujocos_friction_cone():
    import mujoco

    from robotft.real_robot.sim_scene import SimSceneConfig, build_model

    assert SimSceneConfig().friction_cone == "elliptic" and SimSceneConfig().impratio == 10.0
    model = build_model(SimSceneConfig(friction_cone="pyramidal", impratio=2.0), 1000.0, 0.1034)
    assert model.opt.cone == mujoco.mjtCone.mjCONE_PYRAMIDAL and model.opt.impratio == 2.0
    assert build_model(SimSceneConfig(), 1000.0, 0.1034).opt.cone == mujoco.mjtCone.mjCONE_ELLIPTIC
    with pytest.raises(ValueError, match="friction_cone must be one of .*'conical'"):
        SimSceneConfig(friction_cone="conical")


def _squeeze_and_carry(finger_contact_solref):
    """Grasp the PickCube rig's cube (seed 4) and carry it up and sideways in lock-step; the measured finger
    opening at each control step once the fingers have closed, and the cube's height at the end."""
    import dataclasses

    from robotft.real_robot.lockstep import make_lockstep_robot
    from robotft.real_robot.rig import load_rig

    rig = load_rig("sim_franka_pick_cube")
    config = {**rig.robot.config, "finger_contact_solref": finger_contact_solref}
    robot = make_lockstep_robot(dataclasses.replace(rig, robot=dataclasses.replace(rig.robot, config=config)))
    dt = 1.0 / rig.control_hz
    widths = []
    with robot:
        robot.reset_episode(seed=4)  # a yawed cube that robosuite's pads bounce (seeds 0-3 stay still)
        cube = robot.object_poses()["cube"].pos
        quat = robot.get_observation().ee_quat

        def go(target, width, steps, record=False):
            for _ in range(steps):
                here = robot.get_observation()
                # ManiSkill-sized steps: at most 5 cm toward the target per control step
                step = np.clip(np.asarray(target) - here.ee_pos, -0.05, 0.05)
                robot.safety.watchdog.heartbeat("policy", robot.clock())  # the policy is alive
                robot.send_action(RobotCommand("ee_pose", robot.clock() + dt, width,
                                               ee_pos=here.ee_pos + step, ee_quat=quat))
                robot.advance(dt)
                if record:
                    widths.append(robot.get_observation().gripper_width)

        go(cube + [0, 0, 0.08], 0.08, 20)
        go(cube, 0.08, 20)
        go(cube, 0.0, 10)
        go(cube + [0, 0, 0.15], 0.0, 20, record=True)
        go(cube + [-0.1, 0.1, 0.15], 0.0, 20, record=True)
        height = robot.object_poses()["cube"].pos[2]
    return np.array(widths), height


def test_critically_damped_finger_contacts_hold_a_squeezed_cube_still():
    """robosuite's finger pads are under-damped (0.01 s at damping ratio 0.5): a cube squeezed between them
    bounces, the measured opening swinging by millimetres from one control step to the next, which dropped a
    carried cube in 14 of 100 PickCube lock-step episodes. The PickCube rig's `finger_contact_solref` (MuJoCo's
    default contact, critically damped) holds it still; both lift it."""
    damped, damped_height = _squeeze_and_carry([0.02, 1.0])
    bouncy, bouncy_height = _squeeze_and_carry(None)
    assert damped_height > 0.1 and bouncy_height > 0.1, (damped_height, bouncy_height)
    swing = lambda w: float(np.max(np.abs(np.diff(w))))  # noqa: E731 - largest change in one control step
    assert swing(damped) < 0.002 < 0.005 < swing(bouncy), (swing(damped), swing(bouncy))
