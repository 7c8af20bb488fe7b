"""The off-policy core's replay buffer over action chunks, and demonstrations (or recorded deployments) as chunks.

One transition is one executed chunk, as in the PPO core: the observation history the policy saw, the chunk it
predicted (`[H, A]` env units), the algorithm's critic action (DSRL: the initial noise; the others: the executed
part of the chunk, normalized), the reward summed over the `act_steps` executed steps and the history after them.
On truncation the next observation is the one the episode stopped at (ChunkedEnv's `final_obs`), and the critic
bootstraps from it; on termination it does not.

Layout: a ring of `capacity` slots written one batch of `stride` envs at a time, so the next transition of the env
in slot i lies in slot i + stride. n-step returns are formed at sampling time by walking that stream:

    R = Σ_{k<m} γ^k r_{t+k},   bootstrap γ^m Q(s_{t+m}, ·) unless the episode terminated within the m steps,

where m ≤ n stops at the end of an episode (or of the stream: a restart of the envs, a resume, the write head).
When an episode ends, its transitions are labelled with its success (`success`), which filtered BC samples by, and
its last one is marked `ended`; the Monte-Carlo return-to-go of a transition (Cal-QL's reference value, see
`returns_to_go`) walks the stream to that mark.

State is saved as tensors (robotft.checkpoint's safetensors training state, no pickle); `load_state_dict` restores
it exactly, so a resumed run continues with the same buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from robotft.envs.base import Obs


@dataclass
class ReplayBatch:
    """A sampled minibatch of n-step chunk transitions (all tensors `[N, ...]` on the buffer's device)."""

    obs: Obs
    """Observation histories the chunk was predicted from."""
    action: torch.Tensor
    """`[N, D]` critic actions."""
    chunk: torch.Tensor
    """`[N, H, A]` the predicted chunks, env units."""
    reward: torch.Tensor
    """`[N]` n-step discounted reward sums."""
    discount: torch.Tensor
    """`[N]` γ^m, or 0 where the episode terminated within the m steps (multiplies the bootstrap)."""
    next_obs: Obs
    """Histories to bootstrap from (m chunks later)."""
    success: torch.Tensor
    """`[N]` bool: the transition's episode ended in success."""
    return_to_go: torch.Tensor | None = None
    """`[N]` discounted return from the transition to the end of its episode, -inf where the episode had not ended
    when sampled (asked for with `batch(..., return_to_go=True)`)."""

    def __len__(self) -> int:
        return self.reward.shape[0]


class ChunkReplayBuffer:
    """A ring buffer of chunk transitions from `stride` parallel streams (envs); see the module docstring."""

    def __init__(self, capacity: int, stride: int, device: torch.device | str = "cpu") -> None:
        if capacity < 1 or stride < 1:
            raise ValueError(f"replay buffer capacity and stride must be >= 1, got {capacity} and {stride}")
        self.stride = stride
        self.capacity = -(-capacity // stride) * stride  # a multiple of stride keeps each env's stream contiguous
        self.device = torch.device(device)
        self.data: dict[str, torch.Tensor] = {}
        self.obs: dict[str, torch.Tensor] = {}
        self.next_obs: dict[str, torch.Tensor] = {}
        self.pos = 0
        """Next slot to write."""
        self.size = 0
        """Slots holding a transition."""
        self.added = 0
        """Transitions ever added (the buffer holds the last `capacity` of them)."""
        self._episode: list[list[int]] = [[] for _ in range(stride)]
        """Per stream, the slots of the episode in progress (labelled with its success when it ends)."""

    def __len__(self) -> int:
        return self.size

    # -- writing ---------------------------------------------------------------------------------------

    def add(self, obs: Obs, action: torch.Tensor, chunk: torch.Tensor, reward: torch.Tensor, next_obs: Obs,
            terminated: torch.Tensor, done: torch.Tensor, success: torch.Tensor) -> None:
        """Add one transition per stream (`[stride, ...]` each). `done`: the episode ended with this chunk
        (terminated or truncated); `success`: at its last step (used where `done`)."""
        if reward.shape != (self.stride,):
            raise ValueError(f"replay add: reward must be [{self.stride}], got {tuple(reward.shape)}")
        rows = {"action": action.reshape(self.stride, -1), "chunk": chunk, "reward": reward.float(),
                "terminated": terminated.bool(), "boundary": done.bool(), "ended": done.bool(),
                "success": torch.zeros_like(done.bool())}
        if not self.data:
            self._allocate(obs, rows)
        sl = slice(self.pos, self.pos + self.stride)
        for key, value in rows.items():
            self.data[key][sl] = value.to(self.device)
        for key, value in obs.items():
            self.obs[key][sl] = value.to(self.device)
            self.next_obs[key][sl] = next_obs[key].to(self.device)
        for b in range(self.stride):
            self._episode[b].append(self.pos + b)
        for b in done.nonzero().flatten().tolist():
            self._close_episode(b, bool(success[b]))
        self.pos = (self.pos + self.stride) % self.capacity
        self.size = min(self.size + self.stride, self.capacity)
        self.added += self.stride

    def _allocate(self, obs: Obs, rows: dict[str, torch.Tensor]) -> None:
        def alloc(like: torch.Tensor) -> torch.Tensor:
            return torch.zeros((self.capacity, *like.shape[1:]), dtype=like.dtype, device=self.device)

        self.data = {k: alloc(v) for k, v in rows.items()}
        self.obs = {k: alloc(v) for k, v in obs.items()}
        self.next_obs = {k: alloc(v) for k, v in obs.items()}

    def _close_episode(self, stream: int, success: bool) -> None:
        # A stream writes one slot per batch and the ring holds the last capacity / stride batches: older slots
        # of a very long episode hold newer transitions by now and are not relabelled.
        slots = self._episode[stream][-(self.capacity // self.stride):]
        if success and slots:
            self.data["success"][torch.tensor(slots, dtype=torch.long, device=self.device)] = True
        self._episode[stream] = []

    def end_streams(self) -> None:
        """Mark the newest transition of every stream as the end of its stream: the envs restart (after an
        evaluation on the training envs, or a resume), so n-step returns must not run on into the new episodes.
        Their unfinished episodes keep success False (the bootstrap from the stored next observation stands) and
        have no return-to-go (they are not marked `ended`)."""
        if self.size == 0:
            return
        last = (self.pos - self.stride) % self.capacity
        self.data["boundary"][last : last + self.stride] = True
        self._episode = [[] for _ in range(self.stride)]

    # -- reading ---------------------------------------------------------------------------------------

    def sample_indices(self, n: int, generator: torch.Generator | None = None,
                       only_success: bool = False) -> torch.Tensor:
        """`[n]` uniform slot indices (of successful episodes only with `only_success`; may then be empty)."""
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        if only_success:
            pool = self.data["success"][: self.size].nonzero().flatten()
            if pool.numel() == 0:
                return pool
            pick = torch.randint(0, pool.numel(), (n,), generator=generator).to(self.device)
            return pool[pick]
        return torch.randint(0, self.size, (n,), generator=generator).to(self.device)

    def batch(self, idx: torch.Tensor, n_step: int, gamma: float, reward_offset: float = 0.0,
              return_to_go: bool = False) -> ReplayBatch:
        """The n-step transitions starting at slots `idx` (see the module docstring), `reward_offset` added to every
        transition's stored reward (the stored rewards stay as collected); with `return_to_go`, their
        `returns_to_go` too."""
        d = self.data
        reward = torch.zeros(idx.shape[0], device=self.device)
        discount = torch.ones(idx.shape[0], device=self.device)
        alive = torch.ones(idx.shape[0], dtype=torch.bool, device=self.device)
        last = idx.clone()
        cur = idx.clone()
        for k in range(n_step):
            if k > 0:
                # Continue only within the stream: the previous step did not end it, and it is not in the newest
                # batch (whose successors are not written yet).
                nxt = (cur + self.stride) % self.capacity
                can = alive & ~d["boundary"][cur] & self._behind_head(cur)
                alive = can
                cur = torch.where(alive, nxt, cur)
            reward = reward + torch.where(alive, discount * (d["reward"][cur] + reward_offset), 0.0)
            discount = torch.where(alive, discount * gamma, discount)
            last = torch.where(alive, cur, last)
        discount = discount * (~d["terminated"][last]).float()
        return ReplayBatch(
            obs={k: v[idx] for k, v in self.obs.items()},
            action=d["action"][idx], chunk=d["chunk"][idx], reward=reward, discount=discount,
            next_obs={k: v[last] for k, v in self.next_obs.items()}, success=d["success"][idx],
            return_to_go=self.returns_to_go(idx, gamma, reward_offset) if return_to_go else None,
        )

    def _behind_head(self, slot: torch.Tensor) -> torch.Tensor:
        """Whether the stream's next transition after `slot` is written (it is not in the newest batch)."""
        return ((self.pos - 1 - slot) % self.capacity) >= self.stride

    def returns_to_go(self, idx: torch.Tensor, gamma: float, reward_offset: float = 0.0) -> torch.Tensor:
        """`[N]` Monte-Carlo returns G_t = Σ_{k ≥ 0} γ^k (r_{t+k} + offset) to the end of each transition's episode
        (a termination or a time limit), walking its stream; -inf where the walk meets the end of the stream
        first (an episode still running, or cut short by a restart of the envs): no return is known there."""
        d = self.data
        ret = torch.zeros(idx.shape[0], device=self.device)
        weight = torch.ones(idx.shape[0], device=self.device)
        known = torch.zeros(idx.shape[0], dtype=torch.bool, device=self.device)
        alive = torch.ones_like(known)
        cur = idx.clone()
        for _ in range(self.capacity // self.stride):
            ret = ret + torch.where(alive, weight * (d["reward"][cur] + reward_offset), 0.0)
            weight = weight * gamma
            known = known | (alive & d["ended"][cur])
            alive = alive & ~d["boundary"][cur] & self._behind_head(cur)
            if not bool(alive.any()):
                break
            cur = torch.where(alive, (cur + self.stride) % self.capacity, cur)
        return torch.where(known, ret, torch.full_like(ret, -torch.inf))

    def recent_obs(self, n: int) -> Obs:
        """Up to `n` of the most recently added observation histories (for the KL-to-base monitor)."""
        n = min(n, self.size)
        idx = (self.pos - 1 - torch.arange(n, device=self.device)) % self.capacity
        return {k: v[idx] for k, v in self.obs.items()}

    # -- resume ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The filled slots, the write position and the open episodes' slots, as tensors and ints."""
        n = self.size
        return {
            "capacity": self.capacity, "stride": self.stride, "pos": self.pos, "size": n, "added": self.added,
            "data": {k: v[:n] for k, v in self.data.items()},
            "obs": {k: v[:n] for k, v in self.obs.items()},
            "next_obs": {k: v[:n] for k, v in self.next_obs.items()},
            "episode": [torch.tensor(s, dtype=torch.long) for s in self._episode],
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["capacity"]) != self.capacity or int(state["stride"]) != self.stride:
            raise ValueError(f"replay buffer state has capacity {state['capacity']} and stride {state['stride']}; this "
                             f"buffer has {self.capacity} and {self.stride} (keep offpolicy.buffer_size and "
                             f"env.num_envs when resuming)")
        self.pos, self.size, self.added = int(state["pos"]), int(state["size"]), int(state["added"])
        self.data, self.obs, self.next_obs = {}, {}, {}
        if self.size:
            def grow(v: torch.Tensor) -> torch.Tensor:
                full = torch.zeros((self.capacity, *v.shape[1:]), dtype=v.dtype, device=self.device)
                full[: v.shape[0]] = v.to(self.device)
                return full

            self.data = {k: grow(v) for k, v in state["data"].items()}
            # Runs saved before episode ends were marked apart from stream ends: every boundary counts as one.
            self.data.setdefault("ended", self.data["boundary"].clone())
            self.obs = {k: grow(v) for k, v in state["obs"].items()}
            self.next_obs = {k: grow(v) for k, v in state["next_obs"].items()}
        self._episode = [t.tolist() for t in state["episode"]]


# -- a dataset store (demonstrations, recorded deployments) as chunk transitions -----------------------


def store_transitions(path: str | Path, obs_keys: list[str], obs_steps: int, horizon: int, act_steps: int,
                      device: torch.device | str = "cpu") -> tuple[ChunkReplayBuffer, dict[str, float]]:
    """Episodes of a dataset store (robotft.datasets.store) as chunk transitions in a buffer of stride 1.

    Chunks start every `act_steps` steps of an episode: the observation history ends at the chunk's first step
    (padded with the episode's first frame, as ChunkedEnv pads), the chunk is the next `horizon` actions (padded
    with the last one), the reward is the sum of `reward` over the executed steps, and the next history ends
    after them. The store's `reward` is used where present; otherwise (a deployment recorded by `robotft deploy
    --record`) the reward is 1 at the last step of a successful episode: the operator's label. An episode whose
    last step is a success terminates; any other ends by truncation (the critic bootstraps from its last
    history). The critic's action is filled in by the algorithm (its `action` here is the executed part).
    Returns the buffer and `{"episodes", "transitions", "success_rate"}`."""
    from robotft.datasets.store import DatasetError, ReplayBuffer

    store = ReplayBuffer.open(path)
    missing = [k for k in [*obs_keys, "action"] if k not in store.features]
    if missing:
        raise DatasetError(f"{path}: the policy reads keys {missing} that the store lacks; it has {store.keys}")
    if "reward" not in store.features and "success" not in store.features:
        raise DatasetError(f"{path}: needs a 'reward' or a 'success' key to learn from; it has {store.keys}")
    arrays = {k: store.array(k) for k in obs_keys}
    actions = store.array("action").astype(np.float32)
    rewards = store.array("reward").astype(np.float32) if "reward" in store.features else None
    success = store.array("success").astype(bool) if "success" in store.features else None
    lists: dict[str, list] = {k: [] for k in ("chunk", "reward", "terminated", "done", "success")}
    obs_l: dict[str, list] = {k: [] for k in obs_keys}
    next_l: dict[str, list] = {k: [] for k in obs_keys}
    successes = 0
    for e in range(store.n_episodes):
        sl = store.episode_slice(e)
        start, length = sl.start, sl.stop - sl.start
        won = bool(success[sl.stop - 1]) if success is not None else False
        successes += won
        if rewards is not None:
            r = rewards[sl]
        else:
            r = np.zeros(length, dtype=np.float32)
            r[-1] = float(won)
        for t in range(0, length, act_steps):
            end = min(t + act_steps, length)
            hist = np.clip(np.arange(t - obs_steps + 1, t + 1), 0, length - 1) + start
            # The history after the chunk ends at the observation after its last executed step; the store holds
            # none after an episode's last step, so there it ends at the last stored observation.
            after = end if end < length else length - 1
            nxt = np.clip(np.arange(after - obs_steps + 1, after + 1), 0, length - 1) + start
            for k in obs_keys:
                obs_l[k].append(arrays[k][hist])
                next_l[k].append(arrays[k][nxt])
            steps = np.minimum(np.arange(t, t + horizon), length - 1) + start
            lists["chunk"].append(actions[steps])
            lists["reward"].append(float(r[t:end].sum()))
            last = end == length
            lists["terminated"].append(last and won)
            lists["done"].append(last)
            lists["success"].append(won)
    n = len(lists["reward"])
    if n == 0:
        raise DatasetError(f"{path}: holds no episodes")

    def stack(items: list) -> torch.Tensor:
        x = torch.as_tensor(np.stack(items))
        return x.float() if x.dtype == torch.float64 else x

    chunks = stack(lists["chunk"]).float()
    buf = ChunkReplayBuffer(n, 1, device)
    buf.data = {"action": chunks[:, :act_steps].flatten(1), "chunk": chunks,
                "reward": torch.tensor(lists["reward"], dtype=torch.float32),
                "terminated": torch.tensor(lists["terminated"]), "boundary": torch.tensor(lists["done"]),
                "ended": torch.tensor(lists["done"]),
                "success": torch.tensor(lists["success"])}
    buf.data = {k: v.to(buf.device) for k, v in buf.data.items()}
    buf.obs = {k: stack(v).to(buf.device) for k, v in obs_l.items()}
    buf.next_obs = {k: stack(v).to(buf.device) for k, v in next_l.items()}
    buf.pos, buf.size, buf.added = 0, n, n
    return buf, {"episodes": store.n_episodes, "transitions": n, "success_rate": successes / store.n_episodes}
