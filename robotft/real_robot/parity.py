"""Parity of the simulated rig with the training simulator: the same start, the same actions, per-segment error.

The simulated rig is only a rehearsal if it reproduces the simulator a policy was trained in. This tool
steps ManiSkill (CPU physics, state observations) and the rig's `SimFranka` (lock-step, no real-time
thread) side by side:

1. reset ManiSkill with a seed and copy its initial state into the rig: the arm's joints from
   `agent/qpos`, and every object the rig reads a state segment from (e.g. the cube from
   `extra/obj_pose`, the goal from `extra/goal_pos`), through the rig's own `world_from_base`;
2. each control step, send the same action to both: ManiSkill's controller, and the rig's action mapping
   (robotft.real_robot.actions), safety layer and joint controller, simulating one control period;
3. build the rig's observation with the rig preset's sources (robotft.real_robot.rig.ObservationBuilder),
   exactly as a deployment feeds the policy, and compare it with ManiSkill's, segment by segment.

Errors are per named segment of the state vector (`agent/qpos`, `extra/tcp_pose`, ...): for 7-dim poses
the position error (m) and the rotation angle (rad) separately, otherwise the largest absolute
difference over the segment's dimensions (in the segment's units: rad, rad/s, m).

Actions come from a scripted push or pick (`scripted_push`, `scripted_pick`: closed loop on ManiSkill's
state, so the same sequence is replayed open loop on the rig) or are random free-space motions
(`RandomMotion`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from robotft.real_robot.actions import make_mapper
from robotft.real_robot.lockstep import make_lockstep_robot, samples
from robotft.real_robot.rig import (
    ROBOT_FIELDS,
    ObservationBuilder,
    RigConfig,
    SourceConfig,
    load_rig,
    require_compatible,
)
from robotft.real_robot.transforms import Transform
from robotft.specs import EnvSpec

ActionSource = Callable[[dict[str, np.ndarray], int, np.random.Generator], np.ndarray]
"""`(ManiSkill state segments, step, rng) -> action [A]` (normalized, the env's control mode)."""


@dataclass
class ParityResult:
    """Per-segment errors of one side-by-side run."""

    errors: dict[str, np.ndarray] = field(default_factory=dict)
    """Metric name (`agent/qpos`, `extra/tcp_pose/pos_m`, `extra/tcp_pose/rot_rad`, ...) -> error `[T + 1]`
    at the reset and after each step, up to the end of ManiSkill's episode (success or time limit)."""
    actions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    """The actions sent to both `[T, A]`."""
    safety_counters: dict[str, int] = field(default_factory=dict)
    """What the rig's safety layer clipped or refused during the run."""
    success: tuple[bool, bool] = (False, False)
    """Whether ManiSkill and the rig's success predicate reported success at any step."""

    def max(self) -> dict[str, float]:
        """Largest error of each metric over the run."""
        return {k: float(np.max(v)) for k, v in self.errors.items()}

    def table(self, every: int = 10) -> str:
        """The errors at every `every`-th step, one row per metric, as aligned text."""
        steps = list(range(0, len(next(iter(self.errors.values()))), every))
        width = max(len(k) for k in self.errors)
        head = f"{'segment':<{width}}  " + " ".join(f"{f't={s}':>8}" for s in steps) + f"  {'max':>8}"
        rows = [
            f"{k:<{width}}  " + " ".join(f"{v[s]:8.4f}" for s in steps) + f"  {np.max(v):8.4f}"
            for k, v in self.errors.items()
        ]
        return "\n".join([head, *rows])


def segments(names: tuple[str, ...], vector: np.ndarray) -> dict[str, np.ndarray]:
    """Split a named flat vector into its segments: `agent/qpos/0..8` -> `{"agent/qpos": [9]}`."""
    out: dict[str, list[float]] = {}
    for name, value in zip(names, vector, strict=True):
        head, _, tail = name.rpartition("/")
        out.setdefault(head if tail.isdigit() and head else name, []).append(float(value))
    return {k: np.asarray(v) for k, v in out.items()}


def segment_errors(sim: dict[str, np.ndarray], rig: dict[str, np.ndarray]) -> dict[str, float]:
    """Error per segment present in both (see the module docstring for the metrics)."""
    errors = {}
    for name, a in sim.items():
        if name not in rig:
            continue
        b = rig[name]
        if name.endswith("pose") and a.size == 7:
            errors[f"{name}/pos_m"] = float(np.linalg.norm(a[:3] - b[:3]))
            dot = abs(float(np.dot(a[3:], b[3:]))) / (np.linalg.norm(a[3:]) * np.linalg.norm(b[3:]))
            errors[f"{name}/rot_rad"] = 2.0 * math.acos(min(1.0, dot))
        else:
            errors[name] = float(np.max(np.abs(a - b)))
    return errors


def scripted_push(state: dict[str, np.ndarray], step: int, rng: np.random.Generator) -> np.ndarray:
    """A PushCube expert on ManiSkill's state (world frame): gripper closed, go above a point 5 cm behind
    the cube, lower to 2 cm, push the cube 3 cm past the goal centre. Returns a `pd_ee_delta_pose` action
    `[7]` (rotation held); `pd_ee_delta_pos` uses its first three and last entries."""
    tcp, cube, goal = state["extra/tcp_pose"][:3], state["extra/obj_pose"][:3], state["extra/goal_pos"]
    approach = np.array([cube[0] - 0.05, cube[1], 0.02])
    aligned = abs(tcp[1] - cube[1]) < 0.01 and tcp[0] < cube[0] - 0.02
    if aligned and tcp[2] < 0.03:
        target = np.array([goal[0] + 0.03 - 0.045, cube[1], 0.02])  # the TCP stays a half cube behind
    elif np.linalg.norm((tcp - approach)[:2]) < 0.01:
        target = approach
    else:
        target = approach + np.array([0.0, 0.0, 0.06])
    delta = np.clip((target - tcp) / 0.1, -0.5, 0.5)
    return np.concatenate([delta, np.zeros(3), [-1.0]])


def scripted_pick(state: dict[str, np.ndarray], step: int, rng: np.random.Generator) -> np.ndarray:
    """A PickCube expert on ManiSkill's state (world frame): open above the cube, lower to its centre,
    close, and once ManiSkill reports the grasp carry the cube to the goal. Returns a `pd_ee_delta_pose`
    action `[7]` (rotation held, as for `scripted_push`)."""
    tcp, cube, goal = state["extra/tcp_pose"][:3], state["extra/obj_pose"][:3], state["extra/goal_pos"]
    if state["extra/is_grasped"][0] > 0.5:
        target, grip = goal, -1.0
    elif np.linalg.norm((tcp - cube)[:2]) > 0.01:
        target, grip = cube + np.array([0.0, 0.0, 0.06]), 1.0
    elif tcp[2] - cube[2] > 0.005:
        target, grip = cube, 1.0
    else:
        target, grip = cube, -1.0
    delta = np.clip((target - tcp) / 0.1, -0.5, 0.5)
    return np.concatenate([delta, np.zeros(3), [grip]])


def scripted_drag(state: dict[str, np.ndarray], step: int, rng: np.random.Generator) -> np.ndarray:
    """Press the closed gripper onto the cube's top face 1.2 cm behind its centre (the first 30 steps: above that
    point, then down towards 3 cm, which the cube stops at ~5 cm), then move forward while pressing: the cube goes
    along only as far as static friction holds it (how a PushCube policy moves a cube that starts under the
    gripper). Returns a `pd_ee_delta_pose` action `[7]` (rotation held)."""
    tcp, cube = state["extra/tcp_pose"][:3], state["extra/obj_pose"][:3]
    above = np.array([cube[0] - 0.012, cube[1]])
    if step < 30 and np.linalg.norm(tcp[:2] - above) > 0.003 and tcp[2] > 0.06:
        target = np.array([*above, 0.08])
    elif step < 30:
        target = np.array([*above, 0.03])
    else:
        target = tcp + np.array([0.05, 0.0, -0.02])
    delta = np.clip((target - tcp) / 0.1, -0.5, 0.5)
    return np.concatenate([delta, np.zeros(3), [-1.0]])


class RandomMotion:
    """Random `pd_ee_delta_pose` motion in free space: a new random direction and rotation every 5 steps,
    steered back into a box 8-25 cm above the table, 0.4-0.75 m in front of the base and 20 cm to either
    side (a target in the table is clipped by the rig's safety layer and not by ManiSkill; near full reach
    the two IK solvers part ways), the gripper toggling every 10 steps. One instance per run."""

    LOW = np.array([-0.215, -0.2, 0.08])
    """Lower corner of the box, ManiSkill's world frame (m)."""
    HIGH = np.array([0.135, 0.2, 0.25])
    """Upper corner of the box (m)."""

    def __init__(self) -> None:
        self._move = self._rot = np.zeros(3)

    def __call__(self, state: dict[str, np.ndarray], step: int, rng: np.random.Generator) -> np.ndarray:
        if step % 5 == 0:
            self._move, self._rot = rng.uniform(-0.5, 0.5, 3), rng.uniform(-0.3, 0.3, 3)
        tcp = state["extra/tcp_pose"][:3]
        move = np.where(tcp < self.LOW, 0.5, np.where(tcp > self.HIGH, -0.5, self._move))
        grip = 1.0 if (step // 10) % 2 == 0 else -1.0
        return np.concatenate([move, self._rot, [grip]])


ACTION_SOURCES: dict[str, Callable[[], ActionSource]] = {
    "scripted": lambda: scripted_push,
    "pick": lambda: scripted_pick,
    "drag": lambda: scripted_drag,
    "random": RandomMotion,
}
"""Action sequences by name: a factory of one run's action source."""


def _to_arm_action(action: np.ndarray, dim: int) -> np.ndarray:
    """A 7-dim `pd_ee_delta_pose` action cut to `dim`: position + gripper for `pd_ee_delta_pos` (4)."""
    return action if action.size == dim else np.concatenate([action[: dim - 1], action[-1:]])


def initial_state(
    rig: RigConfig, names: tuple[str, ...], state: np.ndarray
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The arm joints `[7]` and object poses (base frame) that reproduce ManiSkill's `state` on the rig,
    read through the rig's own observation sources (so a wrong source or frame shows up as an error)."""
    segs = segments(names, state)
    obs = rig.observation("state")
    if obs is None:
        raise ValueError(f"rig {rig.name!r} has no `state` observation to compare")
    base_from_world = rig.world_from_base.inverse()
    joints = None
    poses: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for src in obs.sources:
        if src.segment not in segs:
            continue
        values = segs[src.segment]
        if src.source == "robot" and "joint_positions" in src.fields:
            start = sum(ROBOT_FIELDS[f] for f in src.fields[: src.fields.index("joint_positions")])
            joints = values[start : start + ROBOT_FIELDS["joint_positions"]]
        elif src.source == "object" and src.fields[0] in ("pos", "pose") and not src.relative_to:
            poses[src.object] = _object_pose(src, values, base_from_world)
    if joints is None:
        raise ValueError(f"rig {rig.name!r}: no `robot` source with joint_positions among {sorted(segs)}")
    return joints, poses


def _object_pose(
    src: SourceConfig, values: np.ndarray, base_from_world: Transform
) -> tuple[np.ndarray, np.ndarray]:
    """An object's pose in the base frame from the values of its `pos` or `pose` source."""
    pos = values[:3]
    quat = values[3:7] if src.fields[0] == "pose" else np.array([1.0, 0.0, 0.0, 0.0])
    if src.frame == "world":
        pos, quat = base_from_world.point(pos), base_from_world.orientation(quat)
    return np.asarray(pos), np.asarray(quat)


def run_parity(
    env: Any,
    rig: RigConfig,
    steps: int,
    seed: int = 0,
    actions: ActionSource = scripted_push,
    robot: Any = None,
) -> ParityResult:
    """Step `env` (a robotft ManiSkill env, one env, state observations) and the rig side by side.

    `robot` is a connected lock-step `SimFranka` for `rig` (built here when None). Returns the
    per-segment errors after the reset and after each of `steps` steps.
    """
    spec: EnvSpec = env.spec
    names = spec.observations["state"].names
    require_compatible(rig, spec, ["state"], f"(the {getattr(env, 'task', 'env')} spec)")
    builder = ObservationBuilder(rig, spec, ["state"])
    mapper = make_mapper(rig.action_mapping(spec.action.control_mode))
    dt = 1.0 / rig.control_hz
    own = robot is None
    if own:
        robot = make_lockstep_robot(rig)
        robot.connect()
    rng = np.random.default_rng(seed)
    try:
        sim_state = env.reset(seed=seed)["state"][0].cpu().numpy().astype(np.float64)
        joints, poses = initial_state(rig, names, sim_state)
        robot.reset_episode(object_poses=poses, joint_positions=joints)
        result = ParityResult(safety_counters={})
        before = dict(robot.safety.counters)
        history: list[dict[str, float]] = []
        sent = []
        sim_success = rig_success = done = False
        judge = _success_judge(rig)
        for step in range(steps + 1):
            rig_state = builder.build(samples(robot, builder))["state"].astype(np.float64)
            sim_segs = segments(names, sim_state)
            history.append(segment_errors(sim_segs, segments(names, rig_state)))
            if step == steps or done:
                break
            action = _to_arm_action(actions(sim_segs, step, rng), spec.action.dim)
            sent.append(action)
            now = robot.clock()
            robot.safety.watchdog.heartbeat("policy", now)
            robot.send_action(mapper.to_command(action, robot.get_observation(), now + dt))
            robot.advance(dt)
            obs, _, terminated, truncated, info = env.step(_tensor(action))
            sim_state = obs["state"][0].cpu().numpy().astype(np.float64)
            sim_success |= bool(info["success"][0])
            # ManiSkill's episode ends at success (or its time limit): compare up to there.
            done = bool(terminated[0]) or bool(truncated[0])
            rig_success |= judge is not None and judge(robot.object_poses(), robot.get_observation()) == "success"
        result.errors = {k: np.array([h[k] for h in history]) for k in history[0]}
        result.actions = np.array(sent)
        result.safety_counters = {
            k: v - before.get(k, 0) for k, v in robot.safety.counters.items() if v != before.get(k, 0)
        }
        result.success = (sim_success, rig_success)
        return result
    finally:
        if own:
            robot.disconnect()


def _success_judge(rig: RigConfig) -> Callable[..., str | None] | None:
    from robotft.real_robot.operator import SceneJudge

    return None if rig.success is None else SceneJudge(rig.success).judge


def _tensor(action: np.ndarray) -> Any:
    import torch

    return torch.as_tensor(action, dtype=torch.float32)[None]


def make_env(env_preset: str, control_mode: str | None = None) -> Any:
    """The robotft ManiSkill env of `env_preset` as the parity tool needs it: one env, CPU physics, state."""
    from robotft.config import load_env_config
    from robotft.envs.maniskill import ManiSkillEnv

    overrides = {"num_envs": "1", "sim_backend": "physx_cpu", "obs_mode": "state"}
    if control_mode:
        overrides["control_mode"] = control_mode
    return ManiSkillEnv(load_env_config(env_preset, overrides))


def parity(
    env_preset: str,
    rig_name: str,
    steps: int,
    seed: int = 0,
    actions: str = "scripted",
    control_mode: str | None = None,
) -> ParityResult:
    """`run_parity` from preset names (what `scripts/parity.py` calls)."""
    if actions not in ACTION_SOURCES:
        raise ValueError(f"actions {actions!r} must be one of {sorted(ACTION_SOURCES)}")
    env = make_env(env_preset, control_mode)
    try:
        return run_parity(env, load_rig(rig_name), steps, seed, ACTION_SOURCES[actions]())
    finally:
        env.close()
