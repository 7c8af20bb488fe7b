"""robomimic HDF5 import: round trip of a small robomimic-format file built with h5py, malformed input."""

import hashlib
import json

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from robotft.datasets.robomimic_import import import_robomimic_hdf5, is_robomimic_hdf5  # noqa: E402
from robotft.datasets.store import DatasetError, ReplayBuffer, validate_store  # noqa: E402

ROBOSUITE_15_OSC = {"type": "BASIC", "body_parts": {"right": {"type": "OSC_POSE", "input_max": 1}}}
LENGTHS = {"demo_0": 4, "demo_1": 3, "demo_10": 5}


def low_dim(rng, T, arms=1):
    obs = {}
    for i in range(arms):
        obs[f"robot{i}_eef_pos"] = rng.normal(size=(T, 3))
        obs[f"robot{i}_eef_quat"] = rng.normal(size=(T, 4))
        obs[f"robot{i}_gripper_qpos"] = rng.normal(size=(T, 2))
        obs[f"robot{i}_joint_pos"] = rng.normal(size=(T, 7))  # not one of robomimic's low-dim keys: ignored
    obs["object"] = rng.normal(size=(T, 10))
    return obs


def write_robomimic(path, *, images=True, arms=1, env_args=None, mutate=None):
    """A robomimic-style file: demos 0, 1 and 10 (stored out of order), `mask/train` = demos 0 and 10."""
    rng = np.random.default_rng(0)
    args = {"env_name": "Lift", "type": 1, "env_kwargs": {"control_freq": 20, "controller_configs": ROBOSUITE_15_OSC}}
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["env_args"] = json.dumps(env_args if env_args is not None else args)
        for name in ("demo_10", "demo_0", "demo_1"):
            T = LENGTHS[name]
            g = data.create_group(name)
            for key, value in low_dim(rng, T, arms).items():
                g[f"obs/{key}"] = value
            if images:
                g["obs/agentview_image"] = rng.integers(0, 256, size=(T, 8, 6, 3), dtype=np.uint8)
                g["obs/robot0_eye_in_hand_image"] = rng.integers(0, 256, size=(T, 8, 6, 3), dtype=np.uint8)
            g["actions"] = rng.uniform(-1, 1, size=(T, 7 * arms))
            g["rewards"] = (np.arange(T) == T - 1).astype(np.float64)
            g["dones"] = (np.arange(T) == T - 1).astype(np.int64)
        f["mask/train"] = np.array([b"demo_0", b"demo_10"])
        if mutate is not None:
            mutate(f)
    return path


