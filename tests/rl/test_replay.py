"""The chunk replay buffer: n-step returns within streams, truncation vs termination, success labels, exact
save/restore through a checkpoint's safetensors training state, and dataset stores (demos, deployments) as chunks."""

import math

import numpy as np
import pytest
import torch

from robotft.checkpoint import flatten_state, unflatten_state
from robotft.datasets.store import DatasetWriter
from robotft.rl.replay import ChunkReplayBuffer, store_transitions
from robotft.specs import FeatureSpec


def _add(buf, t, reward, terminated=None, done=None, success=None, streams=2):
    obs = {"state": torch.full((streams, 1, 1), float(t))}
    nxt = {"state": torch.full((streams, 1, 1), float(t + 1))}
    z = torch.zeros(streams, dtype=torch.bool)
    buf.add(obs, torch.full((streams, 1), float(t)), torch.zeros(streams, 2, 1), torch.tensor(reward),
            nxt, z if terminated is None else torch.tensor(terminated), z if done is None else torch.tensor(done),
            z if success is None else torch.tensor(success))


def test_n_step_returns_stop_at_episode_ends_and_the_write_head():
    buf = ChunkReplayBuffer(capacity=20, stride=2)
    # stream 0: rewards 1, 2, 4 then terminates; stream 1: 10, 20, 40 then is truncated.
    _add(buf, 0, [1.0, 10.0])
    _add(buf, 1, [2.0, 20.0])
    _add(buf, 2, [4.0, 40.0], terminated=[True, False], done=[True, True], success=[True, False])
    _add(buf, 3, [100.0, 100.0])
    b = buf.batch(torch.tensor([0, 1, 2, 4, 6]), n_step=3, gamma=0.5)
    assert torch.allclose(b.reward, torch.tensor([1 + 1 + 1.0, 10 + 10 + 10.0, 2 + 2.0, 4.0, 100.0]))
    # Stream 0 terminated within the walk: no bootstrap; stream 1 truncated: bootstrap γ^3 from the stop.
    assert torch.allclose(b.discount, torch.tensor([0.0, 0.125, 0.0, 0.0, 0.5]))
    assert b.next_obs["state"].flatten().tolist() == [3.0, 3.0, 3.0, 3.0, 4.0]
    # Only the episode that ended in success is labelled.
    assert buf.data["success"][:6].tolist() == [True, False, True, False, True, False]


def test_reward_offset_is_added_to_every_transition_of_the_walk_and_not_stored():
    buf = ChunkReplayBuffer(capacity=20, stride=2)
    _add(buf, 0, [0.0, 0.0])
    _add(buf, 1, [1.0, 0.0], terminated=[True, False], done=[True, False], success=[True, False])
    b = buf.batch(torch.tensor([0, 1]), n_step=2, gamma=0.5, reward_offset=-1.0)
    # Stream 0: -1 then (1 - 1) at success; stream 1: -1 - 0.5 (the offset makes every chunk cost).
    assert torch.allclose(b.reward, torch.tensor([-1.0, -1.5]))
    assert buf.data["reward"][:4].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_end_streams_cuts_n_step_returns_after_a_restart():
    buf = ChunkReplayBuffer(capacity=20, stride=2)
    _add(buf, 0, [1.0, 1.0])
    buf.end_streams()
    _add(buf, 1, [5.0, 5.0])
    b = buf.batch(torch.tensor([0]), n_step=2, gamma=1.0)
    assert b.reward.item() == 1.0 and b.discount.item() == 1.0


def test_returns_to_go_run_to_the_episode_end_and_are_unknown_while_it_runs():
    """Cal-QL's reference value: G_t = Σ γ^k (r + offset) to the end of the episode, whether it terminated or hit
    its time limit; -inf for an episode still running or cut off by a restart of the envs."""
    buf = ChunkReplayBuffer(capacity=20, stride=2)
    # stream 0: rewards 1, 2, 4 then terminates; stream 1: 10, 20 then truncated by the time limit.
    _add(buf, 0, [1.0, 10.0])
    _add(buf, 1, [2.0, 20.0], done=[False, True])
    _add(buf, 2, [4.0, 40.0], terminated=[True, False], done=[True, False], success=[True, False])
    _add(buf, 3, [8.0, 80.0])
    g = buf.returns_to_go(torch.tensor([0, 2, 4, 1, 3, 5, 6]), gamma=0.5)
    assert g.tolist() == [1 + 1 + 1.0, 2 + 2.0, 4.0, 10 + 10.0, 20.0, -math.inf, -math.inf]
    assert buf.returns_to_go(torch.tensor([0, 1]), gamma=0.5, reward_offset=-1.0).tolist() == [0 + 0.5 + 0.75, 9 + 9.5]
    buf.end_streams()
    _add(buf, 4, [1.0, 1.0], done=[True, True])
    assert buf.returns_to_go(torch.tensor([6, 7, 8]), gamma=0.5).tolist() == [-math.inf, -math.inf, 1.0]
    b = buf.batch(torch.tensor([0, 6]), n_step=1, gamma=0.5, return_to_go=True)
    assert b.return_to_go.tolist() == [3.0, -math.inf] and buf.batch(torch.tensor([0]), 1, 0.5).return_to_go is None
    restored = ChunkReplayBuffer(capacity=20, stride=2)
    tensors = {}
    skeleton = flatten_state(buf.state_dict(), "s", tensors)
    restored.load_state_dict(unflatten_state(skeleton, tensors))
    idx = torch.arange(10)
    assert torch.equal(restored.returns_to_go(idx, 0.5), buf.returns_to_go(idx, 0.5))


