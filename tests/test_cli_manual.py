"""The command line explains itself: `--help` lists every config field (checked against the dataclasses), the
choices of `--algo/--env/--policy`, and the presets; `--config` reruns a saved run to the same resolved config;
dataset recipes build stores; the progress bar and Weights & Biases logging behave off a terminal."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import typing
from pathlib import Path

import pytest

from robotft.cli import build_parser, main, resolve_finetune, resolve_pretrain
from robotft.config import ConfigError, EnvConfig, list_presets, to_dict

TINY_RECIPE = "# tiny toy demos\ntype: toy_scripted\nenv: toy/nav2d\nepisodes: 8\n"
TINY_BC = ["--env", "toy/nav2d", "--policy", "diffusion_mlp", "--steps", "3", "--train.eval_episodes", "0",
           "--train.batch_size", "8", "--policy.hidden_dims", "16,16", "--train.save_every", "3"]


def leaf_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field of a dataclass, nested dataclasses (also `X | None`) flattened."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or (
            [tp] if dataclasses.is_dataclass(tp) else [])
        names += leaf_fields(inner[0], f"{prefix}{f.name}.") if inner else [prefix + f.name]
    return names


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _configs() -> dict[str, list[tuple[type, str]]]:
    from robotft.datasets.recipe import DatasetRecipe
    from robotft.distill import DistillConfig
    from robotft.finetune import FinetuneConfig
    from robotft.policies.diffusion import DiffusionPolicyConfig
    from robotft.pretrain import PretrainConfig
    from robotft.real_robot.deploy import DeployOptions

    return {
        "pretrain --policy diffusion_mlp": [(PretrainConfig, ""), (DiffusionPolicyConfig, "policy.")],
        "finetune": [(FinetuneConfig, "")],
        "distill --policy diffusion_mlp": [(DistillConfig, ""), (DiffusionPolicyConfig, "policy.")],
        "eval": [(EnvConfig, "env.")],
        "deploy": [(DeployOptions, "")],
        "data": [(DatasetRecipe, ""), (EnvConfig, "env.")],
        "data generate": [(DatasetRecipe, ""), (EnvConfig, "env.")],
    }


@pytest.mark.parametrize("command", list(_configs()))
def test_help_lists_every_field(capsys, command):
    text = help_text(capsys, *command.split())
    for cls, prefix in _configs()[command]:
        for name in leaf_fields(cls, prefix):
            lines = [ln for ln in text.splitlines() if ln.startswith(f"  --{name} ") and "(default: " in ln]
            assert lines, f"`robotft {command} --help` does not list --{name} ({cls.__name__}) with its default"


def test_help_shows_docstrings_and_choices(capsys):
    from robotft.finetune import ALGORITHMS

    text = help_text(capsys, "finetune")
    assert "PPO clip range" in text or "clip" in text.split("--rl.clip_eps", 1)[1].split("\n  --", 1)[0]
    for algo in ALGORITHMS:
        assert f"\n  {algo} " in text, f"--algo {algo} not listed"
    for env in list_presets("envs"):
        assert f"\n  {env} " in text, f"--env {env} not listed"
    text = help_text(capsys, "pretrain")
    for policy in list_presets("policies"):
        assert f"\n  {policy} " in text, f"--policy {policy} not listed"


def test_presets_command_lists_each_kind(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for folder in ("envs", "policies", "real_robot", "datasets"):
        assert f"{folder}/" in out
        for name in list_presets(folder):
            line = next(ln for ln in out.splitlines() if ln.strip().startswith(name + " "))
            assert len(line.split(None, 1)) == 2, f"preset {folder}/{name} has no description: {line!r}"
    assert main(["presets", "rigs"]) == 0
    rigs = capsys.readouterr().out
    assert "sim_franka" in rigs and "maniskill/pick_cube" not in rigs


def test_recipe_builds_a_valid_store(tmp_path, monkeypatch, capsys):
    from robotft.datasets.store import ReplayBuffer, validate_store

    monkeypatch.chdir(tmp_path)
    (tmp_path / "datasets" / "mine").mkdir(parents=True)
    (tmp_path / "datasets" / "mine" / "tiny.yaml").write_text(TINY_RECIPE)
    assert main(["data", "generate", "mine/tiny", "--episodes", "5"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    store = tmp_path / "data" / "mine" / "tiny.zarr"
    assert stats["out"] == str(Path("data/mine/tiny.zarr")) and stats["source"] == "toy_scripted"
    validate_store(store)
    assert len(ReplayBuffer.open(store).episode_lengths) == 5
    # The same recipe by path, into an explicit store; an existing store is refused, not touched.
    assert main(["data", "generate", str(tmp_path / "datasets" / "mine" / "tiny.yaml"), "--out", "b.zarr"]) == 0
    validate_store(tmp_path / "b.zarr")
    assert main(["data", "generate", "mine/tiny", "--episodes", "5"]) == 1


def _run_args(argv: list[str]):
    args, extra = build_parser().parse_known_args(argv)
    return args, extra


def test_pretrain_builds_missing_recipe_and_config_reruns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_RECIPE)
    assert not (tmp_path / "data" / "tiny.zarr").exists()
    assert main(["pretrain", *TINY_BC, "--data", "tiny.yaml", "--out", "bc"]) == 0
    assert (tmp_path / "data" / "tiny.zarr").is_dir(), "pretrain --data RECIPE did not build the store"
    saved = json.loads((tmp_path / "bc" / "config.json").read_text())
    assert saved["run"]["data"] == str(Path("data/tiny.zarr"))

    cfg, policy_cfg = resolve_pretrain(*_run_args(["pretrain", "--config", "bc/config.json"]))
    assert {"stage": "pretrain", **to_dict(cfg)} == saved["run"]
    assert to_dict(policy_cfg) == saved["policy"]
    # Flags go on top of the saved run.
    cfg, policy_cfg = resolve_pretrain(*_run_args(["pretrain", "--config", "bc/config.json", "--steps", "7",
                                                   "--policy.ddim_steps", "3"]))
    assert cfg.train.steps == 7 and policy_cfg.ddim_steps == 3 and list(policy_cfg.hidden_dims) == [16, 16]

    # A full rerun writes the same resolved config (the run directory aside).
    assert main(["pretrain", "--config", "bc/config.json", "--out", "bc2"]) == 0
    rerun = json.loads((tmp_path / "bc2" / "config.json").read_text())
    assert rerun["run"].pop("out") == "bc2" and saved["run"].pop("out") == "bc"
    assert rerun == saved

    assert main(["finetune", "--from", "bc", "--iterations", "1", "--out", "ft", "--rl.steps_per_iter", "2",
                 "--eval_episodes", "0", "--env.num_envs", "2", "--dppo.ft_denoising_steps", "2"]) == 0
    ft_saved = json.loads((tmp_path / "ft" / "config.json").read_text())
    ft_cfg, _ = resolve_finetune(*_run_args(["finetune", "--config", "ft/config.json"]))
    assert {"stage": "finetune", **to_dict(ft_cfg)} == ft_saved["run"]
    # A pretrain config is not a finetune one.
    assert main(["finetune", "--config", "bc/config.json"]) == 1


def test_progress_bar_writes_sparse_lines_off_a_terminal(monkeypatch):
    from robotft.runlog import capped_update, progress_bar

    monkeypatch.setenv("ROBOTFT_PROGRESS_INTERVAL", "3600")
    out = io.StringIO()
    with progress_bar(total=1000, desc="eval", file=out) as bar:
        step = capped_update(bar)
        for _ in range(1200):
            step(1)
            bar.set_postfix(sr="0.50")
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2, lines  # the first state and the final one
    assert lines[-1].startswith("eval: 100% 1000/1000"), lines[-1]
    quiet = io.StringIO()
    with progress_bar(total=3, desc="off", file=quiet, disable=True) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""


def test_maniskill_warning_once_per_process():
    from robotft.envs.maniskill import _OncePerProcess

    f = _OncePerProcess()

    def record(msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("mani_skill ", level, __file__, 1, msg, None, None)

    cuda = 'Requested to use render device "sapien_cuda", but CUDA device was not found.'
    assert f.filter(record(cuda)) and not f.filter(record(cuda)) and not f.filter(record(cuda))
    assert f.filter(record("another warning"))
    assert f.filter(record("info", logging.INFO)) and f.filter(record("info", logging.INFO))


def test_require_names_the_extra():
    from robotft.optional import MissingDependency, require

    assert require("json", "dev", "a test").dumps([1]) == "[1]"
    with pytest.raises(MissingDependency, match=r"the franky robot backend needs no_such_module_xyz .*; pip install robotft\[franka\]"):
        require("no_such_module_xyz", "franka", "the franky robot backend")


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from robotft.runlog import RunLogger, WandbConfig

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = WandbConfig(enabled=True, mode="offline", project="robotft-test")
    with RunLogger(tmp_path / "run", wandb=cfg, config={"run": {"stage": "pretrain"}}) as log:
        log.log(1, {"train/loss": 0.5})
        log.log(2, {"train/loss": 0.25})
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    runs = list((tmp_path / "run").rglob(f"offline-run-*-{run_id}"))
    assert runs, f"no offline W&B run {run_id} under {tmp_path / 'run'}"
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [0.5, 0.25]


def test_task_recipe_applies_to_fresh_runs_only(tmp_path, monkeypatch):
    """The env preset's task recipe goes under the user's flags, and a rerun does not apply it again over the
    flags saved with the run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "task.yaml").write_text(
        "# toy with a recipe\nbase: toy/nav2d\nrecipe: {policy: {horizon_steps: 8, obs_steps: 2}, train: {steps: 9}}\n")
    (tmp_path / "store.zarr").mkdir()
    argv = ["pretrain", "--env", "task", "--policy", "diffusion_mlp", "--data", "store.zarr", "--out", "bc",
            "--policy.horizon_steps", "4"]
    cfg, policy_cfg = resolve_pretrain(*_run_args(argv))
    assert (policy_cfg.horizon_steps, policy_cfg.obs_steps, cfg.train.steps) == (4, 2, 9)
    (tmp_path / "config.json").write_text(json.dumps({"run": {"stage": "pretrain", **to_dict(cfg)},
                                                      "policy": to_dict(policy_cfg)}))
    again, policy_again = resolve_pretrain(*_run_args(["pretrain", "--config", "config.json"]))
    assert to_dict(again) == to_dict(cfg) and to_dict(policy_again) == to_dict(policy_cfg)


