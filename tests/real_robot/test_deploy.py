"""The deployment runner against the simulated Franka and simulated camera, in real time, with a policy
checkpoint made here; and `robotft deploy` refusing what a rig cannot run."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import numpy as np
import pytest
import torch
from test_rig import PUSH_CUBE_NAMES, push_cube_spec

from robotft.checkpoint import load_policy, read_checkpoint, write_checkpoint
from robotft.config import EnvConfig, to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.datasets.sampler import SequenceSampler
from robotft.datasets.store import DatasetWriter, ReplayBuffer, validate_store
from robotft.policies.base import build_policy
from robotft.policies.gaussian import GaussianPolicyConfig
from robotft.policies.residual import wrap_residual
from robotft.pretrain import check_dataset_matches_env
from robotft.real_robot.deploy import make_devices
from robotft.real_robot.latency import write_report
from robotft.real_robot.operator import KeyboardOperator, SceneJudge
from robotft.real_robot.rig import load_rig
from robotft.real_robot.runner import Recorder, Runner
from robotft.real_robot.safety import SafetyLayer
from robotft.specs import FeatureSpec

CONTROL_HZ = 20.0


def make_checkpoint(path, names=PUSH_CUBE_NAMES, steps: int = 30):
    """A tiny Gaussian policy BC-trained for a few steps on a PushCube-shaped dataset (35-dim named state,
    `pd_ee_delta_pose` at 20 Hz): small pushes toward +x with the gripper closed, plus noise."""
    spec = push_cube_spec(names)
    rng = np.random.default_rng(0)
    n = 256
    state = rng.normal(0.0, 0.3, (n, len(names))).astype(np.float32)
    action = np.clip(rng.normal([0.3, 0, 0, 0, 0, 0, -1], 0.1, (n, 8, 7)), -1, 1).astype(np.float32)
    normalizer = Normalizer.fit(
        {"state": state, "action": action.reshape(-1, 7)}, {"state": "minmax", "action": "minmax"}
    )
    policy = build_policy(
        GaussianPolicyConfig(hidden_dims=(32,), horizon_steps=8, act_steps=4), spec, normalizer
    )
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    for _ in range(steps):
        loss, _ = policy.loss(
            {"obs": {"state": torch.from_numpy(state[:, None])}, "action": torch.from_numpy(action)}
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    env = EnvConfig(type="maniskill", task="PushCube-v1", max_episode_steps=40, control_hz=CONTROL_HZ)
    write_checkpoint(
        path,
        model_state=policy.export_state_dict(),
        config={"policy": to_dict(policy.config), "env": to_dict(env), "spec": spec.to_dict()},
        normalizer=normalizer,
        meta={"stage": "pretrain", "step": steps},
    )
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "push_cube")


@pytest.fixture(scope="module")
def rig_devices():
    """The sim rig's robot and camera (compiling the MuJoCo scene takes seconds: once per module)."""
    rig = load_rig("sim_franka")
    # A smaller, slower camera than the preset's, and more patience with it: software rendering competes
    # for the 2 shared cores with the physics thread and other tests (a stale camera holds the arm).
    rig.cameras[0].config.update(width=64, height=64, fps=5)
    rig.cameras[0].max_age_s = 1.0
    rig.max_state_age_s = 0.2
    # A tight TCP step limit (the preset allows ManiSkill's full 0.1 m actions) to see it enforced.
    rig.safety = dataclasses.replace(rig.safety, camera_timeout_s=1.0, max_ee_step_m=0.005)
    safety = SafetyLayer(rig.safety, 1.0 / rig.control_hz, cameras=[c.name for c in rig.cameras])
    robot, cameras = make_devices(rig, safety)
    return rig, robot, cameras


def _run(rig, robot, cameras, policy, spec, operator, episodes, seconds, recorder=None, executor=None):
    robot.safety.counters.clear()
    with robot:
        for cam in cameras.values():
            cam.connect()
        try:
            runner = Runner(
                rig,
                policy,
                spec,
                robot,
                cameras,
                operator,
                recorder=recorder,
                episode_time_s=seconds,
                executor=executor,
            )
            return runner.run(episodes)
        finally:
            for cam in cameras.values():
                cam.disconnect()


