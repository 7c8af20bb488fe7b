"""ManiSkill3 behind the BatchedEnv contract, on its GPU backend or its CPU backend.

- GPU (`physx_cuda`): one raw ManiSkill env simulates all `num_envs` envs in this process; partial
  resets go through `env.reset(options={"env_idx": ids})`; tensors stay on the GPU.
- CPU (`physx_cpu`) simulates one env per process: `num_envs == 1` runs that same in-process path
  (so CPU tests exercise the GPU code path), `num_envs > 1` runs one in-process env per worker
  process and steps the workers concurrently over pipes. Workers are started with `spawn`, so a
  script that builds such an env must guard its entry point with `if __name__ == "__main__":`.

The raw env (`gym.make(...).unwrapped`) is used: no ManiSkill time limit and no auto-reset;
truncation comes from per-env step counters against `cfg.max_episode_steps`.
mani_skill is imported lazily, inside the functions that build envs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import time
import traceback
import warnings
from typing import Any

import numpy as np
import torch

from robotft.config import EnvConfig
from robotft.envs.base import BatchedEnv, Obs
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

INSTALL_HINT = "pip install robotft[maniskill]"
STARTUP_TIMEOUT_S = 300.0
"""How long a worker may take to import ManiSkill and build its env (software Vulkan is slow)."""
STEP_TIMEOUT_S = 120.0
"""How long one worker command (reset, step, render) may take before the pool gives up."""
_POLL_S = 0.05


def resolve_sim_backend(sim_backend: str) -> str:
    """`auto` -> `physx_cuda` when CUDA is present, else `physx_cpu`."""
    if sim_backend == "auto":
        return "physx_cuda" if torch.cuda.is_available() else "physx_cpu"
    if sim_backend not in ("physx_cpu", "physx_cuda"):
        raise ValueError(f"env.sim_backend {sim_backend!r}: expected auto, physx_cpu or physx_cuda")
    if sim_backend == "physx_cuda" and not torch.cuda.is_available():
        raise ValueError(
            "env.sim_backend 'physx_cuda' needs CUDA, which is not available; use auto or physx_cpu"
        )
    return sim_backend


class ManiSkillEnv(BatchedEnv):
    """A ManiSkill3 task as a BatchedEnv; picks the in-process or the worker-process implementation.

    Observations: obs_mode `state` -> `{"state": [B, D] float32}`; obs_mode `rgb` -> `rgb/<camera>`
    uint8 `[B, H, W, 3]` plus `state` (agent qpos/qvel and task extras, flattened). `info["success"]`
    is bool `[B]`; other per-env info entries of ManiSkill (e.g. `fail`) are passed through.
    `reset(seed)` seeds env i with `seed + i`.
    """

    def __init__(self, cfg: EnvConfig, device: str | torch.device = "cpu") -> None:
        sim_backend = resolve_sim_backend(cfg.sim_backend)
        if sim_backend == "physx_cpu" and cfg.num_envs > 1:
            self._impl: BatchedEnv = _WorkerPool(cfg, device)
        else:
            self._impl = _RawManiSkill(cfg, sim_backend, device)
        self.num_envs = self._impl.num_envs
        self.device = self._impl.device
        self.spec = self._impl.spec
        self.max_episode_steps = self._impl.max_episode_steps

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the CPU worker processes; empty when simulating in this process."""
        return self._impl.pids if isinstance(self._impl, _WorkerPool) else []

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        return self._impl.reset(seed=seed, env_ids=env_ids)

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        return self._impl.step(action)

    def render_rgb(self) -> torch.Tensor | None:
        return self._impl.render_rgb()

    def close(self) -> None:
        self._impl.close()


# --------------------------------------------------------------------------------------------------
# In-process: one raw ManiSkill env holding all envs (GPU), or the single env of a CPU process.


