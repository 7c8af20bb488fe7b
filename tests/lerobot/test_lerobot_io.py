"""LeRobot interoperability of datasets: LeRobotDataset.create → import → export → LeRobotDataset, and the
errors for malformed or partial LeRobot datasets (which must write nothing)."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot.datasets.lerobot_dataset import LeRobotDataset  # noqa: E402

from robotft.cli import main  # noqa: E402
from robotft.datasets.store import DatasetError, DatasetWriter, ReplayBuffer  # noqa: E402
from robotft.lerobot.dataset import export_lerobot, import_lerobot, load_key_map, map_key  # noqa: E402
from robotft.specs import ActionSpec, FeatureSpec  # noqa: E402

FPS = 10
LENGTHS = (5, 7, 4)
TASKS = ("push the cube", "pick the cube", "push the cube")
H, W = 32, 48
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": (3,), "names": ["x", "y", "z"]},
    "action": {"dtype": "float32", "shape": (2,), "names": None},
    "observation.images.front": {
        "dtype": "video",
        "shape": (H, W, 3),
        "names": ["height", "width", "channels"],
    },
    "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
}


def _frame_image(ep: int, t: int) -> np.ndarray:
    """A smooth image (video codecs keep gradients well) that differs per episode and step."""
    yy, xx = np.mgrid[0:H, 0:W]
    img = np.stack(
        [(4 * xx + 20 * t) % 256, (6 * yy + 40 * ep) % 256, np.full_like(xx, 30 * ep + 10 * t)], -1
    )
    return img.astype(np.uint8)


@pytest.fixture(scope="module")
def lerobot_root(tmp_path_factory):
    """A 3-episode LeRobot v3.0 dataset with a state, an action, a reward, one camera as video, two tasks."""
    root = tmp_path_factory.mktemp("lerobot") / "src"
    ds = LeRobotDataset.create(
        "robotft/src", fps=FPS, features=FEATURES, root=root, use_videos=True, vcodec="h264"
    )
    rng = np.random.default_rng(0)
    for ep, (n, task) in enumerate(zip(LENGTHS, TASKS, strict=True)):
        for t in range(n):
            ds.add_frame(
                {
                    "observation.state": rng.normal(size=3).astype(np.float32),
                    "action": rng.uniform(-1, 1, 2).astype(np.float32),
                    "observation.images.front": _frame_image(ep, t),
                    "next.reward": np.array([float(t == n - 1)], np.float32),
                    "task": task,
                }
            )
        ds.save_episode()
    ds.finalize()
    return root


def _load(root, repo_id="robotft/src"):
    return LeRobotDataset(repo_id, root=root)


def test_round_trip_keeps_frames_actions_states_episodes_tasks_and_fps(lerobot_root, tmp_path):
    store = tmp_path / "imported.zarr"
    stats = import_lerobot(lerobot_root, store)
    assert stats["episodes"] == 3 and stats["steps"] == sum(LENGTHS) and stats["skipped"] == []

    buf = ReplayBuffer.open(store)
    assert sorted(buf.keys) == ["action", "reward", "rgb/front", "state"]
    assert buf.fps == FPS and list(buf.episode_lengths) == list(LENGTHS)
    assert buf.episode_tasks == list(TASKS)
    assert buf.features["rgb/front"].shape == (H, W, 3) and buf.features["rgb/front"].dtype == "uint8"
    assert buf.features["state"].names == ("x", "y", "z") and buf.features["reward"].shape == ()
    src = _load(lerobot_root)
    raw = src.hf_dataset.with_format("numpy")
    np.testing.assert_array_equal(buf.array("state"), np.asarray(raw["observation.state"]))
    np.testing.assert_array_equal(buf.array("action"), np.asarray(raw["action"]))
    np.testing.assert_array_equal(buf.array("reward"), np.asarray(raw["next.reward"]).reshape(-1))
    imported = buf.array("rgb/front", in_memory=False)[:].astype(float)
    decoded = np.stack([src[i]["observation.images.front"].numpy() for i in range(src.num_frames)])
    np.testing.assert_array_equal(imported, np.rint(decoded * 255).transpose(0, 2, 3, 1))  # LeRobot's frames
    originals = np.concatenate(
        [np.stack([_frame_image(ep, t) for t in range(n)]) for ep, n in enumerate(LENGTHS)]
    )
    err = np.abs(imported - originals).mean()
    # Lossy video (H.264, crf 30): a few levels of error, far below the difference between distinct frames.
    assert err < 6.0, f"imported frames differ from the recorded ones by {err:.2f} / 255 on average"
    assert np.abs(originals[1:].astype(float) - originals[:-1]).mean() > 4 * err

    out = tmp_path / "exported"
    export_lerobot(store, out, "robotft/exported", vcodec="h264")
    back = _load(out, "robotft/exported")
    assert back.meta.info["codebase_version"] == "v3.0" and back.fps == FPS
    assert back.num_episodes == 3 and back.num_frames == sum(LENGTHS)
    assert back.meta.features["observation.images.front"]["dtype"] == "video"
    ends = [int(back.meta.episodes[i]["dataset_to_index"]) for i in range(3)]
    assert ends == list(np.cumsum(LENGTHS))
    braw = back.hf_dataset.with_format("numpy")
    np.testing.assert_array_equal(np.asarray(braw["observation.state"]), np.asarray(raw["observation.state"]))
    np.testing.assert_array_equal(np.asarray(braw["action"]), np.asarray(raw["action"]))
    np.testing.assert_array_equal(np.asarray(braw["next.reward"]), np.asarray(raw["next.reward"]))
    np.testing.assert_array_equal(np.asarray(braw["episode_index"]), np.asarray(raw["episode_index"]))
    assert [back[i]["task"] for i in (0, 5, 12)] == list(TASKS)
    frames = np.stack([back[i]["observation.images.front"].numpy() for i in range(back.num_frames)])
    err = np.abs(np.rint(frames * 255).transpose(0, 2, 3, 1) - originals).mean()
    assert err < 8.0, f"exported video frames differ from the originals by {err:.2f} / 255 on average"
    assert not (out / "images").exists(), "the PNG frames LeRobot encoded from must not be left behind"


def test_robotft_export_round_trip_keeps_keys_units_and_action_spec(tmp_path):
    """A store shaped like a recorded deployment (nested keys, float64 timestamps, flags, units, frames, an
    action spec) → LeRobot → robotft: the same keys, specs and data."""
    features = {
        "state": FeatureSpec("state", (3,), "float32", unit="m", frame="robot_base", names=("x", "y", "z")),
        "robot/joint_pos": FeatureSpec("robot/joint_pos", (7,), "float32", unit="rad"),
        "action": FeatureSpec("action", (2,), "float32", unit="env", frame="robot_base"),
        "timestamp": FeatureSpec("timestamp", (), "float64", unit="s"),
        "intervention": FeatureSpec("intervention", (), "bool"),
        "outcome": FeatureSpec("outcome", (), "uint8", unit="enum:success,failure"),
    }
    action_spec = ActionSpec(
        "ee_delta_pose", 2, (-0.05, -0.05), (0.05, 0.05), control_hz=FPS, frame="robot_base"
    )
    rng = np.random.default_rng(1)
    episodes = []
    with DatasetWriter(
        tmp_path / "rec.zarr",
        features,
        fps=FPS,
        action_spec=action_spec,
        env={"rig": "franka"},
        source="deploy",
    ) as w:
        for n, task in ((6, "stack"), (3, "wipe")):
            ep = {
                "state": rng.normal(size=(n, 3)),
                "robot/joint_pos": rng.normal(size=(n, 7)),
                "action": rng.uniform(-0.05, 0.05, (n, 2)),
                "timestamp": 1.7e9 + np.arange(n) / FPS,
                "intervention": rng.random(n) < 0.5,
                "outcome": np.full(n, 1, np.uint8),
            }
            w.add_episode(ep, task=task)
            episodes.append(ep)
    export_lerobot(tmp_path / "rec.zarr", tmp_path / "lr", "robotft/rec", vcodec="h264")
    assert "observation.robot.joint_pos" in _load(tmp_path / "lr", "robotft/rec").meta.features
    info = (tmp_path / "lr" / "meta" / "info.json").read_bytes()
    with pytest.raises(DatasetError, match="already exists"):
        export_lerobot(tmp_path / "rec.zarr", tmp_path / "lr", "robotft/rec", vcodec="h264")
    assert (tmp_path / "lr" / "meta" / "info.json").read_bytes() == info
    export_lerobot(tmp_path / "rec.zarr", tmp_path / "lr", "robotft/rec", vcodec="h264", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr", "rec.zarr"], "no temporary directory left behind"
    import_lerobot(tmp_path / "lr", tmp_path / "back.zarr")
    back = ReplayBuffer.open(tmp_path / "back.zarr")
    assert back.features == ReplayBuffer.open(tmp_path / "rec.zarr").features
    assert back.action_spec == action_spec and back.env["rig"] == "franka" and back.fps == FPS
    assert back.episode_tasks == ["stack", "wipe"] and list(back.episode_lengths) == [6, 3]
    for key, spec in features.items():
        want = np.concatenate([ep[key] for ep in episodes]).astype(spec.dtype)
        np.testing.assert_array_equal(back.array(key), want, err_msg=key)


def test_images_stored_as_png_import_exactly(tmp_path):
    """LeRobot's `image` dtype (lossless PNG frames in the parquet files) comes back bit for bit."""
    features = {
        **FEATURES,
        "observation.images.front": {**FEATURES["observation.images.front"], "dtype": "image"},
    }
    ds = LeRobotDataset.create(
        "robotft/png", fps=FPS, features=features, root=tmp_path / "png", use_videos=False
    )
    for t in range(3):
        ds.add_frame(
            {
                "observation.state": np.zeros(3, np.float32),
                "action": np.zeros(2, np.float32),
                "observation.images.front": _frame_image(1, t),
                "next.reward": np.zeros(1, np.float32),
                "task": "look",
            }
        )
    ds.save_episode()
    ds.finalize()
    import_lerobot(tmp_path / "png", tmp_path / "png.zarr")
    frames = ReplayBuffer.open(tmp_path / "png.zarr").array("rgb/front", in_memory=False)[:]
    np.testing.assert_array_equal(frames, np.stack([_frame_image(1, t) for t in range(3)]))


