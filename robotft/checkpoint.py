"""Checkpoints: one directory, safetensors + JSON, written atomically, loaded without pickle.

Layout (docs/design.md):

    <ckpt>/model.safetensors       policy weights shipped for evaluation/deployment (EMA where kept)
    <ckpt>/config.json             {"policy": ..., "env": ..., "spec": ..., "run": ...}: rebuilds the policy
    <ckpt>/normalizer.safetensors  dataset statistics (modes in the safetensors metadata)
    <ckpt>/meta.json               stage, step, env steps, git revision, metrics, time
    <ckpt>/training_state.*        optional: everything else a killed run needs to resume

A run directory keeps numbered checkpoints in `checkpoints/step_XXXXXXXX/` and a `checkpoint` symlink
to the newest; the directory and the link are each replaced atomically (write to a temp path, then
rename), so a run killed at any moment leaves the previous checkpoint intact. `RUN_MARKER` names the
stage that owns a run directory (`prepare_run_dir`), so that `--out` never writes into, and `--overwrite`
never deletes, a directory that is not a run of the same stage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from robotft.config import EnvConfig, apply_overrides, from_dict
from robotft.datasets.normalizer import Normalizer
from robotft.specs import EnvSpec

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
NORMALIZER_FILE = "normalizer.safetensors"
META_FILE = "meta.json"
STATE_TENSORS_FILE = "training_state.safetensors"
STATE_JSON_FILE = "training_state.json"
LATEST_LINK = "checkpoint"
RUN_MARKER = "robotft-run.json"
"""File in every run directory: `{"format": ..., "stage": "pretrain" | "finetune" | ...}`."""
RUN_FORMAT = "robotft-run"
BEST_DIR = "best"
"""A run's checkpoint with the highest evaluation success so far (beside the latest)."""
KEEP_LAST = 2


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or inconsistent; the message names the file."""


def git_revision() -> str:
    """Short git revision of the robotft source tree, `unknown` outside a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# -- nested state (optimizer states, RNG states) to safetensors + JSON, no pickle ------------------


