"""Windows of observations and action chunks for behaviour cloning, one sample per time step.

Padding follows diffusion_policy: the observation window `t-obs_steps+1 .. t` repeats the episode's
first frame before its start; the action window `t .. t+horizon_steps-1` repeats the episode's last
action past its end. Windows never cross an episode boundary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from robotft.datasets.store import DatasetError, ReplayBuffer, is_image


def split_episodes(n_episodes: int, val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Random disjoint episode split: `(train_ids, val_ids)`, both sorted.

    The validation set gets `round(n_episodes * val_fraction)` episodes, at least one when
    `val_fraction > 0` and there are two or more episodes, and never all of them.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = round(n_episodes * val_fraction)
    if val_fraction > 0 and n_episodes >= 2:
        n_val = min(max(n_val, 1), n_episodes - 1)
    perm = np.random.default_rng(seed).permutation(n_episodes)
    return sorted(perm[n_val:].tolist()), sorted(perm[:n_val].tolist())


class SequenceSampler(torch.utils.data.Dataset):
    """`dataset[i]` → `{"obs": {key: [obs_steps, *shape]}, "action": [horizon_steps, act_dim] float32}`.

    Observations keep their stored dtype (images stay uint8, `[obs_steps, H, W, C]`); the default
    torch collate stacks them into `[B, obs_steps, ...]` tensors. Low-dim keys are read from memory,
    images from zarr (one contiguous read per sample).
    """

    def __init__(
        self,
        buffer: ReplayBuffer,
        obs_keys: list[str],
        obs_steps: int,
        horizon_steps: int,
        episodes: Sequence[int] | None = None,
    ) -> None:
        if obs_steps < 1 or horizon_steps < 1:
            raise ValueError(f"obs_steps and horizon_steps must be >= 1, got {obs_steps}, {horizon_steps}")
        for key in [*obs_keys, "action"]:
            if key not in buffer.features:
                raise DatasetError(
                    f"{buffer.path}: sampler key {key!r} not in dataset; available keys: {buffer.keys}"
                )
        self.buffer = buffer
        self.obs_keys = list(obs_keys)
        self.obs_steps = obs_steps
        self.horizon_steps = horizon_steps
        ids = np.arange(buffer.n_episodes) if episodes is None else np.asarray(episodes, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= buffer.n_episodes):
            raise IndexError(
                f"{buffer.path}: episode ids {ids.tolist()} out of range [0, {buffer.n_episodes})"
            )
        self.episodes = ids
        ends = buffer.episode_ends[ids]
        starts = np.concatenate([[0], buffer.episode_ends])[ids]
        lengths = ends - starts
        # Per sample: its global time index and the [start, end) of its episode.
        self._start = np.repeat(starts, lengths)
        self._end = np.repeat(ends, lengths)
        self._t = self._start + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        self._arrays = {
            key: buffer.array(key, in_memory=not is_image(buffer.features[key]))
            for key in [*self.obs_keys, "action"]
        }
        self._obs_offsets = np.arange(-obs_steps + 1, 1)
        self._act_offsets = np.arange(horizon_steps)

    def __len__(self) -> int:
        return len(self._t)

    def __getitem__(self, i: int) -> dict:
        t, start, end = int(self._t[i]), int(self._start[i]), int(self._end[i])
        obs_idx = np.clip(t + self._obs_offsets, start, end - 1)
        act_idx = np.clip(t + self._act_offsets, start, end - 1)
        obs = {}
        for key in self.obs_keys:
            arr = self._arrays[key]
            if isinstance(arr, np.ndarray):
                obs[key] = arr[obs_idx]
            else:  # zarr: read the covering range once, then pad by local indexing
                lo = int(obs_idx[0])
                obs[key] = arr[lo : t + 1][obs_idx - lo]
        return {"obs": obs, "action": np.asarray(self._arrays["action"][act_idx], dtype=np.float32)}


def infinite_batches(dataset: torch.utils.data.Dataset, batch_size: int, seed: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict]:
    """Shuffled batches of `dataset` forever, this rank's share of a global batch of `batch_size`.

    One process: a reshuffled pass per epoch drawn from a generator seeded with `seed`. `world_size`
    processes (torchrun): every epoch one permutation (seeded by `seed` and the epoch, the same on all
    ranks) is dealt round-robin into disjoint per-rank shards (torch's DistributedSampler), and each rank
    draws `batch_size / world_size` samples per step, so the ranks' batches together are one global batch
    of `batch_size` distinct samples, as in the single-process run.
    """
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(f"train.batch_size {batch_size} must be a positive multiple of the number of "
                         f"processes ({world_size}): each rank draws batch_size / world_size samples")
    per_rank = batch_size // world_size
    if world_size == 1:
        loader = torch.utils.data.DataLoader(dataset, batch_size=per_rank, shuffle=True,
                                             drop_last=len(dataset) > per_rank,
                                             generator=torch.Generator().manual_seed(seed))
        return _epochs(loader, None)
    shards = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                                 seed=seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=per_rank, sampler=shards,
                                         drop_last=len(shards) > per_rank)
    return _epochs(loader, shards)


def _epochs(loader: torch.utils.data.DataLoader,
            shards: torch.utils.data.DistributedSampler | None) -> Iterator[dict]:
    epoch = 0
    while True:
        if shards is not None:
            shards.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
        yield from loader
        epoch += 1
