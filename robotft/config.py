"""Typed dataclass configs, YAML presets found by name, and dotted CLI overrides.

A preset is a YAML file in one of the top-level preset folders (`envs/`, `policies/`, `real_robot/`,
`datasets/`); `--env maniskill/push_cube` finds `envs/maniskill/push_cube.yaml`. Any field can be
overridden from the command line with a dotted flag (`--rl.clip_eps 0.01`). The resolved config is
saved as JSON in every run directory and checkpoint.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.resources
import inspect
import json
import os
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root of a checkout (editable install): its preset folders are the source of truth."""

PRESET_FOLDERS = ("envs", "policies", "real_robot", "datasets")
"""Top-level preset folders; a wheel ships copies of them as package data under `robotft/_presets`."""


class ConfigError(ValueError):
    """A config file, preset or override is wrong; the message names it and what was expected."""


def preset_roots() -> list[Any]:
    """Folders searched for presets, first match wins: `$ROBOTFT_PRESETS` (os.pathsep-separated), the cwd,
    the repository of a checkout (editable install), and the presets shipped inside an installed wheel."""
    roots: list[Any] = [Path(p) for p in os.environ.get("ROBOTFT_PRESETS", "").split(os.pathsep) if p]
    roots.append(Path.cwd())
    if (REPO_ROOT / "pyproject.toml").is_file():  # a checkout: its folders, not a copy, are the presets
        roots.append(REPO_ROOT)
    shipped = importlib.resources.files("robotft") / "_presets"
    if shipped.is_dir():
        roots.append(shipped)
    return roots


