"""Dataset recipes: a YAML file in `datasets/` says how a dataset store is made, so that a dataset is named,
versioned and rebuilt like any other preset.

    robotft data generate maniskill/pick_cube          # datasets/maniskill/pick_cube.yaml -> data/maniskill/pick_cube.zarr
    robotft pretrain --data maniskill/pick_cube ...    # builds the store first when it is missing

A recipe names its *source* with `type:` (the sources are registered below: one function per way of making
episodes) and gives what that source needs: an env preset for generated demonstrations, a file, folder or
LeRobot repo id for imports. Adding a source is adding one `@register_source` function; adding a recipe is
adding one YAML file. (Recipes written before `type:` named the source with `source:`; they still load.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from robotft.config import (
    ConfigError,
    EnvConfig,
    find_preset,
    from_dict,
    load_env_config,
    load_preset,
    to_dict,
)


@dataclasses.dataclass
class DatasetRecipe:
    """How a dataset store is made (a file in `datasets/`)."""

    OLD_TYPE_KEY = "source"
    """What `type` was called in recipes before (robotft.config.migrate_type_key)."""

    type: str = "toy_scripted"
    """Where the episodes come from: one of the registered sources (`robotft data generate --help` lists them)."""
    env: str = ""
    """Env preset the demonstrations are generated in (generated sources), e.g. `maniskill/pick_cube`."""
    env_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Env fields set on top of the preset, dotted keys allowed, e.g. `{max_episode_steps: 150}`."""
    controller: str = ""
    """Control mode the actions are recorded in (ManiSkill demos are replayed into it); '' keeps the env's."""
    episodes: int = 100
    """Episodes to generate (generated sources; imports take every episode the filters keep)."""
    seed: int = 0
    """First seed of generation (the ManiSkill motion planner skips seeds it fails on)."""
    replay_noise_std: float = 0.0
    """ManiSkill motion-planned demos: std of the Gaussian noise on the executed arm actions while the replay
    records the noise-free tracking actions (DART), in the controller's normalized units (0.05: 5 mm per step
    in `pd_ee_delta_pos`); the demos then show recovery from perturbations. Needs a delta controller."""
    path: str = ""
    """What an import reads: a ManiSkill `.h5`, a robomimic `.hdf5`, a LeRobot root or hub-cache repo id."""
    key_map: dict[str, str | None] = dataclasses.field(default_factory=dict)
    """LeRobot imports: `lerobot_key: robotft_key` entries on top of the default map (empty value drops a key)."""
    only_success: bool = True
    """ManiSkill `.h5` imports: keep only the successful episodes."""
    filter_key: str = ""
    """robomimic imports: import only the demos listed in `mask/<filter_key>` (e.g. `train`); '' takes all."""
    out: str = ""
    """Store to write; '' writes `data/<recipe name>.zarr` under the current directory."""

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {self.episodes}")
        if self.replay_noise_std < 0:
            raise ValueError(f"replay_noise_std must be >= 0, got {self.replay_noise_std}")
        if self.replay_noise_std > 0 and self.type != "maniskill_motion_planner":
            raise ValueError(f"replay_noise_std is for recipes of type maniskill_motion_planner, not {self.type!r}")

    def env_config(self) -> EnvConfig:
        """The env the demonstrations are generated in: the preset, the overrides, then the controller."""
        if not self.env:
            raise ConfigError(f"recipe type {self.type!r} needs `env:` (an env preset, e.g. maniskill/pick_cube)")
        cfg = load_env_config(self.env, {k: str(v) if not isinstance(v, str) else v
                                         for k, v in _dotted(self.env_overrides).items()})
        return dataclasses.replace(cfg, control_mode=self.controller) if self.controller else cfg