def test_key_map_overrides_rename_and_drop(lerobot_root, tmp_path, tmp_path_factory):
    table = load_key_map({"observation.images.front": "rgb/base", "next.reward": ""})
    assert map_key("observation.images.front", table) == "rgb/base"
    assert map_key("observation.images.wrist", table) == "rgb/wrist"  # the default prefix rule still applies
    assert map_key("next.reward", table) == "" and map_key("observation.velocity", table) is None
    stats = import_lerobot(lerobot_root, tmp_path / "a.zarr", key_map=table)
    assert stats["skipped"] == ["next.reward"]
    assert sorted(ReplayBuffer.open(tmp_path / "a.zarr").keys) == ["action", "rgb/base", "state"]

    map_file = tmp_path / "map.yaml"
    map_file.write_text("observation.state: state/joints\n")
    assert (
        main(
            [
                "data",
                "import",
                "--from-lerobot",
                str(lerobot_root),
                "--out",
                str(tmp_path / "b.zarr"),
                "--map-file",
                str(map_file),
                "--map",
                "next.reward=",
            ]
        )
        == 0
    )
    assert sorted(ReplayBuffer.open(tmp_path / "b.zarr").keys) == ["action", "rgb/front", "state/joints"]
    assert (
        main(
            [
                "data",
                "export",
                str(tmp_path / "b.zarr"),
                "--to-lerobot",
                str(tmp_path / "c"),
                "--repo-id",
                "robotft/c",
                "--map-file",
                str(map_file),
                "--vcodec",
                "h264",
            ]
        )
        == 0
    )
    assert "observation.state" in _load(tmp_path / "c", "robotft/c").meta.features


