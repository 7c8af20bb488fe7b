"""`robotft deploy CKPT --rig real_robot/<rig>.yaml`: check, connect, run, record, report.

1. Load the rig preset and the checkpoint; refuse `--no-operator` on a real robot and any checkpoint whose
   observations or control mode the rig cannot provide (robotft.real_robot.rig.check_rig), before any
   hardware is touched.
2. Build the safety layer, the robot and the cameras (robotft.real_robot.backends), connect them.
3. Run the episodes (robotft.real_robot.runner), recording them into the dataset store.
4. Write `latency.json` / `latency.png` (robotft.real_robot.latency) and `deploy.json` (the tally with
   its Wilson interval, each episode's outcome and safety interventions, the paths) into the output folder.

`--check` stops after step 1 and prints the observation and action mapping (`check_deployment`);
`--lockstep` runs a simulated rig without the wall clock (robotft.real_robot.lockstep) instead of 2-3.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from robotft.config import ConfigError, resolve_device, to_dict
from robotft.real_robot.backends import make_object_pose_source
from robotft.real_robot.camera import Camera
from robotft.real_robot.latency import atomic_write, write_report
from robotft.real_robot.operator import KeyboardOperator, Operator, SceneJudge
from robotft.real_robot.rig import RigConfig, load_rig, require_compatible
from robotft.real_robot.robot import Robot
from robotft.real_robot.safety import SafetyLayer

log = logging.getLogger(__name__)


@dataclass
class DeployOptions:
    """What `robotft deploy` was asked to do."""

    checkpoint: str
    """Checkpoint directory or run directory."""
    rig: str
    """Rig preset name or YAML path."""
    episodes: int = 1
    """Episodes to run (the operator may quit earlier)."""
    record: str | None = None
    """Dataset store to record the episodes into; None: do not record."""
    record_mode: str = "create"
    """`create`, `append` or `overwrite` (robotft.datasets.store.DatasetWriter)."""
    no_operator: bool = False
    """Outcomes from the simulated scene instead of a person (simulated rigs only)."""
    executor: str | None = None
    """Chunk executor overriding the rig's: `receding_horizon`, `temporal_ensemble`, `async`."""
    out: str | None = None
    """Folder for the latency report and `deploy.json`; default: beside the recording, else `runs/deploy`."""
    episode_time_s: float = 0.0
    """Episode time limit (s); 0: the rig's, else the checkpoint env's `max_episode_steps / control_hz`."""
    seed: int = 0
    """Seed of the simulated scene's randomization (episode i uses seed + i)."""
    device: str = "auto"
    """Policy device: `auto`, `cpu` or `cuda`."""
    lockstep: bool = False
    """Simulated rigs: step the physics one control period per action instead of in real time
    (robotft.real_robot.lockstep): no timing effects (simulated cameras render each observation in step), no
    recording, no latency report."""


def check_operator_mode(rig: RigConfig, no_operator: bool, where: str) -> None:
    """`--no-operator` needs a simulated rig with a success predicate."""
    if not no_operator:
        return
    if not rig.simulated:
        raise ConfigError(
            f"--no-operator is refused on a real robot (rig {rig.name or where!r} is not simulated): on hardware "
            "a person must start each episode, judge it and be ready to stop the arm"
        )
    if rig.success is None:
        raise ConfigError(f"--no-operator needs a success predicate in rig {where} (key 'success')")


def check_deployment(checkpoint: str, rig_name: str) -> tuple[list[str], list[str]]:
    """`robotft deploy --check`: the observation/action mapping of `checkpoint` on rig `rig_name` and what is
    missing (empty when it can run), from the checkpoint's config alone: no policy is built, no device is
    touched."""
    from robotft.checkpoint import read_checkpoint
    from robotft.real_robot.rig import check_rig, describe_mapping

    rig = load_rig(rig_name)
    ckpt = read_checkpoint(checkpoint)
    obs_keys = list(ckpt.config.get("policy", {}).get("obs_keys", []))
    if not obs_keys:
        raise ConfigError(f"{ckpt.path}: config.json names no policy.obs_keys")
    lines = [f"checkpoint {ckpt.path} on rig {rig.name or rig_name}:", *describe_mapping(rig, ckpt.spec, obs_keys)]
    return lines, check_rig(rig, ckpt.spec, obs_keys)


def make_devices(rig: RigConfig, safety: SafetyLayer) -> tuple[Robot, dict[str, Camera]]:
    """The rig's robot and cameras, not yet connected (robotft.real_robot.backends)."""
    from robotft.real_robot.backends import make_camera, make_robot

    robot = make_robot(rig.robot.type, rig.robot.config, safety)
    cameras = {c.name: make_camera(c.name, c.type, c.config, robot) for c in rig.cameras}
    return robot, cameras


