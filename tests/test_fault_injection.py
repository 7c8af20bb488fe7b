"""Kill -9 at random moments of `pretrain`, `finetune`, `data generate` and `data import` (toy env, tiny budgets),
and a death injected between the renames of a store swap: whatever the moment, what is on disk is complete
(a loadable checkpoint, a valid store holding the old or the new episodes) and the next run continues.

`deploy --record` is in tests/real_robot/test_deploy_kill.py; scripts/fault_injection.sh runs both with
more kills."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fault_injection import kill_series, robotft_argv

from robotft.checkpoint import read_checkpoint, resume_checkpoint
from robotft.cli import main
from robotft.datasets.store import DatasetWriter, ReplayBuffer, validate_store
from robotft.specs import FeatureSpec

TOY_BC = ["--env", "toy/nav2d", "--policy", "diffusion_mlp", "--train.eval_episodes", "0",
          "--train.batch_size", "16", "--policy.hidden_dims", "32,32"]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name or ".old-" in p.name or ".new-" in p.name)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kills")
    assert main(["data", "generate", "--env", "toy/nav2d", "-n", "10", "--out", str(root / "demos.zarr")]) == 0
    return root


def _run_is_intact(run: Path) -> None:
    ckpt = resume_checkpoint(run)  # raises on a dangling link
    if ckpt is not None:
        read_checkpoint(ckpt).training_state()


def _finish(argv: list[str], run: Path, total: int, cwd: Path) -> None:
    """Run `argv` (a `--resume` command) to the end unless a run the kills missed already got there."""
    done = resume_checkpoint(run)
    if done is None or read_checkpoint(done).meta["step"] < total:
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
    assert read_checkpoint(run).meta["step"] == total


def test_pretrain_killed_at_random_moments_resumes_to_the_end(work):
    run = work / "bc"
    argv = robotft_argv("pretrain", *TOY_BC, "--data", work / "demos.zarr", "--steps", "150",
                        "--train.save_every", "10", "--out", run, "--resume")
    tally = kill_series("pretrain", lambda i: argv, lambda i, o: _run_is_intact(run), (2.0, 6.0), work)
    print("pretrain", dict(tally))
    _finish(argv, run, 150, work)
    assert leftovers(run) == []


def test_finetune_killed_at_random_moments_resumes_to_the_end(work):
    assert main(["pretrain", *TOY_BC, "--data", str(work / "demos.zarr"), "--steps", "10",
                 "--out", str(work / "ft_src")]) == 0
    run = work / "ft"
    argv = robotft_argv("finetune", "--from", work / "ft_src", "--out", run, "--iterations", "12", "--resume",
                        "--rl.steps_per_iter", "5", "--save_every", "1", "--eval_episodes", "0",
                        "--env.num_envs", "4")
    tally = kill_series("finetune", lambda i: argv, lambda i, o: _run_is_intact(run), (2.5, 7.0), work)
    print("finetune", dict(tally))
    _finish(argv, run, 12, work)
    assert leftovers(run) == []


def _store_check(store: Path, added: int):
    """After a kill: the store opens (an interrupted swap is finished or undone) holding the episodes it had or
    those plus the `added` ones, and nothing half-written is left beside it."""
    seen = [ReplayBuffer.open(store).n_episodes]

    def check(i: int, outcome: str) -> None:
        validate_store(store)
        n = ReplayBuffer.open(store).n_episodes
        assert n in (seen[-1], seen[-1] + added), f"{n} episodes after holding {seen[-1]} (+{added} appended)"
        assert [p.name for p in store.parent.iterdir() if p.name.startswith(store.name + ".")] == []
        seen.append(n)

    return check


def test_data_generate_append_killed_at_random_moments(work):
    store = work / "gen.zarr"
    assert main(["data", "generate", "--env", "toy/nav2d", "-n", "4", "--out", str(store)]) == 0
    argv = robotft_argv("data", "generate", "--env", "toy/nav2d", "-n", "60", "--out", store, "--append")
    print("data generate", dict(kill_series("data-generate", lambda i: argv, _store_check(store, 60),
                                            (1.5, 4.0), work)))


def _robomimic_file(path: Path, demos: int = 60, T: int = 40) -> Path:
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(0)
    controller = {"type": "BASIC", "body_parts": {"right": {"type": "OSC_POSE", "input_max": 1}}}
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["env_args"] = json.dumps({"env_name": "Lift", "type": 1, "env_kwargs": {
            "control_freq": 20, "controller_configs": controller}})
        for d in range(demos):
            g = data.create_group(f"demo_{d}")
            for key, dim in (("robot0_eef_pos", 3), ("robot0_eef_quat", 4), ("robot0_gripper_qpos", 2),
                             ("object", 10)):
                g[f"obs/{key}"] = rng.normal(size=(T, dim))
            g["obs/agentview_image"] = rng.integers(0, 256, size=(T, 32, 32, 3), dtype=np.uint8)
            g["actions"] = rng.uniform(-1, 1, size=(T, 7))
            g["rewards"] = (np.arange(T) == T - 1).astype(np.float64)
            g["dones"] = (np.arange(T) == T - 1).astype(np.int64)
    return path


def test_data_import_append_killed_at_random_moments(work):
    src = _robomimic_file(work / "demos.hdf5")
    store = work / "imported.zarr"
    assert main(["data", "import", str(src), "--out", str(store)]) == 0
    argv = robotft_argv("data", "import", src, "--out", store, "--append")
    print("data import", dict(kill_series("data-import", lambda i: argv, _store_check(store, 60),
                                          (1.5, 4.0), work)))


_SWAP_SCRIPT = """
import os, sys
import numpy as np
from robotft.datasets.store import DatasetWriter
from robotft.specs import FeatureSpec