def _broken_copy(src, dst, damage):
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def _drop_info(root):
    (root / "meta" / "info.json").unlink()


def _drop_parquet(root):
    for f in (root / "data").rglob("*.parquet"):
        f.unlink()


def _drop_video(root):
    for f in (root / "videos").rglob("*.mp4"):
        f.unlink()


def _bad_json(root):
    (root / "meta" / "info.json").write_text("{ not json")


def _old_version(root):
    info = json.loads((root / "meta" / "info.json").read_text())
    info["codebase_version"] = "v2.1"
    (root / "meta" / "info.json").write_text(json.dumps(info))


def _drop_column(root):
    """info.json declares a feature that the parquet files do not hold."""
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.velocity"] = {"dtype": "float32", "shape": [3], "names": None}
    (root / "meta" / "info.json").write_text(json.dumps(info))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_drop_info, "meta/info.json: missing"),
        (_bad_json, "info.json: not valid JSON"),
        (_old_version, "convert_dataset_v21_to_v30"),
        (_drop_parquet, "missing data file of episode 0"),
        (_drop_video, "missing video of feature 'observation.images.front'"),
        (_drop_column, "file-000.parquet: lacks columns ['observation.velocity']"),
    ],
)
def test_malformed_dataset_gives_a_clear_error_and_writes_nothing(lerobot_root, tmp_path, damage, expected):
    broken = _broken_copy(lerobot_root, tmp_path / "broken", damage)
    out = tmp_path / "out.zarr"
    key_map = load_key_map({"observation.velocity": "velocity"}) if damage is _drop_column else None
    with pytest.raises(DatasetError, match=re.escape(expected)):
        import_lerobot(broken, out, key_map=key_map)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"], (
        "nothing may be written beside the target"
    )


