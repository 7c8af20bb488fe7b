"""ManiSkill demos: end to end through the real motion planner and replay tool, with and without DART
replay noise (CPU, ~15-25 s per generation, marked `maniskill`), and the importer's errors on synthetic
trajectory files (h5py only, fast)."""

import hashlib
import json

import numpy as np
import pytest

from robotft.config import EnvConfig
from robotft.datasets.store import DatasetError, ReplayBuffer, validate_store

try:
    import mani_skill  # noqa: F401

    HAVE_MANISKILL = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_MANISKILL = False

needs_maniskill = pytest.mark.skipif(
    not HAVE_MANISKILL, reason="mani_skill is not importable (pip install robotft[maniskill])"
)

ENV = EnvConfig(type="maniskill", task="PushCube-v1", sim_backend="physx_cpu")


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    from robotft.datasets.maniskill_demos import generate_maniskill_demos

    out = tmp_path_factory.mktemp("ms") / "pushcube.zarr"
    stats = generate_maniskill_demos(ENV, n_episodes=2, out=out, seed=3, progress=False)
    return out, stats


def maniskill_dims() -> tuple[int, int]:
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the envs

    env = gym.make(ENV.task, obs_mode="state", control_mode=ENV.control_mode, sim_backend="physx_cpu")
    try:
        return env.observation_space.shape[-1], env.action_space.shape[-1]
    finally:
        env.close()


@pytest.mark.maniskill
@needs_maniskill
def test_generate_end_to_end(demos):
    out, stats = demos
    assert stats["planned"] == 2 and stats["replayed"] == 2 and stats["kept"] == 2
    assert stats["planner_attempts"] >= 2
    assert stats["planner_failure_rate"] == (stats["planner_attempts"] - 2) / stats["planner_attempts"]
    print("demo generation stats:", stats)  # timings, visible with -s
    validate_store(out)
    buf = ReplayBuffer.open(out)
    state_dim, act_dim = maniskill_dims()
    assert buf.features["state"].shape == (state_dim,)
    assert buf.features["action"].shape == (act_dim,) == (7,)
    assert buf.action_spec.control_mode == "pd_ee_delta_pose" and buf.action_spec.dim == 7
    assert buf.fps == 20.0 and buf.tasks == ["PushCube-v1"]
    assert buf.env["env_id"] == "PushCube-v1"
    assert set(buf.keys) == {"state", "action", "reward", "success"}
    for i in range(2):
        ep = buf.episode(i)
        assert 20 < len(ep["action"]) <= 100
        assert ep["success"][-1]
        assert np.abs(ep["action"]).max() <= 1.0


def _tracking_r2(store) -> float:
    """R² of the TCP's per-step displacement regressed on the recorded position action (`pd_ee_delta_pos`):
    high when the recorded actions are the ones that moved the arm."""
    buf = ReplayBuffer.open(store)
    episodes = [buf.episode(i) for i in range(buf.n_episodes)]
    tcp = slice(18, 21)  # PushCube's flat state: qpos (9), qvel (9), then the TCP pose's position
    moved = np.concatenate([e["state"][1:, tcp] - e["state"][:-1, tcp] for e in episodes])
    action = np.concatenate([e["action"][:-1, :3] for e in episodes])
    coef, *_ = np.linalg.lstsq(action, moved, rcond=None)
    return 1 - float(((moved - action @ coef) ** 2).sum() / ((moved - moved.mean(0)) ** 2).sum())


