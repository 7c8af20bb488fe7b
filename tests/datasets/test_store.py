import hashlib
from pathlib import Path

import numpy as np
import pytest
import zarr

from robotft.datasets.store import DatasetError, DatasetWriter, ReplayBuffer, summarize, validate_store
from robotft.specs import ActionSpec, FeatureSpec

FEATURES = {
    "state": FeatureSpec("state", (3,), "float32", unit="m", frame="world"),
    "rgb/base": FeatureSpec("rgb/base", (4, 5, 3), "uint8", unit="rgb8"),
    "action": FeatureSpec("action", (2,), "float32", unit="normalized"),
    "success": FeatureSpec("success", (), "bool"),
}
ACTION_SPEC = ActionSpec("pd_ee_delta_pose", 2, (-1.0, -1.0), (1.0, 1.0), control_hz=20.0)


def make_episode(T: int, offset: float = 0.0) -> dict[str, np.ndarray]:
    t = np.arange(T, dtype=np.float32)[:, None]
    return {
        "state": offset + t + np.array([0.0, 0.1, 0.2], np.float32),
        "rgb/base": np.full((T, 4, 5, 3), T, np.uint8),
        "action": offset + t + np.array([0.5, 0.6], np.float32),
        "success": np.arange(T) == T - 1,
    }


def write_store(path: Path, lengths=(3, 5), mode: str = "create") -> Path:
    with DatasetWriter(
        path, FEATURES, fps=20.0, action_spec=ACTION_SPEC, env={"id": "x"}, source="test", mode=mode
    ) as w:
        for i, T in enumerate(lengths):
            w.add_episode(make_episode(T, offset=100.0 * i), task=f"task{i % 2}")
    return path


