import json
import os

import pytest
import torch

from robotft import checkpoint as ck
from robotft.datasets.normalizer import Normalizer


def _norm():
    import numpy as np

    return Normalizer.fit({"state": np.arange(12.0).reshape(6, 2), "action": np.ones((6, 3))},
                          {"state": "minmax", "action": "meanstd"})


def _write(target, step=1, w=1.0):
    return ck.write_checkpoint(
        target,
        model_state={"w": torch.full((3,), w)},
        config={"policy": {"type": "x"}, "spec": {"observations": {}, "action": None}},
        normalizer=_norm(),
        meta={"stage": "pretrain", "step": step},
        training_state={"opt": {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}},
                                "param_groups": [{"lr": 0.1, "params": [0]}]},
                        "rng": torch.get_rng_state(), "it": 4},
    )


def test_round_trip_without_pickle(tmp_path):
    path = _write(tmp_path / "ckpt")
    loaded = ck.read_checkpoint(path)
    assert torch.equal(loaded.model_state["w"], torch.ones(3))
    assert loaded.meta["step"] == 1 and "git_revision" in loaded.meta
    norm = loaded.normalizer
    x = torch.tensor([[4.0, 5.0]])
    assert torch.allclose(norm.unnormalize("state", norm.normalize("state", x)), x)
    assert norm.mode == {"state": "minmax", "action": "meanstd"}
    state = loaded.training_state()
    assert state["it"] == 4 and state["opt"]["state"][0]["step"].item() == 3.0
    assert list(state["opt"]["state"]) == [0]  # int keys survive JSON
    assert sorted(os.listdir(path)) == sorted(
        ["model.safetensors", "config.json", "normalizer.safetensors", "meta.json",
         "training_state.safetensors", "training_state.json"]
    )


def test_run_checkpoints_link_to_newest_and_prune(tmp_path):
    for step in (10, 20, 30):
        ck.save_run_checkpoint(
            tmp_path, step, model_state={"w": torch.full((1,), float(step))},
            config={"policy": {"type": "x"}, "spec": {}}, normalizer=_norm(), meta={"step": step},
        )
    assert ck.resolve_checkpoint(tmp_path).name == "step_00000030"
    assert ck.read_checkpoint(tmp_path).model_state["w"].item() == 30.0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000020", "step_00000030"]


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path):
    target = _write(tmp_path / "ckpt", w=1.0)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(TypeError, match="cannot store"):
        ck.write_checkpoint(target, model_state={"w": torch.zeros(3)}, config={}, normalizer=_norm(), meta={},
                            training_state={"bad": object()})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp")]


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ck.CheckpointError, match="no such checkpoint"):
        ck.read_checkpoint(tmp_path / "missing")
    path = _write(tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ck.CheckpointError, match=r"config.json: not valid JSON"):
        ck.read_checkpoint(path)
    (path / "config.json").write_text(json.dumps({"spec": {}}))
    with pytest.raises(ck.CheckpointError, match="missing key 'policy'"):
        ck.read_checkpoint(path)


def _save(run_dir, step):
    return ck.save_run_checkpoint(run_dir, step, model_state={"w": torch.zeros(1)},
                                  config={"policy": {"type": "x"}, "spec": {}}, normalizer=_norm(), meta={"step": step})


def test_resume_checkpoint_refuses_a_broken_link_and_cleans_leftovers(tmp_path):
    assert ck.resume_checkpoint(tmp_path) is None
    ckpt = _save(tmp_path, 5)
    assert ck.resume_checkpoint(tmp_path) == ckpt.resolve()
    assert (ckpt.stat().st_mode & 0o044) == 0o044, "checkpoints must be readable like other files"
    # leftovers of a run killed mid-save
    (tmp_path / "checkpoints" / ".step_00000010.tmp-abc").mkdir()
    os.symlink("nowhere", tmp_path / ".checkpoint.tmp-123")
    _save(tmp_path, 10)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert not (tmp_path / ".checkpoint.tmp-123").is_symlink()
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(ck.CheckpointError, match="not a complete checkpoint"):
        ck.resume_checkpoint(tmp_path)


def test_run_logger_resume_drops_rows_logged_after_the_checkpoint(tmp_path):
    from robotft.runlog import RunLogger, read_metrics

    with RunLogger(tmp_path) as log:
        for step in (10, 20, 30):
            log.log(step, {"loss": float(step)})
    with RunLogger(tmp_path, resume_step=20) as log:
        log.log(30, {"loss": 3.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(10, 10.0), (20, 20.0), (30, 3.0)]