@pytest.mark.maniskill
@needs_maniskill
def test_replay_noise_perturbs_the_executed_actions_and_records_the_tracking_ones(tmp_path):
    """DART: with replay noise the arm leaves the plan's path and the demos still succeed; the recorded actions
    are the noise-free tracking actions, so they explain the arm's motion worse than in a noise-free replay
    (they would explain it as well if the noisy actions were recorded)."""
    from robotft.datasets.maniskill_demos import generate_maniskill_demos

    env = EnvConfig(type="maniskill", task="PushCube-v1", sim_backend="physx_cpu", control_mode="pd_ee_delta_pos")
    clean, noisy = tmp_path / "clean.zarr", tmp_path / "noisy.zarr"
    generate_maniskill_demos(env, n_episodes=2, out=clean, seed=3, progress=False)
    stats = generate_maniskill_demos(env, n_episodes=2, out=noisy, seed=3, progress=False, replay_noise_std=0.1)
    assert stats["kept"] == 2
    first_clean, first_noisy = ReplayBuffer.open(clean).episode(0), ReplayBuffer.open(noisy).episode(0)
    assert not np.allclose(first_clean["state"][5:20], first_noisy["state"][5:20], atol=1e-3)
    assert np.abs(first_noisy["action"]).max() <= 1.0 and first_noisy["success"][-1]
    r2_clean, r2_noisy = _tracking_r2(clean), _tracking_r2(noisy)
    assert r2_clean > 0.8 and r2_noisy < r2_clean - 0.15, (r2_clean, r2_noisy)


def test_replay_noise_needs_a_delta_controller(tmp_path):
    from robotft.datasets.maniskill_demos import generate_maniskill_demos

    env = EnvConfig(type="maniskill", task="PushCube-v1", control_mode="pd_joint_pos")
    with pytest.raises(ValueError, match="delta controller.*pd_joint_pos"):
        generate_maniskill_demos(env, n_episodes=1, out=tmp_path / "x.zarr", replay_noise_std=0.1)
    assert not (tmp_path / "x.zarr").exists()


def test_a_recipe_refuses_replay_noise_for_other_sources():
    from robotft.datasets.recipe import DatasetRecipe

    with pytest.raises(ValueError, match="replay_noise_std.*'robosuite_scripted'"):
        DatasetRecipe(type="robosuite_scripted", env="robosuite/lift", replay_noise_std=0.05)
    with pytest.raises(ValueError, match="replay_noise_std must be >= 0"):
        DatasetRecipe(type="maniskill_motion_planner", env="maniskill/stack_cube", replay_noise_std=-1)


def write_trajectory(path, T=5, obs_mode="state", control_mode="pd_ee_delta_pose", obs_group=False, drop=()):
    """A small ManiSkill-style .h5 + .json pair: two episodes, the second a failure."""
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(2):
            g = f.create_group(f"traj_{i}")
            if obs_group:
                g["obs/agent/qpos"] = rng.normal(size=(T + 1, 9)).astype(np.float32)
            else:
                g["obs"] = rng.normal(size=(T + 1, 6)).astype(np.float32)
            g["actions"] = rng.uniform(-1, 1, size=(T, 7)).astype(np.float32)
            g["rewards"] = rng.uniform(size=T).astype(np.float32)
            g["success"] = np.arange(T) == T - 1 if i == 0 else np.zeros(T, bool)
            for key in drop:
                del g[key]
    meta = {
        "env_info": {
            "env_id": "PushCube-v1",
            "env_kwargs": {"obs_mode": obs_mode, "control_mode": control_mode, "reward_mode": "dense"},
            "max_episode_steps": 50,
        },
        "episodes": [{"episode_id": 0, "success": True}, {"episode_id": 1, "success": False}],
    }
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


def write_rgb_trajectory(path, T=4):
    """A ManiSkill-style obs_mode `rgb` file: nested obs groups recorded in creation order (track_order)."""
    import h5py

    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        g = f.create_group("traj_0", track_order=True)
        obs = g.create_group("obs", track_order=True)
        agent = obs.create_group("agent", track_order=True)
        agent["qvel"] = np.full((T + 1, 2), 2.0, np.float32)  # created first: must come first in `state`
        agent["qpos"] = np.full((T + 1, 3), 1.0, np.float32)
        extra = obs.create_group("extra", track_order=True)
        extra["tcp_pose"] = np.full((T + 1, 1, 2), 3.0, np.float32)
        obs["sensor_param/cam/intrinsic_cv"] = np.zeros((T + 1, 3, 3), np.float32)
        obs["sensor_data/cam/rgb"] = rng.integers(0, 256, size=(T + 1, 6, 5, 3), dtype=np.uint8)
        g["actions"] = rng.uniform(-1, 1, size=(T, 7)).astype(np.float32)
        g["success"] = np.arange(T) == T - 1
    meta = {
        "env_info": {"env_id": "PushCube-v1", "env_kwargs": {"obs_mode": "rgb", "control_mode": "pd_ee_delta_pose"}},
        "episodes": [{"episode_id": 0, "success": True}],
    }
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


