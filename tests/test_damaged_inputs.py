"""Damaged and foreign inputs: each damaged store and checkpoint gives exit 1 with one line naming the file, and
writes nothing; every count and rate of the CLI is bound-checked before work starts; `--out`/`--overwrite`
never touch what is not theirs; constant action dimensions stay within the action spec after training."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from robotft import checkpoint as ck
from robotft.cli import main
from robotft.datasets.normalizer import Normalizer
from robotft.datasets.store import DatasetWriter, ReplayBuffer

TOY_BC = ["--env", "toy/nav2d", "--policy", "diffusion_mlp", "--train.eval_episodes", "0",
          "--train.batch_size", "16", "--policy.hidden_dims", "32,32"]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(err: str) -> str:
    """The `robotft: error:` line of stderr, asserting there is exactly one (progress lines may precede it)."""
    lines = [line for line in err.splitlines() if line.startswith("robotft: error:")]
    assert len(lines) == 1, err
    return lines[0]


def run_cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """demos.zarr (toy nav2d, 1024-step chunks so that the store has several) and a 10-step BC run."""
    root = tmp_path_factory.mktemp("damaged")
    assert main(["data", "generate", "--env", "toy/nav2d", "-n", "64", "--out", str(root / "demos.zarr")]) == 0
    assert ReplayBuffer.open(root / "demos.zarr").n_steps > 1024
    assert main(["pretrain", *TOY_BC, "--data", str(root / "demos.zarr"), "--steps", "10",
                 "--train.save_every", "5", "--out", str(root / "bc")]) == 0
    return root


# -- damaged stores ---------------------------------------------------------------------------------


def _zarray(store, key):
    return store / "data" / key / ".zarray"


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


STORE_DAMAGE = {
    "missing action chunk": (lambda s: (s / "data/action/1.0").unlink(), "data/action: chunk files ['1.0']"),
    "missing state chunk": (lambda s: (s / "data/state/0.0").unlink(), "data/state: chunk files ['0.0']"),
    "missing episode_ends chunk": (lambda s: (s / "meta/episode_ends/0").unlink(), "meta/episode_ends: chunk"),
    "garbage chunk": (lambda s: (s / "data/action/0.0").write_bytes(b"\x00garbage" * 50),
                      "data/action: chunk 0"),
    "truncated chunk": (lambda s: (s / "data/state/1.0").write_bytes((s / "data/state/1.0").read_bytes()[:40]),
                        "data/state: chunk 1"),
    "empty chunk": (lambda s: (s / "data/action/1.0").write_bytes(b""), "data/action: chunk 1"),
    "dtype in .zarray": (lambda s: _edit_json(_zarray(s, "action"), dtype="<f8"), "data/action: dtype float64"),
    "shape in .zarray": (lambda s: _edit_json(_zarray(s, "state"), shape=[2, 3], chunks=[1024, 3]),
                         "data/state: per-step shape (3,)"),
    ".zarray not JSON": (lambda s: _zarray(s, "action").write_text("{oops"), "zarr metadata cannot be read"),
    "meta attrs not JSON": (lambda s: (s / "meta/.zattrs").write_text("[1, "), "not a zarr group|cannot be read"),
    "no .zgroup": (lambda s: (s / ".zgroup").unlink(), "not a zarr group"),
    "NaN in a chunk": (lambda s: _nan_in_action(s), "NaN or inf at step"),
}


def _nan_in_action(store):
    import zarr

    arr = zarr.open_group(str(store), mode="r+")["data/action"]
    arr[5] = np.nan


@pytest.mark.parametrize("damage", sorted(STORE_DAMAGE))
def test_damaged_store_is_reported_and_refused_without_a_write(toy, tmp_path, capsys, damage):
    store = tmp_path / "demos.zarr"
    shutil.copytree(toy / "demos.zarr", store)
    hurt, expected = STORE_DAMAGE[damage]
    hurt(store)
    before = digest(store)
    rc, err = run_cli(capsys, "data", "validate", store)
    assert rc == 1 and str(store) in err, err
    assert any(e in err for e in expected.split("|")), err
    rc, err = run_cli(capsys, "pretrain", *TOY_BC, "--data", store, "--steps", "5", "--out", tmp_path / "bc")
    if damage != "NaN in a chunk":  # NaN is found by validate's value scan, and by the normalizer at load
        assert rc == 1, err
        assert str(store) in one_error_line(err), err
    else:
        assert rc == 1 and "NaN" in err, err
    assert not (tmp_path / "bc").exists()
    assert digest(store) == before, "reading a damaged store must not change it"


def test_info_names_a_missing_chunk_instead_of_showing_zeros(toy, tmp_path, capsys):
    store = tmp_path / "demos.zarr"
    shutil.copytree(toy / "demos.zarr", store)
    (store / "data/action/0.0").unlink()
    rc, err = run_cli(capsys, "data", "info", store)
    assert rc == 1 and "data/action: chunk files ['0.0'] missing" in err, err


# -- damaged checkpoints ----------------------------------------------------------------------------


def _truncate(name):
    def hurt(c):
        (c / name).write_bytes((c / name).read_bytes()[:100])
    return hurt


def _empty(name):
    return lambda c: (c / name).write_bytes(b"")


def _other_widths(c):
    cfg = json.loads((c / "config.json").read_text())
    cfg["policy"]["hidden_dims"] = [48, 48]
    (c / "config.json").write_text(json.dumps(cfg))


def _drop_weight(c):
    from safetensors.torch import load_file, save_file

    w = load_file(c / "model.safetensors")
    w.pop(sorted(w)[0])
    save_file(w, c / "model.safetensors")


CKPT_DAMAGE = {
    "truncated model": (_truncate("model.safetensors"), "model.safetensors: not a readable safetensors"),
    "empty model": (_empty("model.safetensors"), "model.safetensors: not a readable safetensors"),
    "truncated normalizer": (_truncate("normalizer.safetensors"), "normalizer.safetensors: not a readable"),
    "empty normalizer": (_empty("normalizer.safetensors"), "normalizer.safetensors: not a readable"),
    "weights of other widths": (_other_widths, "model.safetensors: weights do not fit"),
    "a weight missing": (_drop_weight, "model.safetensors: weights do not match"),
    "meta not JSON": (lambda c: (c / "meta.json").write_text("{"), "meta.json: not valid JSON"),
    "config without policy": (lambda c: (c / "config.json").write_text("{}"), "config.json: missing key 'policy'"),
}


@pytest.mark.parametrize("damage", sorted(CKPT_DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(toy, tmp_path, capsys, damage):
    run = tmp_path / "bc"
    shutil.copytree(toy / "bc", run, symlinks=True)
    ckpt = ck.resolve_checkpoint(run)
    hurt, expected = CKPT_DAMAGE[damage]
    hurt(ckpt)
    before = digest(run)
    rc, err = run_cli(capsys, "eval", run, "--episodes", "1")
    assert rc == 1 and expected in one_error_line(err), err
    rc, err = run_cli(capsys, "finetune", "--from", run, "--out", tmp_path / "ft", "--iterations", "1")
    assert rc == 1 and expected in err, err
    assert not (tmp_path / "ft").exists()
    assert digest(run) == before


@pytest.mark.parametrize("name", ["training_state.safetensors", "training_state.json"])
def test_damaged_resume_state_is_refused_naming_the_file(toy, tmp_path, capsys, name):
    run = tmp_path / "bc"
    shutil.copytree(toy / "bc", run, symlinks=True)
    _truncate(name)(ck.resolve_checkpoint(run))
    before = digest(run)
    rc, err = run_cli(capsys, "pretrain", *TOY_BC, "--data", toy / "demos.zarr", "--steps", "20", "--out", run,
                      "--resume")
    assert rc == 1 and name in err, err
    assert digest(run) == before


def test_debug_shows_the_traceback(toy, tmp_path, capsys):
    rc, err = run_cli(capsys, "--debug", "eval", tmp_path / "nothing", "--episodes", "1")
    assert rc == 1 and "Traceback" in err and err.strip().endswith("no such checkpoint or run directory")


# -- pruning, --out and --overwrite -----------------------------------------------------------------


def _save(run, step):
    return ck.save_run_checkpoint(run, step, model_state={"w": torch.zeros(1)}, config={"policy": {}, "spec": {}},
                                  normalizer=Normalizer.fit({"a": np.ones((2, 1))}, {"a": "minmax"}),
                                  meta={"step": step})


def test_pruning_orders_by_step_number_and_keeps_the_new_checkpoint(tmp_path):
    for step in (500, 600):
        _save(tmp_path, step)
    _save(tmp_path, 100_000_000)  # outgrows the 8-digit padding: sorts before step_00000500 by name
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000600", "step_100000000"]
    assert ck.read_checkpoint(tmp_path).meta["step"] == 100_000_000
    # a folder of a higher step (not this run's history) does not make the new one be deleted
    shutil.copytree(tmp_path / "checkpoints" / "step_100000000", tmp_path / "checkpoints" / "step_200000000")
    _save(tmp_path, 100_000_010)
    assert ck.read_checkpoint(tmp_path).meta["step"] == 100_000_010
    # a folder whose suffix str.isdigit() accepts but int() refuses is not a checkpoint step, not a crash
    (tmp_path / "checkpoints" / "step_²").mkdir()
    _save(tmp_path, 100_000_020)
    assert ck.read_checkpoint(tmp_path).meta["step"] == 100_000_020


def test_out_and_overwrite_refuse_what_is_not_theirs(toy, tmp_path, capsys):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    pre = ["pretrain", *TOY_BC, "--data", toy / "demos.zarr", "--steps", "5"]
    for argv, expected in [
        ([*pre, "--out", foreign, "--overwrite"], "is not a robotft run directory"),
        ([*pre, "--out", foreign], "is not a robotft run directory"),
        ([*pre, "--out", a_file], "is a file"),
        (["data", "generate", "--env", "toy/nav2d", "-n", "2", "--out", foreign, "--overwrite"],
         "is not a robotft dataset store"),
        (["data", "generate", "--env", "toy/nav2d", "-n", "2", "--out", a_file, "--overwrite"], "is a file"),
        (["finetune", "--from", toy / "bc", "--out", toy / "bc", "--iterations", "1"], "holds the checkpoint"),
        (["finetune", "--from", toy / "bc", "--out", toy / "bc", "--iterations", "1", "--overwrite"],
         "holds the checkpoint"),
        ([*pre, "--out", toy / "bc"], "already holds a pretrain run"),
    ]:
        before = digest(tmp_path)
        rc, err = run_cli(capsys, *argv)
        assert rc == 1 and expected in err, (argv, err)
        assert digest(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "photos"]  # no .old-* left


def test_overwrite_replaces_a_run_of_the_same_stage(toy, tmp_path, capsys):
    run = tmp_path / "bc"
    shutil.copytree(toy / "bc", run, symlinks=True)
    rc, err = run_cli(capsys, "pretrain", *TOY_BC, "--data", toy / "demos.zarr", "--steps", "3", "--out", run,
                      "--overwrite")
    assert rc == 0, err
    assert ck.read_checkpoint(run).meta["step"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003"]
    assert json.loads((run / ck.RUN_MARKER).read_text())["stage"] == "pretrain"


# -- bounds -----------------------------------------------------------------------------------------


BAD_NUMBERS = [
    (["pretrain", "--steps", "0"], "--train.steps is 0, expected >=1"),
    (["pretrain", "--steps", "-5"], "--train.steps is -5"),
    (["pretrain", "--train.save_every", "0"], "--train.save_every is 0"),
    (["pretrain", "--train.batch_size", "0"], "--train.batch_size is 0"),
    (["pretrain", "--train.lr", "nan"], "--train.lr is nan, expected a finite number"),
    (["pretrain", "--train.lr", "-1e-3"], "--train.lr is -0.001, expected >=0"),
    (["pretrain", "--train.eval_every", "-1"], "--train.eval_every is -1"),
    (["pretrain", "--policy.horizon_steps", "0"], "horizon_steps=0"),
    (["pretrain", "--env.num_envs", "0"], "num_envs must be >= 1, got 0"),
    (["finetune", "--iterations", "0"], "rl.iterations"),
    (["finetune", "--rl.clip_eps", "nan"], "rl.clip_eps"),
    (["finetune", "--rl.gamma", "1.5"], "rl.gamma"),
    (["finetune", "--save_every", "0"], "--save_every is 0"),
    (["finetune", "--eval_every", "0"], "--eval_every is 0, expected >=1"),
    (["finetune", "--rl.steps_per_iter", "0"], "rl.steps_per_iter must be >= 1, got 0"),
    (["eval", "--episodes", "0"], "--episodes is 0"),
    (["eval", "--num-envs", "0"], "--num_envs is 0"),
    (["data", "generate", "-n", "0"], "--episodes is 0"),
    (["deploy", "--episodes", "-1"], "--episodes is -1"),
]


@pytest.mark.parametrize("argv,expected", BAD_NUMBERS, ids=[" ".join(a) for a, _ in BAD_NUMBERS])
def test_bad_counts_and_rates_are_refused_before_any_work(toy, tmp_path, capsys, argv, expected):
    out = tmp_path / "out"
    full = {
        "pretrain": lambda a: ["pretrain", *TOY_BC, "--data", toy / "demos.zarr", "--out", out, *a[1:]],
        "finetune": lambda a: ["finetune", "--from", toy / "bc", "--out", out, *a[1:]],
        "eval": lambda a: ["eval", toy / "bc", *a[1:]],
        "data": lambda a: ["data", "generate", "--env", "toy/nav2d", "--out", out, *a[2:]],
        "deploy": lambda a: ["deploy", toy / "bc", "--rig", "sim_franka", *a[1:]],
    }[argv[0]](argv)
    rc, err = run_cli(capsys, *full)
    assert rc == 1 and expected in err, err
    assert not out.exists()


# -- constant action dimensions ---------------------------------------------------------------------


def test_constant_dimensions_unnormalize_to_their_value():
    x = np.stack([np.linspace(-0.5, 0.7, 50), np.full(50, -1.0)], axis=1)
    for mode in ("minmax", "meanstd"):
        norm = Normalizer.fit({"action": x}, {"action": mode})
        y = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.3, 5.0]])
        back = norm.unnormalize("action", y)
        assert torch.all(back[:, 1] == -1.0), back
        if mode == "minmax":
            assert torch.allclose(back[:2, 0], torch.tensor([-0.5, 0.7]))
        assert torch.allclose(norm.normalize("action", torch.tensor(x[:3], dtype=torch.float32))[:, 1],
                              torch.zeros(3))
        # and through the checkpoint format
        again = Normalizer.from_tensors(norm.to_tensors(), norm.metadata())
        assert torch.equal(again.unnormalize("action", y), back)


def test_trained_policy_keeps_a_constant_gripper_within_the_action_spec(tmp_path, capsys):
    """PushCube's gripper is always -1 in its demos: BC must not predict values outside [-1, 1] for it."""
    from robotft.checkpoint import load_policy
    from robotft.specs import ActionSpec, FeatureSpec

    rng = np.random.default_rng(0)
    features = {"state": FeatureSpec("state", (3,), "float32"), "action": FeatureSpec("action", (3,), "float32")}
    spec = ActionSpec("pd_ee_delta_pos", 3, (-1.0,) * 3, (1.0,) * 3, control_hz=20.0)
    with DatasetWriter(tmp_path / "d.zarr", features, fps=20.0, action_spec=spec) as w:
        for _ in range(4):
            a = np.concatenate([rng.uniform(-1, 1, (30, 2)), np.full((30, 1), -1.0)], axis=1)
            w.add_episode({"state": rng.normal(size=(30, 3)), "action": a})
    rc, err = run_cli(capsys, "pretrain", "--policy", "diffusion_mlp", "--data", tmp_path / "d.zarr", "--steps",
                      "30", "--train.batch_size", "16", "--policy.hidden_dims", "32,32", "--out", tmp_path / "bc")
    assert rc == 0, err
    policy, _ = load_policy(tmp_path / "bc")
    chunk = policy.predict_chunk({"state": torch.randn(64, policy.config.obs_steps, 3) * 3}, deterministic=False)
    assert torch.all(chunk[..., 2] == -1.0), chunk[..., 2].unique()
    assert torch.all(chunk >= -1.0) and torch.all(chunk <= 1.0)