def test_runner_on_sim_franka_records_at_the_control_rate(checkpoint, rig_devices, tmp_path):
    rig, robot, cameras = rig_devices
    policy, ckpt = load_policy(checkpoint)
    features = Recorder.features(ckpt.spec, ["state"], "ee_pose")
    writer = DatasetWriter(tmp_path / "rec.zarr", features, fps=rig.control_hz, action_spec=ckpt.spec.action)
    result = _run(
        rig,
        robot,
        cameras,
        policy,
        ckpt.spec,
        SceneJudge(rig.success),
        episodes=2,
        seconds=2.0,
        recorder=Recorder(writer, "PushCube-v1"),
    )
    writer.finalize()

    assert [e.outcome in ("success", "timeout") for e in result.episodes] == [True, True]
    validate_store(tmp_path / "rec.zarr")
    buf = ReplayBuffer.open(tmp_path / "rec.zarr")
    assert buf.n_episodes == 2 and buf.features["state"].names == PUSH_CUBE_NAMES
    for i in range(2):
        ep = buf.episode(i)
        assert len(ep["action"]) >= 15  # 40 ticks of 50 ms in 2 s, some held until the camera delivers
        # Commands reach the robot at the configured rate (from the send times).
        # (Loose bounds: the physics thread, the camera's software rendering and other tests share 2 cores.)
        sent_at = ep["command_timestamp"]
        assert np.median(np.diff(sent_at)) == pytest.approx(1 / CONTROL_HZ, rel=0.1)
        assert (len(sent_at) - 1) / (sent_at[-1] - sent_at[0]) == pytest.approx(CONTROL_HZ, rel=0.15)
        ticks = np.diff(ep["timestamp"]) * CONTROL_HZ  # deadlines lie on the fixed-rate grid
        np.testing.assert_allclose(ticks, np.round(ticks), atol=1e-6)
        # What was sent respects the rig's limits: the workspace box and the per-command TCP step.
        sent = ep["sent/ee_pos"]
        assert np.all(sent >= np.array(rig.safety.workspace_min) - 1e-6)
        assert np.all(sent <= np.array(rig.safety.workspace_max) + 1e-6)
        assert np.linalg.norm(np.diff(sent, axis=0), axis=1).max() <= rig.safety.max_ee_step_m + 1e-6
        # The policy pushes toward +x: the arm moved.
        assert ep["robot/ee_pos"][-1, 0] - ep["robot/ee_pos"][0, 0] > 0.02
        assert ep["outcome"][0] in (0, 2) and ep["success"][-1] == (ep["outcome"][0] == 0)
    # The recording feeds BC pretraining again: same keys, spec and control mode as the checkpoint.
    check_dataset_matches_env(buf, ckpt.spec, policy.config)
    sample = SequenceSampler(buf, ["state"], 1, 8)[0]
    assert sample["obs"]["state"].shape == (1, 35) and sample["action"].shape == (8, 7)

    json_path, png_path = write_report(result.latency, rig.control_hz, tmp_path / "report")
    report = json.loads(json_path.read_text())
    assert report["inference_ms"]["count"] >= 10 and report["ticks"] >= 50
    assert report["achieved_hz"] == pytest.approx(CONTROL_HZ, rel=0.1)
    assert set(report["obs_age_ms"]) == {"robot", "object/cube", "object/goal", "camera/base"}
    assert report["commands_clipped"].get("ee_step", 0) > 0  # 0.03 m pushes, 0.005 m allowed here
    assert png_path.stat().st_size > 0


class SlowPolicy(torch.nn.Module):
    """The checkpoint's policy with inference delayed by `delay_s` on every call after the first."""

    def __init__(self, policy, delay_s: float) -> None:
        super().__init__()
        self.policy, self.config, self.delay_s, self.calls = policy, policy.config, delay_s, 0

    def predict_chunk(self, obs, deterministic=True):
        self.calls += 1
        if self.calls > 1:
            time.sleep(self.delay_s)
        return self.policy.predict_chunk(obs, deterministic)


def test_watchdog_holds_the_arm_when_inference_stalls(checkpoint, rig_devices):
    rig, robot, cameras = rig_devices
    policy, ckpt = load_policy(checkpoint)
    slow = SlowPolicy(policy, delay_s=2.0 * rig.safety.policy_timeout_s)
    result = _run(
        rig,
        robot,
        cameras,
        slow,
        ckpt.spec,
        SceneJudge(rig.success),
        episodes=1,
        seconds=1.6,
        executor="async",
    )
    refused = result.latency.safety_counters.get("watchdog_policy", 0)
    assert refused >= 3, result.latency.safety_counters