store, after = sys.argv[1], int(sys.argv[2])
renames = []
real_rename = os.rename
def rename(src, dst):
    real_rename(src, dst)
    renames.append((src, dst))
    if len(renames) == after:
        os._exit(9)  # a kill -9 right after this rename: no handler, no cleanup
os.rename = rename
features = {"action": FeatureSpec("action", (2,), "float32")}
with DatasetWriter(store, features, fps=10.0, mode="overwrite") as w:
    w.add_episode({"action": np.full((7, 2), 2.0)})
"""


@pytest.mark.parametrize("after", [1, 2])
def test_death_between_the_renames_of_a_store_swap_leaves_a_store(tmp_path, after):
    """The swap renames temp -> `.new-`, store -> `.old-`, `.new-` -> store. Dying after the first rename
    keeps the old store; after the second (no store at the path), the next open completes the swap."""
    store = tmp_path / "s.zarr"
    features = {"action": FeatureSpec("action", (2,), "float32")}
    with DatasetWriter(store, features, fps=10.0) as w:
        w.add_episode({"action": np.ones((3, 2))})
    proc = subprocess.run([sys.executable, "-c", _SWAP_SCRIPT, str(store), str(after)], capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    if after == 2:
        assert not store.exists(), "the injected death should come with no store at the path"
    buf = ReplayBuffer.open(store)
    assert buf.n_steps == (3 if after == 1 else 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


_COMMIT_SCRIPT = """
import os, sys
import numpy as np
from robotft.datasets.store import DatasetWriter
from robotft.specs import FeatureSpec

w = DatasetWriter(sys.argv[1], {"action": FeatureSpec("action", (2,), "float32")}, fps=10.0)
for i in range(3):
    w.add_episode({"action": np.full((4, 2), float(i))})
    if i < 2:
        w.commit()  # as a deployment does after each finished episode
os._exit(9)  # killed while the third episode is not yet committed
"""


def test_committed_episodes_survive_a_kill(tmp_path):
    store = tmp_path / "rec.zarr"
    proc = subprocess.run([sys.executable, "-c", _COMMIT_SCRIPT, str(store)], capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    buf = ReplayBuffer.open(store)
    assert buf.n_episodes == 2 and buf.array("action")[:, 0].tolist() == [0.0] * 4 + [1.0] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.zarr"]