# -- pretrain: the last checkpoint before the closing evaluation; the env's keys checked up front ------------


def test_an_evaluation_error_does_not_lose_the_training(toy, tmp_path, capsys, monkeypatch):
    import robotft.pretrain as pretrain

    def broken_eval(*args, **kwargs):
        raise KeyError("observation key 'env_state' missing")

    monkeypatch.setattr(pretrain, "evaluate_in_env", broken_eval)
    rc, err = run_cli(capsys, "pretrain", *TOY_BC[:-6], "--train.batch_size", "16", "--policy.hidden_dims", "32,32",
                      "--train.eval_episodes", "2", "--data", toy / "demos.zarr", "--steps", "7", "--out", tmp_path / "bc")
    assert rc == 1 and "env_state" in err, err
    assert ck.read_checkpoint(tmp_path / "bc").meta["step"] == 7


def test_env_without_a_policy_key_is_refused_before_training(tmp_path, capsys):
    from robotft.specs import FeatureSpec

    rng = np.random.default_rng(0)
    features = {"state": FeatureSpec("state", (4,), "float32"), "env_state": FeatureSpec("env_state", (2,), "float32"),
                "action": FeatureSpec("action", (2,), "float32")}
    with DatasetWriter(tmp_path / "d.zarr", features, fps=10.0) as w:
        for _ in range(2):
            w.add_episode({"state": rng.normal(size=(20, 4)), "env_state": rng.normal(size=(20, 2)),
                           "action": rng.uniform(-1, 1, (20, 2))})
    argv = ["pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--policy.obs_keys", "state,env_state",
            "--policy.hidden_dims", "16", "--train.batch_size", "8", "--data", tmp_path / "d.zarr", "--steps", "3",
            "--out", tmp_path / "bc"]
    rc, err = run_cli(capsys, *argv, "--train.eval_episodes", "2")
    assert rc == 1 and "provides no observation ['env_state']" in err, err
    assert not (tmp_path / "bc").exists()
    rc, err = run_cli(capsys, *argv, "--train.eval_episodes", "0")  # no evaluation: nothing to feed
    assert rc == 0, err
