"""CPU vectorization for simulators that hold one env per simulator instance: envs spread over worker processes.

`WorkerPool` is a BatchedEnv over `num_envs` envs in `num_processes` spawned worker processes; each process
holds its share of the envs (in-process BatchedEnvs of batch 1 that `build(cfg)` returns, contiguous env
indices) and steps them in turn, so the processes step concurrently. By default there is one process per
available CPU core, at most one per env: more processes than cores only add context switches and pipe
messages (4 ManiSkill PushCube envs on 2 cores step a 4-step chunk in 2 processes faster than in 4).
Commands and numpy results travel over pipes. A worker that raises sends its traceback before exiting; one
that dies or stops answering is detected by polling, so the caller gets a `WorkerError` naming the worker
instead of a hang. Workers are started with `spawn` (forking a process that holds torch, Vulkan or OpenGL
state is unsafe), so a script that builds a pool must guard its entry point with
`if __name__ == "__main__":`, and `build` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from robotft.config import EnvConfig
from robotft.envs.base import BatchedEnv, Obs
from robotft.specs import EnvSpec
from robotft.threads import available_cores

STARTUP_TIMEOUT_S = 300.0
"""How long a worker may take to import its simulator and build its envs (software rendering is slow)."""
STEP_TIMEOUT_S = 120.0
"""How long one worker command (reset, step, render) may take before the pool gives up."""
_POLL_S = 0.05
_STALL_S = 5.0
"""A gap this much longer than one poll between two polls means the learner itself was stopped (SIGSTOP, a
suspended machine); its workers were too, so that time does not count against their timeout."""

EnvBuilder = Callable[[EnvConfig], BatchedEnv]
"""Builds one in-process env of a worker from its config (`num_envs == 1`)."""


def process_count(num_envs: int, requested: int) -> int:
    """Worker processes for `num_envs` envs: `requested`, or with 0 one per available CPU core; at most one per env."""
    return min(requested or available_cores(), num_envs)


def split_envs(num_envs: int, num_processes: int) -> list[range]:
    """Contiguous env indices of each process, sizes differing by at most one (the first processes larger)."""
    base, extra = divmod(num_envs, num_processes)
    bounds = np.cumsum([0] + [base + (w < extra) for w in range(num_processes)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class WorkerError(RuntimeError):
    """A worker process crashed, raised, or did not answer in time; the message names the worker."""


# Results leave a worker as numpy arrays and nothing in it is differentiated: inference mode skips autograd's
# bookkeeping on the simulator's many small tensor ops (a ManiSkill PushCube CPU step: 1.68 -> 1.48 ms).
@torch.inference_mode()
def _worker_main(conn: Any, build: EnvBuilder, cfg: EnvConfig, count: int) -> None:
    """Entry point of a worker process: build `count` envs, then serve (command, argument) pairs. Every answer
    holds the process's envs in order, concatenated along the batch dimension."""
    # Each env is single-threaded physics; extra torch threads would only oversubscribe the cores the other
    # workers use.
    torch.set_num_threads(1)
    envs: list[BatchedEnv] = []
    try:
        for _ in range(count):
            envs.append(build(cfg))
        conn.send(("ok", (envs[0].spec.to_dict(), envs[0].max_episode_steps)))
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                break
            if cmd == "reset":  # arg: (local env index, seed or None) pairs
                result = _concat([_to_numpy(envs[j].reset(seed=seed)) for j, seed in arg])
            elif cmd == "step":  # arg: [count, act_dim]
                result = _concat([_to_numpy(env.step(torch.from_numpy(arg[j : j + 1]))) for j, env in enumerate(envs)])
            elif cmd == "step_chunk":  # arg: [count, T, act_dim]; each env steps its T actions, then the next env
                per_env = [[_to_numpy(env.step(torch.from_numpy(arg[j : j + 1, t]))) for t in range(arg.shape[1])]
                           for j, env in enumerate(envs)]
                result = [_concat([steps[t] for steps in per_env]) for t in range(arg.shape[1])]
            elif cmd == "render":  # arg: local env indices
                frames = [envs[j].render_rgb() for j in arg]
                result = None if any(f is None for f in frames) else np.concatenate([f.numpy() for f in frames])
            else:
                raise ValueError(f"unknown worker command {cmd!r}")
            conn.send(("ok", result))
    except KeyboardInterrupt:
        pass
    except BaseException:  # report any failure, with its traceback, to the parent before exiting
        conn.send(("error", traceback.format_exc()))
    finally:
        for env in envs:
            env.close()
        conn.close()