def test_stop_key_latches_the_safety_stop(checkpoint, rig_devices):
    rig, robot, cameras = rig_devices
    policy, ckpt = load_policy(checkpoint)
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb", buffering=0) as stream:
        operator = KeyboardOperator(stream, out=open(os.devnull, "w"), spacemouse=False)  # noqa: SIM115
        os.write(write_fd, b"g")
        threading.Timer(0.7, os.write, (write_fd, b" ")).start()
        try:
            result = _run(rig, robot, cameras, policy, ckpt.spec, operator, episodes=1, seconds=5.0)
            assert robot.safety.stopped
        finally:
            operator.close()
            os.close(write_fd)
    assert result.episodes[0].outcome == "stopped"
    assert result.tally.scored == 0
    # The key (0.7 s after the start; the episode starts once the camera has delivered) ended it at once.
    assert result.episodes[0].duration_s < 2.0


class PlanStepRecorder(torch.nn.Module):
    """A policy that records the `plan_step` of every query."""

    def __init__(self, policy) -> None:
        super().__init__()
        self.policy, self.config, self.steps = policy, policy.config, []

    def predict_chunk(self, obs, deterministic=True):
        self.steps.append(int(obs["plan_step"][0, -1, 0]))
        return self.policy.predict_chunk(obs, deterministic)


class TakeoverAfter(SceneJudge):
    """Takes over once the policy has been queried `after` times, and hands back `ticks` ticks later."""

    def __init__(self, success, policy: PlanStepRecorder, after: int, ticks: int) -> None:
        super().__init__(success)
        self.policy, self.after, self.ticks, self.polls_since = policy, after, ticks, None

    def poll(self) -> list[str]:
        if self.polls_since is None and len(self.policy.steps) >= self.after:
            self.polls_since = 0
            return ["takeover"]
        if self.polls_since is not None:
            self.polls_since += 1
            if self.polls_since == self.ticks:
                return ["takeover"]
        return []


def test_a_closed_loop_residual_re_plans_when_the_operator_hands_back_control(checkpoint, rig_devices, tmp_path):
    """In real time on the sim rig a closed-loop residual is queried on every tick with its plan step counting
    0..K-1; a take-over holds the arm (no teleoperation device), and handing control back starts a new plan."""
    rig, robot, cameras = rig_devices
    policy, ckpt = load_policy(closed_loop_checkpoint(checkpoint, tmp_path / "closed_loop"))
    recorder = PlanStepRecorder(policy)
    operator = TakeoverAfter(rig.success, recorder, after=6, ticks=3)
    result = _run(rig, robot, cameras, recorder, ckpt.spec, operator, episodes=1, seconds=1.5)
    assert result.episodes[0].outcome == "timeout" and len(recorder.steps) >= 10
    assert recorder.steps[:6] == [0, 1, 2, 3, 0, 1]
    assert recorder.steps[6:] == [i % 4 for i in range(len(recorder.steps) - 6)]


# ---- the command line ----------------------------------------------------------------------------------


def test_deploy_refuses_a_checkpoint_the_rig_cannot_feed(cli, tmp_path):
    names = (*PUSH_CUBE_NAMES[:-7], *[f"extra/peg_pose/{i}" for i in range(7)])
    ckpt = make_checkpoint(tmp_path / "peg", names=names, steps=1)
    proc = cli.run(
        "deploy",
        ckpt,
        "--rig",
        "sim_franka",
        "--no-operator",
        "--record",
        tmp_path / "r.zarr",
        cwd=tmp_path,
        expect_rc=1,
    )
    assert "cannot deploy checkpoint" in proc.stderr and "extra/peg_pose (7 dims)" in proc.stderr
    assert not (tmp_path / "r.zarr").exists()


def closed_loop_checkpoint(checkpoint, path):
    """A zero-initialised closed-loop residual (`residual_ppo_step`'s policy) over the checkpoint's policy."""
    base, ckpt = load_policy(checkpoint)
    residual = wrap_residual(base, (16,), -4.0, closed_loop=True)
    write_checkpoint(path, model_state=residual.export_state_dict(), normalizer=ckpt.normalizer,
                     config={**ckpt.config, "policy": to_dict(residual.config)}, meta={"stage": "finetune"})
    return path