def deploy(opts: DeployOptions, operator_stream: IO | None = None) -> dict[str, Any]:
    """Run a deployment session; returns the summary also written to `deploy.json`."""
    from robotft.checkpoint import load_policy
    from robotft.datasets.store import DatasetWriter
    from robotft.real_robot.runner import Recorder, Runner, executor_for

    rig = load_rig(opts.rig)
    check_operator_mode(rig, opts.no_operator, opts.rig)
    if opts.episodes < 1:
        raise ConfigError(f"--episodes must be >= 1, got {opts.episodes}")
    device = resolve_device(opts.device)
    policy, ckpt = load_policy(opts.checkpoint, device=device)
    executor = executor_for(rig, policy.config, opts.executor)
    if executor != (opts.executor or rig.executor.type):
        log.warning("%s is a closed-loop residual (one action per query): it runs the receding_horizon executor, "
                    "not the rig's %s", ckpt.path, rig.executor.type)
    spec = ckpt.spec
    require_compatible(rig, spec, policy.config.obs_keys, ckpt.path)
    episode_time_s = opts.episode_time_s or rig.episode_time_s or _env_episode_time(ckpt.config, rig)
    out = Path(opts.out) if opts.out else (Path(opts.record).parent if opts.record else Path("runs/deploy"))
    if opts.lockstep:
        return _deploy_lockstep(opts, rig, policy, ckpt, episode_time_s, out, device)

    mapping = rig.action_mapping(spec.action.control_mode)
    writer = None
    if opts.record:
        from robotft.real_robot.actions import make_mapper

        features = Recorder.features(spec, list(policy.config.obs_keys), make_mapper(mapping).robot_mode)
        writer = DatasetWriter(
            opts.record,
            features,
            fps=rig.control_hz,
            action_spec=spec.action,
            env={
                "rig": to_dict(rig),
                "checkpoint": str(ckpt.path),
                "checkpoint_env": (ckpt.config.get("env") or {}),
            },
            source=f"robotft deploy {ckpt.path} on rig {rig.name or opts.rig}",
            mode=opts.record_mode,
        )
    safety = SafetyLayer(rig.safety, 1.0 / rig.control_hz, cameras=[c.name for c in rig.cameras])
    operator: Operator | None = None
    try:
        robot, cameras = make_devices(rig, safety)
        object_source = make_object_pose_source(rig, robot, cameras)
        operator = SceneJudge(rig.success) if opts.no_operator else KeyboardOperator(operator_stream)
        recorder = (
            Recorder(writer, rig.task or str((ckpt.config.get("env") or {}).get("task", ""))) if writer else None
        )
        with robot, contextlib.ExitStack() as stack:
            for cam in cameras.values():
                stack.enter_context(cam)
            if object_source is not robot:  # e.g. a marker tracker reading a camera's frames
                stack.enter_context(object_source)
            runner = Runner(
                rig,
                policy,
                spec,
                robot,
                cameras,
                operator,
                executor=executor,
                recorder=recorder,
                episode_time_s=episode_time_s,
                seed=opts.seed,
                device=device,
                object_source=object_source,
            )
            result = runner.run(opts.episodes)
    finally:
        if operator is not None:
            operator.close()
        if writer is not None:
            # Episodes already added are complete: keep them even when the session ended in an error.
            if writer.n_episodes:
                writer.finalize()
            else:
                writer.abort()
    json_path, png_path = write_report(result.latency, rig.control_hz, out)
    summary = {
        **result.tally.to_dict(),
        "episode_results": [vars(e) for e in result.episodes],
        "checkpoint": str(ckpt.path),
        "rig": rig.name or opts.rig,
        "executor": executor,
        "mode": "realtime",
        "safety_total": result.latency.safety_counters,
        "record": opts.record,
        "latency_json": str(json_path),
        "latency_png": str(png_path),
    }
    atomic_write(out / "deploy.json", json.dumps(summary, indent=2).encode())
    return summary


def _deploy_lockstep(
    opts: DeployOptions, rig: RigConfig, policy: Any, ckpt: Any, episode_time_s: float, out: Path, device: str
) -> dict[str, Any]:
    """`deploy --lockstep`: the episodes in lock-step, `deploy.json` with each episode's safety counts."""
    from robotft.real_robot.lockstep import make_lockstep_robot, run_lockstep
    from robotft.real_robot.operator import Tally

    if not opts.no_operator or opts.record:
        raise ConfigError("--lockstep needs --no-operator (outcomes from the scene) and records nothing (no --record)")
    robot = make_lockstep_robot(rig)
    with robot:
        episodes = run_lockstep(
            policy, ckpt.spec, rig, robot, opts.episodes, round(episode_time_s * rig.control_hz), opts.seed, device
        )
    tally = Tally()
    for e in episodes:
        tally.add(e.outcome)
    summary = {
        **tally.to_dict(),
        "episode_results": [vars(e) for e in episodes],
        "safety_total": dict(robot.safety.counters),
        "checkpoint": str(ckpt.path),
        "rig": rig.name or opts.rig,
        "mode": "lockstep",
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "deploy.json", json.dumps(summary, indent=2).encode())
    return summary


def _env_episode_time(config: dict[str, Any], rig: RigConfig) -> float:
    """The training env's episode length in seconds (`max_episode_steps / control_hz`), 10 s if unknown."""
    steps = (config.get("env") or {}).get("max_episode_steps")
    return float(steps) / rig.control_hz if steps else 10.0