def _to_numpy(tree: Any) -> Any:
    """Tensors -> numpy arrays throughout a result; numpy pickles compactly over a pipe."""
    if isinstance(tree, torch.Tensor):
        return tree.numpy()
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_to_numpy(v) for v in tree)
    return tree


def _concat(parts: list[Any]) -> Any:
    """Batch-1 results (dicts and tuples of `[1, ...]` arrays) of several envs as one result of `[n, ...]` arrays."""
    if isinstance(parts[0], dict):
        return {k: _concat([p[k] for p in parts]) for k in parts[0]}
    if isinstance(parts[0], tuple):
        return tuple(_concat(list(p)) for p in zip(*parts, strict=True))
    return np.concatenate(parts)


class WorkerPool(BatchedEnv):
    """`num_envs` envs, each built by `build(worker_cfg)`, in `num_processes` worker processes, as one BatchedEnv.

    `num_processes` 0: one per available CPU core, at most `num_envs`. `name` labels the workers in errors and
    process names (e.g. `ManiSkill worker 1 (pid 123, envs 2-3) died`). `reset(seed)` of all envs seeds env i
    with `seed + i`, exactly as a single env with that seed, whichever process holds it; a partial reset passes
    no seed (BatchedEnv.reset's rule), so each env continues its own stream.
    """

    def __init__(
        self,
        build: EnvBuilder,
        worker_cfg: EnvConfig,
        num_envs: int,
        device: str | torch.device,
        name: str,
        num_processes: int = 0,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        if worker_cfg.num_envs != 1:
            raise ValueError(f"WorkerPool: worker_cfg.num_envs must be 1, got {worker_cfg.num_envs}")
        if num_processes < 0:
            raise ValueError(f"WorkerPool: num_processes must be >= 0 (0: one per CPU core), got {num_processes}")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.name = name
        self.step_timeout_s = step_timeout_s
        self._envs_of = split_envs(num_envs, process_count(num_envs, num_processes))
        self._where = [(w, j) for w, envs in enumerate(self._envs_of) for j in range(len(envs))]
        """Env index -> (its process, its index in that process)."""
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for w, envs in enumerate(self._envs_of):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(child, build, worker_cfg, len(envs)),
                name=f"{name.lower()}-worker-{w}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # The latest observation of every env, so that a partial reset can return all of them.
        self._obs: Obs = {}
        try:
            ready = [self._recv(w, startup_timeout_s) for w in range(self.num_processes)]
            self.reset()
        except BaseException:
            self.close()
            raise
        spec_dict, self.max_episode_steps = ready[0]
        self.spec = EnvSpec.from_dict(spec_dict)

    @property
    def num_processes(self) -> int:
        return len(self._envs_of)

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker processes, in order (each holds a contiguous share of the envs)."""
        return [p.pid for p in self._procs]

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        ids = range(self.num_envs) if env_ids is None else [int(i) for i in env_ids]
        requests: dict[int, list[tuple[int, int | None]]] = {}
        for i in ids:
            w, j = self._where[i]
            requests.setdefault(w, []).append((j, None if seed is None else seed + i))
        for w, pairs in requests.items():
            self._send(w, "reset", pairs)
        fresh = self._stack([self._recv(w) for w in requests])
        if env_ids is None:
            self._obs = fresh
        else:
            # Each process answers for its requested envs in `ids`' order, the processes in `requests`' order.
            order = [i for w in requests for i in ids if self._where[i][0] == w]
            index = torch.tensor(order, device=self.device)
            for k, v in fresh.items():
                self._obs[k][index] = v
        return {k: v.clone() for k, v in self._obs.items()}

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if tuple(action.shape) != (self.num_envs, self.spec.action.dim):
            raise ValueError(
                f"{self.name} step: action must be [{self.num_envs}, {self.spec.action.dim}], "
                f"got {list(action.shape)}"
            )
        actions = action.detach().to("cpu", torch.float32).numpy()
        for w, envs in enumerate(self._envs_of):
            self._send(w, "step", actions[envs.start : envs.stop])
        return self._gather_step([self._recv(w) for w in range(self.num_processes)])

    def step_chunk(self, actions: torch.Tensor) -> list[tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
        """All T actions of `actions` `[B, T, act_dim]` in one message per worker process (each steps its envs T
        times and answers once): T times fewer round trips than `step`, the same results."""
        if actions.ndim != 3 or tuple(actions.shape[::2]) != (self.num_envs, self.spec.action.dim):
            raise ValueError(
                f"{self.name} step_chunk: actions must be [{self.num_envs}, T, {self.spec.action.dim}], "
                f"got {list(actions.shape)}"
            )
        chunk = actions.detach().to("cpu", torch.float32).numpy()
        for w, envs in enumerate(self._envs_of):
            self._send(w, "step_chunk", chunk[envs.start : envs.stop])
        per_worker = [self._recv(w) for w in range(self.num_processes)]
        return [self._gather_step([steps[t] for steps in per_worker]) for t in range(chunk.shape[1])]

    def _gather_step(self, results: list[Any]) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """One step's per-process results as batched tensors; remembers the observations for partial resets."""
        obs, reward, terminated, truncated, info = (self._stack([r[j] for r in results]) for j in range(5))
        self._obs = obs
        return {k: v.clone() for k, v in obs.items()}, reward, terminated, truncated, info

    def render_rgb(self) -> torch.Tensor | None:
        for w, envs in enumerate(self._envs_of):
            self._send(w, "render", list(range(len(envs))))
        frames = [self._recv(w) for w in range(self.num_processes)]
        if any(f is None for f in frames):
            return None
        return torch.from_numpy(np.concatenate(frames)).to(self.device)

    def render_env(self, i: int) -> torch.Tensor | None:
        """Env `i`'s frame from its process alone: the other envs do not render."""
        w, j = self._where[i]
        self._send(w, "render", [j])
        frame = self._recv(w)
        return None if frame is None else torch.from_numpy(frame[0]).to(self.device)

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):  # its end of the pipe may already be gone
                    conn.send(("close", None))
        for conn, proc in zip(self._conns, self._procs, strict=True):
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            conn.close()
        self._conns, self._procs = [], []

    def _stack(self, parts: list[Any]) -> Any:
        """Concatenate per-process numpy results (`[n_w, ...]` leaves) into `[sum n_w, ...]` tensors."""
        if isinstance(parts[0], dict):
            return {k: self._stack([p[k] for p in parts]) for k in parts[0]}
        return torch.from_numpy(np.concatenate(parts)).to(self.device)

    def _send(self, w: int, cmd: str, arg: Any) -> None:
        try:
            self._conns[w].send((cmd, arg))
        except OSError as e:
            raise WorkerError(self._describe_death(w, f"could not send {cmd!r}: {e}")) from e

    def _recv(self, w: int, timeout_s: float | None = None) -> Any:
        """Wait for worker `w`'s answer, polling so that a dead or stuck worker raises instead of hanging."""
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        conn, proc = self._conns[w], self._procs[w]
        last = time.monotonic()
        deadline = last + timeout_s
        while not conn.poll(_POLL_S):
            if not proc.is_alive() and not conn.poll(0):
                raise WorkerError(self._describe_death(w, "died"))
            now = time.monotonic()
            if now - last > _POLL_S + _STALL_S:
                deadline += now - last
            last = now
            if now > deadline:
                raise WorkerError(f"{self._label(w)} did not answer within {timeout_s:.0f} s")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as e:  # the worker died mid-message or closed its end
            raise WorkerError(self._describe_death(w, f"closed its pipe ({e!r})")) from e
        if status == "error":
            raise WorkerError(f"{self._label(w)} failed:\n{payload}")
        return payload

    def _label(self, w: int) -> str:
        envs = self._envs_of[w]
        held = f"env {envs.start}" if len(envs) == 1 else f"envs {envs.start}-{envs.stop - 1}"
        return f"{self.name} worker {w} (pid {self._procs[w].pid}, {held})"

    def _describe_death(self, w: int, what: str) -> str:
        self._procs[w].join(timeout=1)
        return (
            f"{self._label(w)} {what}; exit code {self._procs[w].exitcode} "
            "(negative = killed by that signal number)"
        )


class PooledEnv(BatchedEnv):
    """A simulator adapter that runs either in this process or as a WorkerPool of worker processes: the
    subclass picks the implementation in its constructor and calls `_use(impl)`; everything else delegates."""

    def _use(self, impl: BatchedEnv) -> None:
        self._impl = impl
        self.num_envs = impl.num_envs
        self.device = impl.device
        self.spec = impl.spec
        self.max_episode_steps = impl.max_episode_steps

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes; empty when simulating in this process."""
        return self._impl.pids if isinstance(self._impl, WorkerPool) else []

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        return self._impl.reset(seed=seed, env_ids=env_ids)

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        return self._impl.step(action)

    def step_chunk(self, actions: torch.Tensor) -> list[tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
        return self._impl.step_chunk(actions)

    def render_rgb(self) -> torch.Tensor | None:
        return self._impl.render_rgb()

    def render_env(self, i: int) -> torch.Tensor | None:
        return self._impl.render_env(i)

    def close(self) -> None:
        self._impl.close()