def test_round_trip(tmp_path):
    h5 = write_robomimic(tmp_path / "lift.hdf5")
    assert is_robomimic_hdf5(h5)
    stats = import_robomimic_hdf5(h5, tmp_path / "out.zarr")
    assert stats == {"episodes": 3, "steps": 12, "state_dim": 19, "act_dim": 7,
                     "cameras": ["agentview", "robot0_eye_in_hand"]}
    validate_store(tmp_path / "out.zarr")
    buf = ReplayBuffer.open(tmp_path / "out.zarr")
    assert set(buf.keys) == {"state", "rgb/agentview", "rgb/robot0_eye_in_hand", "action", "reward", "terminated"}
    assert buf.features["rgb/agentview"].shape == (8, 6, 3) and buf.features["rgb/agentview"].dtype == "uint8"
    assert buf.action_spec.control_mode == "OSC_POSE" and buf.action_spec.low == (-1.0,) * 7
    assert buf.fps == 20.0 and buf.tasks == ["Lift"] and buf.env["task"] == "Lift"
    names = buf.features["state"].names
    assert len(names) == 19 and names[:3] == ("robot0_eef_pos.x", "robot0_eef_pos.y", "robot0_eef_pos.z")
    with h5py.File(h5) as f:
        for i, name in enumerate(("demo_0", "demo_1", "demo_10")):  # numeric order, not storage order
            ep, g = buf.episode(i), f[f"data/{name}"]
            expected = np.concatenate(
                [g[f"obs/{k}"][:] for k in ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object")],
                axis=1,
            )
            np.testing.assert_allclose(ep["state"], expected, rtol=1e-6)
            np.testing.assert_array_equal(ep["rgb/agentview"], g["obs/agentview_image"][:])
            np.testing.assert_array_equal(ep["rgb/robot0_eye_in_hand"], g["obs/robot0_eye_in_hand_image"][:])
            np.testing.assert_allclose(ep["action"], g["actions"][:], rtol=1e-6)
            assert ep["terminated"].tolist() == [False] * (LENGTHS[name] - 1) + [True]
            assert ep["reward"][-1] == 1.0


def test_filter_key_two_arms_and_state_only(tmp_path):
    h5 = write_robomimic(tmp_path / "t.hdf5", images=False, arms=2)
    stats = import_robomimic_hdf5(h5, tmp_path / "out.zarr", filter_key="train")
    assert stats["episodes"] == 2 and stats["steps"] == 9 and stats["act_dim"] == 14 and stats["cameras"] == []
    buf = ReplayBuffer.open(tmp_path / "out.zarr")
    assert buf.features["state"].shape == (2 * 9 + 10,) and buf.episode_lengths.tolist() == [4, 5]
    assert buf.features["state"].names[9] == "robot1_eef_pos.x"


def test_same_keys_and_shapes_as_the_adapter(tmp_path):
    """An imported Lift dataset trains a policy for the robosuite Lift env: keys, shapes and action spec match."""
    pytest.importorskip("robosuite")
    from robotft.config import EnvConfig
    from robotft.envs.robosuite import RobosuiteEnv

    import_robomimic_hdf5(write_robomimic(tmp_path / "l.hdf5", images=False), tmp_path / "o.zarr")
    buf = ReplayBuffer.open(tmp_path / "o.zarr")
    with RobosuiteEnv(EnvConfig(type="robosuite", task="Lift", control_mode="OSC_POSE")) as env:
        spec = env.spec
    assert buf.features["state"].shape == spec.observations["state"].shape
    robot_dims = 9
    assert buf.features["state"].names[:robot_dims] == spec.observations["state"].names[:robot_dims]
    assert buf.action_spec.control_mode == spec.action.control_mode and buf.action_spec.dim == spec.action.dim


def _drop(key):
    return lambda f: f.__delitem__(key)


def _replace(key, value):
    def mutate(f):
        del f[key]
        f[key] = value

    return mutate


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mutate": _drop("data/demo_1/obs/object")}, r"bad.hdf5: data/demo_1/obs/object missing"),
        ({"mutate": _drop("data/demo_0/actions")}, r"bad.hdf5: data/demo_0/actions missing"),
        ({"mutate": _replace("data/demo_1/actions", np.zeros((2, 7)))},
         r"bad.hdf5: data/demo_1/obs/robot0_eef_pos has shape \(3, 3\), expected \[2, 3\]"),
        ({"mutate": _replace("data/demo_0/obs/agentview_image", np.zeros((4, 8, 6, 3)))},
         r"bad.hdf5: data/demo_0/obs/agentview_image is float64 .*expected uint8"),
        ({"mutate": _replace("data/demo_10/rewards", np.zeros(4))}, r"bad.hdf5: data/demo_10/rewards has shape"),
        ({"env_args": {"env_name": "Lift", "type": 1,
                       "env_kwargs": {"controller_configs": {"type": "JOINT_VELOCITY"}}}},
         r"bad.hdf5: data.attrs\['env_args'\].env_kwargs.controller_configs is 'JOINT_VELOCITY'"),
        ({"env_args": {"env_name": "PushT", "type": 3}}, r"bad.hdf5: data.attrs\['env_args'\].type is 3"),
        ({"mutate": lambda f: f["data"].attrs.__setitem__("env_args", "{not json")},
         r"bad.hdf5: data.attrs\['env_args'\] is not valid JSON"),
        ({"mutate": _replace("data/demo_0/obs/object", np.full((4, 10), np.nan))},
         r"bad.hdf5: data/demo_0: state holds NaN"),
    ],
)
def test_malformed_input_is_a_clear_error_and_writes_nothing(tmp_path, kwargs, match):
    existing = tmp_path / "existing.zarr"
    import_robomimic_hdf5(write_robomimic(tmp_path / "good.hdf5"), existing)
    before = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in existing.rglob("*") if p.is_file())
    bad = write_robomimic(tmp_path / "bad.hdf5", **kwargs)
    with pytest.raises(DatasetError, match=match):
        import_robomimic_hdf5(bad, tmp_path / "new.zarr")
    with pytest.raises(DatasetError, match=match):
        import_robomimic_hdf5(bad, existing, mode="overwrite")
    after = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in existing.rglob("*") if p.is_file())
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.hdf5", "existing.zarr", "good.hdf5"]


def test_bad_filter_key_and_missing_data_group(tmp_path):
    h5 = write_robomimic(tmp_path / "t.hdf5")
    with pytest.raises(DatasetError, match=r"t.hdf5: no filter key 'mask/valid'; available: \['train'\]"):
        import_robomimic_hdf5(h5, tmp_path / "o.zarr", filter_key="valid")
    with h5py.File(tmp_path / "empty.hdf5", "w") as f:
        f["x"] = np.zeros(3)
    assert not is_robomimic_hdf5(tmp_path / "empty.hdf5")
    with pytest.raises(DatasetError, match=r"empty.hdf5: missing group 'data'"):
        import_robomimic_hdf5(tmp_path / "empty.hdf5", tmp_path / "o.zarr")
    assert not (tmp_path / "o.zarr").exists()


def test_cli_import(cli, tmp_path):
    h5 = write_robomimic(tmp_path / "lift.hdf5")
    proc = cli.run("data", "import", h5, "--out", tmp_path / "a.zarr", "--filter-key", "train", cwd=tmp_path)
    assert json.loads(proc.stdout.strip().splitlines()[-1])[str(h5)]["episodes"] == 2
    validate_store(tmp_path / "a.zarr")
    bad = write_robomimic(tmp_path / "bad.hdf5", mutate=_drop("data/demo_1/obs/object"))
    proc = cli.run("data", "import", bad, "--out", tmp_path / "b.zarr", cwd=tmp_path, expect_rc=1)
    assert "bad.hdf5: data/demo_1/obs/object missing" in proc.stderr and not (tmp_path / "b.zarr").exists()
