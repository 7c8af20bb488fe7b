"""A policy on the simulated rig in lock-step: the rig's mapping and physics without the wall clock.

`robotft deploy --lockstep` on a simulated rig runs each episode as the training simulator does: observe,
predict a chunk, execute `act_steps` actions, each through the rig's action mapping and safety layer
followed by exactly one control period of physics (`SimFranka.advance`). Observations come from the
rig's sources (robotft.real_robot.rig.ObservationBuilder) and success from the rig's scene predicate,
exactly as in a real-time deployment; what is left out is timing (inference latency, a loaded CPU
stealing time from the physics thread, camera frame ages). Simulated cameras render the scene in the calling
thread at every observation (`SimCamera.snapshot`), so a camera policy sees each frame of the state it acts
on. So the lock-step success against the training simulator's measures the sim-to-sim gap of the rig itself
(scene, robot model, controller, mapping, and for camera policies the renderer), and the real-time run adds
the timing on top.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from robotft.real_robot.actions import make_mapper
from robotft.real_robot.operator import SceneJudge
from robotft.real_robot.policy_input import PolicyInput
from robotft.real_robot.rig import ObservationBuilder, RigConfig
from robotft.real_robot.runner import executor_for
from robotft.real_robot.safety import SafetyLayer
from robotft.specs import EnvSpec

log = logging.getLogger(__name__)


@dataclass
class LockstepEpisode:
    """One lock-step episode."""

    index: int
    outcome: str
    """`success` or `timeout`."""
    steps: int
    """Control steps executed."""
    safety: dict[str, int] = field(default_factory=dict)
    """Commands the safety layer clipped or refused in this episode, by reason."""
    start_positions: dict[str, list[float]] = field(default_factory=dict)
    """Each object's and marker's position `[x, y, z]` (m, robot base frame) after the episode's reset: the
    start state, so that failures can be traced to the starts they come from."""
    end_positions: dict[str, list[float]] = field(default_factory=dict)
    """The same after the episode's last step: where a failed episode left each object (e.g. a cube carried to a
    few cm of its goal, or still on the table)."""
    end_grasped: list[str] = field(default_factory=list)
    """Objects the gripper held after the last step."""


def make_lockstep_robot(rig: RigConfig) -> Any:
    """The rig's simulated robot in lock-step mode (`realtime=False`), not connected; its safety layer
    watches only the policy (cameras render in step with the physics: no frame can be late)."""
    from robotft.real_robot.backends import make_robot, parse_robot_config

    cfg = parse_robot_config(rig.robot.type, rig.robot.config)
    if not rig.simulated or not hasattr(cfg, "realtime"):
        raise ValueError(
            f"rig {rig.name!r}: lock-step needs a simulated robot, got robot type {rig.robot.type!r}"
        )
    safety = SafetyLayer(rig.safety, 1.0 / rig.control_hz, cameras=())
    return make_robot(rig.robot.type, replace(cfg, realtime=False), safety)


def run_lockstep(
    policy: Any,
    spec: EnvSpec,
    rig: RigConfig,
    robot: Any,
    episodes: int,
    max_steps: int,
    seed: int = 0,
    device: str = "cpu",
) -> list[LockstepEpisode]:
    """Run `episodes` episodes (scene seeds `seed + i`) of at most `max_steps` control steps on the connected
    lock-step `robot`; a receding-horizon executor runs the policy's `act_steps` of each chunk (one per query for a
    closed-loop policy, which reads its plan anchors from robotft.real_robot.policy_input)."""
    if rig.success is None:
        raise ValueError(f"rig {rig.name!r} has no success predicate (key 'success')")
    executor_for(rig, policy.config, "receding_horizon")
    obs_keys = list(policy.config.obs_keys)
    builder = ObservationBuilder(rig, spec, obs_keys)
    cameras = snapshot_cameras(rig, builder, robot)
    mapper = make_mapper(rig.action_mapping(spec.action.control_mode))
    judge = SceneJudge(rig.success)
    dt = 1.0 / rig.control_hz
    act_steps = rig.executor.act_steps or int(policy.config.act_steps)
    obs_steps = int(policy.config.obs_steps)
    policy_input = PolicyInput.for_policy(policy, device)
    results = []
    try:
        for i in range(episodes):
            robot.reset_episode(seed=seed + i)
            policy_input.reset()
            start = _positions(robot.object_poses())
            before = dict(robot.safety.counters)
            history: collections.deque[dict[str, np.ndarray]] = collections.deque(maxlen=obs_steps)
            queue: list[np.ndarray] = []
            outcome, step = "timeout", 0
            while step < max_steps:
                obs = builder.build(samples(robot, builder, cameras))
                history.append(obs)
                while len(history) < obs_steps:
                    history.appendleft(obs)
                if not queue:
                    queue = list(_predict(policy, policy_input(list(history)))[:act_steps])
                action = queue.pop(0)
                now = robot.clock()
                robot.safety.watchdog.heartbeat("policy", now)
                robot.send_action(mapper.to_command(action, robot.get_observation(), now + dt))
                robot.advance(dt)
                step += 1
                if judge.judge(robot.object_poses(), robot.get_observation()) == "success":
                    outcome = "success"
                    break
            counts = {k: v - before.get(k, 0) for k, v in robot.safety.counters.items() if v != before.get(k, 0)}
            end = robot.object_poses()
            held = [name for name, pose in end.items() if pose.grasped]
            results.append(LockstepEpisode(i, outcome, step, counts, start, _positions(end), held))
            log.info("lock-step episode %d: %s after %d steps; safety %s", i, outcome, step, counts or "none")
    finally:
        for camera in cameras.values():
            camera.close_snapshots()
    return results


def _positions(poses: dict[str, Any]) -> dict[str, list[float]]:
    """`{name: [x, y, z]}` (m, rounded to 0.1 mm) of object and marker poses."""
    return {name: [round(float(v), 4) for v in pose.pos] for name, pose in poses.items()}


def snapshot_cameras(rig: RigConfig, builder: ObservationBuilder, robot: Any) -> dict[str, Any]:
    """The rig's cameras that the observations read, unconnected, to render in the calling thread
    (`SimCamera.snapshot`); only simulated cameras can."""
    from robotft.real_robot.backends import make_camera

    names = [s.removeprefix("camera/") for s in builder.stream_names if s.startswith("camera/")]
    configs = {c.name: c for c in rig.cameras}
    cameras = {}
    for name in names:
        camera = make_camera(name, configs[name].type, configs[name].config, robot)
        if not hasattr(camera, "snapshot"):
            raise ValueError(f"lock-step renders cameras in step with the physics; camera {name!r} "
                             f"(type {configs[name].type!r}) is not simulated")
        cameras[name] = camera
    return cameras


def samples(robot: Any, builder: ObservationBuilder, cameras: dict[str, Any] | None = None) -> dict[str, Any]:
    """One sample per stream the observations need, read from the robot now (camera frames rendered now)."""
    poses = robot.object_poses()
    out: dict[str, Any] = {"robot": robot.get_observation()}
    for name in builder.stream_names:
        if name.startswith("object/"):
            out[name] = poses[name.removeprefix("object/")]
        elif name.startswith("camera/"):
            out[name] = (cameras or {})[name.removeprefix("camera/")].snapshot()
    return out


@torch.no_grad()
def _predict(policy: Any, obs: dict[str, torch.Tensor]) -> np.ndarray:
    return policy.predict_chunk(obs, deterministic=True)[0].detach().cpu().numpy()
