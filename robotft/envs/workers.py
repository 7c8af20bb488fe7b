"""CPU vectorization for simulators that hold one env per process: one env per worker process.

`WorkerPool` is a BatchedEnv over `num_envs` spawned worker processes, each holding one in-process
BatchedEnv (batch 1) that `build(cfg)` returns; commands and numpy results travel over pipes and the
workers step concurrently. A worker that raises sends its traceback before exiting; one that dies or
stops answering is detected by polling, so the caller gets a `WorkerError` naming the worker instead
of a hang. Workers are started with `spawn` (forking a process that holds torch, Vulkan or OpenGL
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

STARTUP_TIMEOUT_S = 300.0
"""How long a worker may take to import its simulator and build its env (software rendering is slow)."""
STEP_TIMEOUT_S = 120.0
"""How long one worker command (reset, step, render) may take before the pool gives up."""
_POLL_S = 0.05

EnvBuilder = Callable[[EnvConfig], BatchedEnv]
"""Builds the one in-process env of a worker from its config (`num_envs == 1`)."""


class WorkerError(RuntimeError):
    """A worker process crashed, raised, or did not answer in time; the message names the worker."""


def _worker_main(conn: Any, build: EnvBuilder, cfg: EnvConfig) -> None:
    """Entry point of a worker process: build one env, then serve (command, argument) pairs."""
    # One env per process is single-threaded physics; extra torch threads would only oversubscribe
    # the cores the other workers use.
    torch.set_num_threads(1)
    env = None
    try:
        env = build(cfg)
        conn.send(("ok", (env.spec.to_dict(), env.max_episode_steps)))
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                break
            if cmd == "reset":
                result = env.reset(seed=arg)
            elif cmd == "step":
                result = env.step(torch.from_numpy(arg))
            elif cmd == "step_chunk":
                result = [env.step(torch.from_numpy(arg[:, t])) for t in range(arg.shape[1])]
            elif cmd == "render":
                result = env.render_rgb()
            else:
                raise ValueError(f"unknown worker command {cmd!r}")
            conn.send(("ok", _to_numpy(result)))
    except KeyboardInterrupt:
        pass
    except BaseException:  # report any failure, with its traceback, to the parent before exiting
        conn.send(("error", traceback.format_exc()))
    finally:
        if env is not None:
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
    if isinstance(tree, list):
        return [_to_numpy(v) for v in tree]
    return tree


class WorkerPool(BatchedEnv):
    """`num_envs` worker processes, each running `build(worker_cfg)`, as one BatchedEnv.

    `name` labels the workers in errors and process names (e.g. `ManiSkill worker 1 (pid 123) died`).
    `reset(seed)` of all envs seeds worker i with `seed + i`, exactly as a single env with that seed; a
    partial reset passes no seed (BatchedEnv.reset's rule), so each worker continues its own stream.
    """

    def __init__(
        self,
        build: EnvBuilder,
        worker_cfg: EnvConfig,
        num_envs: int,
        device: str | torch.device,
        name: str,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        if worker_cfg.num_envs != 1:
            raise ValueError(f"WorkerPool: worker_cfg.num_envs must be 1, got {worker_cfg.num_envs}")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.name = name
        self.step_timeout_s = step_timeout_s
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for i in range(num_envs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(child, build, worker_cfg),
                name=f"{name.lower()}-worker-{i}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # The latest observation of every env, so that a partial reset can return all of them.
        self._obs: Obs = {}
        try:
            ready = [self._recv(i, startup_timeout_s) for i in range(num_envs)]
            self.reset()
        except BaseException:
            self.close()
            raise
        spec_dict, self.max_episode_steps = ready[0]
        self.spec = EnvSpec.from_dict(spec_dict)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        ids = range(self.num_envs) if env_ids is None else [int(i) for i in env_ids]
        for i in ids:
            self._send(i, "reset", None if seed is None else seed + i)
        fresh = {i: self._recv(i) for i in ids}
        if env_ids is None:
            self._obs = self._stack([fresh[i] for i in ids])
        else:
            for i, obs in fresh.items():
                for k, v in obs.items():
                    self._obs[k][i] = torch.from_numpy(v[0]).to(self.device)
        return {k: v.clone() for k, v in self._obs.items()}

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if tuple(action.shape) != (self.num_envs, self.spec.action.dim):
            raise ValueError(
                f"{self.name} step: action must be [{self.num_envs}, {self.spec.action.dim}], "
                f"got {list(action.shape)}"
            )
        actions = action.detach().to("cpu", torch.float32).numpy()
        for i in range(self.num_envs):
            self._send(i, "step", actions[i : i + 1])
        return self._gather_step([self._recv(i) for i in range(self.num_envs)])

    def step_chunk(self, actions: torch.Tensor) -> list[tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
        """All T actions of `actions` `[B, T, act_dim]` in one message per worker (each worker steps T times and
        answers once): T times fewer round trips than `step`, the same results."""
        if actions.ndim != 3 or tuple(actions.shape[::2]) != (self.num_envs, self.spec.action.dim):
            raise ValueError(
                f"{self.name} step_chunk: actions must be [{self.num_envs}, T, {self.spec.action.dim}], "
                f"got {list(actions.shape)}"
            )
        chunk = actions.detach().to("cpu", torch.float32).numpy()
        for i in range(self.num_envs):
            self._send(i, "step_chunk", chunk[i : i + 1])
        per_worker = [self._recv(i) for i in range(self.num_envs)]
        return [self._gather_step([steps[t] for steps in per_worker]) for t in range(chunk.shape[1])]

    def _gather_step(self, results: list[Any]) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """One step's per-worker results as batched tensors; remembers the observations for partial resets."""
        obs, reward, terminated, truncated, info = (self._stack([r[j] for r in results]) for j in range(5))
        self._obs = obs
        return {k: v.clone() for k, v in obs.items()}, reward, terminated, truncated, info

    def render_rgb(self) -> torch.Tensor | None:
        for i in range(self.num_envs):
            self._send(i, "render", None)
        frames = [self._recv(i) for i in range(self.num_envs)]
        if any(f is None for f in frames):
            return None
        return torch.from_numpy(np.concatenate(frames)).to(self.device)

    def render_env(self, i: int) -> torch.Tensor | None:
        """Env `i`'s frame from its worker alone: the other workers do not render."""
        self._send(i, "render", None)
        frame = self._recv(i)
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
        """Concatenate per-worker numpy results (`[1, ...]` leaves) into `[B, ...]` tensors."""
        if isinstance(parts[0], dict):
            return {k: self._stack([p[k] for p in parts]) for k in parts[0]}
        return torch.from_numpy(np.concatenate(parts)).to(self.device)

    def _send(self, i: int, cmd: str, arg: Any) -> None:
        try:
            self._conns[i].send((cmd, arg))
        except OSError as e:
            raise WorkerError(self._describe_death(i, f"could not send {cmd!r}: {e}")) from e

    def _recv(self, i: int, timeout_s: float | None = None) -> Any:
        """Wait for worker `i`'s answer, polling so that a dead or stuck worker raises instead of hanging."""
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        conn, proc = self._conns[i], self._procs[i]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(_POLL_S):
            if not proc.is_alive() and not conn.poll(0):
                raise WorkerError(self._describe_death(i, "died"))
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{self.name} worker {i} (pid {proc.pid}) did not answer within {timeout_s:.0f} s"
                )
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as e:  # the worker died mid-message or closed its end
            raise WorkerError(self._describe_death(i, f"closed its pipe ({e!r})")) from e
        if status == "error":
            raise WorkerError(f"{self.name} worker {i} (pid {proc.pid}) failed:\n{payload}")
        return payload

    def _describe_death(self, i: int, what: str) -> str:
        proc = self._procs[i]
        proc.join(timeout=1)
        return (
            f"{self.name} worker {i} (pid {proc.pid}) {what}; exit code {proc.exitcode} "
            "(negative = killed by that signal number)"
        )


class PooledEnv(BatchedEnv):
    """A simulator adapter that runs either in this process or as a WorkerPool of one-env processes: the
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

