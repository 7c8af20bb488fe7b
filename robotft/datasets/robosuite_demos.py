"""robosuite demonstrations without downloads: scripted pick-and-place experts for Lift and PickPlaceCan.

The experts act through the adapter's own action space (OSC_POSE deltas in [-1, 1] plus gripper) and read
only the adapter's `state` observation, locating the end effector and the object by the dimension names
of its FeatureSpec, so whatever they record is exactly what a policy sees and does. Each is a small state
machine per env: move above the object, descend, close the gripper, lift; for PickPlaceCan then carry it
above its quadrant of the target bin, lower it and release. Orientation inputs stay zero (the Panda keeps
its top-down grasp pose). `generate_robosuite_demos` records successful episodes into a dataset store.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from robotft.config import EnvConfig, to_dict
from robotft.envs.base import Obs
from robotft.specs import EnvSpec


@dataclasses.dataclass(frozen=True)
class PickPlacePlan:
    """Waypoints of a scripted pick(-and-place), in the world frame (metres)."""

    object_key: str
    """robosuite observable holding the object's position, e.g. `cube_pos` (found as `object.<key>.x`)."""
    hover_m: float = 0.08
    """Height above the object at which the gripper lines up before descending."""
    grasp_offset_m: float = 0.0
    """Grasp height relative to the object's centre."""
    close_steps: int = 12
    """Steps the gripper closes for while holding still, before lifting."""
    lift_height_m: float = 1.0
    """Height (world z) the object is carried at."""
    place_xy: tuple[float, float] | None = None
    """Where to release the object (world x, y); None: only lift (Lift)."""
    release_height_m: float = 0.0
    """Height (world z) of the end effector at release."""
    retreat_height_m: float = 1.05
    """Height the empty gripper rises to after release (robosuite counts PickPlace success only once the
    gripper is more than ~4 cm from the object)."""
    tolerance_m: float = 0.01
    """Distance to a waypoint that counts as reached."""
    max_wait_steps: int = 40
    """Steps after which a waypoint counts as reached anyway: a finger resting on a bin wall can hold the
    gripper a centimetre short of it."""
    gain: float = 10.0
    """Position input per metre of error, clipped to [-1, 1] (an input of 1 moves the target 5 cm)."""


PLANS: dict[str, PickPlacePlan] = {
    "Lift": PickPlacePlan(object_key="cube_pos", grasp_offset_m=-0.005, lift_height_m=0.95),
    # The can's target is the centre of quadrant 3 of bin 2 (robosuite PickPlace: bin2_pos (0.1, 0.28, 0.8),
    # bin_size (0.39, 0.49)); release it 10 cm above the bin floor, then lift the gripper away.
    "PickPlaceCan": PickPlacePlan(
        object_key="Can_pos",
        grasp_offset_m=0.0,
        lift_height_m=1.0,
        place_xy=(0.1975, 0.4025),
        release_height_m=0.92,
    ),
}
"""Scripted plans per robosuite task."""

# Phases of the state machine (per env).
_ABOVE, _DESCEND, _CLOSE, _LIFT, _CARRY, _LOWER, _RELEASE, _RETREAT = range(8)


