"""Typed dataclass configs, YAML presets found by name, and dotted CLI overrides.

A preset is a YAML file in one of the top-level preset folders (`envs/`, `policies/`, `real_robot/`,
`datasets/`); `--env maniskill/push_cube` finds `envs/maniskill/push_cube.yaml`. Any field can be
overridden from the command line with a dotted flag (`--rl.clip_eps 0.01`). The resolved config is
saved as JSON in every run directory and checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
"""Where the preset folders live (the repository root of an editable install)."""


class ConfigError(ValueError):
    """A config file, preset or override is wrong; the message names it and what was expected."""


def preset_roots() -> list[Path]:
    """Folders searched for presets: `$ROBOTFT_PRESETS` (os.pathsep-separated), the cwd, the repo."""
    roots = [Path(p) for p in os.environ.get("ROBOTFT_PRESETS", "").split(os.pathsep) if p]
    roots += [Path.cwd(), REPO_ROOT]
    return roots


def find_preset(folder: str, name: str) -> Path:
    """Resolve a preset name (`maniskill/push_cube`) or a path to a YAML file."""
    direct = Path(name)
    if direct.suffix in (".yaml", ".yml") and direct.is_file():
        return direct
    tried = []
    for root in preset_roots():
        candidate = root / folder / f"{name}.yaml"
        tried.append(str(candidate))
        if candidate.is_file():
            return candidate
    available = sorted(
        str(p.relative_to(REPO_ROOT / folder).with_suffix(""))
        for p in (REPO_ROOT / folder).rglob("*.yaml")
    ) if (REPO_ROOT / folder).is_dir() else []
    raise ConfigError(
        f"no {folder} preset named {name!r} (looked for {', '.join(tried)}); available: {available}"
    )


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` (from YAML, JSON or a CLI string) to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} does not match {tp}: {'; '.join(errors)}")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, where=where)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [
                v for v in value.split(",") if v
            ]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if f != int(f):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a nested dict; unknown keys are an error naming the key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {unknown}; expected some of {sorted(fields)}"
        )
    kwargs = {
        name: _coerce(value, hints[name], f"{where + '.' if where else ''}{name}")
        for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-serialisable dict of a (nested) dataclass config."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=list))


def apply_overrides(cfg: T, overrides: dict[str, str], prefix: str = "") -> T:
    """Return a copy of `cfg` with dotted overrides applied: `{"rl.clip_eps": "0.01"}`.

    `prefix` is how the CLI names this config's section (e.g. `train.`), used in error messages."""
    data = to_dict(cfg)
    for key, raw in overrides.items():
        dotted = prefix + key
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"override --{dotted}: {part!r} is not a config section")
            node = node[part]
        if parts[-1] not in node:
            raise ConfigError(
                f"override --{dotted}: unknown field {parts[-1]!r}; expected one of {sorted(node)}"
            )
        node[parts[-1]] = raw
    return from_dict(type(cfg), data, where=prefix.rstrip("."))