class _RawManiSkill(BatchedEnv):
    def __init__(self, cfg: EnvConfig, sim_backend: str, device: str | torch.device) -> None:
        gym = _import_mani_skill()
        self.num_envs = cfg.num_envs
        self.device = torch.device(device)
        self.max_episode_steps = cfg.max_episode_steps
        self.obs_mode = cfg.obs_mode
        if cfg.obs_mode not in ("state", "rgb"):
            raise ValueError(f"env.obs_mode {cfg.obs_mode!r}: the ManiSkill adapter supports state and rgb")
        self._env = gym.make(
            cfg.task,
            num_envs=cfg.num_envs,
            obs_mode=cfg.obs_mode,
            control_mode=cfg.control_mode,
            reward_mode=cfg.reward_mode,
            sim_backend=sim_backend,
            render_mode="rgb_array",
            **cfg.kwargs,
        ).unwrapped
        if abs(self._env.control_freq - cfg.control_hz) > 1e-6:
            warnings.warn(
                f"env.control_hz is {cfg.control_hz} but {cfg.task} runs at {self._env.control_freq} Hz; "
                f"the spec records {self._env.control_freq} Hz",
                stacklevel=2,
            )
        self._elapsed = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        first = self._convert_obs(self._env.reset()[0])
        self.spec = _make_spec(first, self._env.single_action_space, cfg.control_mode, self._env.control_freq)

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        options = {} if env_ids is None else {"env_idx": env_ids.to(self._env.device, torch.long)}
        # ManiSkill takes one seed per env (length num_envs); a partial reset uses only its envs' seeds.
        seeds = None if seed is None else [seed + i for i in range(self.num_envs)]
        obs, _ = self._env.reset(seed=seeds, options=options)
        ids = slice(None) if env_ids is None else env_ids.to(self.device, torch.long)
        self._elapsed[ids] = 0
        return self._convert_obs(obs)

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if tuple(action.shape) != (self.num_envs, self.spec.action.dim):
            raise ValueError(
                f"ManiSkill step: action must be [{self.num_envs}, {self.spec.action.dim}], got {list(action.shape)}"
            )
        obs, reward, terminated, _, raw_info = self._env.step(action.to(self._env.device, torch.float32))
        self._elapsed += 1
        truncated = self._elapsed >= self.max_episode_steps
        info = {
            k: v.to(self.device)
            for k, v in raw_info.items()
            # elapsed_steps counts ManiSkill's own (unused) time limit, not ours.
            if isinstance(v, torch.Tensor) and v.shape[:1] == (self.num_envs,) and k != "elapsed_steps"
        }
        info["success"] = info["success"].bool()
        return (
            self._convert_obs(obs),
            reward.to(self.device, torch.float32),
            terminated.to(self.device, torch.bool),
            truncated,
            info,
        )

    def render_rgb(self) -> torch.Tensor | None:
        try:
            frame = self._env.render()
        except RuntimeError:  # no renderer on this machine (e.g. no Vulkan device for rendering)
            return None
        return None if frame is None else torch.as_tensor(frame).to(self.device)

    def close(self) -> None:
        self._env.close()

    def _convert_obs(self, obs: Any) -> Obs:
        if self.obs_mode == "state":
            return {"state": obs.to(self.device, torch.float32)}
        out = {
            f"rgb/{cam}": data["rgb"].to(self.device)
            for cam, data in obs["sensor_data"].items()
            if "rgb" in data
        }
        state = [_flatten(obs["agent"]), _flatten(obs["extra"])]
        out["state"] = torch.cat([s for s in state if s is not None], dim=-1).to(self.device, torch.float32)
        return out


def _import_mani_skill() -> Any:
    """Import gymnasium with ManiSkill's tasks registered; a clear error when mani_skill is missing."""
    try:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401 - registers the ManiSkill tasks with gymnasium
    except ImportError as e:
        raise ImportError(f"the maniskill env backend needs mani_skill ({e}); {INSTALL_HINT}") from e
    return gym


def _flatten(tree: dict) -> torch.Tensor | None:
    """Concatenate the leaves of a nested dict of `[B, ...]` tensors into `[B, D]` (insertion order)."""
    leaves = []
    for value in tree.values():
        if isinstance(value, dict):
            value = _flatten(value)
        if value is not None:
            leaves.append(value.reshape(value.shape[0], -1).float())
    return torch.cat(leaves, dim=-1) if leaves else None


