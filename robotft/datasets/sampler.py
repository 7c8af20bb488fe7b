"""Windows of observations and action chunks for behaviour cloning, one sample per time step.

Padding follows diffusion_policy: the observation window `t-obs_steps+1 .. t` repeats the episode's
first frame before its start; the action window `t .. t+horizon_steps-1` repeats the episode's last
action past its end. Windows never cross an episode boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

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
