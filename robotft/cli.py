"""`robotft pretrain | finetune | distill | eval | deploy | calibrate | data ... | presets`: the command line.

Every config field can be overridden with a dotted flag after the named options, e.g.
`robotft finetune --from runs/bc --algo dppo --rl.clip_eps 0.02 --env.num_envs 4`; `--help` of each
command lists every field with its type, default and description, and `--config RUN/config.json` reruns a
saved run (flags on top).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from robotft.config import (
    PRESET_FOLDERS,
    ConfigError,
    EnvConfig,
    TaskRecipe,
    apply_overrides,
    describe_fields,
    first_sentence,
    from_dict,
    load_env_config,
    load_preset,
    load_run_file,
    merge,
    parse_override_args,
    render_fields,
    render_presets,
    to_dict,
)


def _split_overrides(overrides: dict[str, str], sections: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Group `{"env.num_envs": "4", ...}` by their first component; unknown sections are an error."""
    groups: dict[str, dict[str, str]] = {s: {} for s in sections}
    for key, value in overrides.items():
        section, _, rest = key.partition(".")
        if not rest and "" in groups:
            groups[""][key] = value
            continue
        if section not in groups or not rest:
            raise ConfigError(f"unknown option --{key}; overrides start with one of {[s + '.' for s in sections]}")
        groups[section][rest] = value
    return groups


# -- bounds of counts and rates ----------------------------------------------------------------------

_BOUNDS: dict[str, str] = {
    **dict.fromkeys(("steps", "iterations", "episodes", "num_envs", "batch_size", "log_every", "save_every",
                     "max_episode_steps", "steps_per_iter", "update_epochs", "minibatch_size", "num_workers",
                     "envs_per_worker", "obs_steps", "horizon_steps", "act_steps", "num_train_timesteps",
                     "ddim_steps", "num_steps"), ">=1"),
    **dict.fromkeys(("eval_every", "eval_episodes", "eval_num_envs", "warmup_steps", "weight_decay", "grad_clip",
                     "critic_warmup_iters", "clip_value", "dual_clip", "max_restarts", "vf_coef", "target_kl",
                     "max_grad_norm", "bc_coef", "episode_time", "min_sampling_std", "min_logprob_std",
                     "ft_denoising_steps", "lr", "actor_lr", "critic_lr"), ">=0"),  # lr 0: frozen, on purpose
    **dict.fromkeys(("clip_eps", "clip_eps_base", "control_hz", "fps", "cpus_per_worker"), ">0"),
    **dict.fromkeys(("gamma", "gae_lambda", "gamma_denoising"), "(0,1]"),
    **dict.fromkeys(("ema_decay",), "[0,1)"),
}
"""Allowed range of every count and rate, by config field (or CLI option) name; every float must be finite."""
_STAGE_BOUNDS: dict[tuple[str, str], str] = {("FinetuneConfig", "eval_every"): ">=1"}
"""Where one config's field of a shared name has a narrower range (fine-tuning evaluates every N iterations)."""
_TESTS = {
    ">=1": lambda v: v >= 1, ">=0": lambda v: v >= 0, ">0": lambda v: v > 0,
    "(0,1]": lambda v: 0 < v <= 1, "[0,1)": lambda v: 0 <= v < 1,
}