def _yaml_files(folder: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """`(name, file)` of every YAML file below a folder (a Path or an importlib Traversable)."""
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.is_dir():
            out += _yaml_files(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith((".yaml", ".yml")):
            out.append((prefix + entry.name.rsplit(".", 1)[0], entry))
    return out


def list_presets(folder: str) -> dict[str, Any]:
    """Preset name → file, over all preset roots (earlier roots shadow later ones)."""
    found: dict[str, Any] = {}
    for root in reversed(preset_roots()):
        if (root / folder).is_dir():
            found.update(_yaml_files(root / folder))
    return dict(sorted(found.items()))


def find_preset(folder: str, name: str) -> Any:
    """Resolve a preset name (`maniskill/push_cube`) or a path to a YAML file; returns a Path or, for a
    preset shipped inside the package, an importlib.resources Traversable (read it with `load_yaml`)."""
    direct = Path(name)
    if direct.suffix in (".yaml", ".yml") and direct.is_file():
        return direct
    key = name[: -len(direct.suffix)] if direct.suffix in (".yaml", ".yml") else name
    key = key[len(folder) + 1:] if key.startswith(folder + "/") else key
    tried = []
    for root in preset_roots():
        candidate = root / folder / f"{key}.yaml"
        tried.append(str(candidate))
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"no {folder} preset named {name!r} (looked for {', '.join(tried)}); available: {list(list_presets(folder))}"
    )


def first_sentence(text: str | None, limit: int = 140) -> str:
    """The first sentence of the first paragraph of `text`, on one line (cut at `limit` characters)."""
    para = " ".join((text or "").strip().split("\n\n")[0].split())
    end = re.search(r"(?<!\bal)(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z(`])", para)
    sentence = para if end is None else para[: end.start() + 1]
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def preset_description(path: Any) -> str:
    """The first sentence of a preset file's leading comment: its one-line description."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return first_sentence("\n".join(lines))


def load_yaml(path: Any) -> dict[str, Any]:
    """A YAML file (a Path or a Traversable) whose top level is a mapping."""
    try:
        data = yaml.safe_load(path.read_text() if hasattr(path, "read_text") else Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_preset(folder: str, name: str, _seen: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any]]:
    """`(file, data)` of a preset with its `base:` chain resolved: the base (a preset name in the same
    folder) is loaded first and this file's keys are merged on top, mappings key by key."""
    path = find_preset(folder, name)
    data = load_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return path, data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a {folder} preset name, got {base!r}")
    if str(path) in _seen:
        raise ConfigError(f"{path}: 'base' chain loops: {' -> '.join(_seen)} -> {path}")
    _, base_data = load_preset(folder, base, (*_seen, str(path)))
    return path, merge(base_data, data)


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


def migrate_type_key(data: dict[str, Any], old_key: str, where: str) -> dict[str, Any]:
    """`data` with the old name `old_key` of its discriminator renamed to `type`, the one key that names a
    registered implementation (env presets, rig devices and object-pose sources said `backend:`, dataset
    recipes `source:`). Saved runs, checkpoints and user YAML files written before the rename load unchanged;
    giving both keys with different values is an error naming `where` (the file) and both keys."""
    if old_key not in data:
        return data
    out = dict(data)
    value = out.pop(old_key)
    if "type" in out and out["type"] != value:
        raise ConfigError(f"{where}: gives both 'type' ({out['type']!r}) and {old_key!r} ({value!r}), the old name "
                          "of 'type'; keep only 'type'")
    return {"type": value, **out}


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a nested dict; unknown keys are an error naming the key. A class whose
    discriminator `type` was once named otherwise says so in `OLD_TYPE_KEY`; the old key is renamed here
    (`migrate_type_key`), so every loader accepts files written before the rename."""
    old_key = getattr(cls, "OLD_TYPE_KEY", None)
    if old_key is not None:
        data = migrate_type_key(data, old_key, where or cls.__name__)
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
    `make_env` refuses a field the chosen env type does not implement. Observation noise, action noise
    and action latency work on any env type (robotft.envs.randomization).
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
    texture_swap_prob: float = 0.0
    """Probability, per textured object (ManiSkill: the table and the floor) and reset, that its image texture is
    replaced by a uniformly random flat colour (Tobin et al. 2017's random textures)."""
    obs_noise_std: float = 0.0
    """Std of Gaussian noise added to the `state` observation at every step (state units; images untouched)."""
    action_noise_std: float = 0.0
    """Std of Gaussian noise added to every action (action units), then clipped to the action bounds."""
    action_latency_steps: tuple[int, int] = (0, 0)
    """[low, high] control steps by which actions reach the simulator late, drawn per env at each reset;
    until the first commanded action arrives the env receives the midpoint of the action bounds."""

    PHYSICAL = ("friction_scale", "mass_scale", "object_pos_range", "object_yaw_range", "camera_pos_range",
                "camera_fov_range", "light_scale", "color_jitter", "texture_swap_prob")
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
        if not 0.0 <= self.texture_swap_prob <= 1.0:
            raise ValueError(f"env.randomization.texture_swap_prob must be in [0, 1], got {self.texture_swap_prob}")

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
    policy_by_type: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Policy fields for one registered policy type only, applied after `policy` when the chosen policy has that
    type: fields other types lack (`{diffusion_mlp: {deterministic_sampler: model_std}}`)."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """BC training fields (`TrainConfig`, e.g. `steps`)."""


@dataclasses.dataclass
class EnvConfig:
    """A simulated task: which simulator, which task, how it is controlled and observed."""

    OLD_TYPE_KEY = "backend"
    """What `type` was called in env presets and saved configs before (robotft.config.migrate_type_key)."""

    type: str = "toy"
    """Simulator adapter (a registered env type, robotft.envs.factory): `maniskill`, `robosuite`, `mujoco`
    (gymnasium locomotion), `isaacgym` (FurnitureSim, untested here) or `toy`."""
    task: str = "nav2d"
    """Task id inside the simulator, e.g. `PushCube-v1` for ManiSkill, `nav2d` for the toy suite."""
    num_envs: int = 1
    """Parallel environments. ManiSkill CPU and robosuite: spread over `worker_processes` worker processes;
    ManiSkill GPU: all in one process."""
    worker_processes: int = 0
    """Worker processes that step the envs of simulators holding one env per instance (ManiSkill CPU, robosuite;
    `num_envs > 1`), each stepping its share in turn. 0: one per available CPU core, at most `num_envs` (more
    processes than cores only add context switches)."""
    sim_backend: str = "auto"
    """ManiSkill physics backend: `auto` (GPU when CUDA is present), `physx_cpu` or `physx_cuda`."""
    control_mode: str = "pd_ee_delta_pose"
    """Action meaning; must match the dataset's and the rig's (robosuite: `OSC_POSE`)."""
    obs_mode: str = "state"
    """Observation mode: `state`, or `rgb` for camera observations."""
    reward_mode: str = "dense"
    """Reward: `normalized_dense`, `dense` or `sparse` (ManiSkill and the toy suite); `dense`/`sparse` for
    robosuite."""
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
        if self.worker_processes < 0:
            raise ValueError(f"env.worker_processes must be >= 0 (0: one per CPU core), got {self.worker_processes}")
        if self.max_episode_steps < 1:
            raise ValueError(f"env.max_episode_steps must be >= 1, got {self.max_episode_steps}")


def load_env_config(name_or_path: str, overrides: dict[str, str] | None = None) -> EnvConfig:
    """Load `envs/<name>.yaml` (or a YAML path, `base:` resolved) into an EnvConfig, then apply `overrides`."""
    path, data = load_preset("envs", name_or_path)
    cfg = from_dict(EnvConfig, data, where=str(path))
    return apply_overrides(cfg, overrides, prefix="env.") if overrides else cfg


def resolve_device(device: str) -> str:
    """`auto` → `cuda` when present, else `cpu`."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# --------------------------------------------------------------------------------------------------
# `--help` from the dataclasses: every dotted field with its type, default and first docstring line.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name → docstring (the string literal under the field, as tyro and Sphinx read it), over the
    dataclass and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@dataclasses.dataclass(frozen=True)
class FieldHelp:
    """One line of `--help`: a dotted config field."""

    name: str
    """Dotted name, e.g. `rl.clip_eps`."""
    type: str
    """Type as shown, e.g. `FLOAT` or `[INT, ...]`."""
    default: str
    """Default as shown."""
    doc: str
    """First line of the field's docstring."""


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass inside `tp` (also `X | None`), else None."""
    if _is_dataclass_type(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and _is_dataclass_type(inner[0]):
            return inner[0]
    return None


def type_name(tp: Any) -> str:
    """A short, CLI-oriented spelling of an annotation: `FLOAT`, `[INT, INT]`, `STR|none`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return "|".join(names) + ("|none" if type(None) in args else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"[{type_name(args[0])}, ...]"
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin is list:
        return f"[{type_name(args[0]) if args else 'VALUE'}, ...]"
    if origin is dict or tp is dict:
        return "{KEY: VALUE}"
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if _is_dataclass_type(tp):
        return tp.__name__
    return {int: "INT", float: "FLOAT", str: "STR", bool: "BOOL"}.get(tp, "VALUE")


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, str):
        return value if value else "''"
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return json.dumps(value, default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else list(v))


def describe_fields(cls: type, prefix: str = "") -> list[FieldHelp]:
    """Every leaf field of dataclass `cls`, nested dataclasses flattened into dotted names."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[FieldHelp] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        inner = _dataclass_in(hints[f.name])
        if inner is not None:
            out += describe_fields(inner, f"{prefix}{f.name}.")
            continue
        doc = docs.get(f.name, "").split("\n\n")[0].replace("\n", " ")
        out.append(FieldHelp(prefix + f.name, type_name(hints[f.name]), _default_text(f), doc))
    return out


def render_fields(fields: list[FieldHelp], width: int = 100) -> str:
    """`--help` text of `fields`: one `--name TYPE (default: D)` line, the docstring wrapped below it."""
    lines = []
    for f in fields:
        lines.append(f"  --{f.name} {f.type}  (default: {f.default})")
        if f.doc:
            lines += textwrap.wrap(f.doc, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def render_presets(folder: str) -> str:
    """`  name  description` for every preset of a folder."""
    presets = list_presets(folder)
    width = max((len(n) for n in presets), default=0)
    return "\n".join(f"  {n:<{width}}  {preset_description(p)}" for n, p in presets.items())


def load_run_file(path: str | Path, stage: str) -> dict[str, Any]:
    """A saved run to rerun (`--config`): a run's or checkpoint's `config.json`, or a YAML file.

    Returns `{"run": {...the stage's config fields...}, "policy": mapping or preset name (or absent)}`. A YAML
    file may hold the run's fields at the top level (with `policy:` beside them) instead of under `run:`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file (expected a run's config.json or a YAML file)")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {path}: not valid JSON: {e}") from e
    else:
        data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping")
    if "run" not in data:
        data = {"run": {k: v for k, v in data.items() if k != "policy"}, **({"policy": data["policy"]} if "policy" in data else {})}
    run = dict(data["run"])
    saved_stage = run.pop("stage", stage)
    if saved_stage != stage:
        raise ConfigError(f"--config {path}: a {saved_stage} run's config, not a {stage} one "
                          f"(rerun it with `robotft {saved_stage} --config {path}`)")
    return {**data, "run": run}