def _dotted(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in mapping.items():
        if isinstance(v, dict):
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


Source = Callable[[DatasetRecipe, Path, str], dict[str, Any]]
"""`(recipe, out, mode) -> stats` where mode is `create`, `append` or `overwrite`."""


@dataclasses.dataclass(frozen=True)
class _Registered:
    build: Source
    env_type: str | None
    description: str


SOURCES: dict[str, _Registered] = {}
"""Registered dataset sources by name."""


def register_source(name: str, env_type: str | None = None) -> Callable[[Source], Source]:
    """Register a dataset source (a recipe's `type`); `env_type` marks it as the demonstration generator of
    that env type (what `robotft data generate --env PRESET` uses). The function's first docstring line
    describes it."""

    def deco(fn: Source) -> Source:
        SOURCES[name] = _Registered(fn, env_type, (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


def source_for_env_type(env_type: str) -> str:
    """The registered demonstration generator of an env type."""
    for name, reg in SOURCES.items():
        if reg.env_type == env_type:
            return name
    raise ConfigError(f"no demonstration generator for env type {env_type!r}; generators exist for "
                      f"{sorted(r.env_type for r in SOURCES.values() if r.env_type)}")


@register_source("maniskill_motion_planner", env_type="maniskill")
def _maniskill_motion_planner(recipe: DatasetRecipe, out: Path, mode: str) -> dict[str, Any]:
    """ManiSkill's motion planner, replayed into the recipe's controller and observation mode."""
    from robotft.datasets.maniskill_demos import generate_maniskill_demos

    return generate_maniskill_demos(recipe.env_config(), recipe.episodes, out, seed=recipe.seed, mode=mode,
                                    replay_noise_std=recipe.replay_noise_std)


@register_source("robosuite_scripted", env_type="robosuite")
def _robosuite_scripted(recipe: DatasetRecipe, out: Path, mode: str) -> dict[str, Any]:
    """robotft's scripted robosuite experts (Lift, PickPlaceCan)."""
    from robotft.datasets.robosuite_demos import generate_robosuite_demos

    return generate_robosuite_demos(recipe.env_config(), recipe.episodes, out, seed=recipe.seed, mode=mode)


@register_source("toy_scripted", env_type="toy")
def _toy_scripted(recipe: DatasetRecipe, out: Path, mode: str) -> dict[str, Any]:
    """The bimodal scripted expert of the toy 2-D navigation task."""
    from robotft.datasets.recording import record_rollouts, rollout_features
    from robotft.datasets.store import DatasetWriter
    from robotft.envs.factory import make_env
    from robotft.envs.toy import TASKS, Nav2DExpert

    env_cfg = recipe.env_config()
    env = make_env(dataclasses.replace(env_cfg, num_envs=min(recipe.episodes, env_cfg.num_envs)), device="cpu")
    expert = Nav2DExpert(env.num_envs, obstacle_radius=TASKS[env_cfg.task], seed=recipe.seed)
    try:
        with DatasetWriter(out, rollout_features(env.spec), fps=env_cfg.control_hz, action_spec=env.spec.action,
                           env=to_dict(env_cfg), source=f"scripted expert on toy/{env_cfg.task}",
                           mode=mode) as writer:
            return record_rollouts(env, expert, recipe.episodes, writer, seed=recipe.seed, task=env_cfg.task)
    finally:
        env.close()


@register_source("lerobot")
def _lerobot(recipe: DatasetRecipe, out: Path, mode: str) -> dict[str, Any]:
    """A LeRobot v3.0 dataset (local root or hub-cache repo id), features renamed by `key_map`."""
    from robotft.lerobot.dataset import import_lerobot, load_key_map

    return import_lerobot(_need_path(recipe), out, key_map=load_key_map(recipe.key_map or None), mode=mode)


@register_source("robomimic")
def _robomimic(recipe: DatasetRecipe, out: Path, mode: str) -> dict[str, Any]:
    """A robomimic `.hdf5` file (optionally only the demos of one filter key)."""
    from robotft.datasets.robomimic_import import import_robomimic_hdf5

    return import_robomimic_hdf5(_need_path(recipe), out, mode=mode, filter_key=recipe.filter_key or None)


@register_source("maniskill_h5")
def _maniskill_h5(recipe: DatasetRecipe, out: Path, mode: str) -> dict[str, Any]:
    """A ManiSkill trajectory `.h5` already replayed into state or rgb observations."""
    from robotft.datasets.maniskill_demos import import_maniskill_h5

    return import_maniskill_h5(_need_path(recipe), out, control_mode=recipe.controller or None, mode=mode,
                               only_success=recipe.only_success)


def _need_path(recipe: DatasetRecipe) -> str:
    if not recipe.path:
        raise ConfigError(f"recipe type {recipe.type!r} needs `path:` (the file, folder or repo id to import)")
    return recipe.path


def is_recipe(name: str) -> bool:
    """Whether `name` is a recipe file or the name of a recipe in `datasets/`."""
    if name.endswith((".yaml", ".yml")):
        return Path(name).is_file()
    try:
        find_preset("datasets", name)
    except ConfigError:
        return False
    return True


def load_recipe(name: str, overrides: dict[str, str] | None = None) -> tuple[DatasetRecipe, Path]:
    """A recipe (name in `datasets/` or YAML path, `base:` resolved) and the store it writes."""
    from robotft.config import apply_overrides

    path, data = load_preset("datasets", name)
    recipe = from_dict(DatasetRecipe, data, where=str(path))
    recipe = apply_overrides(recipe, overrides) if overrides else recipe
    if recipe.type not in SOURCES:
        raise ConfigError(f"{path}: unknown type {recipe.type!r}; registered sources: {sorted(SOURCES)}")
    if recipe.out:
        return recipe, Path(recipe.out)
    stem = Path(name).with_suffix("") if name.endswith((".yaml", ".yml")) else Path(name)
    stem = Path(stem.name) if stem.is_absolute() or ".." in stem.parts else stem
    return recipe, Path("data") / stem.with_suffix(".zarr")


def build_dataset(recipe: DatasetRecipe, out: str | Path, mode: str = "create") -> dict[str, Any]:
    """Run the recipe's source into the store `out`; returns the source's stats plus `out` and `source` (the
    recipe's `type`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = SOURCES[recipe.type].build(recipe, out, mode)
    return {**stats, "source": recipe.type, "out": str(out)}


def ensure_dataset(name: str) -> Path:
    """The store of recipe `name`, built first when it does not exist (an existing store is reused as is)."""
    import sys

    recipe, out = load_recipe(name)
    if not out.exists():
        print(f"dataset {out} missing: building it from recipe {name!r} ({recipe.type})", file=sys.stderr)
        build_dataset(recipe, out)
    return out