def test_failed_import_leaves_an_existing_store_untouched(lerobot_root, tmp_path):
    store = tmp_path / "store.zarr"
    import_lerobot(lerobot_root, store)
    before = {p.relative_to(store): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    broken = _broken_copy(lerobot_root, tmp_path / "broken", _drop_video)
    with pytest.raises(DatasetError, match="missing video"):
        import_lerobot(broken, store, mode="overwrite")
    after = {p.relative_to(store): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    assert after == before


def test_missing_feature_in_the_key_map_and_unknown_source_are_named(lerobot_root, tmp_path):
    with pytest.raises(DatasetError, match=r"names features \['observation.images.wrist'\]"):
        import_lerobot(
            lerobot_root, tmp_path / "x.zarr", key_map=load_key_map({"observation.images.wrist": "rgb/w"})
        )
    with pytest.raises(DatasetError, match="no feature maps to robotft key 'action'"):
        import_lerobot(lerobot_root, tmp_path / "x.zarr", key_map=load_key_map({"action": ""}))
    with pytest.raises(DatasetError, match="not in LeRobot's hub cache"):
        import_lerobot("nobody/no-such-dataset", tmp_path / "x.zarr")
    assert list(tmp_path.iterdir()) == []


# -- damaged datasets through the CLI, feature names, pretraining without a simulator --------------------------


def _truncate(pattern, keep=3000):
    def damage(root):
        for f in root.rglob(pattern):
            f.write_bytes(f.read_bytes()[:keep])

    return damage


def _empty(pattern):
    def damage(root):
        for f in root.rglob(pattern):
            f.write_bytes(b"")

    return damage


CLI_DAMAGE = {
    "truncated mp4": (_truncate("videos/**/*.mp4"), "file-000.mp4: cannot decode the frames"),
    "empty mp4": (_empty("videos/**/*.mp4"), "file-000.mp4: cannot decode the frames"),
    "truncated data parquet": (_truncate("data/**/*.parquet", 500), "data/chunk-000/file-000.parquet: not a readable"),
    "truncated episodes parquet": (_truncate("meta/episodes/**/*.parquet", 500),
                                   "meta/episodes/chunk-000/file-000.parquet: not a readable parquet"),
    "stats.json not JSON": (lambda r: (r / "meta" / "stats.json").write_text("{"), "stats.json: not a readable JSON"),
    "info.json missing": (_drop_info, "meta/info.json: missing"),
}


@pytest.mark.parametrize("damage", sorted(CLI_DAMAGE))
def test_damaged_lerobot_dataset_exits_1_naming_the_file(lerobot_root, tmp_path, capsys, damage):
    hurt, expected = CLI_DAMAGE[damage]
    broken = _broken_copy(lerobot_root, tmp_path / "broken", hurt)
    before = {p: p.read_bytes() for p in broken.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["data", "import", "--from-lerobot", str(broken), "--out", str(tmp_path / "out.zarr")]) == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("robotft: error:") and expected in line], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]
    assert {p: p.read_bytes() for p in broken.rglob("*") if p.is_file()} == before