def parse_override_args(args: list[str]) -> dict[str, str]:
    """Parse `--a.b value` / `--a.b=value` pairs left over by argparse into a dict."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} needs a value")
            value = args[i + 1]
            i += 2
        out[key.replace("-", "_")] = value
    return out


# --------------------------------------------------------------------------------------------------
# Run configs shared by the stages. Policy configs live beside their policies (robotft.policies) and
# are registered by name; RL algorithm configs live in robotft.rl.


def _check_range(name: str, lo_hi: tuple, minimum: float | None = None) -> None:
    """`lo_hi` is a `[low, high]` pair with low <= high (and low >= minimum when given)."""
    if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
        raise ValueError(f"env.randomization.{name} must be [low, high] with low <= high, got {list(lo_hi)}")
    if minimum is not None and lo_hi[0] < minimum:
        raise ValueError(f"env.randomization.{name} must be >= {minimum}, got {list(lo_hi)}")


@dataclasses.dataclass
class DomainRandomizationConfig:
    """Domain randomization for sim-to-real (Tobin et al. 2017, arXiv 1703.06907; Peng et al. 2018,
    arXiv 1710.06537), applied at every reset. The defaults change nothing: an env with them is
    bit-identical to one without randomization.

    Physical fields (friction, mass, object pose, camera, light) are implemented per adapter, and
    `make_env` refuses a field the chosen backend does not implement. Observation noise, action noise
    and action latency work on any backend (robotft.envs.randomization).
    Override from the CLI: `--env.randomization.friction_scale [0.5,1.5]` or, in `robotft eval`,
    `--env-override randomization.friction_scale=[0.5,1.5]`.
    """

    friction_scale: tuple[float, float] = (1.0, 1.0)
    """[low, high] of the factor drawn per env at each reset that multiplies the nominal friction
    coefficients (MuJoCo: every geom; ManiSkill: the task's movable objects)."""
    mass_scale: tuple[float, float] = (1.0, 1.0)
    """[low, high] of the factor drawn per env at each reset that multiplies the nominal masses
    (MuJoCo: every body, inertia scaled alike; ManiSkill: the task's movable objects)."""
    object_pos_range: float = 0.0
    """Half-width (metres) of a uniform x/y offset added to each movable object's initial position,
    on top of the task's own randomization."""
    object_yaw_range: float = 0.0
    """Half-width (radians) of a uniform rotation about z added to each movable object's initial pose."""
    camera_pos_range: float = 0.0
    """Half-width (metres) of a uniform offset added to each camera position, per axis."""
    camera_fov_range: tuple[float, float] = (0.0, 0.0)
    """[low, high] (degrees) of an offset added to each camera's vertical field of view."""
    light_scale: tuple[float, float] = (1.0, 1.0)
    """[low, high] of the factor that multiplies the nominal light intensities (where the renderer allows)."""
    color_jitter: float = 0.0
    """Half-width of a uniform offset added to each RGB channel (0-1) of every object's colour at each reset,
    the same offset for all shapes of one object (where the renderer allows)."""
    obs_noise_std: float = 0.0
    """Std of Gaussian noise added to the `state` observation at every step (state units; images untouched)."""
    action_noise_std: float = 0.0
    """Std of Gaussian noise added to every action (action units), then clipped to the action bounds."""
    action_latency_steps: tuple[int, int] = (0, 0)
    """[low, high] control steps by which actions reach the simulator late, drawn per env at each reset;
    until the first commanded action arrives the env receives the midpoint of the action bounds."""

    PHYSICAL = ("friction_scale", "mass_scale", "object_pos_range", "object_yaw_range", "camera_pos_range",
                "camera_fov_range", "light_scale", "color_jitter")
    """Fields each adapter implements itself (or refuses)."""

    def __post_init__(self) -> None:
        for name in ("friction_scale", "mass_scale", "camera_fov_range", "light_scale", "action_latency_steps"):
            setattr(self, name, tuple(getattr(self, name)))  # lists from Python callers compare like YAML's
        for name in ("friction_scale", "mass_scale", "light_scale"):
            _check_range(name, getattr(self, name), minimum=0.0)
        _check_range("camera_fov_range", self.camera_fov_range)
        _check_range("action_latency_steps", self.action_latency_steps, minimum=0)
        for name in ("object_pos_range", "object_yaw_range", "camera_pos_range", "obs_noise_std",
                     "action_noise_std", "color_jitter"):
            if getattr(self, name) < 0:
                raise ValueError(f"env.randomization.{name} must be >= 0, got {getattr(self, name)}")

    def active_physical(self) -> list[str]:
        """Names of the physical fields that differ from their no-op default."""
        default = DomainRandomizationConfig()
        return [n for n in self.PHYSICAL if getattr(self, n) != getattr(default, n)]

    @property
    def generic_active(self) -> bool:
        """Whether observation noise, action noise or action latency is on."""
        return self.obs_noise_std > 0 or self.action_noise_std > 0 or self.action_latency_steps[1] > 0


@dataclasses.dataclass
class TaskRecipe:
    """What BC needs on this task, measured: policy and training fields that `robotft pretrain` applies over
    the policy preset and the training defaults, under any flag the user passes (`--policy.horizon_steps 4`
    still wins). Example (PickCube): `policy: {obs_steps: 2, horizon_steps: 8, act_steps: 4}`, `train:
    {steps: 8000}`."""

    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Policy config fields (e.g. `obs_steps`, `horizon_steps`, `act_steps`); a field the chosen policy type
    does not have is an error naming it."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """BC training fields (`TrainConfig`, e.g. `steps`)."""


@dataclasses.dataclass
class EnvConfig:
    """A simulated task: which simulator, which task, how it is controlled and observed."""

    backend: str = "toy"
    """Simulator adapter: `maniskill`, `robosuite`, `mujoco` (gymnasium locomotion), `isaacgym` (FurnitureSim,
    untested here) or `toy`."""
    task: str = "nav2d"
    """Task id inside the backend, e.g. `PushCube-v1` for ManiSkill, `nav2d` for the toy suite."""
    num_envs: int = 1
    """Parallel environments. ManiSkill CPU and robosuite: one per worker process; ManiSkill GPU: all in one
    process."""
    sim_backend: str = "auto"
    """ManiSkill physics backend: `auto` (GPU when CUDA is present), `physx_cpu` or `physx_cuda`."""
    control_mode: str = "pd_ee_delta_pose"
    """Action meaning; must match the dataset's and the rig's (robosuite: `OSC_POSE`)."""
    obs_mode: str = "state"
    """Observation mode: `state`, or `rgb` for camera observations."""
    reward_mode: str = "dense"
    """Reward: `normalized_dense`, `dense` or `sparse` (ManiSkill); `dense`/`sparse` for robosuite and the
    toy suite."""
    max_episode_steps: int = 100
    """Episode limit in env steps (not chunks); motion-planned demos need >= 100 on ManiSkill."""
    control_hz: float = 20.0
    """Control rate in steps per second (ManiSkill default 20 Hz)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments passed to the simulator's constructor."""
    randomization: DomainRandomizationConfig = dataclasses.field(default_factory=DomainRandomizationConfig)
    """Domain randomization applied at reset; the defaults change nothing."""
    recipe: TaskRecipe = dataclasses.field(default_factory=TaskRecipe)
    """BC policy and training fields measured to work on this task (applied by `robotft pretrain`)."""

    def __post_init__(self) -> None:
        if self.num_envs < 1:
            raise ValueError(f"env.num_envs must be >= 1, got {self.num_envs}")
        if self.max_episode_steps < 1:
            raise ValueError(f"env.max_episode_steps must be >= 1, got {self.max_episode_steps}")


def load_env_config(name_or_path: str, overrides: dict[str, str] | None = None) -> EnvConfig:
    """Load `envs/<name>.yaml` (or a YAML path) into an EnvConfig, then apply `overrides`."""
    path = find_preset("envs", name_or_path)
    cfg = from_dict(EnvConfig, load_yaml(path), where=str(path))
    return apply_overrides(cfg, overrides, prefix="env.") if overrides else cfg


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when present, else `cpu`."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