def check_bound(name: str, value: object, rule: str | None = None, where: str = "") -> None:
    """Raise ConfigError when a number is NaN/inf or outside the range of `rule` (default: `_BOUNDS[name]`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    flag = f"--{where}{name}"
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{flag} is {value}, expected a finite number")
    rule = rule or _BOUNDS.get(name)
    if rule is not None and not _TESTS[rule](value):
        raise ConfigError(f"{flag} is {value}, expected {rule.replace('(', 'in (').replace('[', 'in [')}")


def check_bounds(cfg: object, where: str = "") -> None:
    """`check_bound` every numeric field of a (nested) dataclass config, before any work starts."""
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{where}{field.name}.")
        elif isinstance(value, (list, tuple)):
            for v in value:  # e.g. hidden sizes: finite (a name outside _BOUNDS checks nothing else)
                check_bound(f"{field.name}[]", v, None, where)
        else:
            check_bound(field.name, value, _STAGE_BOUNDS.get((type(cfg).__name__, field.name)), where)


# -- data -------------------------------------------------------------------------------------------


def _reattach_taken_value(extra: list[str], positional: str) -> tuple[list[str], str | None]:
    """`data generate --env E --FIELD VALUE`: argparse takes VALUE for the optional positional recipe and leaves
    `--FIELD` without its value. Give the value back to the first override that lacks one."""
    for i, arg in enumerate(extra):
        if arg.startswith("--") and "=" not in arg and (i + 1 == len(extra) or extra[i + 1].startswith("--")):
            return [*extra[: i + 1], positional, *extra[i + 1:]], None
    return extra, positional


def cmd_data_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.datasets.recipe import DatasetRecipe, build_dataset, load_recipe, source_for_env_type

    if args.episodes is not None:
        check_bound("episodes", args.episodes)
    mode = "append" if args.append else "overwrite" if args.overwrite else "create"
    if args.recipe and args.env:
        extra, args.recipe = _reattach_taken_value(extra, args.recipe)
    overrides = parse_override_args(extra)
    if bool(args.recipe) == bool(args.env):
        raise ConfigError("data generate: give a recipe (a datasets/ preset name or YAML file) or --env PRESET")
    if args.recipe:
        named = {k: v for k, v in (("episodes", args.episodes), ("seed", args.seed), ("out", args.out))
                 if v is not None}
        recipe, out = load_recipe(args.recipe, {**{k: str(v) for k, v in named.items()}, **overrides})
        out = Path(args.out) if args.out else out
    else:
        groups = _split_overrides(overrides, ("env", ""))
        if args.out is None:
            raise ConfigError("data generate --env: --out is required (a recipe names its own store)")
        env_cfg = load_env_config(args.env)
        recipe = DatasetRecipe(type=source_for_env_type(env_cfg.type), env=args.env, env_overrides=groups["env"],
                               episodes=args.episodes or 100, seed=args.seed or 0)
        # Recipe fields (e.g. --replay_noise_std) apply as they would in a recipe file.
        recipe = apply_overrides(recipe, groups[""]) if groups[""] else recipe
        out = Path(args.out)
    print(json.dumps(build_dataset(recipe, out, mode=mode), default=str))
    return 0


def cmd_data_import(args: argparse.Namespace, extra: list[str]) -> int:
    mode = "append" if args.append else "overwrite" if args.overwrite else "create"
    if bool(args.files) == bool(args.from_lerobot):
        raise ConfigError("data import: give either ManiSkill .h5 / robomimic .hdf5 FILES or --from-lerobot ROOT_OR_REPO_ID")
    if args.from_lerobot:
        from robotft.lerobot.dataset import import_lerobot, load_key_map, parse_map_args

        key_map = load_key_map(parse_map_args(args.map), args.map_file)
        print(json.dumps(import_lerobot(args.from_lerobot, args.out, key_map=key_map, mode=mode), default=str))
        return 0
    from robotft.datasets.maniskill_demos import import_maniskill_h5
    from robotft.datasets.robomimic_import import import_robomimic_hdf5, is_robomimic_hdf5

    total = {}
    for i, path in enumerate(args.files):
        file_mode = mode if i == 0 else "append"
        if is_robomimic_hdf5(path):
            stats = import_robomimic_hdf5(path, args.out, mode=file_mode, filter_key=args.filter_key)
        else:
            stats = import_maniskill_h5(path, args.out, control_mode=args.control_mode,
                                        mode=file_mode, only_success=not args.keep_failures)
        total[str(path)] = stats
    print(json.dumps(total, default=str))
    return 0


def cmd_data_export(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.lerobot.dataset import export_lerobot, load_key_map, parse_map_args

    key_map = load_key_map(parse_map_args(args.map), args.map_file)
    print(json.dumps(export_lerobot(args.path, args.to_lerobot, args.repo_id, key_map=key_map,
                                    overwrite=args.overwrite, vcodec=args.vcodec, robot_type=args.robot_type)))
    return 0


def cmd_data_info(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.datasets.store import summarize

    print(summarize(args.path))
    return 0


def cmd_data_validate(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.datasets.store import DatasetError, validate_store

    try:
        validate_store(args.path)
    except DatasetError as e:
        print(f"INVALID: {e}", file=sys.stderr)
        return 1
    print(f"{args.path}: valid")
    return 0


# -- policy ---------------------------------------------------------------------------------------


def cmd_policy_import(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.lerobot.dataset import parse_map_args
    from robotft.lerobot.policy import import_lerobot_policy

    env_cfg = load_env_config(args.env, _split_overrides(parse_override_args(extra), ("env",))["env"])
    out = import_lerobot_policy(args.from_lerobot, args.out, env_cfg, key_map=parse_map_args(args.map),
                                task=args.task)
    print(f"checkpoint: {out}", file=sys.stderr)
    return 0


# -- pretrain / finetune / eval ---------------------------------------------------------------------


def resolve_pretrain(args: argparse.Namespace, extra: list[str]) -> tuple[Any, Any]:
    """`(PretrainConfig, policy config)` from, later winning: `--config` (a saved run) or the presets with the
    env's task recipe over them, then the named flags, then dotted overrides."""
    from robotft.policies.base import policy_config_class
    from robotft.pretrain import PretrainConfig, TrainConfig

    overrides = parse_override_args(extra)
    policy_overrides = {k[len("policy."):]: v for k, v in overrides.items() if k.startswith("policy.")}
    run_overrides = {k: v for k, v in overrides.items() if not k.startswith("policy.")}
    saved = load_run_file(args.config, "pretrain") if args.config else {"run": {}}
    run = dict(saved["run"])
    if args.env:
        run["env"] = to_dict(load_env_config(args.env))
    elif "env" not in run:  # no simulator: specs from the dataset, no evaluation (e.g. real-robot demos)
        run["env"] = None
    env_overrides = {k[len("env."):]: v for k, v in run_overrides.items() if k.startswith("env.")}
    if env_overrides and run["env"] is None:
        raise ConfigError(f"--env.* overrides {sorted(env_overrides)} need --env")
    where = f"{args.config}: run.env" if args.config and not args.env else "env"
    recipe = (apply_overrides(from_dict(EnvConfig, run["env"], where=where), env_overrides, prefix="env.").recipe
              if run["env"] is not None else TaskRecipe())
    if "train" not in run:  # a fresh run: the task's recipe over the training defaults (a saved run has both)
        run["train"] = to_dict(apply_overrides(TrainConfig(), recipe.train, prefix="env.recipe.train.")
                               if recipe.train else TrainConfig())
    run["train"] = merge(run["train"], {k: v for k, v in (("steps", args.steps), ("seed", args.seed))
                                        if v is not None})
    run.update({k: v for k, v in (("out", args.out), ("rig", args.rig)) if v is not None})
    if args.wandb:
        run["wandb"] = merge(run.get("wandb", {}), {"enabled": True})
    if args.data is not None:
        run["data"] = _dataset_path(args.data)
    if not run.get("data"):
        raise ConfigError("pretrain: --data is required (a dataset store or a recipe in datasets/)")
    cfg = from_dict(PretrainConfig, run, where=str(args.config or "pretrain"))
    cfg = apply_overrides(cfg, run_overrides) if run_overrides else cfg

    policy = args.policy or saved.get("policy")
    if policy is None:
        raise ConfigError("pretrain: --policy is required (or --config with a saved run)")
    where, policy_data = load_preset("policies", policy) if isinstance(policy, str) else (args.config, policy)
    if "type" not in policy_data:
        raise ConfigError(f"{where}: missing key 'type' (the registered policy name)")
    policy_cfg = from_dict(policy_config_class(policy_data["type"]), policy_data, where=str(where))
    if isinstance(policy, str):  # a saved run's policy already holds the recipe
        for fields, prefix in ((recipe.policy, "env.recipe.policy."),
                               (recipe.policy_by_type.get(policy_cfg.type, {}),
                                f"env.recipe.policy_by_type.{policy_cfg.type}.")):
            policy_cfg = apply_overrides(policy_cfg, fields, prefix=prefix) if fields else policy_cfg
    policy_cfg = apply_overrides(policy_cfg, policy_overrides, prefix="policy.") if policy_overrides else policy_cfg
    return cfg, policy_cfg