def test_environment_state_keeps_its_name_through_robotft(tmp_path):
    """LeRobot → robotft → LeRobot keeps `observation.environment_state`, and any renamed feature's name."""
    features = {
        "observation.state": {"dtype": "float32", "shape": (3,), "names": None},
        "observation.environment_state": {"dtype": "float32", "shape": (4,), "names": None},
        "observation.velocity": {"dtype": "float32", "shape": (2,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
    }
    ds = LeRobotDataset.create("robotft/env", fps=FPS, features=features, root=tmp_path / "src", use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(2):
        for _ in range(4):
            ds.add_frame({k: rng.normal(size=f["shape"]).astype(np.float32) for k, f in features.items()}
                         | {"task": "t"})
        ds.save_episode()
    ds.finalize()
    import_lerobot(tmp_path / "src", tmp_path / "s.zarr", key_map=load_key_map({"observation.velocity": "vel"}))
    assert sorted(ReplayBuffer.open(tmp_path / "s.zarr").keys) == ["action", "env_state", "state", "vel"]
    export_lerobot(tmp_path / "s.zarr", tmp_path / "back", "robotft/back", vcodec="h264")
    assert sorted(_load(tmp_path / "back", "robotft/back").meta.features) == sorted(
        [*features, "timestamp", "frame_index", "episode_index", "index", "task_index"])


def test_export_overwrite_refuses_what_is_not_a_lerobot_dataset(tmp_path, capsys):
    features = {"action": FeatureSpec("action", (2,), "float32")}
    with DatasetWriter(tmp_path / "s.zarr", features, fps=FPS) as w:
        w.add_episode({"action": np.zeros((3, 2))})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("keep")
    (tmp_path / "file").write_text("keep")
    for target, expected in (("mine", "is not a LeRobot dataset"), ("file", "is a file")):
        capsys.readouterr()
        rc = main(["data", "export", str(tmp_path / "s.zarr"), "--to-lerobot", str(tmp_path / target),
                   "--repo-id", "x/y", "--overwrite"])
        assert rc == 1 and expected in capsys.readouterr().err
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "s.zarr"]


def test_pretrain_on_a_lerobot_recording_with_no_matching_simulator(tmp_path, capsys):
    """A hardware recording (9-d state, one camera, 7-d actions; no env has this layout) trains without --env:
    the specs come from the dataset, there is no evaluation, and the checkpoint loads and predicts."""
    from robotft.checkpoint import load_policy

    features = {
        "observation.state": {"dtype": "float32", "shape": (9,), "names": [f"q{i}" for i in range(9)]},
        "observation.images.wrist": {"dtype": "video", "shape": (24, 32, 3),
                                     "names": ["height", "width", "channels"]},
        "action": {"dtype": "float32", "shape": (7,), "names": None},
    }
    ds = LeRobotDataset.create("lab/franka", fps=FPS, features=features, root=tmp_path / "rec", use_videos=True,
                               vcodec="h264")
    rng = np.random.default_rng(0)
    for ep in range(2):
        for t in range(12):
            ds.add_frame({"observation.state": rng.normal(size=9).astype(np.float32),
                          "observation.images.wrist": _frame_image(ep, t)[:24, :32],
                          "action": np.r_[rng.uniform(-0.5, 0.5, 6), -1.0].astype(np.float32), "task": "wipe"})
        ds.save_episode()
    ds.finalize()
    assert main(["data", "import", "--from-lerobot", str(tmp_path / "rec"), "--out", str(tmp_path / "d.zarr")]) == 0
    capsys.readouterr()
    rc = main(["pretrain", "--policy", "gaussian_mlp", "--data", str(tmp_path / "d.zarr"), "--steps", "4",
               "--train.batch_size", "8", "--policy.hidden_dims", "16", "--out", str(tmp_path / "bc")])
    assert rc == 0, capsys.readouterr().err
    policy, ckpt = load_policy(tmp_path / "bc")
    assert ckpt.config["env"] is None and ckpt.spec.observations["state"].names[0] == "q0"
    assert ckpt.spec.action.control_mode == "unknown" and ckpt.spec.action.control_hz == FPS
    chunk = policy.predict_chunk({"state": torch.zeros(2, policy.config.obs_steps, 9)})
    assert chunk.shape[-1] == 7 and torch.all(chunk[..., 6] == -1.0)
