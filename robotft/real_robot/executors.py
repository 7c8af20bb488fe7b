"""Chunk executors: turn predicted action chunks `[H, A]` into one action per control tick.

The runner's loop is the same for every executor:

    if executor.needs_chunk(now):
        executor.request(policy_fn, obs, obs_time)   # inline, or in the background for `async`
    action = executor.action(now)                     # None: nothing to execute, hold the arm

Times are seconds on the `time.monotonic()` clock. Action `i` of a chunk predicted from an observation
captured at `obs_time` belongs to time `obs_time + i * dt` (the diffusion_policy convention). The rig
preset picks an executor by name through `make_executor`.
"""

from __future__ import annotations

import abc
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np


def _check_chunk(chunk: np.ndarray, min_steps: int = 1) -> np.ndarray:
    arr = np.asarray(chunk, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < min_steps:
        raise ValueError(f"action chunk must be [H >= {min_steps}, act_dim], got shape {arr.shape}")
    return arr


def _check_dt(dt: float) -> None:
    if not (math.isfinite(dt) and dt > 0):
        raise ValueError(f"executor dt (control period, s) must be a finite number > 0, got {dt}")


class ChunkExecutor(abc.ABC):
    """Common interface; see the module docstring for the loop that drives it."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all chunks (start of an episode)."""

    @abc.abstractmethod
    def needs_chunk(self, now: float) -> bool:
        """Whether a new chunk should be requested at time `now` (s)."""

    @abc.abstractmethod
    def add_chunk(self, chunk: np.ndarray, obs_time: float) -> None:
        """Take a predicted chunk `[H, A]` (env units) for an observation captured at `obs_time` (s)."""

    @abc.abstractmethod
    def action(self, now: float) -> np.ndarray | None:
        """The action `[A]` to execute at the tick `now` (s); None when there is none (hold the arm)."""

    def request(self, predict: Callable[[Any], np.ndarray], obs: Any, obs_time: float) -> None:
        """Compute a chunk with `predict(obs)` and add it; synchronous here (the arm waits)."""
        self.add_chunk(predict(obs), obs_time)

    def close(self) -> None:  # noqa: B027 - only executors with a worker thread hold resources
        """Release background resources."""

    def __enter__(self) -> ChunkExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RecedingHorizonExecutor(ChunkExecutor):
    """Execute the first `act_steps` of each chunk, one per tick, then ask for a new chunk.

    Synchronous, step-indexed (Chi et al. 2023, diffusion policy): the arm holds while the policy
    infers, so no action goes stale and none is skipped; the chunk starts at the next tick.
    """

    def __init__(self, act_steps: int) -> None:
        if act_steps < 1:
            raise ValueError(f"act_steps must be >= 1, got {act_steps}")
        self.act_steps = act_steps
        self._queue: deque[np.ndarray] = deque()

    def reset(self) -> None:
        self._queue.clear()

    def needs_chunk(self, now: float) -> bool:
        return not self._queue

    def add_chunk(self, chunk: np.ndarray, obs_time: float) -> None:
        self._queue = deque(_check_chunk(chunk, self.act_steps)[: self.act_steps])

    def action(self, now: float) -> np.ndarray | None:
        return self._queue.popleft() if self._queue else None


class TemporalEnsembleExecutor(ChunkExecutor):
    """Query every tick and average all chunks' predictions for the current time (ACT).

    Temporal ensembling (Zhao et al. 2023, "Learning Fine-Grained Bimanual Manipulation with Low-Cost
    Hardware", arXiv 2304.13705, Sec. 3.3): the action at time t is `sum_i w_i a_i / sum_i w_i` over the
    predictions `a_i` for t from every chunk that covers t, with `w_i = exp(-m i)` and `i = 0` the
    oldest prediction (smaller `m` incorporates new observations more slowly).
    The prediction of a chunk for `now` is its action `round((now - obs_time) / dt)`.
    """

    def __init__(self, dt: float, m: float = 0.01) -> None:
        _check_dt(dt)
        if not (math.isfinite(m) and m >= 0):
            raise ValueError(f"temporal ensemble weight m must be a finite number >= 0, got {m}")
        self.dt = dt
        self.m = m
        self._chunks: list[tuple[float, np.ndarray]] = []

    def reset(self) -> None:
        self._chunks.clear()

    def needs_chunk(self, now: float) -> bool:
        """True once per tick: when the newest chunk's observation is at least half a period old."""
        return not self._chunks or now - self._chunks[-1][0] >= self.dt / 2

    def add_chunk(self, chunk: np.ndarray, obs_time: float) -> None:
        arr = _check_chunk(chunk)
        if self._chunks and arr.shape[1] != self._chunks[-1][1].shape[1]:
            raise ValueError(f"action dim changed from {self._chunks[-1][1].shape[1]} to {arr.shape[1]}")
        self._chunks.append((obs_time, arr))

    def action(self, now: float) -> np.ndarray | None:
        live, preds = [], []
        for obs_time, chunk in self._chunks:
            j = math.floor((now - obs_time) / self.dt + 0.5)
            if j < len(chunk):  # a chunk that ends before `now` never contributes again
                live.append((obs_time, chunk))
                if j >= 0:
                    preds.append(chunk[j])
        self._chunks = live
        if not preds:
            return None
        weights = np.exp(-self.m * np.arange(len(preds)))
        return np.einsum("i,ia->a", weights, np.stack(preds)) / weights.sum()


class RunningStats:
    """Count, last, mean and max of a stream of durations (s)."""

    def __init__(self) -> None:
        self.count = 0
        self.last_s = 0.0
        self.max_s = 0.0
        self._sum = 0.0

    def add(self, value_s: float) -> None:
        self.count += 1
        self.last_s = value_s
        self.max_s = max(self.max_s, value_s)
        self._sum += value_s

    @property
    def mean_s(self) -> float:
        return self._sum / self.count if self.count else 0.0


@dataclass
class _Current:
    obs_time: float
    chunk: np.ndarray
    next_index: int
    """First action not yet executed, skipped or dropped."""


class AsyncExecutor(ChunkExecutor):
    """Infer the next chunk in a background thread while the current one runs (latency compensation).

    Actions are scheduled at absolute times `obs_time + i * dt`. A new chunk replaces the current one
    as soon as it arrives; its actions scheduled before the arrival time are skipped (their time has
    passed while the policy was thinking), as in diffusion_policy's real-robot evaluation. At each tick
    the executor returns the next action not yet executed, dropping those scheduled more than half a
    period before `now` (stale: the loop fell behind). A new request is due when the current chunk
    will have run `act_steps` actions by the time the new one is expected, using the largest of the
    last `latency_window` measured latencies (obs capture to chunk arrival).
    """

    def __init__(
        self,
        dt: float,
        act_steps: int,
        latency_window: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_dt(dt)
        if act_steps < 1 or latency_window < 1:
            raise ValueError(
                f"act_steps and latency_window must be >= 1, got {act_steps} and {latency_window}"
            )
        self.dt = dt
        self.act_steps = act_steps
        self.clock = clock
        self.latency = RunningStats()
        """Observation capture to chunk arrival (s): what the skipped actions compensate for."""
        self.inference = RunningStats()
        """Time `predict` took in the worker (s)."""
        self.skipped = 0
        """Actions skipped because their time passed before their chunk arrived."""
        self.dropped = 0
        """Actions dropped because the control loop reached them more than half a period late."""
        self._recent: deque[float] = deque(maxlen=latency_window)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="robotft-policy")
        self._in_flight = False
        self._generation = 0
        self._error: BaseException | None = None
        self._current: _Current | None = None

    def reset(self) -> None:
        with self._lock:
            # A chunk still being computed belongs to the old episode; its result is ignored.
            self._generation += 1
            self._in_flight = False
            self._current = None
            self._error = None

    @property
    def in_flight(self) -> bool:
        """True while a requested chunk is being computed."""
        return self._in_flight

    def needs_chunk(self, now: float) -> bool:
        with self._lock:
            self._raise_worker_error()
            if self._in_flight:
                return False
            if self._current is None:
                return True
            expected = max(self._recent, default=0.0)
            return now + expected >= self._current.obs_time + self.act_steps * self.dt

    def request(self, predict: Callable[[Any], np.ndarray], obs: Any, obs_time: float) -> None:
        """Start `predict(obs)` in the background and return at once; the chunk is added on arrival."""
        with self._lock:
            if self._in_flight:
                raise RuntimeError("AsyncExecutor.request while a chunk is being computed; check needs_chunk")
            self._in_flight = True
            generation = self._generation
        submitted = self.clock()
        future = self._pool.submit(predict, obs)
        future.add_done_callback(lambda f: self._arrived(f, obs_time, submitted, generation))

    def _arrived(self, future: Future, obs_time: float, submitted: float, generation: int) -> None:
        arrival = self.clock()
        error = future.exception()
        chunk = None if error is not None else _check_chunk(future.result())
        with self._lock:
            if generation != self._generation:
                return
            # Cleared in the same critical section that installs the chunk, so `needs_chunk` never
            # sees "nothing in flight" together with the previous chunk.
            self._in_flight = False
            if error is not None:
                self._error = error
                return
            self.inference.add(arrival - submitted)
            self._install(chunk, obs_time, arrival)

    def add_chunk(self, chunk: np.ndarray, obs_time: float, now: float | None = None) -> None:
        """Make `chunk` current, skipping its actions scheduled before `now` (default: the clock)."""
        arr = _check_chunk(chunk)
        now = self.clock() if now is None else now
        with self._lock:
            self._install(arr, obs_time, now)

    def _install(self, chunk: np.ndarray, obs_time: float, now: float) -> None:
        passed = min(max(math.ceil((now - obs_time) / self.dt), 0), len(chunk))  # #{i: obs_time + i dt < now}
        self.latency.add(now - obs_time)
        self._recent.append(now - obs_time)
        self.skipped += passed
        self._current = _Current(obs_time, chunk, passed)

    def action(self, now: float) -> np.ndarray | None:
        with self._lock:
            self._raise_worker_error()
            cur = self._current
            if cur is None:
                return None
            # First index whose scheduled time is not more than half a period before `now`.
            fresh = math.ceil((now - cur.obs_time) / self.dt - 0.5)
            i = max(cur.next_index, fresh)
            self.dropped += min(i, len(cur.chunk)) - cur.next_index
            if i >= len(cur.chunk):
                cur.next_index = len(cur.chunk)
                return None
            cur.next_index = i + 1
            return cur.chunk[i]

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("policy inference failed in the background thread") from self._error

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True)


EXECUTORS: dict[str, type[ChunkExecutor]] = {
    "receding_horizon": RecedingHorizonExecutor,
    "temporal_ensemble": TemporalEnsembleExecutor,
    "async": AsyncExecutor,
}
"""Executor name (as written in rig presets) -> class."""


def make_executor(name: str, **kwargs: Any) -> ChunkExecutor:
    """Build the executor registered under `name` with its constructor options.

    Example: `make_executor("async", dt=0.1, act_steps=8)`.
    """
    if name not in EXECUTORS:
        raise ValueError(f"unknown chunk executor {name!r}; available: {sorted(EXECUTORS)}")
    try:
        return EXECUTORS[name](**kwargs)
    except TypeError as e:
        raise TypeError(f"chunk executor {name!r}: bad options {sorted(kwargs)}: {e}") from e