class PickPlaceExpert:
    """Batched scripted expert for a robosuite task in `PLANS` (see the module docstring).

    Implements robotft.datasets.recording.Expert: `reset(env_ids, obs)` starts those envs' plans over,
    `__call__(obs)` returns `[B, 7]` actions in the adapter's units.
    """

    def __init__(self, task: str, spec: EnvSpec, num_envs: int) -> None:
        if task not in PLANS:
            raise ValueError(f"no scripted robosuite expert for task {task!r}; available: {sorted(PLANS)}")
        if spec.action is None or spec.action.dim != 7:
            raise ValueError(f"PickPlaceExpert drives one OSC_POSE arm (7-D actions), got {spec.action}")
        self.plan = PLANS[task]
        names = list(spec.observations["state"].names)
        self._eef = _indices(names, "robot0_eef_pos")
        self._obj = _indices(names, f"object.{self.plan.object_key}")
        self.phase = torch.zeros(num_envs, dtype=torch.long)
        self._timer = torch.zeros(num_envs, dtype=torch.long)

    def reset(self, env_ids: torch.Tensor, obs: Obs) -> None:
        ids = env_ids.cpu()
        self.phase[ids] = _ABOVE
        self._timer[ids] = 0

    def __call__(self, obs: Obs) -> torch.Tensor:
        state = obs["state"].detach().to("cpu", torch.float32)
        eef, obj = state[:, self._eef], state[:, self._obj]
        p = self.plan
        target = eef.clone()
        gripper = torch.full((len(state),), -1.0)
        for phase in range(8):
            m = self.phase == phase
            if not m.any():
                continue
            target[m], gripper[m] = self._waypoint(phase, eef[m], obj[m])
        error = target - eef
        reached = error.norm(dim=-1) < p.tolerance_m
        self._timer += 1
        self._advance(reached)
        action = torch.zeros(len(state), 7)
        action[:, :3] = (p.gain * error).clamp(-1.0, 1.0)
        action[:, 6] = gripper
        return action.to(obs["state"].device)

    def _waypoint(self, phase: int, eef: torch.Tensor, obj: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Target end-effector position `[n, 3]` and gripper input of envs in `phase`."""
        p = self.plan
        target = obj.clone()
        if phase == _ABOVE:
            target[:, 2] += p.hover_m
            return target, -1.0
        if phase in (_DESCEND, _CLOSE):
            target[:, 2] += p.grasp_offset_m
            return target, -1.0 if phase == _DESCEND else 1.0
        if phase == _LIFT:
            target = eef.clone()
            target[:, 2] = p.lift_height_m
            return target, 1.0
        # The place phases exist only for plans with a place_xy (`_advance` stops Lift at _LIFT).
        target = torch.tensor([*p.place_xy, 0.0]).expand_as(eef).clone()
        if phase == _CARRY:
            target[:, 2] = p.lift_height_m
            return target, 1.0
        if phase in (_LOWER, _RELEASE):
            target[:, 2] = p.release_height_m
            return target, 1.0 if phase == _LOWER else -1.0
        target[:, 2] = p.retreat_height_m  # _RETREAT
        return target, -1.0

    def _advance(self, reached: torch.Tensor) -> None:
        """Move envs to their next phase when their waypoint is reached (or a timed phase is over)."""
        p = self.plan
        timed = torch.isin(self.phase, torch.tensor([_CLOSE, _RELEASE]))
        done_timed = timed & (self._timer >= p.close_steps)
        last = _LIFT if p.place_xy is None else _RETREAT
        moved = ~timed & (reached | (self._timer >= p.max_wait_steps))
        go = (moved | done_timed) & (self.phase < last)
        self.phase[go] += 1
        self._timer[go] = 0


def _indices(names: list[str], prefix: str) -> list[int]:
    """Indices of `<prefix>.x`, `.y`, `.z` in the state names; a clear error when absent."""
    try:
        return [names.index(f"{prefix}.{c}") for c in "xyz"]
    except ValueError:
        raise ValueError(
            f"state has no dims named {prefix}.x/.y/.z (the scripted expert needs them); state names: {names}"
        ) from None


def generate_robosuite_demos(
    env_cfg: EnvConfig,
    n_episodes: int,
    out: str | Path,
    seed: int = 0,
    mode: str = "create",
    progress: bool = True,
) -> dict[str, Any]:
    """Record `n_episodes` successful scripted episodes of `env_cfg.task` into the store `out`.

    Uses `env_cfg` as given (num_envs > 1 records with worker processes; obs_mode rgb records camera
    frames too). Failed episodes are dropped; gives up after 10x `n_episodes` attempts. Returns
    `record_rollouts`' stats plus `out`.
    """
    from robotft.datasets.recording import record_rollouts, rollout_features
    from robotft.datasets.store import DatasetWriter
    from robotft.envs.factory import make_env

    if env_cfg.type != "robosuite":
        raise ValueError(f"generate_robosuite_demos needs env.type='robosuite', got {env_cfg.type!r}")
    if env_cfg.task not in PLANS:
        raise ValueError(f"no scripted robosuite expert for task {env_cfg.task!r}; available: {sorted(PLANS)}")
    env = make_env(dataclasses.replace(env_cfg, num_envs=min(n_episodes, env_cfg.num_envs)), device="cpu")
    try:
        expert = PickPlaceExpert(env_cfg.task, env.spec, env.num_envs)
        with DatasetWriter(
            out,
            rollout_features(env.spec),
            fps=env_cfg.control_hz,
            action_spec=env.spec.action,
            env=to_dict(env_cfg),
            source=f"scripted expert on robosuite/{env_cfg.task}",
            mode=mode,
        ) as writer:
            stats = record_rollouts(env, expert, n_episodes, writer, seed=seed, task=env_cfg.task, progress=progress)
    finally:
        env.close()
    return {**stats, "out": str(out)}
