import numpy as np
import pytest
import torch

from robotft.datasets.sampler import SequenceSampler, split_episodes
from robotft.datasets.store import DatasetError, DatasetWriter, ReplayBuffer
from robotft.specs import FeatureSpec

FEATURES = {
    "state": FeatureSpec("state", (2,), "float32"),
    "rgb/base": FeatureSpec("rgb/base", (2, 2, 3), "uint8"),
    "action": FeatureSpec("action", (1,), "float32"),
}
LENGTHS = (4, 1, 6)


def episode(e: int, T: int) -> dict[str, np.ndarray]:
    """Step t of episode e carries the value 10*e + t in every key, so windows are readable."""
    v = 10 * e + np.arange(T)
    return {
        "state": np.stack([v, -v], axis=1).astype(np.float32),
        "rgb/base": np.broadcast_to(v[:, None, None, None], (T, 2, 2, 3)).astype(np.uint8),
        "action": v[:, None].astype(np.float32),
    }


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "d.zarr"
    with DatasetWriter(path, FEATURES, fps=10.0) as w:
        for e, T in enumerate(LENGTHS):
            w.add_episode(episode(e, T))
    return ReplayBuffer.open(path)


def test_padding_matches_hand_built_windows(buffer):
    ds = SequenceSampler(buffer, ["state", "rgb/base"], obs_steps=3, horizon_steps=4)
    assert len(ds) == sum(LENGTHS)
    # Episode 0 (values 0..3): t=0 pads the obs window with the first frame, t=2 pads actions with the last.
    s = ds[0]
    np.testing.assert_array_equal(s["obs"]["state"][:, 0], [0, 0, 0])
    np.testing.assert_array_equal(s["obs"]["state"][:, 1], [0, 0, 0])
    np.testing.assert_array_equal(s["action"][:, 0], [0, 1, 2, 3])
    s = ds[2]
    np.testing.assert_array_equal(s["obs"]["state"][:, 0], [0, 1, 2])
    np.testing.assert_array_equal(s["action"][:, 0], [2, 3, 3, 3])
    np.testing.assert_array_equal(s["obs"]["rgb/base"][:, 0, 0, 0], [0, 1, 2])
    # Episode 1 has one step (value 10): everything is padding.
    s = ds[4]
    np.testing.assert_array_equal(s["obs"]["state"][:, 0], [10, 10, 10])
    np.testing.assert_array_equal(s["action"][:, 0], [10, 10, 10, 10])
    # Episode 2 (values 20..25), t=1: obs [20, 20, 21], actions [21..24]; last step: all 25.
    s = ds[6]
    np.testing.assert_array_equal(s["obs"]["state"][:, 1], [-20, -20, -21])
    np.testing.assert_array_equal(s["obs"]["rgb/base"][:, 1, 1, 2], [20, 20, 21])
    np.testing.assert_array_equal(s["action"][:, 0], [21, 22, 23, 24])
    np.testing.assert_array_equal(ds[10]["action"][:, 0], [25, 25, 25, 25])
    assert s["action"].dtype == np.float32 and s["obs"]["rgb/base"].dtype == np.uint8
    assert s["obs"]["rgb/base"].shape == (3, 2, 2, 3)


def test_windows_never_cross_episodes(buffer):
    ds = SequenceSampler(buffer, ["state"], obs_steps=5, horizon_steps=7)
    for i in range(len(ds)):
        s = ds[i]
        episodes = set((s["obs"]["state"][:, 0] // 10).tolist()) | set((s["action"][:, 0] // 10).tolist())
        assert len(episodes) == 1, (i, s)


def test_episode_subset_and_collate(buffer):
    ds = SequenceSampler(buffer, ["state", "rgb/base"], obs_steps=2, horizon_steps=3, episodes=[2])
    assert len(ds) == LENGTHS[2]
    assert ds[0]["obs"]["state"][0, 0] == 20
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["obs"]["state"].shape == (4, 2, 2)
    assert batch["obs"]["rgb/base"].shape == (4, 2, 2, 2, 3)
    assert batch["action"].shape == (4, 3, 1) and batch["action"].dtype == torch.float32


def test_unknown_key_is_named(buffer):
    with pytest.raises(DatasetError, match="'depth/wrist' not in dataset; available keys"):
        SequenceSampler(buffer, ["depth/wrist"], obs_steps=1, horizon_steps=1)


def test_split_episodes():
    train, val = split_episodes(10, 0.2, seed=0)
    assert len(val) == 2 and sorted(train + val) == list(range(10))
    assert (train, val) == split_episodes(10, 0.2, seed=0)
    assert split_episodes(3, 0.01)[1] != []  # at least one validation episode
    assert split_episodes(1, 0.5) == ([0], [])
    assert split_episodes(4, 0.0) == ([0, 1, 2, 3], [])