def tree_hash(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_round_trip(tmp_path):
    path = write_store(tmp_path / "d.zarr", lengths=(3, 5, 2))
    buf = ReplayBuffer.open(path)
    assert buf.n_episodes == 3 and buf.n_steps == 10
    assert buf.episode_ends.tolist() == [3, 8, 10]
    assert buf.features == FEATURES and buf.keys == sorted(FEATURES)  # zarr sorts JSON keys
    assert buf.fps == 20.0 and buf.action_spec == ACTION_SPEC
    assert buf.env == {"id": "x"} and buf.source == "test"
    assert buf.tasks == ["task0", "task1"]
    assert buf.episode_tasks == ["task0", "task1", "task0"]
    assert set(buf.spec.observations) == {"state", "rgb/base"}
    assert buf.episode_slice(1) == slice(3, 8)
    ep = buf.episode(1)
    ref = make_episode(5, offset=100.0)
    for k in FEATURES:
        np.testing.assert_array_equal(ep[k], ref[k])
        assert ep[k].dtype == np.dtype(FEATURES[k].dtype)
    assert buf.array("state") is buf.array("state")  # cached
    assert isinstance(buf.array("rgb/base", in_memory=False), zarr.Array)
    assert buf.array("rgb/base", in_memory=False).chunks[0] == 1
    with pytest.raises(DatasetError, match="'nope'.*available keys"):
        buf.array("nope")
    validate_store(path)
    text = summarize(path)
    assert "episodes  3" in text and "rgb/base" in text and "task1" in text and "min 2" in text
    assert leftovers(path) == []


def test_an_env_recorded_with_the_old_key_reads_as_type(tmp_path):
    """Stores written before `type` named the simulator recorded `backend`; reading renames it."""
    from robotft.config import EnvConfig, from_dict

    env = {"backend": "toy", "task": "nav2d", "num_envs": 2}
    with DatasetWriter(tmp_path / "d.zarr", FEATURES, fps=20.0, action_spec=ACTION_SPEC, env=env) as w:
        w.add_episode(make_episode(3))
    buf = ReplayBuffer.open(tmp_path / "d.zarr")
    assert buf.env == {"type": "toy", "task": "nav2d", "num_envs": 2}
    assert from_dict(EnvConfig, buf.env) == EnvConfig(type="toy", task="nav2d", num_envs=2)


def test_float64_cast_to_float32_and_int_rejected_for_float(tmp_path):
    path = tmp_path / "d.zarr"
    with DatasetWriter(path, FEATURES, fps=10.0) as w:
        ep = make_episode(4)
        ep["state"] = ep["state"].astype(np.float64)
        w.add_episode(ep)
        bad = make_episode(4)
        bad["rgb/base"] = bad["rgb/base"].astype(np.float32)
        with pytest.raises(DatasetError, match="'rgb/base': dtype float32, expected uint8"):
            w.add_episode(bad)
    assert ReplayBuffer.open(path).array("state").dtype == np.float32


def test_append_keeps_existing_episodes(tmp_path):
    path = write_store(tmp_path / "d.zarr", lengths=(3,))
    with DatasetWriter(path, FEATURES, fps=20.0, mode="append") as w:
        w.add_episode(make_episode(4, offset=7.0), task="new")
    buf = ReplayBuffer.open(path)
    assert buf.episode_ends.tolist() == [3, 7]
    assert buf.episode_tasks == ["task0", "new"]
    assert buf.action_spec == ACTION_SPEC and buf.source == "test"
    np.testing.assert_array_equal(buf.episode(0)["state"], make_episode(3)["state"])
    np.testing.assert_array_equal(buf.episode(1)["action"], make_episode(4, 7.0)["action"])
    assert leftovers(path) == []


def test_overwrite_replaces(tmp_path):
    path = write_store(tmp_path / "d.zarr", lengths=(3, 4))
    write_store(path, lengths=(2,), mode="overwrite")
    assert ReplayBuffer.open(path).episode_ends.tolist() == [2]
    assert leftovers(path) == []


def test_create_refuses_existing(tmp_path):
    path = write_store(tmp_path / "d.zarr")
    with pytest.raises(DatasetError, match="already exists"):
        DatasetWriter(path, FEATURES, fps=20.0)


def _bad_episodes():
    def mutate(fn):
        ep = make_episode(4)
        fn(ep)
        return ep

    def nan(ep):
        ep["state"][2, 1] = np.nan

    def inf(ep):
        ep["action"][0, 0] = np.inf

    return {
        "missing keys \\['success'\\]": mutate(lambda ep: ep.pop("success")),
        "unexpected keys \\['extra'\\]": mutate(lambda ep: ep.update(extra=np.zeros(4))),
        "'state': shape \\(4, 4\\), expected": mutate(
            lambda ep: ep.update(state=np.zeros((4, 4), np.float32))
        ),
        "'success': dtype float32, expected bool": mutate(
            lambda ep: ep.update(success=np.zeros(4, np.float32))
        ),
        "'state': NaN or inf at step 2": mutate(nan),
        "'action': NaN or inf at step 0": mutate(inf),
        "different lengths": mutate(lambda ep: ep.update(action=np.zeros((3, 2), np.float32))),
        "empty": {k: v[:0] for k, v in make_episode(4).items()},
    }


@pytest.mark.parametrize("mode", ["append", "overwrite"])
@pytest.mark.parametrize("match", list(_bad_episodes()))
def test_bad_episode_leaves_store_untouched(tmp_path, mode, match):
    path = write_store(tmp_path / "d.zarr")
    before = tree_hash(path)
    with (
        pytest.raises(DatasetError, match=match) as err,
        DatasetWriter(path, FEATURES, fps=20.0, mode=mode) as w,
    ):
        w.add_episode(make_episode(2))
        w.add_episode(_bad_episodes()[match])
    assert str(path) in str(err.value)
    assert tree_hash(path) == before
    assert leftovers(path) == []


def test_append_with_different_features_fails_untouched(tmp_path):
    path = write_store(tmp_path / "d.zarr")
    before = tree_hash(path)
    other = dict(FEATURES, state=FeatureSpec("state", (3,), "float32", unit="rad"))
    with pytest.raises(DatasetError, match="features differ for keys \\['state'\\]"):
        DatasetWriter(path, other, fps=20.0, mode="append")
    with pytest.raises(DatasetError, match="fps"):
        DatasetWriter(path, FEATURES, fps=10.0, mode="append")
    assert tree_hash(path) == before
    assert leftovers(path) == []


def test_exception_inside_context_discards_everything(tmp_path):
    path = tmp_path / "d.zarr"
    with pytest.raises(RuntimeError), DatasetWriter(path, FEATURES, fps=20.0) as w:
        w.add_episode(make_episode(3))
        raise RuntimeError("crash while recording")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_bad_features(tmp_path):
    with pytest.raises(DatasetError, match="must include 'action'"):
        DatasetWriter(tmp_path / "d.zarr", {"state": FEATURES["state"]}, fps=20.0)
    with pytest.raises(DatasetError, match="FeatureSpec.key is 'state'"):
        DatasetWriter(tmp_path / "d.zarr", {"x": FEATURES["state"], "action": FEATURES["action"]}, fps=20.0)
    assert list(tmp_path.iterdir()) == []


# --- validate_store: corrupt a valid store in place, one way at a time ----------------------------


def corrupt_ends(root):
    root["meta"].array("episode_ends", np.array([5, 3], np.int64), overwrite=True)


def corrupt_ends_zero(root):
    root["meta"].array("episode_ends", np.array([0, 8], np.int64), overwrite=True)


def corrupt_ends_float(root):
    root["meta"].array("episode_ends", np.array([3.0, 8.0]), overwrite=True)


def corrupt_length(root):
    root["data/state"].resize(7, 3)


def corrupt_missing_array(root):
    del root["data/state"]


def corrupt_extra_array(root):
    root["data"].array("extra", np.zeros(8))


def corrupt_dtype(root):
    root["data"].array("state", np.zeros((8, 3), np.float64), overwrite=True)


def corrupt_shape(root):
    root["data"].array("state", np.zeros((8, 4), np.float32), overwrite=True)


def corrupt_nan(root):
    root["data/action"][6, 1] = np.nan


def corrupt_inf(root):
    root["data/state"][0, 0] = -np.inf


def corrupt_task_index(root):
    root["meta"].array("episode_task_index", np.array([0, 5], np.int64), overwrite=True)


def corrupt_features_attr(root):
    attrs = dict(root["meta"].attrs)
    del attrs["features"]
    root["meta"].attrs.put(attrs)


def corrupt_no_meta(root):
    del root["meta"]


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (corrupt_ends, "episode_ends: not strictly increasing"),
        (corrupt_ends_zero, "episode_ends: first end is 0"),
        (corrupt_ends_float, "episode_ends: dtype float64"),
        (corrupt_length, "data/state: length 7, expected episode_ends\\[-1\\] = 8"),
        (corrupt_missing_array, "data/state: feature declared but array missing"),
        (corrupt_extra_array, "data/extra: array has no declared feature"),
        (corrupt_dtype, "data/state: dtype float64, expected float32"),
        (corrupt_shape, "data/state: per-step shape \\(4,\\), expected \\(3,\\)"),
        (corrupt_nan, "data/action: NaN or inf at step 6"),
        (corrupt_inf, "data/state: NaN or inf at step 0"),
        (corrupt_task_index, "episode_task_index: values in \\[0, 5\\]"),
        (corrupt_features_attr, "missing meta attr 'features'"),
        (corrupt_no_meta, "missing group 'meta'"),
    ],
)
def test_validate_store_finds_problem(tmp_path, corrupt, match):
    path = write_store(tmp_path / "d.zarr")
    corrupt(zarr.open_group(str(path), mode="r+"))
    with pytest.raises(DatasetError, match=match) as err:
        validate_store(path)
    assert str(path) in str(err.value)


def test_validate_lists_every_problem(tmp_path):
    path = write_store(tmp_path / "d.zarr")
    root = zarr.open_group(str(path), mode="r+")
    corrupt_nan(root)
    corrupt_extra_array(root)
    corrupt_task_index(root)
    with pytest.raises(DatasetError) as err:
        validate_store(path)
    assert all(s in str(err.value) for s in ("data/action", "data/extra", "episode_task_index"))


def test_open_rejects_non_store(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="not a zarr group"):
        ReplayBuffer.open(tmp_path / "plain")
    with pytest.raises(DatasetError, match="does not exist"):
        ReplayBuffer.open(tmp_path / "missing")