def _dataset_path(data: str) -> str:
    """A dataset store path, or the store of a recipe in `datasets/` (built first when it is missing)."""
    from robotft.datasets.recipe import ensure_dataset, is_recipe

    if not is_recipe(data) or (Path(data).is_dir() and not data.endswith((".yaml", ".yml"))):
        return data
    return str(ensure_dataset(data))


def cmd_pretrain(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.pretrain import run_pretrain

    cfg, policy_cfg = resolve_pretrain(args, extra)
    check_bounds(cfg)
    check_bounds(policy_cfg, "policy.")
    out = run_pretrain(cfg, policy_cfg, resume=args.resume, overwrite=args.overwrite)
    print(f"checkpoint: {out / 'checkpoint'}\nlogs: tensorboard --logdir {out / 'tb'}", file=sys.stderr)
    return 0


def resolve_finetune(args: argparse.Namespace, extra: list[str]) -> tuple[Any, dict[str, str]]:
    """`(FinetuneConfig, policy overrides)` from `--config`, the env preset, the named flags and dotted
    overrides, in that order (later wins)."""
    from robotft.finetune import FinetuneConfig

    overrides = parse_override_args(extra)
    policy_overrides = {k[len("policy."):]: v for k, v in overrides.items() if k.startswith("policy.")}
    run_overrides = {k: v for k, v in overrides.items() if not k.startswith("policy.")}
    saved = load_run_file(args.config, "finetune") if args.config else {"run": {}}
    run = dict(saved["run"])
    named = {"source": args.source, "out": args.out, "algo": args.algo, "seed": args.seed}
    run.update({k: v for k, v in named.items() if v is not None})
    if "rl" not in saved["run"]:  # a fresh run: the algorithm's own core defaults (a saved run has them)
        base = to_dict(FinetuneConfig.for_algorithm(run.get("algo", FinetuneConfig.algo)))
        for core in ("rl", "offpolicy"):
            run[core] = merge(base[core], run.get(core, {}))
    if args.iterations is not None:
        run["rl"] = merge(run.get("rl", {}), {"iterations": args.iterations})
    if args.wandb:
        run["wandb"] = merge(run.get("wandb", {}), {"enabled": True})
    if args.env:
        run["env"] = to_dict(load_env_config(args.env))
    elif run.get("env") is None and any(k.startswith("env.") for k in run_overrides):
        from robotft.checkpoint import read_checkpoint

        run["env"] = to_dict(_checkpoint_env(read_checkpoint(run.get("source", ""))))
    if not run.get("source"):
        raise ConfigError("finetune: --from is required (or --config with a saved run)")
    cfg = from_dict(FinetuneConfig, run, where=str(args.config or "finetune"))
    cfg = apply_overrides(cfg, run_overrides) if run_overrides else cfg
    return cfg, policy_overrides


def cmd_finetune(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.finetune import run_finetune

    cfg, policy_overrides = resolve_finetune(args, extra)
    check_bounds(cfg)
    _check_finetune_out(Path(cfg.source), Path(cfg.out))
    from robotft.checkpoint import load_policy, prepare_run_dir

    _, source = load_policy(cfg.source)  # a damaged source is refused before the run directory is made
    if cfg.env is None:
        _checkpoint_env(source)
    prepare_run_dir(cfg.out, "finetune", resume=args.resume, overwrite=args.overwrite)
    out = run_finetune(cfg, policy_overrides=policy_overrides, resume=args.resume)
    print(f"checkpoint: {out / 'checkpoint'}\nlearning curve: {out / 'learning_curve.png'}\n"
          f"logs: tensorboard --logdir {out / 'tb'}", file=sys.stderr)
    return 0


def cmd_distill(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.distill import DistillConfig, run_distill
    from robotft.policies.base import policy_config_class

    groups = _split_overrides(parse_override_args(extra), ("env", "policy", ""))
    env_cfg = load_env_config(args.env, groups["env"])
    policy_path, policy_data = load_preset("policies", args.policy)
    policy_cfg = from_dict(policy_config_class(policy_data.get("type", "")), policy_data, where=str(policy_path))
    policy_cfg = apply_overrides(policy_cfg, groups["policy"], prefix="policy.") if groups["policy"] else policy_cfg
    cfg = DistillConfig(teacher=args.teacher, out=args.out, env=env_cfg, rig=args.rig or "", rounds=args.rounds,
                        seed=args.seed)
    cfg = apply_overrides(cfg, groups[""]) if groups[""] else cfg
    out = run_distill(cfg, policy_cfg, resume=args.resume)
    print(f"checkpoint: {out / 'checkpoint'}\nlogs: tensorboard --logdir {out / 'tb'}", file=sys.stderr)
    return 0


def _checkpoint_env(ckpt) -> EnvConfig:
    """The env config a checkpoint was trained with; one trained without a simulator needs `--env`."""
    env = ckpt.env_config()
    if env is None:
        raise ConfigError(f"{ckpt.path}: was trained without a simulator (no env in config.json); pass --env PRESET")
    return env


def _check_finetune_out(source: Path, out: Path) -> None:
    """The fine-tuned run must not be written where the checkpoint it starts from lives."""
    from robotft.checkpoint import resolve_checkpoint

    src = resolve_checkpoint(source).resolve()
    dst = out.resolve()
    if dst == src or dst in src.parents:
        raise ConfigError(f"--out {out} holds the checkpoint --from {source} starts from ({src}); "
                          "write the fine-tuned run to another directory")


_FAILED_SEEDS_SHOWN = 20
"""How many failed start-state seeds `robotft eval` prints (all of them are in its --json line)."""


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.checkpoint import describe_choice, load_policy
    from robotft.config import resolve_device
    from robotft.envs.factory import make_env
    from robotft.evaluation import EVAL_SEED, paired_comparison

    check_bound("episodes", args.episodes)
    check_bound("num_envs", args.num_envs, where="")
    device = resolve_device(args.device)
    seed = EVAL_SEED if args.seed is None else args.seed
    choice = describe_choice(args.checkpoint)
    if choice:
        print(choice, file=sys.stderr)
    groups = _split_overrides(parse_override_args(extra), ("env", "policy"))
    policy, ckpt = load_policy(args.checkpoint, device=device, overrides=groups["policy"])
    baseline_json = _read_baseline_json(Path(args.against), args.episodes, seed) if _is_json(args.against) else None
    env_overrides = groups["env"]
    for item in args.env_override or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env-override expects KEY=VALUE, got {item!r}")
        env_overrides[key] = value
    env_cfg = load_env_config(args.env) if args.env else _checkpoint_env(ckpt)
    env_cfg = dataclasses.replace(env_cfg, num_envs=args.num_envs)
    env_cfg = apply_overrides(env_cfg, env_overrides, prefix="env.") if env_overrides else env_cfg
    env = make_env(env_cfg, device=device)
    try:
        result = _evaluate_on(policy, ckpt, env, args.episodes, seed, args.video)
        if args.against is not None and baseline_json is None:
            base_policy, base_ckpt = load_policy(args.against, device=device)
            base = _evaluate_on(base_policy, base_ckpt, env, args.episodes, seed, None)
            baseline = {"success_rate": base.success_rate, "episode_success": list(base.episode_success),
                        "checkpoint": str(base_ckpt.path)}
        else:
            baseline = baseline_json
    finally:
        env.close()
    lo, hi = result.ci95
    print(f"{ckpt.path}: success {result.success_rate:.3f} (95% CI {lo:.3f}-{hi:.3f}) over {result.episodes} "
          f"episodes, mean return {result.mean_return:.3f}, {result.seconds:.1f} s", file=sys.stderr)
    if result.milestones:
        rates = ", ".join(f"{m} {rate:.2f}" for m, rate in result.milestone_rates.items())
        stages = ", ".join(f"{m} {count}" for m, count in result.failure_stages.items())
        print(f"episodes reaching each milestone: {rates}; failed episodes by the furthest milestone they reached: "
              f"{stages}", file=sys.stderr)
    failed = result.failed_seeds
    if failed:
        shown = ", ".join(map(str, failed[:_FAILED_SEEDS_SHOWN])) + (", ..." if len(failed) > _FAILED_SEEDS_SHOWN else "")
        print(f"failed start states (replay one with --seed S --episodes 1 --video out.mp4): {shown}",
              file=sys.stderr)
    report = {"success_rate": result.success_rate, "ci95": [lo, hi], "episodes": result.episodes,
              "mean_return": result.mean_return, "mean_length": result.mean_length,
              "success_once": result.success_once, "success_at_end": result.success_at_end,
              "seed": result.seed, "episode_success": list(result.episode_success),
              "episode_length": list(result.episode_length), "failed_seeds": failed,
              "checkpoint": str(ckpt.path)}
    if result.milestones:
        report.update(milestone_rates=result.milestone_rates, failure_stages=result.failure_stages,
                      episode_milestones=[list(m) for m in result.episode_milestones])
    if baseline is not None:
        paired = paired_comparison(result.episode_success, baseline["episode_success"])
        clo, chi = paired.ci95
        print(f"against {baseline['checkpoint']} on the same {paired.episodes} start states: "
              f"{paired.baseline_success_rate:.3f} -> {paired.success_rate:.3f}, difference {paired.difference:+.3f} "
              f"(95% CI {clo:+.3f} to {chi:+.3f}); {paired.only_this} start states succeed only here, "
              f"{paired.only_baseline} only with the baseline; exact McNemar p = {paired.p_value:.3g} (two-sided), "
              f"{paired.p_value_greater:.3g} (one-sided, this one better)", file=sys.stderr)
        report["against"] = {"checkpoint": baseline["checkpoint"], **paired.to_dict()}
    if args.json:
        print(json.dumps(report))
    return 0


def _evaluate_on(policy: Any, ckpt: Any, env: Any, episodes: int, seed: int, video: str | None) -> Any:
    """`robotft eval`'s evaluation of one checkpoint's policy on `env`, with a progress bar."""
    from robotft.envs.chunked import ChunkedEnv
    from robotft.evaluation import evaluate
    from robotft.runlog import capped_update, progress_bar
    from robotft.specs import check_policy_fits_env

    check_policy_fits_env(ckpt.spec, env.spec, str(ckpt.path))
    chunked = ChunkedEnv.for_policy(env, policy.config)
    with progress_bar(total=episodes, desc="eval", unit="episode") as bar:
        return evaluate(lambda o: policy.predict_chunk(o, deterministic=True), chunked, episodes, seed=seed,
                        video_path=video, progress=capped_update(bar))


def _is_json(path: str | None) -> bool:
    return path is not None and Path(path).suffix == ".json"


def _read_baseline_json(path: Path, episodes: int, seed: int) -> dict:
    """The outcomes of an earlier `robotft eval --json` (its last line), checked to pair with this evaluation."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        report = json.loads(lines[-1]) if lines else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--against {path}: not the JSON line of `robotft eval --json` ({e})") from e
    if not isinstance(report, dict) or not isinstance(report.get("episode_success"), list):
        raise ConfigError(f"--against {path}: expected the JSON line of `robotft eval --json` with an "
                          f"'episode_success' list (per start state)")
    if report.get("seed") != seed or len(report["episode_success"]) != episodes:
        raise ConfigError(f"--against {path}: evaluated {len(report['episode_success'])} episodes from seed "
                          f"{report.get('seed')}, this evaluation runs {episodes} from seed {seed}; pass the same "
                          f"--episodes and --seed so the start states pair up")
    report.setdefault("checkpoint", str(path))
    return report


def cmd_deploy(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.real_robot.deploy import DeployOptions, deploy

    if args.check:
        from robotft.real_robot.deploy import check_deployment

        lines, problems = check_deployment(args.checkpoint, args.rig)
        print("\n".join(lines))
        if problems:
            print("cannot deploy:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
            return 2
        print("ok: the rig provides every observation and executes the action")
        return 0
    check_bound("episodes", args.episodes)
    check_bound("episode_time", args.episode_time)
    mode = "append" if args.append else "overwrite" if args.overwrite else "create"
    options = DeployOptions(
        checkpoint=args.checkpoint, rig=args.rig, episodes=args.episodes, record=args.record, record_mode=mode,
        no_operator=args.no_operator, executor=args.executor, out=args.out, episode_time_s=args.episode_time,
        seed=args.seed, device=args.device, lockstep=args.lockstep,
    )
    overrides = parse_override_args(extra)
    options = apply_overrides(options, overrides) if overrides else options
    summary = deploy(options)
    lo, hi = summary["ci95"]
    report = f"latency report {summary['latency_json']}" if "latency_json" in summary else "lock-step"
    print(f"success {summary['success_rate']:.3f} (95% CI {lo:.3f}-{hi:.3f}) over {summary['scored']} scored "
          f"episodes; {report}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def cmd_presets(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"presets: unexpected arguments {extra}")
    folders = [_PRESET_KINDS[args.kind]] if args.kind else list(PRESET_FOLDERS)
    for folder in folders:
        print(f"{folder}/  (--{_PRESET_FLAG[folder]} NAME)")
        print(render_presets(folder) or "  (none)")
    return 0


_PRESET_FLAG = {"envs": "env", "policies": "policy", "real_robot": "rig", "datasets": "data"}
_PRESET_KINDS = {"envs": "envs", "policies": "policies", "rigs": "real_robot", "real_robot": "real_robot",
                 "datasets": "datasets"}


# -- --help: the manual ----------------------------------------------------------------------------


class _ManualHelp(argparse.Action):
    """`-h/--help`: argparse's usage, then `manual(namespace)`: every config field and the choices.

    Built only when asked for, because listing algorithms and policies imports torch."""

    def __init__(self, option_strings: list[str], manual: Callable[[argparse.Namespace], str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="show this help: every option, config field and preset, then exit")
        self.manual = manual

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        text = parser.format_help()
        if self.manual is not None:
            text += "\n" + self.manual(namespace).rstrip() + "\n"
        parser._print_message(text, sys.stdout)
        parser.exit()


def _section(title: str, body: str) -> str:
    return f"{title}\n{body}\n"


def _presets_section(folder: str, flag: str) -> str:
    return _section(f"{flag} choices (presets in {folder}/, or a YAML path):", render_presets(folder) or "  (none)")


def _fields_section(title: str, cls: type, prefix: str = "", skip: tuple[str, ...] = ()) -> str:
    fields = [f for f in describe_fields(cls, prefix) if f.name not in skip]
    return _section(title, render_fields(fields))


def manual_pretrain(ns: argparse.Namespace) -> str:
    from robotft.policies.base import PolicyConfig, policy_config_class
    from robotft.pretrain import PretrainConfig

    policy = getattr(ns, "policy", None)
    if policy:
        _, data = load_preset("policies", policy)
        policy_cls, which = policy_config_class(data.get("type", "")), f"policy preset {policy!r}"
    else:
        policy_cls, which = PolicyConfig, "every policy; give --policy NAME before --help for its own fields"
    return "\n".join([
        _presets_section("envs", "--env"), _presets_section("policies", "--policy"),
        _presets_section("datasets", "--data (a store path, or a recipe: built when missing)"),
        _presets_section("real_robot", "--rig"),
        _fields_section("Config fields (--FIELD VALUE after the options above):", PretrainConfig),
        _fields_section(f"Policy fields ({which}):", policy_cls, "policy."),
    ])


def manual_finetune(ns: argparse.Namespace) -> str:
    from robotft.finetune import ALGORITHMS, FinetuneConfig

    algos = "\n".join(f"  {name:<14} {first_sentence(sys.modules[cls.__module__].__doc__)}"
                      for name, cls in ALGORITHMS.items())
    return "\n".join([
        _section("--algo choices (each reads the config section of the same name):", algos),
        _presets_section("envs", "--env"),
        _fields_section("Config fields (--FIELD VALUE after the options above; --policy.FIELD sets a field of "
                        "the checkpoint's policy):", FinetuneConfig),
    ])


def manual_distill(ns: argparse.Namespace) -> str:
    from robotft.distill import DistillConfig
    from robotft.policies.base import PolicyConfig, policy_config_class

    policy = getattr(ns, "policy", None)
    policy_cls = policy_config_class(load_preset("policies", policy)[1].get("type", "")) if policy else PolicyConfig
    return "\n".join([
        _presets_section("envs", "--env"), _presets_section("policies", "--policy"),
        _presets_section("real_robot", "--rig"),
        _fields_section("Config fields (--FIELD VALUE after the options above):", DistillConfig),
        _fields_section("Student policy fields (--policy.FIELD VALUE):", policy_cls, "policy."),
    ])


def manual_eval(ns: argparse.Namespace) -> str:
    return "\n".join([_presets_section("envs", "--env"),
                      _fields_section("Env fields (--env.FIELD VALUE, on top of the checkpoint's env):",
                                      EnvConfig, "env."),
                      "--policy.FIELD VALUE sets a field of the checkpoint's policy that leaves its weights alone, e.g.\n"
                      "  --policy.deterministic_sampler model_std (a diffusion policy evaluated with its own sampler)"])


def manual_deploy(ns: argparse.Namespace) -> str:
    from robotft.real_robot.deploy import DeployOptions

    return "\n".join([_presets_section("real_robot", "--rig"),
                      _fields_section("Deploy fields (set by the options above, or any of them as --FIELD VALUE):", DeployOptions)])


def manual_data_generate(ns: argparse.Namespace) -> str:
    from robotft.datasets.recipe import SOURCES, DatasetRecipe

    sources = "\n".join(f"  {name:<26} {reg.description}" + (f" (--env {reg.env_type}/...)" if reg.env_type else "")
                        for name, reg in SOURCES.items())
    return "\n".join([
        _presets_section("datasets", "RECIPE"), _section("Sources (a recipe's `type:`):", sources),
        _fields_section("Recipe fields (a recipe's keys; --FIELD VALUE overrides one):", DatasetRecipe),
        _presets_section("envs", "--env"),
        _fields_section("Env fields (--env.FIELD VALUE with --env):", EnvConfig, "env."),
    ])


def manual_data(ns: argparse.Namespace) -> str:
    return manual_data_generate(ns)


def _add_parser(sub: Any, name: str, manual: Callable[[argparse.Namespace], str] | None = None,
                **kwargs: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(name, add_help=False, **kwargs)
    p.add_argument("-h", "--help", action=_ManualHelp, manual=manual)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="robotft", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (or set ROBOTFT_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)

    data = _add_parser(sub, "data", manual_data, help="create, import, inspect and validate datasets")
    dsub = data.add_subparsers(dest="data_command", required=True)
    g = _add_parser(dsub, "generate", manual_data_generate,
                    help="build a dataset from a recipe (datasets/), or demonstrations of an env preset")
    g.add_argument("recipe", nargs="?", default=None,
                   help="recipe: a name in datasets/ (e.g. maniskill/pick_cube) or a YAML file")
    g.add_argument("--env", default=None, help="instead of a recipe: an env preset, its env type's demo generator")
    g.add_argument("-n", "--episodes", type=int, default=None, help="episodes (default: the recipe's, else 100)")
    g.add_argument("--out", default=None, help="store to write (default: the recipe's, data/<recipe>.zarr)")
    g.add_argument("--seed", type=int, default=None, help="first seed (default: the recipe's, else 0)")
    _add_write_mode(g)
    g.set_defaults(func=cmd_data_generate)
    im = _add_parser(dsub, "import", help="import ManiSkill .h5, robomimic .hdf5 files or a LeRobot dataset")
    im.add_argument("files", nargs="*", type=Path)
    im.add_argument("--out", required=True)
    im.add_argument("--control-mode", default=None, help="expected control mode (checked)")
    im.add_argument("--keep-failures", action="store_true", help="also import unsuccessful episodes")
    im.add_argument("--filter-key", default=None,
                    help="robomimic .hdf5: import only the demos in mask/<FILTER_KEY> (e.g. train)")
    im.add_argument("--from-lerobot", default=None, metavar="ROOT_OR_REPO_ID",
                    help="a LeRobot v3.0 dataset: a local root, or a repo id in LeRobot's hub cache")
    _add_key_map_args(im)
    _add_write_mode(im)
    im.set_defaults(func=cmd_data_import)
    ex = _add_parser(dsub, "export", help="write a dataset store as a LeRobot v3.0 dataset (images as video)")
    ex.add_argument("path", help="the robotft dataset store")
    ex.add_argument("--to-lerobot", required=True, metavar="OUT", help="directory of the new LeRobot dataset")
    ex.add_argument("--repo-id", required=True, help="the LeRobot repo id recorded in it, e.g. user/pick_cube")
    ex.add_argument("--vcodec", default="libsvtav1", help="video codec (LeRobot's: libsvtav1, h264, hevc, ...)")
    ex.add_argument("--robot-type", default=None, help="robot type recorded in meta/info.json")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    _add_key_map_args(ex)
    ex.set_defaults(func=cmd_data_export)
    info = _add_parser(dsub, "info", help="summarize a dataset store")
    info.add_argument("path")
    info.set_defaults(func=cmd_data_info)
    val = _add_parser(dsub, "validate", help="check a dataset store; exit 1 when invalid")
    val.add_argument("path")
    val.set_defaults(func=cmd_data_validate)

    pol = _add_parser(sub, "policy", help="bring policies from other toolkits into robotft checkpoints")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    pim = _add_parser(psub, "import", help="a LeRobot DiffusionPolicy or SmolVLA pretrained_model directory")
    pim.add_argument("--from-lerobot", required=True, metavar="DIR", help="LeRobot pretrained_model directory")
    pim.add_argument("--env", required=True, help="env preset the policy acts in, e.g. maniskill/pick_cube")
    pim.add_argument("--out", required=True, help="robotft checkpoint directory to write")
    pim.add_argument("--task", default="", help="language instruction given to a VLA (SmolVLA)")
    pim.add_argument("--map", action="append", metavar="LEROBOT_KEY=ROBOTFT_KEY",
                     help="robotft observation key a LeRobot input reads (repeatable), e.g. "
                          "observation.environment_state=state")
    pim.set_defaults(func=cmd_policy_import)

    pre = _add_parser(sub, "pretrain", manual_pretrain, help="BC pretraining on a dataset")
    pre.add_argument("--config", default=None, metavar="PATH",
                     help="rerun a saved run: its config.json (or a YAML file); the flags below go on top")
    pre.add_argument("--env", default=None,
                     help="env preset to evaluate in (its spec must match the data); without it the specs come "
                          "from the dataset and there is no evaluation (e.g. real-robot demonstrations)")
    pre.add_argument("--rig", default=None, help="rig preset to check the policy can be deployed on (= --rig)")
    pre.add_argument("--policy", default=None, help="policy preset, e.g. diffusion_mlp")
    pre.add_argument("--data", default=None, help="dataset store, or a recipe in datasets/ (built when missing)")
    pre.add_argument("--steps", type=int, default=None,
                     help="gradient steps (= --train.steps; default: the task recipe's, else train.steps' default)")
    pre.add_argument("--out", default=None, help="run directory")
    pre.add_argument("--seed", type=int, default=None, help="= --train.seed")
    _add_run_mode(pre)
    pre.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (= --wandb.enabled true)")
    pre.set_defaults(func=cmd_pretrain)

    ft = _add_parser(sub, "finetune", manual_finetune, help="RL fine-tuning in simulation")
    ft.add_argument("--config", default=None, metavar="PATH",
                    help="rerun a saved run: its config.json (or a YAML file); the flags below go on top")
    ft.add_argument("--from", dest="source", default=None, help="pretrained checkpoint or run directory")
    ft.add_argument("--algo", default=None, help="fine-tuning algorithm (default dppo; choices below)")
    ft.add_argument("--iterations", type=int, default=None, help="= --rl.iterations")
    ft.add_argument("--out", default=None, help="run directory")
    ft.add_argument("--env", default=None, help="env preset (default: the checkpoint's env)")
    ft.add_argument("--seed", type=int, default=None)
    _add_run_mode(ft)
    ft.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (= --wandb.enabled true)")
    ft.set_defaults(func=cmd_finetune)

    dis = _add_parser(sub, "distill", manual_distill,
                      help="DAgger: a state teacher labels a camera student in simulation")
    dis.add_argument("--teacher", required=True, help="state policy checkpoint or run directory")
    dis.add_argument("--policy", required=True, help="student policy preset, e.g. diffusion_unet_rgb")
    dis.add_argument("--env", required=True, help="env preset giving the student's and the teacher's keys")
    dis.add_argument("--out", required=True)
    dis.add_argument("--rig", default=None, help="limit the student to what this rig observes, e.g. "
                                                 "real_robot/franka_d435.yaml (checked before training)")
    dis.add_argument("--rounds", type=int, default=5)
    dis.add_argument("--seed", type=int, default=0)
    dis.add_argument("--resume", action="store_true", help="continue after the newest completed round")
    dis.set_defaults(func=cmd_distill)

    ev = _add_parser(sub, "eval", manual_eval, help="evaluate a checkpoint in simulation")
    ev.add_argument("checkpoint")
    ev.add_argument("--episodes", type=int, default=50)
    ev.add_argument("--num-envs", type=int, default=1)
    ev.add_argument("--seed", type=int, default=None,
                    help="seed of the evaluation start states (default: the ones pretrain and finetune evaluate on)")
    ev.add_argument("--env", default=None, help="env preset (default: the checkpoint's env)")
    ev.add_argument("--env-override", action="append", help="KEY=VALUE applied to the env config")
    ev.add_argument("--video", default=None, help="PATH.mp4: one video per episode of the first env, PATH_ep<k>.mp4")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ev.add_argument("--against", default=None, metavar="BASELINE",
                    help="a checkpoint, or an earlier `eval --json` output (.json), to compare with on the same "
                         "start states and env: paired difference with its 95%% CI and an exact McNemar test "
                         "(--policy.FIELD overrides apply to the evaluated checkpoint only, so `eval CKPT "
                         "--policy.act_steps 8 --against CKPT` tests a setting)")
    ev.set_defaults(func=cmd_eval)

    dep = _add_parser(sub, "deploy", manual_deploy,
                      help="run a checkpoint on a rig (real or simulated Franka), record, report")
    dep.add_argument("checkpoint")
    dep.add_argument("--rig", required=True, help="rig preset, e.g. real_robot/sim_franka.yaml or sim_franka")
    dep.add_argument("--episodes", type=int, default=1)
    dep.add_argument("--record", default=None, help="dataset store to record the episodes into")
    dep.add_argument("--no-operator", action="store_true",
                     help="outcomes from the simulated scene instead of a person (refused on a real robot)")
    dep.add_argument("--executor", default=None, choices=["receding_horizon", "temporal_ensemble", "async"],
                     help="chunk executor (default: the rig's)")
    dep.add_argument("--out", default=None, help="folder for latency.json/.png and deploy.json "
                                                 "(default: beside --record, else runs/deploy)")
    dep.add_argument("--episode-time", type=float, default=0.0, help="episode time limit in seconds")
    dep.add_argument("--seed", type=int, default=0)
    dep.add_argument("--device", default="auto")
    dep.add_argument("--lockstep", action="store_true",
                     help="simulated rigs: one control period of physics per action instead of real time "
                          "(no timing effects: simulated cameras render each observation in step; needs --no-operator)")
    dep.add_argument("--check", action="store_true",
                     help="print the observation and action mapping and exit (non-zero when the checkpoint "
                          "cannot run on the rig), without connecting to any device")
    _add_write_mode(dep)
    dep.set_defaults(func=cmd_deploy)

    pr = _add_parser(sub, "presets", help="list the presets (envs, policies, rigs, datasets) with a description")
    pr.add_argument("kind", nargs="?", default=None, choices=sorted(_PRESET_KINDS),
                    help="only this kind (default: all)")
    pr.set_defaults(func=cmd_presets)

    from robotft.real_robot.calibrate import add_cli as add_calibrate

    add_calibrate(sub)
    return p


def _add_key_map_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--map", action="append", metavar="LEROBOT_KEY=ROBOTFT_KEY",
                   help="rename a LeRobot feature (repeatable; 'observation.images.*=rgb/*' maps a prefix; "
                        "an empty value drops the feature)")
    p.add_argument("--map-file", default=None, help="YAML file of LeRobot feature: robotft key entries")


def _add_run_mode(p: argparse.ArgumentParser) -> None:
    m = p.add_mutually_exclusive_group()
    m.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    m.add_argument("--overwrite", action="store_true", help="replace the run of the same stage at --out")


def _add_write_mode(p: argparse.ArgumentParser) -> None:
    m = p.add_mutually_exclusive_group()
    m.add_argument("--append", action="store_true", help="add episodes to an existing store")
    m.add_argument("--overwrite", action="store_true", help="replace an existing store")


def set_cpu_threads() -> None:
    """Torch CPU threads: `$ROBOTFT_NUM_THREADS`, default 1. The MLP policies here run fastest on one
    thread, and multi-threaded OpenMP slows down ~10x when simulator workers share the cores."""
    import torch

    from robotft.threads import process_threads

    torch.set_num_threads(process_threads())


def split_dotted_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """`(named, dotted)`: the dotted overrides (`--env.num_envs 4`, `--rl.clip_eps=0.02`) taken out of `argv`
    before argparse sees it, so that an override's value is never read as an optional positional argument
    (`data generate [RECIPE] ... --env.sim_backend physx_cpu`)."""
    named: list[str] = []
    dotted: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--") and "." in token.split("=", 1)[0]:
            takes_value = "=" not in token and i + 1 < len(argv)
            dotted += argv[i : i + 2] if takes_value else [token]
            i += 2 if takes_value else 1
        else:
            named.append(token)
            i += 1
    return named, dotted


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    named, dotted = split_dotted_overrides(sys.argv[1:] if argv is None else list(argv))
    args, extra = parser.parse_known_args(named)
    extra = [*extra, *dotted]
    try:
        set_cpu_threads()
        return args.func(args, extra)
    except Exception as e:
        # Config, dataset and checkpoint errors name the file, key or value; anything else still gets one
        # line. --debug (or ROBOTFT_DEBUG=1) shows the traceback too.
        if args.debug or os.environ.get("ROBOTFT_DEBUG"):
            traceback.print_exc()
        print(f"robotft: error: {error_line(e)}", file=sys.stderr)
        return 1


def error_line(e: BaseException) -> str:
    """One line for an error: its message (a KeyError's without the quotes), the type where the message
    alone would not say what went wrong, multi-line listings joined with `; `."""
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    if not isinstance(e, (ValueError, KeyError, OSError)) or not msg:
        msg = f"{type(e).__name__}: {msg}"
    parts = (line.strip().removeprefix("- ") for line in msg.splitlines())
    return "; ".join(part for part in parts if part)


if __name__ == "__main__":
    sys.exit(main())