def test_deploy_runs_a_closed_loop_residual_with_one_action_per_query(cli, checkpoint, tmp_path):
    """The runner gives a closed-loop residual its plan anchors and queries it on every executed tick (the
    receding-horizon executor, whatever the rig's); an executor that cannot is refused by name, before any
    recording starts."""
    ckpt = closed_loop_checkpoint(checkpoint, tmp_path / "closed_loop")
    rec = tmp_path / "deploy" / "rec.zarr"
    proc = cli.run("deploy", ckpt, "--rig", "sim_franka", "--no-operator", "--episodes", "1", "--record", rec,
                   "--episode-time", "3", cwd=tmp_path)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["scored"] == 1 and summary["executor"] == "receding_horizon"
    report = json.loads((tmp_path / "deploy" / "latency.json").read_text())
    executed = ReplayBuffer.open(rec).episode(0)["action"].shape[0]
    # One query per executed action: with two or more actions a query per chunk would count fewer. The episode
    # is wall-clock time, so a loaded machine executes fewer ticks (2 of 1.5 s worth beside two training runs).
    assert executed >= 2 and report["inference_ms"]["count"] == executed
    proc = cli.run("deploy", ckpt, "--rig", "sim_franka", "--no-operator", "--executor", "async", "--record",
                   tmp_path / "r.zarr", cwd=tmp_path, expect_rc=1)
    assert "--executor async" in proc.stderr and "closed-loop residual" in proc.stderr
    assert not (tmp_path / "r.zarr").exists()


def test_no_operator_is_refused_on_a_real_robot(cli, checkpoint, tmp_path):
    proc = cli.run(
        "deploy",
        checkpoint,
        "--rig",
        "real_robot/franka_d435.yaml",
        "--no-operator",
        cwd=tmp_path,
        expect_rc=1,
    )
    assert "--no-operator is refused on a real robot" in proc.stderr


