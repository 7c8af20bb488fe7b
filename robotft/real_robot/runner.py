"""The deployment runner: a trained policy on a rig, at a fixed rate, with recording and a latency report.

Timing follows diffusion_policy's real-robot code: a poller thread reads the robot state, the object
poses and the camera frames at their own rates into timestamped buffers; the control loop ticks at the
rig's rate on absolute deadlines (`RateLimiter`), aligns one sample per stream to the tick time
(`align_by_timestamp`, never using a sample from the future), feeds the chunk executor (which schedules
actions at absolute times and drops stale ones), maps the action to an absolute target
(robotft.real_robot.actions) and sends it through `Robot.send_action`, i.e. through the safety layer.

Each tick the watchdog hears from the cameras (the capture time of their newest frame) and from the
policy (when it produced the tick's action); when either stalls, the safety layer replaces commands by a
hold until it recovers. The operator's stop key latches the safety layer's stop for the episode.

Each episode is recorded into the dataset store: the observations the policy saw, the action it chose
(env units, `action`), the absolute target before (`target/*`) and after (`sent/*`) the safety layer,
the measured robot state (`robot/*`), times (`timestamp`, `obs_timestamp`), whether the operator was
driving (`intervention`), the outcome (`outcome`, `success` on the last step).

A closed-loop policy (`plan_every` > 0: a residual that corrects its base every step) queries on every tick with
the plan anchors it reads (robotft.real_robot.policy_input), so it runs the `receding_horizon` executor, one
action per query, whatever executor the rig prefers for chunked policies (`executor_for`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from robotft.config import ConfigError
from robotft.datasets.store import DatasetWriter
from robotft.real_robot.actions import ActionMapper, make_mapper
from robotft.real_robot.camera import Camera
from robotft.real_robot.executors import ChunkExecutor, make_executor
from robotft.real_robot.latency import LatencyLog
from robotft.real_robot.operator import OUTCOMES, Operator, Tally
from robotft.real_robot.policy_input import PolicyInput
from robotft.real_robot.rig import ObservationBuilder, RigConfig
from robotft.real_robot.robot import Robot, RobotCommand, RobotState
from robotft.real_robot.timing import RateLimiter, StaleDataError, StampedBuffer, align_by_timestamp
from robotft.specs import EnvSpec, FeatureSpec

log = logging.getLogger(__name__)


class StreamPoller:
    """A thread that polls the robot state, object poses and camera frames into `StampedBuffer`s.

    Streams: `robot` (RobotState), `object/<name>` (poses from `object_source.object_poses()`, by
    default the robot's simulated scene), `camera/<name>` (Frame). A sample is appended only when its
    capture time is newer than the stream's last one.
    """

    def __init__(
        self,
        robot: Robot,
        cameras: Mapping[str, Camera],
        objects: list[str],
        rate_hz: float,
        history_s: float,
        object_source: Any = None,
    ) -> None:
        self.robot = robot
        self.object_source = robot if object_source is None else object_source
        self.cameras = dict(cameras)
        self.objects = list(objects)
        self.rate_hz = rate_hz
        capacity = max(8, int(rate_hz * history_s) + 1)
        self.buffers: dict[str, StampedBuffer] = {"robot": StampedBuffer(capacity)}
        self.buffers.update({f"object/{n}": StampedBuffer(capacity) for n in self.objects})
        self.buffers.update({f"camera/{n}": StampedBuffer(capacity) for n in self.cameras})
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _put(self, stream: str, t: float, value: Any) -> None:
        with self._lock:  # the control loop may poll too (right after a reset)
            if t > self._last.get(stream, -np.inf):
                self.buffers[stream].append(t, value)
                self._last[stream] = t

    def poll_once(self) -> None:
        """Read every stream once (thread-safe)."""
        state = self.robot.get_observation()
        self._put("robot", state.timestamp_s, state)
        if self.objects:
            poses = self.object_source.object_poses()
            for name in self.objects:
                self._put(f"object/{name}", poses[name].timestamp_s, poses[name])
        for name, cam in self.cameras.items():
            frame = cam.latest()
            if frame is not None:
                self._put(f"camera/{name}", frame.capture_time_s, frame)

    def _run(self) -> None:
        limiter = RateLimiter(self.rate_hz)
        try:
            while not self._stop.is_set():
                limiter.wait()
                self.poll_once()
        except BaseException as e:  # noqa: BLE001 - re-raised in the control loop by check()
            self._error = e

    def check(self) -> None:
        """Re-raise a failure of the polling thread in the caller."""
        if self._error is not None:
            raise RuntimeError(f"stream poller failed: {self._error!r}") from self._error

    def start(self) -> None:
        self.poll_once()  # the first samples exist before the first tick
        self._thread = threading.Thread(target=self._run, name="robotft-stream-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None


@dataclass
class EpisodeResult:
    """What happened in one deployed episode."""

    index: int
    outcome: str
    """One of `OUTCOMES`."""
    steps: int
    """Ticks with an executed action (recorded steps)."""
    duration_s: float
    intervention_steps: int
    """Steps the operator drove during a take-over."""
    safety: dict[str, int] = dataclasses.field(default_factory=dict)
    """Commands the safety layer clipped or refused during this episode, by reason."""


@dataclass
class DeployResult:
    """A whole session."""

    episodes: list[EpisodeResult]
    tally: Tally
    latency: LatencyLog


class Recorder:
    """Buffers one episode's steps and writes them to a `DatasetWriter` (see the module docstring)."""

    def __init__(self, writer: DatasetWriter, task: str) -> None:
        self.writer = writer
        self.task = task
        self._steps: list[dict[str, np.ndarray]] = []

    @staticmethod
    def features(spec: EnvSpec, obs_keys: list[str], control_mode: str) -> dict[str, FeatureSpec]:
        """Dataset features of a deployment with this checkpoint spec and robot control mode."""
        assert spec.action is not None
        pose = {"ee_pos": ((3,), "m"), "ee_quat": ((4,), "quat_wxyz")}
        arm = pose if control_mode == "ee_pose" else {"joint_positions": ((7,), "rad")}
        feats = {k: spec.observations[k] for k in obs_keys}
        feats["action"] = FeatureSpec(
            "action", (spec.action.dim,), "float32", unit="env", frame=spec.action.frame
        )
        for prefix in ("target", "sent"):
            for name, (shape, unit) in {**arm, "gripper_width": ((), "m")}.items():
                key = f"{prefix}/{name}"
                feats[key] = FeatureSpec(key, shape, "float32", unit=unit, frame="robot_base")
        robot = {"joint_positions": ((7,), "rad"), **pose, "gripper_width": ((), "m")}
        for name, (shape, unit) in robot.items():
            feats[f"robot/{name}"] = FeatureSpec(
                f"robot/{name}", shape, "float32", unit=unit, frame="robot_base"
            )
        feats["timestamp"] = FeatureSpec("timestamp", (), "float64", unit="s")
        feats["obs_timestamp"] = FeatureSpec("obs_timestamp", (), "float64", unit="s")
        feats["command_timestamp"] = FeatureSpec("command_timestamp", (), "float64", unit="s")
        feats["intervention"] = FeatureSpec("intervention", (), "bool")
        feats["safety_modified"] = FeatureSpec("safety_modified", (), "bool")
        feats["outcome"] = FeatureSpec("outcome", (), "uint8", unit="enum:" + ",".join(OUTCOMES))
        feats["success"] = FeatureSpec("success", (), "bool")
        return feats

    def add_step(
        self,
        obs: Mapping[str, np.ndarray],
        action: np.ndarray,
        target: RobotCommand,
        sent: RobotCommand,
        state: RobotState,
        t: float,
        obs_t: float,
        command_t: float,
        intervention: bool,
        modified: bool,
    ) -> None:
        """One executed tick; times (s) are relative to the episode start: `t` the tick's deadline,
        `obs_t` the capture of the robot state used, `command_t` when the command went to the robot."""
        step = dict(obs)
        step["action"] = np.asarray(action, dtype=np.float32)
        for prefix, cmd in (("target", target), ("sent", sent)):
            if cmd.control_mode == "ee_pose":
                step[f"{prefix}/ee_pos"], step[f"{prefix}/ee_quat"] = cmd.ee_pos, cmd.ee_quat
            else:
                step[f"{prefix}/joint_positions"] = cmd.joint_positions
            step[f"{prefix}/gripper_width"] = np.float64(cmd.gripper_width)
        step["robot/joint_positions"], step["robot/ee_pos"] = state.joint_positions, state.ee_pos
        step["robot/ee_quat"], step["robot/gripper_width"] = state.ee_quat, np.float64(state.gripper_width)
        step.update(
            timestamp=np.float64(t),
            obs_timestamp=np.float64(obs_t),
            command_timestamp=np.float64(command_t),
            intervention=np.bool_(intervention),
            safety_modified=np.bool_(modified),
        )
        self._steps.append(step)

    def finish(self, outcome: str) -> int:
        """Write the buffered episode with its outcome (nothing when it has no step); returns its length."""
        steps, self._steps = self._steps, []
        if not steps:
            return 0
        episode = {k: np.stack([s[k] for s in steps]) for k in steps[0]}
        # A target may hold NaN (the policy output it; the safety layer replaced it): store what was sent.
        for key in [k for k in episode if k.startswith("target/")]:
            sent = episode["sent/" + key.removeprefix("target/")]
            episode[key] = np.where(np.isfinite(episode[key]), episode[key], sent)
        episode["action"] = np.nan_to_num(episode["action"], nan=0.0, posinf=0.0, neginf=0.0)
        n = len(steps)
        episode["outcome"] = np.full(n, OUTCOMES.index(outcome), dtype=np.uint8)
        episode["success"] = np.zeros(n, dtype=bool)
        episode["success"][-1] = outcome == "success"
        self.writer.add_episode(episode, task=self.task)
        self.writer.commit()  # a session killed later keeps this episode
        return n


def executor_for(rig: RigConfig, policy_config: Any, requested: str | None = None) -> str:
    """The chunk executor a policy runs with on `rig`: `requested` (`--executor`), else the rig's. A closed-loop
    policy (`plan_every` > 0) acts on each tick's observation, one action per query, so it runs `receding_horizon`
    with one step per chunk: another executor asked for by name, or a rig that fixes `executor.act_steps` above 1,
    is refused."""
    name = requested or rig.executor.type
    if not getattr(policy_config, "plan_every", 0):
        return name
    if requested not in (None, "receding_horizon"):
        raise ConfigError(f"--executor {requested}: a closed-loop residual acts on every tick's observation, one "
                          "action per query; it runs the receding_horizon executor")
    if rig.executor.act_steps not in (0, 1):
        raise ConfigError(f"rig {rig.name!r} sets executor.act_steps {rig.executor.act_steps}; a closed-loop "
                          "residual executes one action per query (act_steps 0 or 1)")
    return "receding_horizon"


class Runner:
    """Runs episodes of `policy` on a connected rig. See the module docstring.

    Example:
        runner = Runner(rig, policy, spec, robot, cameras, SceneJudge(rig.success))
        result = runner.run(episodes=2)
    """

    def __init__(
        self,
        rig: RigConfig,
        policy: Any,
        spec: EnvSpec,
        robot: Robot,
        cameras: Mapping[str, Camera],
        operator: Operator,
        *,
        executor: str | None = None,
        recorder: Recorder | None = None,
        episode_time_s: float = 10.0,
        seed: int = 0,
        device: str = "cpu",
        object_source: Any = None,
    ) -> None:
        """`object_source` provides the object poses (`object_poses()`; robotft.real_robot.backends
        `make_object_pose_source`); None: the robot's simulated scene."""
        assert spec.action is not None
        self.rig = rig
        self.policy = policy
        self.spec = spec
        self.robot = robot
        self.cameras = dict(cameras)
        self.operator = operator
        self.recorder = recorder
        self.episode_time_s = episode_time_s
        self.seed = seed
        self.device = device
        self.dt = 1.0 / rig.control_hz
        self.obs_keys = list(policy.config.obs_keys)
        self.obs_steps = int(policy.config.obs_steps)
        self.builder = ObservationBuilder(rig, spec, self.obs_keys)
        mapping = rig.action_mapping(spec.action.control_mode)
        assert mapping is not None, "check_rig first"
        self.mapper: ActionMapper = make_mapper(mapping)
        self.latency = LatencyLog()
        objects = [n.removeprefix("object/") for n in self.builder.stream_names if n.startswith("object/")]
        if rig.success is not None and rig.simulated:
            objects = sorted({*objects, rig.success.object, rig.success.goal})
        self.object_source = robot if object_source is None else object_source
        if (objects and not hasattr(self.object_source, "object_poses")) or (
            rig.simulated and not hasattr(robot, "object_poses")
        ):
            raise ValueError(
                f"rig {rig.name!r} reads object poses {objects} (or a simulated scene), but robot backend "
                f"{type(robot).__name__} has no object_poses()"
            )
        self.poller = StreamPoller(
            robot,
            self.cameras,
            objects,
            rig.state_hz,
            history_s=self.obs_steps * self.dt + 1.0,
            object_source=self.object_source,
        )
        self.policy_input = PolicyInput.for_policy(policy, device)
        self.executor = self._make_executor(executor_for(rig, policy.config, executor))
        self._last_sent: RobotCommand | None = None
        self._episode_start = -np.inf
        self._announced: set[str] = set()

    def _make_executor(self, name: str) -> ChunkExecutor:
        cfg = self.rig.executor
        act_steps = cfg.act_steps or int(self.policy.config.act_steps)
        if name == "receding_horizon":
            return make_executor(name, act_steps=act_steps)
        if name == "temporal_ensemble":
            return make_executor(name, dt=self.dt, m=cfg.ensemble_m)
        return make_executor(name, dt=self.dt, act_steps=act_steps, latency_window=cfg.latency_window)

    # ---- the policy --------------------------------------------------------------------------------

    @torch.no_grad()
    def _predict(self, history: list[dict[str, np.ndarray]]) -> np.ndarray:
        """Chunk `[H, A]` (env units) for an observation history (oldest first); timed for the report."""
        start = time.perf_counter()
        obs = self.policy_input(history)
        chunk = self.policy.predict_chunk(obs, deterministic=True)[0].detach().cpu().numpy()
        self.latency.inference_s.append(time.perf_counter() - start)
        return chunk

    # ---- a session ---------------------------------------------------------------------------------

    def run(self, episodes: int) -> DeployResult:
        """Run up to `episodes` episodes (fewer when the operator quits); the robot must be connected."""
        tally = Tally()
        results = []
        self.poller.start()
        try:
            for i in range(episodes):
                result = self.run_episode(i)
                if result is None:
                    break
                tally.add(result.outcome)
                results.append(result)
                lo, hi = tally.ci95
                log.info(
                    "episode %d: %s after %d steps; success %.2f (95%% CI %.2f-%.2f) over %d scored",
                    i,
                    result.outcome,
                    result.steps,
                    tally.success_rate,
                    lo,
                    hi,
                    tally.scored,
                )
        finally:
            self.poller.stop()
            self.executor.close()
            self.latency.safety_counters = dict(self.robot.safety.counters)
            for name in ("skipped", "dropped"):
                if hasattr(self.executor, name):
                    self.latency.executor[name] = int(getattr(self.executor, name))
        return DeployResult(results, tally, self.latency)

    def _reset_scene(self, index: int) -> None:
        """`reset_episode` of the backend: the simulated scene gets new object poses (seeded per episode)
        and the arm goes home; a real arm moves home while the operator resets the scene. Either way the
        safety layer starts over from the measured state."""
        if hasattr(self.robot, "reset_episode"):
            self.robot.reset_episode(seed=self.seed + index)
        else:
            self.robot.safety.reset()

    def run_episode(self, index: int) -> EpisodeResult | None:
        """One episode; None when the operator quit instead of starting it."""
        self._reset_scene(index)
        if not self.operator.wait_start(index, lambda: self._reset_scene(index)):
            return None
        # Samples captured before the state read now show the previous episode (a simulated reset
        # teleports the scene): ticks hold the arm until every stream has a newer one.
        self._episode_start = self.robot.get_observation().timestamp_s
        self._wait_for_streams(index)
        counters_before = dict(self.robot.safety.counters)
        self.executor.reset()
        self.policy_input.reset()
        self._last_sent = None
        history: collections.deque[dict[str, np.ndarray]] = collections.deque(maxlen=self.obs_steps)
        limiter = RateLimiter(self.rig.control_hz)
        self.latency.episode_starts.append(len(self.latency.tick_start_s))
        takeover = False
        outcome: str | None = None
        steps = interventions = 0
        t0 = None
        while outcome is None:
            tick = limiter.wait()
            now = time.monotonic()
            t0 = tick if t0 is None else t0
            self.latency.add_tick(tick, now)
            self.poller.check()
            for event in self.operator.poll():
                if event == "stop":
                    self.robot.safety.trigger_stop()
                    outcome = "stopped"
                elif event in ("success", "failure", "abort"):
                    outcome = event
                elif event == "reset":
                    outcome = "abort"
                elif event == "takeover":
                    takeover = not takeover
                    self.policy_input.reset()  # the arm moved off the current plan: re-plan on handing back
                    log.warning("operator %s", "took over" if takeover else "gave control back to the policy")
            if outcome is not None:
                break
            if self.rig.simulated:
                scene = self.robot.object_poses()  # type: ignore[attr-defined]
                outcome = self.operator.judge(scene, self.robot.get_observation())
                if outcome is not None:
                    break
            if now - t0 >= self.episode_time_s:
                outcome = self.operator.label_timeout()
                break
            executed = self._tick(now, tick, t0, history, takeover)
            steps += int(executed)
            interventions += int(executed and takeover)
        self.latency.missed_ticks += limiter.stats.missed
        self.robot.stop()
        if self.recorder is not None:
            self.recorder.finish(outcome)
        safety = {
            k: v - counters_before.get(k, 0)
            for k, v in self.robot.safety.counters.items()
            if v != counters_before.get(k, 0)
        }
        return EpisodeResult(index, outcome, steps, (time.monotonic() - (t0 or 0.0)), interventions, safety)

    def _wait_for_streams(self, index: int) -> None:
        """Before the episode's first tick, wait until every stream (robot, objects, cameras) has a sample
        captured after the reset; the arm holds still meanwhile (no command is sent, so nothing counts as a
        safety refusal). Each stream it waits for is named once per session as a warning (a camera's
        first frame), afterwards at debug level (the wait after each reset is ordinary). Raises after
        `rig.start_timeout_s`."""
        deadline = time.monotonic() + self.rig.start_timeout_s
        said: set[str] = set()
        while True:
            self.poller.poll_once()
            self.poller.check()
            waiting = sorted(
                name
                for name, buf in self.poller.buffers.items()
                if (newest := buf.at(math.inf)) is None or newest[0] < self._episode_start
            )
            if not waiting:
                return
            new = [w for w in waiting if w not in said]
            if new:
                first = [w for w in new if w not in self._announced]
                log.log(
                    logging.WARNING if first else logging.DEBUG,
                    "episode %d: waiting for the first sample since the reset from %s (a camera's first frame "
                    "after start-up can take seconds); the policy starts when it arrives",
                    index,
                    ", ".join(new),
                )
                said.update(new)
                self._announced.update(new)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"episode {index}: no sample from {waiting} within {self.rig.start_timeout_s:g} s of the "
                    "reset; check that the camera streams (rig key `start_timeout_s` sets this limit)"
                )
            time.sleep(1.0 / self.rig.state_hz)

    def _heartbeat_cameras(self) -> None:
        for name, cam in self.cameras.items():
            frame = cam.latest()
            if frame is not None:
                # The frame's capture time, not now: a stalled stream ages and trips the watchdog.
                self.robot.safety.watchdog.heartbeat(name, frame.capture_time_s)

    def _tick(self, now: float, tick: float, t0: float, history: collections.deque, takeover: bool) -> bool:
        """One control tick (deadline `tick`, started at `now`, episode start `t0`); True when an action
        was executed (and recorded)."""
        self._heartbeat_cameras()
        try:
            samples = align_by_timestamp(self.poller.buffers, now)
            self._check_ages(samples, now)
        except StaleDataError as e:
            log.warning("holding the arm: %s", e)
            self._send_hold(now)
            return False
        self.latency.add_ages({name: s.age_s for name, s in samples.items()})
        values = {name: s.value for name, s in samples.items()}
        obs = self.builder.build(values)
        history.append(obs)
        while len(history) < self.obs_steps:  # the first observation stands in for the missing past
            history.appendleft(obs)
        state: RobotState = values["robot"]
        if takeover:
            action = self.operator.teleop_action(self.spec.action.dim)
        else:
            if self.executor.needs_chunk(now):
                self.executor.request(self._predict, list(history), samples["robot"].capture_time_s)
            action = self.executor.action(time.monotonic())
        if action is None:
            self._send_hold(now)
            return False
        # Whoever drives (the policy, or the operator during a take-over) has just shown it is alive.
        self.robot.safety.watchdog.heartbeat("policy", time.monotonic())
        # Relative to the freshest measured state: ManiSkill's delta controllers use the current pose.
        fresh = self.robot.get_observation()
        sent_at = time.monotonic()
        target = self.mapper.to_command(action, fresh, sent_at + self.dt)
        sent = self.robot.send_action(target)
        self._last_sent = sent
        self.latency.commands_sent += 1
        if self.recorder is not None:
            report = self.robot.last_report
            self.recorder.add_step(
                obs,
                action,
                target,
                sent,
                state,
                tick - t0,
                samples["robot"].capture_time_s - t0,
                sent_at - t0,
                takeover,
                bool(report and report.modified),
            )
        return True

    def _check_ages(self, samples: Mapping[str, Any], now: float) -> None:
        limits = {f"camera/{c.name}": c.max_age_s for c in self.rig.cameras}
        # Poses measured in camera frames age like camera frames (robotft.real_robot.fiducial).
        pose_age = getattr(self.object_source, "max_age_s", self.rig.max_state_age_s)
        limits.update({n: pose_age for n in self.poller.buffers if n.startswith("object/")})
        for name, sample in samples.items():
            if sample.capture_time_s < self._episode_start:
                raise StaleDataError(f"stream {name!r} has no sample since the episode started")
            limit = limits.get(name, self.rig.max_state_age_s)
            if sample.age_s > limit:
                raise StaleDataError(
                    f"stream {name!r} is {sample.age_s * 1e3:.0f} ms old (max {limit * 1e3:.0f} ms)"
                )

    def _send_hold(self, now: float) -> None:
        """Keep the arm at its last target (or where it is); through the safety layer like any command."""
        if self._last_sent is not None:
            hold = dataclasses.replace(self._last_sent, timestamp_s=now + self.dt)
        else:
            s = self.robot.get_observation()
            if self.mapper.robot_mode == "ee_pose":
                hold = RobotCommand(
                    "ee_pose", now + self.dt, s.gripper_width, ee_pos=s.ee_pos, ee_quat=s.ee_quat
                )
            else:
                hold = RobotCommand(
                    "joint_position", now + self.dt, s.gripper_width, joint_positions=s.joint_positions
                )
        self._last_sent = self.robot.send_action(hold)
        self.latency.commands_sent += 1