def test_a_recipe_field_for_one_policy_type_skips_the_others(tmp_path, monkeypatch):
    """`recipe.policy_by_type` sets a field only the named policy type has (the diffusion policy's evaluation
    sampler) without breaking pretraining of another type on the same task; a typo in it is still refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "task.yaml").write_text(
        "# toy with a per-type recipe\nbase: toy/nav2d\nrecipe: {policy: {obs_steps: 2},\n"
        "  policy_by_type: {diffusion_mlp: {deterministic_sampler: model_std}}}\n")
    (tmp_path / "envs" / "typo.yaml").write_text(
        "# toy with a typo\nbase: toy/nav2d\nrecipe: {policy_by_type: {diffusion_mlp: {determinstic_sampler: x}}}\n")
    (tmp_path / "store.zarr").mkdir()
    argv = ["pretrain", "--env", "task", "--data", "store.zarr", "--out", "bc", "--policy"]
    _, diffusion = resolve_pretrain(*_run_args([*argv, "diffusion_mlp"]))
    assert (diffusion.deterministic_sampler, diffusion.obs_steps) == ("model_std", 2)
    _, gaussian = resolve_pretrain(*_run_args([*argv, "gaussian_mlp"]))
    assert gaussian.obs_steps == 2 and not hasattr(gaussian, "deterministic_sampler")
    with pytest.raises(ConfigError, match="determinstic_sampler"):
        resolve_pretrain(*_run_args(["pretrain", "--env", "typo", "--data", "store.zarr", "--policy", "diffusion_mlp"]))