def flatten_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested dict/list structure by `{"__tensor__": name}`; collect them."""
    if isinstance(obj, torch.Tensor):
        name = f"{prefix}"
        tensors[name] = obj.detach().cpu().contiguous()
        return {"__tensor__": name}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), flatten_state(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [flatten_state(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix!r} in a checkpoint")


def _key(k: Any) -> Any:
    # Optimizer states are keyed by int parameter ids; JSON object keys would turn them into strings.
    if isinstance(k, (int, str)):
        return k
    raise TypeError(f"checkpoint state keys must be int or str, got {k!r}")


def unflatten_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict) and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if isinstance(obj, dict) and "__dict__" in obj:
        return {k: unflatten_state(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj


# -- writing ----------------------------------------------------------------------------------------


def _atomic_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes the directory private (0700); a checkpoint should be as readable as any other file.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def write_checkpoint(
    target: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    config: dict[str, Any],
    normalizer: Normalizer,
    meta: dict[str, Any],
    training_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory at `target` atomically (replacing an existing one)."""
    target = Path(target)
    tmp = _atomic_dir(target)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, tmp / MODEL_FILE)
        save_file(normalizer.to_tensors(), tmp / NORMALIZER_FILE, metadata=normalizer.metadata())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        full_meta = {"git_revision": git_revision(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
        (tmp / META_FILE).write_text(json.dumps(full_meta, indent=2))
        if training_state is not None:
            tensors: dict[str, torch.Tensor] = {}
            skeleton = flatten_state(training_state, "state", tensors)
            save_file(tensors, tmp / STATE_TENSORS_FILE)
            (tmp / STATE_JSON_FILE).write_text(json.dumps(skeleton))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def save_run_checkpoint(run_dir: str | Path, step: int, **kwargs: Any) -> Path:
    """Write `run_dir/checkpoints/step_XXXXXXXX` and point `run_dir/checkpoint` at it atomically."""
    run_dir = Path(run_dir)
    _remove_stale_temporaries(run_dir)
    ckpt = write_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}", **kwargs)
    link_tmp = run_dir / f".{LATEST_LINK}.tmp-{os.getpid()}"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(Path("checkpoints") / ckpt.name, link_tmp)
    os.replace(link_tmp, run_dir / LATEST_LINK)
    _prune(run_dir / "checkpoints", step)
    return ckpt


def _step_number(path: Path) -> int | None:
    """The step of a `step_XXXXXXXX` folder (any number of digits); None for any other name."""
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isdecimal() else None


def _prune(folder: Path, newest: int) -> None:
    """Keep the checkpoint just written (`newest`) and the KEEP_LAST - 1 before it, by step number (names
    sort wrongly once a step outgrows the zero padding). Folders of a higher step than `newest` are not this
    run's history and are left alone."""
    older = sorted((n, p) for p in folder.iterdir() if (n := _step_number(p)) is not None and n < newest)
    for _, stale in older[: max(0, len(older) - (KEEP_LAST - 1))]:
        shutil.rmtree(stale, ignore_errors=True)


def save_best_checkpoint(run_dir: str | Path, score: float, **kwargs: Any) -> Path | None:
    """Write `run_dir/best` when `score` (evaluation success) beats the best saved so far; returns its path,
    or None when it did not. The score is recorded as `best_score` in its meta.json."""
    previous = best_score(run_dir)
    if previous is not None and score <= previous:
        return None
    kwargs["meta"] = {**kwargs.get("meta", {}), "best_score": score}
    return write_checkpoint(Path(run_dir) / BEST_DIR, **kwargs)


def best_score(run_dir: str | Path) -> float | None:
    """The evaluation success of `run_dir/best`, None when the run has no best checkpoint yet."""
    meta = Path(run_dir) / BEST_DIR / META_FILE
    if not meta.is_file():
        return None
    return float(_read_json(meta)["best_score"])


def _remove_stale_temporaries(run_dir: Path) -> None:
    """Delete what a run killed in the middle of a save left behind (temp dirs and links)."""
    for folder in (run_dir, run_dir / "checkpoints"):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
                if p.is_symlink() or p.is_file():
                    p.unlink()
                else:
                    shutil.rmtree(p, ignore_errors=True)


def resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run directory to resume from; None when the run has none yet.

    A `checkpoint` link that exists but points nowhere is an error, not a fresh start: silently
    restarting would overwrite a run's history."""
    link = Path(run_dir) / LATEST_LINK
    if not link.is_symlink() and not link.exists():
        return None
    if not (link / MODEL_FILE).is_file():
        raise CheckpointError(f"{link}: points to {os.readlink(link) if link.is_symlink() else link}, "
                              f"which is not a complete checkpoint")
    return link.resolve()


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file by a temp file and a rename (a kill leaves the old or the new content)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- run directories --------------------------------------------------------------------------------


def run_stage(path: Path) -> str | None:
    """The stage whose run `path` is (from its RUN_MARKER, or from a `checkpoint` link and `config.json` of a
    run written before markers existed); None when `path` is not a run directory."""
    marker = path / RUN_MARKER
    if marker.is_file():
        try:
            data = json.loads(marker.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{marker}: not valid JSON ({e}); expected {{\"stage\": ...}}") from e
        stage = data.get("stage") if isinstance(data, dict) else None
        if data.get("format") != RUN_FORMAT or not isinstance(stage, str):
            raise CheckpointError(f"{marker}: expected {{\"format\": \"{RUN_FORMAT}\", \"stage\": ...}}, got {data!r}")
        return stage
    if (path / LATEST_LINK).is_symlink() and (path / CONFIG_FILE).is_file():
        try:
            stage = json.loads((path / CONFIG_FILE).read_text()).get("run", {}).get("stage")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
        return stage if isinstance(stage, str) else None
    return None


def prepare_run_dir(out: str | Path, stage: str, *, resume: bool = False, overwrite: bool = False) -> Path:
    """Make `out` the run directory of `stage` before any work starts, and mark it (RUN_MARKER).

    A missing or empty directory becomes a new run. An existing run of the same stage is continued with
    `resume` or emptied with `overwrite`; anything else (a file, a run of another stage, a directory that is
    not a run) is refused with a CheckpointError that says what is there, and is never deleted."""
    out = Path(out)
    if resume and overwrite:
        raise CheckpointError(f"{out}: --resume and --overwrite exclude each other")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: is a file, expected a run directory (a new path or a {stage} run)")
    _remove_stale_siblings(out)
    if out.is_dir() and any(out.iterdir()):
        found = run_stage(out)
        if found is None:
            raise CheckpointError(
                f"{out}: exists and is not a robotft run directory (no {RUN_MARKER}); choose a new --out "
                "(robotft neither writes into nor deletes it)")
        if found != stage:
            raise CheckpointError(f"{out}: holds a {found} run, expected a {stage} run; choose another --out")
        started = (out / LATEST_LINK).is_symlink() or (out / LATEST_LINK).exists()
        if overwrite or (not resume and not started):  # a run killed before its first checkpoint: start over
            _replace_with_empty_dir(out)
        elif not resume:
            raise CheckpointError(f"{out}: already holds a {stage} run; pass --resume to continue it or "
                                  "--overwrite to replace it")
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_MARKER
    if not marker.is_file():
        tmp = out / f".{RUN_MARKER}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"format": RUN_FORMAT, "stage": stage}) + "\n")
        os.replace(tmp, marker)
    return out


def _replace_with_empty_dir(out: Path) -> None:
    """Move a run aside, put an empty directory in its place, then delete the old run (a kill in between
    leaves a `.old-` sibling that the next `prepare_run_dir` removes)."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    out.mkdir()
    shutil.rmtree(old)


def _remove_stale_siblings(out: Path) -> None:
    """Delete the `.old-` copy of `out` that an overwrite killed before it finished left behind."""
    if not out.parent.is_dir():
        return
    for p in out.parent.glob(f".{out.name}.old-*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


# -- reading ----------------------------------------------------------------------------------------


def describe_choice(path: str | Path) -> str | None:
    """For a run directory: one line saying which of its checkpoints loads (the latest) and where the best by
    evaluation success is; None for a checkpoint directory."""
    path = Path(path)
    if (path / MODEL_FILE).is_file() or not (path / LATEST_LINK).exists():
        return None
    latest = _read_json(path / LATEST_LINK / META_FILE)
    line = f"{path}: loading the latest checkpoint ({os.readlink(path / LATEST_LINK)}, step {latest.get('step')})"
    score = best_score(path)
    if score is not None:
        best = _read_json(path / BEST_DIR / META_FILE)
        line += (f"; the best by evaluation success ({score:.2f}, step {best.get('step')}) is "
                 f"{path / BEST_DIR}")
    return line


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory whose `checkpoint` link names the newest one."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return path
    if (path / LATEST_LINK / MODEL_FILE).is_file():
        return (path / LATEST_LINK).resolve()
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    raise CheckpointError(
        f"{path}: not a checkpoint (expected {MODEL_FILE}, or a run directory with a '{LATEST_LINK}' link)"
    )


@dataclass
class Checkpoint:
    """A loaded checkpoint directory (no pickle anywhere)."""

    path: Path
    config: dict[str, Any]
    meta: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    normalizer: Normalizer

    @property
    def spec(self) -> EnvSpec:
        return EnvSpec.from_dict(self.config["spec"])

    def env_config(self) -> EnvConfig | None:
        """The env config the checkpoint was trained with; None when it was trained without a simulator. A
        config.json saved while the env's `type` was called `backend` loads too (robotft.config.from_dict)."""
        env = self.config.get("env")
        return from_dict(EnvConfig, env, where=f"{self.path / CONFIG_FILE}: env") if env else None

    def training_state(self) -> dict[str, Any] | None:
        """Resume state, or None when the checkpoint was saved without one."""
        skeleton_file = self.path / STATE_JSON_FILE
        if not skeleton_file.is_file():
            return None
        tensors = _load_tensors(self.path / STATE_TENSORS_FILE)
        skeleton = _read_json(skeleton_file)
        try:
            return unflatten_state(skeleton, tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{skeleton_file}: does not match {STATE_TENSORS_FILE} (missing tensor {e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a missing, empty, truncated or corrupt file is a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises SafetensorError, OSError or RuntimeError by damage kind
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                              f"expected the complete file a checkpoint write leaves") from e


def _load_normalizer(path: Path) -> Normalizer:
    tensors = _load_tensors(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    try:
        return Normalizer.from_tensors(tensors, metadata)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def read_checkpoint(path: str | Path) -> Checkpoint:
    ckpt = resolve_checkpoint(path)
    config = _read_json(ckpt / CONFIG_FILE)
    for key in ("policy", "spec"):
        if key not in config:
            raise CheckpointError(f"{ckpt / CONFIG_FILE}: missing key {key!r}")
    meta = _read_json(ckpt / META_FILE)
    normalizer = _load_normalizer(ckpt / NORMALIZER_FILE)
    return Checkpoint(ckpt, config, meta, _load_tensors(ckpt / MODEL_FILE), normalizer)


def training_dataset(ckpt: Checkpoint, max_depth: int = 16) -> str | None:
    """The dataset store the checkpoint's policy was behaviour-cloned on: its own `dataset` (a `robotft pretrain`
    checkpoint), else that of the checkpoint it was fine-tuned from (`source`), followed back through any chain of
    fine-tuning runs. None where no checkpoint on the way records one, or one on the way no longer exists."""
    for _ in range(max_depth):
        if ckpt.meta.get("dataset"):
            return str(ckpt.meta["dataset"])
        source = ckpt.meta.get("source")
        if not source:
            return None
        try:
            ckpt = read_checkpoint(source)
        except CheckpointError:
            return None
    return None


def load_weights(policy: torch.nn.Module, ckpt: Checkpoint) -> None:
    """Load a checkpoint's weights into the policy its config builds; any mismatch (missing or unexpected
    names, other shapes) is a CheckpointError naming model.safetensors."""
    where = ckpt.path / MODEL_FILE
    try:
        missing, unexpected = policy.load_state_dict(ckpt.model_state, strict=False)
    except RuntimeError as e:  # shape mismatches
        detail = " ".join(str(e).split())
        raise CheckpointError(f"{where}: weights do not fit the policy in {CONFIG_FILE} ({detail[:400]})") from e
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the policy in {CONFIG_FILE} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


def load_policy(path: str | Path, device: str = "cpu", overrides: dict[str, str] | None = None):
    """Rebuild the policy stored in a checkpoint (or a run directory's newest checkpoint). `overrides` set policy
    fields that leave the weights' shapes alone (`{"deterministic_sampler": "model_std"}`: how it samples)."""
    from robotft.policies.base import build_policy, policy_config_class

    ckpt = read_checkpoint(path)
    policy_cfg = from_dict(policy_config_class(ckpt.config["policy"]["type"]), ckpt.config["policy"])
    if overrides:
        policy_cfg = apply_overrides(policy_cfg, overrides, prefix="policy.")
    policy = build_policy(policy_cfg, ckpt.spec, ckpt.normalizer)
    load_weights(policy, ckpt)
    return policy.to(device).eval(), ckpt