def _make_spec(obs: Obs, action_space: Any, control_mode: str, control_hz: float) -> EnvSpec:
    features = {}
    for key, value in obs.items():
        shape, dtype = tuple(value.shape[1:]), str(value.dtype).removeprefix("torch.")
        if key.startswith("rgb/"):
            features[key] = FeatureSpec(key, shape, dtype, unit="rgb8", frame="camera")
        else:
            features[key] = FeatureSpec(key, shape, dtype, unit="mixed", frame="world")
    low, high = np.asarray(action_space.low, dtype=float), np.asarray(action_space.high, dtype=float)
    action = ActionSpec(
        control_mode,
        int(low.size),
        tuple(low.tolist()),
        tuple(high.tolist()),
        float(control_hz),
        "robot_base",
    )
    return EnvSpec(observations=features, action=action)


# --------------------------------------------------------------------------------------------------
# CPU, num_envs > 1: one _RawManiSkill per worker process, commands and numpy results over pipes.


class WorkerError(RuntimeError):
    """A worker process crashed, raised, or did not answer in time; the message names the worker."""


def _worker_main(conn: Any, cfg: EnvConfig) -> None:
    """Entry point of a worker process: build one CPU env, then serve (command, argument) pairs."""
    # One env per process is single-threaded physics; extra torch threads would only oversubscribe
    # the cores the other workers use.
    torch.set_num_threads(1)
    env = None
    try:
        env = _RawManiSkill(cfg, "physx_cpu", "cpu")
        conn.send(("ok", (env.spec.to_dict(), env.max_episode_steps)))
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                break
            if cmd == "reset":
                result = env.reset(seed=arg)
            elif cmd == "step":
                result = env.step(torch.from_numpy(arg))
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
    return tree


class _WorkerPool(BatchedEnv):
    def __init__(self, cfg: EnvConfig, device: str | torch.device) -> None:
        self.num_envs = cfg.num_envs
        self.device = torch.device(device)
        # spawn: a fresh interpreter per worker; forking a process that holds torch or Vulkan state is unsafe.
        ctx = mp.get_context("spawn")
        worker_cfg = dataclasses.replace(cfg, num_envs=1, sim_backend="physx_cpu")
        self._conns, self._procs = [], []
        for i in range(self.num_envs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(child, worker_cfg), name=f"maniskill-worker-{i}", daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # The latest observation of every env, so that a partial reset can return all of them.
        self._obs: Obs = {}
        try:
            ready = [self._recv(i, STARTUP_TIMEOUT_S) for i in range(self.num_envs)]
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
                f"ManiSkill step: action must be [{self.num_envs}, {self.spec.action.dim}], got {list(action.shape)}"
            )
        actions = action.detach().to("cpu", torch.float32).numpy()
        for i in range(self.num_envs):
            self._send(i, "step", actions[i : i + 1])
        results = [self._recv(i) for i in range(self.num_envs)]
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

    def _recv(self, i: int, timeout_s: float = STEP_TIMEOUT_S) -> Any:
        """Wait for worker `i`'s answer, polling so that a dead or stuck worker raises instead of hanging."""
        conn, proc = self._conns[i], self._procs[i]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(_POLL_S):
            if not proc.is_alive() and not conn.poll(0):
                raise WorkerError(self._describe_death(i, "died"))
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"ManiSkill worker {i} (pid {proc.pid}) did not answer within {timeout_s:.0f} s"
                )
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as e:  # the worker died mid-message or closed its end
            raise WorkerError(self._describe_death(i, f"closed its pipe ({e!r})")) from e
        if status == "error":
            raise WorkerError(f"ManiSkill worker {i} (pid {proc.pid}) failed:\n{payload}")
        return payload

    def _describe_death(self, i: int, what: str) -> str:
        proc = self._procs[i]
        proc.join(timeout=1)
        return (
            f"ManiSkill worker {i} (pid {proc.pid}) {what}; exit code {proc.exitcode} "
            "(negative = killed by that signal number)"
        )
