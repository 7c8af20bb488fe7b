"""`robotft pretrain | finetune | distill | eval | deploy | calibrate | data ...`: the command line.

Every config field can be overridden with a dotted flag after the named options, e.g.
`robotft finetune --from runs/bc --algo dppo --rl.clip_eps 0.02 --env.num_envs 4`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import traceback
from pathlib import Path

from robotft.config import (
    ConfigError,
    EnvConfig,
    apply_overrides,
    find_preset,
    from_dict,
    load_env_config,
    load_yaml,
    parse_override_args,
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


def cmd_data_generate(args: argparse.Namespace, extra: list[str]) -> int:
    check_bound("episodes", args.episodes)
    env_cfg = load_env_config(args.env, _split_overrides(parse_override_args(extra), ("env",))["env"])
    check_bounds(env_cfg, "env.")
    mode = "append" if args.append else "overwrite" if args.overwrite else "create"
    if env_cfg.backend == "maniskill":
        from robotft.datasets.maniskill_demos import generate_maniskill_demos

        stats = generate_maniskill_demos(env_cfg, args.episodes, args.out, seed=args.seed, mode=mode)
    elif env_cfg.backend == "toy":
        stats = _generate_toy(env_cfg, args.episodes, args.out, args.seed, mode)
    elif env_cfg.backend == "robosuite":
        from robotft.datasets.robosuite_demos import generate_robosuite_demos

        stats = generate_robosuite_demos(env_cfg, args.episodes, args.out, seed=args.seed, mode=mode)
    else:
        raise ConfigError(f"no demonstration generator for env backend {env_cfg.backend!r}")
    print(json.dumps(stats, default=str))
    return 0


def _generate_toy(env_cfg: EnvConfig, episodes: int, out: str, seed: int, mode: str) -> dict:
    from robotft.datasets.recording import record_rollouts, rollout_features
    from robotft.datasets.store import DatasetWriter
    from robotft.envs.factory import make_env
    from robotft.envs.toy import TASKS, Nav2DExpert

    env = make_env(dataclasses.replace(env_cfg, num_envs=min(episodes, env_cfg.num_envs)), device="cpu")
    expert = Nav2DExpert(env.num_envs, obstacle_radius=TASKS[env_cfg.task], seed=seed)
    try:
        with DatasetWriter(out, rollout_features(env.spec), fps=env_cfg.control_hz, action_spec=env.spec.action,
                           env=to_dict(env_cfg), source=f"scripted expert on toy/{env_cfg.task}",
                           mode=mode) as writer:
            return record_rollouts(env, expert, episodes, writer, seed=seed, task=env_cfg.task)
    finally:
        env.close()


def cmd_data_import(args: argparse.Namespace, extra: list[str]) -> int:
    mode = "append" if args.append else "overwrite" if args.overwrite else "create"
    if bool(args.files) == bool(args.from_lerobot):
        raise ConfigError("data import: give either ManiSkill .h5 / robomimic .hdf5 FILES or --from-lerobot ROOT_OR_REPO_ID")
    if args.from_lerobot:
        from robotft.datasets.lerobot_io import import_lerobot, load_key_map, parse_map_args

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
    from robotft.datasets.lerobot_io import export_lerobot, load_key_map, parse_map_args

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
    from robotft.datasets.lerobot_io import parse_map_args
    from robotft.policies.lerobot_policy import import_lerobot_policy

    env_cfg = load_env_config(args.env, _split_overrides(parse_override_args(extra), ("env",))["env"])
    out = import_lerobot_policy(args.from_lerobot, args.out, env_cfg, key_map=parse_map_args(args.map),
                                task=args.task)
    print(f"checkpoint: {out}", file=sys.stderr)
    return 0


# -- pretrain / finetune / eval ---------------------------------------------------------------------


def cmd_pretrain(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.policies.base import policy_config_class
    from robotft.pretrain import PretrainConfig, TrainConfig, run_pretrain

    groups = _split_overrides(parse_override_args(extra), ("env", "policy", "train"))
    if groups["env"] and not args.env:
        raise ConfigError(f"--env.* overrides {sorted(groups['env'])} need --env")
    env_cfg = load_env_config(args.env, groups["env"]) if args.env else None
    policy_path = find_preset("policies", args.policy)
    policy_data = load_yaml(policy_path)
    if "type" not in policy_data:
        raise ConfigError(f"{policy_path}: missing key 'type' (the registered policy name)")
    policy_cfg = from_dict(policy_config_class(policy_data["type"]), policy_data, where=str(policy_path))
    # The task's recipe goes over the policy preset and the training defaults; the user's flags over both.
    recipe = env_cfg.recipe if env_cfg is not None else None
    if recipe is not None and recipe.policy:
        policy_cfg = apply_overrides(policy_cfg, recipe.policy, prefix="env.recipe.policy.")
    policy_cfg = apply_overrides(policy_cfg, groups["policy"], prefix="policy.") if groups["policy"] else policy_cfg
    train = TrainConfig(seed=args.seed)
    if recipe is not None and recipe.train:
        train = apply_overrides(train, recipe.train, prefix="env.recipe.train.")
    if args.steps is not None:
        train = dataclasses.replace(train, steps=args.steps)
    train = apply_overrides(train, groups["train"], prefix="train.") if groups["train"] else train
    cfg = PretrainConfig(data=args.data, out=args.out, env=env_cfg, train=train, rig=args.rig or "")
    check_bounds(cfg)
    check_bounds(policy_cfg, "policy.")
    out = run_pretrain(cfg, policy_cfg, resume=args.resume, overwrite=args.overwrite)
    print(f"checkpoint: {out / 'checkpoint'}\nlogs: tensorboard --logdir {out / 'tb'}", file=sys.stderr)
    return 0


def cmd_finetune(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.finetune import FinetuneConfig, run_finetune

    groups = _split_overrides(parse_override_args(extra), ("env", "policy", "rl", "dppo", "ppo", "residual_ppo", "reinflow", "flow_sde", "rollout",
                                                             "offpolicy", "dsrl", "pa_rl", "residual_sac", "filtered_bc",
                                                             "kl_to_base", ""))
    env_cfg = None
    if args.env:
        env_cfg = load_env_config(args.env, groups["env"])
    elif groups["env"]:
        from robotft.checkpoint import read_checkpoint

        base = from_dict(EnvConfig, _checkpoint_env(read_checkpoint(args.source)))
        env_cfg = apply_overrides(base, groups["env"], prefix="env.")
    # The algorithm's own defaults for the PPO core (rl_defaults), under the user's flags.
    cfg = FinetuneConfig.for_algorithm(args.algo, source=args.source, out=args.out, env=env_cfg, seed=args.seed)
    cfg.rl.iterations = args.iterations
    section_overrides = {f"{s}.{k}": v for s in ("rl", "dppo", "ppo", "residual_ppo", "reinflow", "flow_sde", "rollout",
                                                       "offpolicy", "dsrl", "pa_rl", "residual_sac", "filtered_bc",
                                                       "kl_to_base") for k, v in groups[s].items()}
    section_overrides.update(groups[""])
    cfg = apply_overrides(cfg, section_overrides) if section_overrides else cfg
    check_bounds(cfg)
    _check_finetune_out(Path(args.source), Path(args.out))
    from robotft.checkpoint import load_policy, prepare_run_dir

    _, source = load_policy(args.source)  # a damaged source is refused before the run directory is made
    if env_cfg is None:
        _checkpoint_env(source)

    prepare_run_dir(args.out, "finetune", resume=args.resume, overwrite=args.overwrite)
    out = run_finetune(cfg, policy_overrides=groups["policy"], resume=args.resume)
    print(f"checkpoint: {out / 'checkpoint'}\nlearning curve: {out / 'learning_curve.png'}\n"
          f"logs: tensorboard --logdir {out / 'tb'}", file=sys.stderr)
    return 0


def cmd_distill(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.distill import DistillConfig, run_distill
    from robotft.policies.base import policy_config_class

    groups = _split_overrides(parse_override_args(extra), ("env", "policy", ""))
    env_cfg = load_env_config(args.env, groups["env"])
    policy_path = find_preset("policies", args.policy)
    policy_data = load_yaml(policy_path)
    policy_cfg = from_dict(policy_config_class(policy_data.get("type", "")), policy_data, where=str(policy_path))
    policy_cfg = apply_overrides(policy_cfg, groups["policy"], prefix="policy.") if groups["policy"] else policy_cfg
    cfg = DistillConfig(teacher=args.teacher, out=args.out, env=env_cfg, rig=args.rig or "", rounds=args.rounds,
                        seed=args.seed)
    cfg = apply_overrides(cfg, groups[""]) if groups[""] else cfg
    out = run_distill(cfg, policy_cfg, resume=args.resume)
    print(f"checkpoint: {out / 'checkpoint'}\nlogs: tensorboard --logdir {out / 'tb'}", file=sys.stderr)
    return 0


def _checkpoint_env(ckpt) -> dict:
    """The env config a checkpoint was trained with; one trained without a simulator needs `--env`."""
    if not ckpt.config.get("env"):
        raise ConfigError(f"{ckpt.path}: was trained without a simulator (no env in config.json); pass --env PRESET")
    return ckpt.config["env"]


def _check_finetune_out(source: Path, out: Path) -> None:
    """The fine-tuned run must not be written where the checkpoint it starts from lives."""
    from robotft.checkpoint import resolve_checkpoint

    src = resolve_checkpoint(source).resolve()
    dst = out.resolve()
    if dst == src or dst in src.parents:
        raise ConfigError(f"--out {out} holds the checkpoint --from {source} starts from ({src}); "
                          "write the fine-tuned run to another directory")


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.checkpoint import describe_choice, load_policy
    from robotft.config import resolve_device
    from robotft.envs.chunked import ChunkedEnv
    from robotft.envs.factory import make_env
    from robotft.evaluation import EVAL_SEED, evaluate
    from robotft.specs import check_policy_fits_env

    check_bound("episodes", args.episodes)
    check_bound("num_envs", args.num_envs, where="")
    device = resolve_device(args.device)
    choice = describe_choice(args.checkpoint)
    if choice:
        print(choice, file=sys.stderr)
    policy, ckpt = load_policy(args.checkpoint, device=device)
    env_overrides = _split_overrides(parse_override_args(extra), ("env",))["env"]
    for item in args.env_override or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env-override expects KEY=VALUE, got {item!r}")
        env_overrides[key] = value
    env_cfg = load_env_config(args.env) if args.env else from_dict(EnvConfig, _checkpoint_env(ckpt))
    env_cfg = dataclasses.replace(env_cfg, num_envs=args.num_envs)
    env_cfg = apply_overrides(env_cfg, env_overrides, prefix="env.") if env_overrides else env_cfg
    env = make_env(env_cfg, device=device)
    try:
        check_policy_fits_env(ckpt.spec, env.spec, str(ckpt.path))
        chunked = ChunkedEnv(env, policy.config.obs_steps, policy.config.act_steps)
        result = evaluate(lambda o: policy.predict_chunk(o, deterministic=True), chunked, args.episodes,
                          seed=EVAL_SEED if args.seed is None else args.seed, video_path=args.video)
    finally:
        env.close()
    lo, hi = result.ci95
    print(f"{ckpt.path}: success {result.success_rate:.3f} (95% CI {lo:.3f}-{hi:.3f}) over {result.episodes} "
          f"episodes, mean return {result.mean_return:.3f}, {result.seconds:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"success_rate": result.success_rate, "ci95": [lo, hi], "episodes": result.episodes,
                          "mean_return": result.mean_return, "mean_length": result.mean_length,
                          "success_once": result.success_once, "success_at_end": result.success_at_end,
                          "checkpoint": str(ckpt.path)}))
    return 0


def cmd_deploy(args: argparse.Namespace, extra: list[str]) -> int:
    from robotft.real_robot.deploy import DeployOptions, deploy

    if extra:
        raise ConfigError(f"deploy: unexpected arguments {extra}")
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
    summary = deploy(DeployOptions(
        checkpoint=args.checkpoint, rig=args.rig, episodes=args.episodes, record=args.record, record_mode=mode,
        no_operator=args.no_operator, executor=args.executor, out=args.out, episode_time_s=args.episode_time,
        seed=args.seed, device=args.device, lockstep=args.lockstep,
    ))
    lo, hi = summary["ci95"]
    report = f"latency report {summary['latency_json']}" if "latency_json" in summary else "lock-step"
    print(f"success {summary['success_rate']:.3f} (95% CI {lo:.3f}-{hi:.3f}) over {summary['scored']} scored "
          f"episodes; {report}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="robotft", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (or set ROBOTFT_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="create, import, inspect and validate datasets")
    dsub = data.add_subparsers(dest="data_command", required=True)
    g = dsub.add_parser("generate", help="scripted/motion-planned demonstrations into a dataset store")
    g.add_argument("--env", required=True, help="env preset, e.g. maniskill/push_cube")
    g.add_argument("-n", "--episodes", type=int, required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--seed", type=int, default=0)
    _add_write_mode(g)
    g.set_defaults(func=cmd_data_generate)
    im = dsub.add_parser("import", help="import ManiSkill .h5, robomimic .hdf5 files or a LeRobot dataset")
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
    ex = dsub.add_parser("export", help="write a dataset store as a LeRobot v3.0 dataset (images as video)")
    ex.add_argument("path", help="the robotft dataset store")
    ex.add_argument("--to-lerobot", required=True, metavar="OUT", help="directory of the new LeRobot dataset")
    ex.add_argument("--repo-id", required=True, help="the LeRobot repo id recorded in it, e.g. user/pick_cube")
    ex.add_argument("--vcodec", default="libsvtav1", help="video codec (LeRobot's: libsvtav1, h264, hevc, ...)")
    ex.add_argument("--robot-type", default=None, help="robot type recorded in meta/info.json")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    _add_key_map_args(ex)
    ex.set_defaults(func=cmd_data_export)
    info = dsub.add_parser("info", help="summarize a dataset store")
    info.add_argument("path")
    info.set_defaults(func=cmd_data_info)
    val = dsub.add_parser("validate", help="check a dataset store; exit 1 when invalid")
    val.add_argument("path")
    val.set_defaults(func=cmd_data_validate)

    pol = sub.add_parser("policy", help="bring policies from other toolkits into robotft checkpoints")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    pim = psub.add_parser("import", help="a LeRobot DiffusionPolicy or SmolVLA pretrained_model directory")
    pim.add_argument("--from-lerobot", required=True, metavar="DIR", help="LeRobot pretrained_model directory")
    pim.add_argument("--env", required=True, help="env preset the policy acts in, e.g. maniskill/pick_cube")
    pim.add_argument("--out", required=True, help="robotft checkpoint directory to write")
    pim.add_argument("--task", default="", help="language instruction given to a VLA (SmolVLA)")
    pim.add_argument("--map", action="append", metavar="LEROBOT_KEY=ROBOTFT_KEY",
                     help="robotft observation key a LeRobot input reads (repeatable), e.g. "
                          "observation.environment_state=state")
    pim.set_defaults(func=cmd_policy_import)

    pre = sub.add_parser("pretrain", help="BC pretraining on a dataset")
    pre.add_argument("--env", default=None,
                     help="env preset to evaluate in (its spec must match the data); without it the specs come "
                          "from the dataset and there is no evaluation (e.g. real-robot demonstrations)")
    pre.add_argument("--rig", default=None, help="rig preset to check the policy can be deployed on")
    pre.add_argument("--policy", required=True, help="policy preset, e.g. diffusion_mlp")
    pre.add_argument("--data", required=True)
    pre.add_argument("--steps", type=int, default=None,
                     help="gradient steps (default: the task recipe's, else train.steps' default)")
    pre.add_argument("--out", required=True)
    pre.add_argument("--seed", type=int, default=0)
    _add_run_mode(pre)
    pre.set_defaults(func=cmd_pretrain)

    ft = sub.add_parser("finetune", help="RL fine-tuning in simulation")
    ft.add_argument("--from", dest="source", required=True, help="pretrained checkpoint or run directory")
    ft.add_argument("--algo", default="dppo")
    ft.add_argument("--iterations", type=int, default=20)
    ft.add_argument("--out", required=True)
    ft.add_argument("--env", default=None, help="env preset (default: the checkpoint's env)")
    ft.add_argument("--seed", type=int, default=0)
    _add_run_mode(ft)
    ft.set_defaults(func=cmd_finetune)

    dis = sub.add_parser("distill", help="DAgger: a state teacher labels a camera student in simulation")
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

    ev = sub.add_parser("eval", help="evaluate a checkpoint in simulation")
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
    ev.set_defaults(func=cmd_eval)

    dep = sub.add_parser("deploy", help="run a checkpoint on a rig (real or simulated Franka), record, report")
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
                          "(no timing effects, no cameras; needs --no-operator)")
    dep.add_argument("--check", action="store_true",
                     help="print the observation and action mapping and exit (non-zero when the checkpoint "
                          "cannot run on the rig), without connecting to any device")
    _add_write_mode(dep)
    dep.set_defaults(func=cmd_deploy)

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

    torch.set_num_threads(max(1, int(os.environ.get("ROBOTFT_NUM_THREADS", "1"))))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    set_cpu_threads()
    try:
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