def test_ring_wraps_and_save_restore_is_exact():
    buf = ChunkReplayBuffer(capacity=6, stride=2)
    for t in range(5):
        _add(buf, t, [float(t), -float(t)], done=[t == 3, False], success=[True, False])
    assert len(buf) == 6 and buf.added == 10 and buf.pos == 4
    tensors: dict = {}
    skeleton = flatten_state(buf.state_dict(), "s", tensors)
    restored = ChunkReplayBuffer(capacity=6, stride=2)
    restored.load_state_dict(unflatten_state(skeleton, tensors))
    for name in ("pos", "size", "added"):
        assert getattr(restored, name) == getattr(buf, name)
    for group in ("data", "obs", "next_obs"):
        for k, v in getattr(buf, group).items():
            assert torch.equal(getattr(restored, group)[k], v), f"{group}/{k} differs after restore"
    assert restored._episode == buf._episode
    idx = torch.arange(6)
    a, b = buf.batch(idx, 2, 0.9), restored.batch(idx, 2, 0.9)
    assert torch.equal(a.reward, b.reward) and torch.equal(a.discount, b.discount)
    with pytest.raises(ValueError, match="capacity"):
        ChunkReplayBuffer(capacity=8, stride=2).load_state_dict(buf.state_dict())


def _store(path, with_reward: bool):
    features = {"state": FeatureSpec("state", (2,), "float32"), "action": FeatureSpec("action", (1,), "float32"),
                "success": FeatureSpec("success", (), "bool")}
    if with_reward:
        features["reward"] = FeatureSpec("reward", (), "float32")
    with DatasetWriter(path, features, fps=10.0) as w:
        for e, (length, won) in enumerate([(5, True), (3, False)]):
            ep = {"state": np.stack([np.arange(length), np.full(length, e)], 1).astype(np.float32),
                  "action": np.arange(length, dtype=np.float32)[:, None],
                  "success": (np.arange(length) == length - 1) & won}
            if with_reward:
                ep["reward"] = np.ones(length, dtype=np.float32)
            w.add_episode(ep)


def test_store_episodes_become_chunk_transitions(tmp_path):
    _store(tmp_path / "demos.zarr", with_reward=True)
    buf, info = store_transitions(tmp_path / "demos.zarr", ["state"], obs_steps=2, horizon=3, act_steps=2)
    assert info == {"episodes": 2, "transitions": 5, "success_rate": 0.5}
    d = buf.data
    # Episode 0 (5 steps): chunks at t = 0, 2, 4; the last executes one step and terminates (success).
    assert d["reward"].tolist() == [2.0, 2.0, 1.0, 2.0, 1.0]
    assert d["chunk"][:3, :, 0].tolist() == [[0, 1, 2], [2, 3, 4], [4, 4, 4]]
    assert buf.obs["state"][0, :, 0].tolist() == [0, 0] and buf.obs["state"][1, :, 0].tolist() == [1, 2]
    assert buf.next_obs["state"][0, :, 0].tolist() == [1, 2]
    assert d["terminated"].tolist() == [False, False, True, False, False]
    assert d["boundary"].tolist() == [False, False, True, False, True]  # the failure ends by truncation
    assert d["success"].tolist() == [True, True, True, False, False]
    # Every episode of a store has ended: each transition has its return-to-go.
    assert buf.returns_to_go(torch.arange(5), gamma=0.5).tolist() == [3.25, 2.5, 1.0, 2.5, 1.0]


def test_recorded_deployment_without_reward_uses_the_operator_label(tmp_path):
    _store(tmp_path / "deploy.zarr", with_reward=False)
    buf, _ = store_transitions(tmp_path / "deploy.zarr", ["state"], obs_steps=1, horizon=2, act_steps=2)
    assert buf.data["reward"].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
