"""Declared meaning of observations and actions: the sim-to-real contract of DESIGN.md.

Every dataset and checkpoint carries these specs, so a rig can check that it provides the same keys,
shapes, units and control mode that a policy was trained with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FeatureSpec:
    """One observation or action feature, per time step (no batch or time axis in `shape`)."""

    key: str
    """Fixed key, e.g. `state`, `rgb/base`, `depth/wrist`, `action`."""
    shape: tuple[int, ...]
    """Per-step shape, e.g. `(25,)` for a state vector, `(128, 128, 3)` for an RGB image."""
    dtype: str
    """numpy dtype name: `float32`, `uint8`, ..."""
    unit: str = ""
    """Physical unit or encoding, e.g. `m`, `rad`, `normalized`, `rgb8`."""
    frame: str = ""
    """Reference frame, e.g. `robot_base`; empty where it does not apply."""
    names: tuple[str, ...] = ()
    """Optional per-dimension names of a vector feature."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["names"] = list(self.names)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FeatureSpec:
        return cls(
            key=d["key"],
            shape=tuple(int(s) for s in d["shape"]),
            dtype=str(d["dtype"]),
            unit=d.get("unit", ""),
            frame=d.get("frame", ""),
            names=tuple(d.get("names", ())),
        )


@dataclass(frozen=True)
class ActionSpec:
    """What an action vector means: control mode, bounds and control rate."""

    control_mode: str
    """Simulator/robot control mode, e.g. `pd_ee_delta_pose` (base frame, + gripper) or `joint_delta_pos`."""
    dim: int
    """Action dimension per step."""
    low: tuple[float, ...]
    """Per-dimension lower bound of one step's action, in env units."""
    high: tuple[float, ...]
    """Per-dimension upper bound of one step's action, in env units."""
    control_hz: float = 0.0
    """Control rate the policy was trained at (steps per second); 0 when unknown."""
    frame: str = ""
    """Reference frame of Cartesian actions, e.g. `robot_base`."""

    def __post_init__(self) -> None:
        if len(self.low) != self.dim or len(self.high) != self.dim:
            raise ValueError(
                f"ActionSpec {self.control_mode!r}: low/high must have dim={self.dim} entries, "
                f"got {len(self.low)} and {len(self.high)}"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["low"], d["high"] = list(self.low), list(self.high)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActionSpec:
        return cls(
            control_mode=d["control_mode"],
            dim=int(d["dim"]),
            low=tuple(float(v) for v in d["low"]),
            high=tuple(float(v) for v in d["high"]),
            control_hz=float(d.get("control_hz", 0.0)),
            frame=d.get("frame", ""),
        )


@dataclass(frozen=True)
class EnvSpec:
    """Observation features and action spec of an environment (or a dataset, or a rig)."""

    observations: dict[str, FeatureSpec] = field(default_factory=dict)
    action: ActionSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "observations": {k: v.to_dict() for k, v in self.observations.items()},
            "action": None if self.action is None else self.action.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EnvSpec:
        return cls(
            observations={k: FeatureSpec.from_dict(v) for k, v in d.get("observations", {}).items()},
            action=None if d.get("action") is None else ActionSpec.from_dict(d["action"]),
        )


def check_policy_fits_env(policy_spec: EnvSpec, env_spec: EnvSpec, where: str) -> None:
    """Refuse to run a policy trained on `policy_spec` (from its checkpoint) in an env whose actions mean
    something else: a different control mode or action size. `where` names the checkpoint."""
    if policy_spec.action is None or env_spec.action is None:
        return
    trained, env = policy_spec.action, env_spec.action
    if trained.control_mode and env.control_mode and trained.control_mode != env.control_mode:
        raise ValueError(f"{where}: the policy was trained with control mode {trained.control_mode!r} but the env "
                         f"uses {env.control_mode!r}; evaluate and fine-tune in the checkpoint's control mode "
                         f"(--env.control_mode {trained.control_mode})")
    if trained.dim != env.dim:
        raise ValueError(f"{where}: the policy outputs {trained.dim}-d actions but the env takes {env.dim}-d ones")