def test_deploy_cli_end_to_end_on_the_sim_rig(cli, checkpoint, tmp_path):
    rec = tmp_path / "deploy" / "rec.zarr"
    proc = cli.run(
        "deploy",
        checkpoint,
        "--rig",
        "real_robot/sim_franka.yaml",
        "--no-operator",
        "--episodes",
        "1",
        "--record",
        rec,
        "--episode-time",
        "1.5",
        cwd=tmp_path,
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 1 and summary["scored"] == 1
    validate_store(rec)
    assert (tmp_path / "deploy" / "latency.png").is_file()
    assert json.loads((tmp_path / "deploy" / "deploy.json").read_text())["outcomes"] == summary["outcomes"]
    assert cli.run("data", "validate", rec, cwd=tmp_path).returncode == 0


def test_deploy_cli_in_lockstep_reports_each_episodes_start(cli, checkpoint, tmp_path):
    """`deploy --lockstep`: episodes of exactly the time limit's control steps (or fewer on success), each with
    its start state, in the summary and in `deploy.json`; nothing recorded."""
    out = tmp_path / "lockstep"
    args = ("deploy", checkpoint, "--rig", "sim_franka", "--no-operator", "--lockstep", "--episodes", "2",
            "--episode-time", "0.5", "--out", out)
    summary = json.loads(cli.run(*args, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert summary["mode"] == "lockstep" and summary["episodes"] == 2
    assert json.loads((out / "deploy.json").read_text())["episode_results"] == summary["episode_results"]
    for e in summary["episode_results"]:
        # 0.5 s at 20 Hz: a timeout ran all 10 control steps, a success fewer
        assert (e["outcome"], e["steps"]) == ("timeout", 10) or (e["outcome"] == "success" and 1 <= e["steps"] < 10)
        assert set(e["start_positions"]) >= {"cube", "goal"}
        cube, goal = np.array(e["start_positions"]["cube"]), np.array(e["start_positions"]["goal"])
        assert np.all(np.abs(cube[:2] - [0.615, 0.0]) <= 0.1 + 1e-3)
        assert goal[0] == pytest.approx(cube[0] + 0.2, abs=1e-3)
    # the two episodes start from the scene seeds `seed` and `seed + 1`: different cubes
    starts = [e["start_positions"]["cube"] for e in summary["episode_results"]]
    assert starts[0] != starts[1]
    proc = cli.run(*args, "--record", tmp_path / "rec.zarr", cwd=tmp_path, expect_rc=1)
    assert "--lockstep needs --no-operator" in proc.stderr and not (tmp_path / "rec.zarr").exists()


@pytest.mark.maniskill
@pytest.mark.slow  # three CLI runs (two build a ManiSkill env): ~1-2 min on shared cores
def test_pretrain_deploy_record_pretrain_loop(cli, tmp_path):
    """BC on a ManiSkill-shaped dataset without per-dimension names (as imported trajectories are) gives a
    checkpoint that names its state (taken from the env), which the sim rig deploys; the recording
    trains again."""
    spec = push_cube_spec()
    features = {
        "state": FeatureSpec("state", (35,), "float32", unit="mixed", frame="world"),
        "action": FeatureSpec("action", (7,), "float32", unit="normalized", frame="robot_base"),
    }
    rng = np.random.default_rng(0)
    with DatasetWriter(tmp_path / "demos.zarr", features, fps=CONTROL_HZ, action_spec=spec.action) as writer:
        for _ in range(2):
            writer.add_episode({"state": rng.normal(size=(20, 35)), "action": rng.uniform(-1, 1, (20, 7))})
    train = [
        "--policy",
        "gaussian_mlp",
        "--steps",
        "3",
        "--train.eval_episodes",
        "0",
        "--train.batch_size",
        "8",
        "--env",
        "maniskill/push_cube",
    ]
    cli.run("pretrain", "--data", tmp_path / "demos.zarr", "--out", tmp_path / "bc", *train, cwd=tmp_path)
    assert read_checkpoint(tmp_path / "bc").spec.observations["state"].names == PUSH_CUBE_NAMES

    rec = tmp_path / "rec.zarr"
    cli.run(
        "deploy",
        tmp_path / "bc",
        "--rig",
        "sim_franka",
        "--no-operator",
        "--record",
        rec,
        "--episode-time",
        "1.5",
        cwd=tmp_path,
    )
    cli.run("pretrain", "--data", rec, "--out", tmp_path / "bc2", *train, cwd=tmp_path)
    assert read_checkpoint(tmp_path / "bc2").spec.observations["state"].names == PUSH_CUBE_NAMES


def test_deploy_check_refuses_a_state_checkpoint_on_the_camera_rig_naming_the_cube(cli, checkpoint, tmp_path):
    """`--check` reads the checkpoint and the rig preset only: the hardware rig's robot address and camera
    serials are placeholders, and nothing tries to reach them."""
    proc = cli.run("deploy", checkpoint, "--rig", "real_robot/franka_d435.yaml", "--check", cwd=tmp_path, expect_rc=2)
    assert "extra/obj_pose (7 dims): object 'cube' pose (NOT OBSERVABLE on this rig)" in proc.stdout
    assert "cannot deploy" in proc.stderr and "needs the pose of object 'cube'" in proc.stderr
    assert "extra/goal_pos" not in proc.stderr  # the hardware rig's fixed goal is a constant source


def test_deploy_check_accepts_a_state_checkpoint_on_the_sim_rig(cli, checkpoint, tmp_path):
    proc = cli.run("deploy", checkpoint, "--rig", "sim_franka", "--check", cwd=tmp_path)
    out = proc.stdout
    for line in (
        "observation state [35]:",
        "agent/qpos (9 dims): robot joint_positions+finger_positions",
        "extra/tcp_pose (7 dims): robot ee_pose, world frame, quat x >= 0",
        "extra/obj_pose (7 dims): object 'cube' pose, world frame",
        "action pd_ee_delta_pose [7] at 20 Hz -> robot ee_pose targets at 20 Hz",
        "ok: the rig provides every observation",
    ):
        assert line in out, out
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing was written


class SilentCamera:
    """A camera that never delivers a frame (a test double: e.g. a RealSense still starting up)."""

    def latest(self):
        return None


def test_a_camera_without_frames_is_named_once_and_then_refused(checkpoint, rig_devices, caplog):
    rig, robot, _ = rig_devices
    policy, ckpt = load_policy(checkpoint)
    rig = dataclasses.replace(rig, start_timeout_s=0.5)
    robot.safety.counters.clear()
    with robot, caplog.at_level("WARNING", logger="robotft.real_robot.runner"):
        runner = Runner(rig, policy, ckpt.spec, robot, {"base": SilentCamera()}, SceneJudge(rig.success))
        with pytest.raises(RuntimeError, match=r"no sample from \['camera/base'\] within 0.5 s"):
            runner.run(1)
    waiting = [r.getMessage() for r in caplog.records if "waiting for the first sample" in r.getMessage()]
    assert len(waiting) == 1 and "camera/base" in waiting[0], waiting
    # The arm was never commanded while waiting, so no safety intervention was counted.
    assert not robot.safety.counters, robot.safety.counters