def test_import_rgb_trajectory_keeps_images_uint8_and_state_in_recorded_order(tmp_path):
    pytest.importorskip("h5py")
    import h5py

    from robotft.datasets.maniskill_demos import import_maniskill_h5

    h5 = write_rgb_trajectory(tmp_path / "rgb.h5")
    stats = import_maniskill_h5(h5, tmp_path / "rgb.zarr")
    assert stats["kept"] == 1 and stats["state_dim"] == 7
    buf = ReplayBuffer.open(tmp_path / "rgb.zarr")
    assert set(buf.keys) == {"state", "rgb/cam", "action", "success"}
    assert buf.features["rgb/cam"].shape == (6, 5, 3) and buf.features["rgb/cam"].dtype == "uint8"
    ep = buf.episode(0)
    np.testing.assert_array_equal(ep["state"][0], [2, 2, 1, 1, 1, 3, 3])
    with h5py.File(h5) as f:
        np.testing.assert_array_equal(ep["rgb/cam"], f["traj_0/obs/sensor_data/cam/rgb"][:-1])
    images = buf.array("rgb/cam", in_memory=False)
    assert images.chunks == (1, 6, 5, 3) and images.compressor is not None  # one compressed frame per chunk


def test_import_synthetic_trajectory(tmp_path):
    pytest.importorskip("h5py")
    from robotft.datasets.maniskill_demos import import_maniskill_h5

    h5 = write_trajectory(tmp_path / "t.h5")
    stats = import_maniskill_h5(h5, tmp_path / "a.zarr", control_mode="pd_ee_delta_pose")
    assert stats == {"episodes": 2, "successes": 1, "kept": 1, "steps": 5, "state_dim": 6, "act_dim": 7}
    buf = ReplayBuffer.open(tmp_path / "a.zarr")
    assert buf.features["state"].shape == (6,) and buf.action_spec.low == (-1.0,) * 7
    assert buf.fps == 20.0 and buf.episode_tasks == ["PushCube-v1"]
    import h5py

    with h5py.File(h5) as f:  # obs[t] pairs with action[t]: the final observation is dropped
        np.testing.assert_array_equal(buf.episode(0)["state"], f["traj_0/obs"][:-1])
    stats = import_maniskill_h5(h5, tmp_path / "b.zarr", only_success=False)
    assert stats["kept"] == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"control_mode": "pd_joint_pos"},
            "t.h5: control mode is 'pd_joint_pos'.*expected 'pd_ee_delta_pose'",
        ),
        ({"obs_mode": "rgbd"}, r"t.h5: obs_mode is 'rgbd'.*expected one of \('state', 'rgb'\)"),
        ({"obs_group": True}, "t.h5: traj_0/obs is not a flat"),
        ({"obs_mode": "rgb"}, "t.h5: traj_0/obs is not a group with 'agent' and 'sensor_data'"),
        ({"drop": ("actions",)}, "t.h5: traj_0/actions missing"),
    ],
)
def test_bad_h5_gives_clear_error_and_writes_nothing(tmp_path, kwargs, match):
    pytest.importorskip("h5py")
    from robotft.datasets.maniskill_demos import import_maniskill_h5

    good = import_maniskill_h5(write_trajectory(tmp_path / "good.h5"), tmp_path / "existing.zarr")
    assert good["kept"] == 1
    existing = tmp_path / "existing.zarr"
    before = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in existing.rglob("*") if p.is_file())
    h5 = write_trajectory(tmp_path / "t.h5", **kwargs)
    with pytest.raises(DatasetError, match=match):
        import_maniskill_h5(h5, tmp_path / "new.zarr", control_mode="pd_ee_delta_pose")
    with pytest.raises(DatasetError, match=match):
        import_maniskill_h5(h5, existing, control_mode="pd_ee_delta_pose", mode="overwrite")
    after = sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in existing.rglob("*") if p.is_file())
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "existing.zarr",
        "good.h5",
        "good.json",
        "t.h5",
        "t.json",
    ]
