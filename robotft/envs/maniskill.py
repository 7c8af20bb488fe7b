"""ManiSkill3 behind the BatchedEnv contract, on its GPU backend or its CPU backend.

- GPU (`physx_cuda`): one raw ManiSkill env simulates all `num_envs` envs in this process; partial
  resets go through `env.reset(options={"env_idx": ids})`; tensors stay on the GPU.
- CPU (`physx_cpu`) simulates one env per ManiSkill instance: `num_envs == 1` runs that same in-process
  path (so CPU tests exercise the GPU code path), `num_envs > 1` spreads the envs over worker processes
  (`env.worker_processes`, one per core by default) and steps the workers concurrently over pipes.
  Workers are started with `spawn`, so a script that builds such an env must guard its entry point with
  `if __name__ == "__main__":`.

The raw env (`gym.make(...).unwrapped`) is used: no ManiSkill time limit and no auto-reset;
truncation comes from per-env step counters against `cfg.max_episode_steps`.
mani_skill is imported lazily, inside the functions that build envs.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from robotft.config import EnvConfig
from robotft.envs.base import MILESTONE_PREFIX, BatchedEnv, Obs
from robotft.envs.workers import PooledEnv, WorkerError, WorkerPool  # noqa: F401 - WorkerError re-exported for callers
from robotft.optional import require
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_MODES = ("state", "rgb", "rgb+state")
"""`state`: the flat privileged state; `rgb`: cameras plus proprioception (`state` = agent qpos/qvel and the
task's non-privileged extras such as the TCP pose); `rgb+state`: `rgb`'s keys plus `privileged/state`, the
`state` mode's vector, for a state teacher labelling a camera student (robotft.distill)."""
PRIVILEGED_STATE = "privileged/state"


def _peg_aligned(env: Any, info: dict) -> torch.Tensor:
    """PegInsertionSide's pre-insertion stage as its dense reward defines it: the peg's head and centre both within
    1 cm of the hole's axis, ready to be pushed in. The reward measures their yz offsets in the goal frame, the
    hole's frame moved along its axis (x), so the hole's frame gives the same offsets: the head's is the step's
    `peg_head_pos_at_hole`, the centre's one rotation away (a third of the cost of composing ManiSkill's poses, which
    would add a quarter to each CPU step)."""
    from mani_skill.utils.geometry.rotation_conversions import quaternion_apply, quaternion_invert

    box = env.box.pose
    hole = box.p + quaternion_apply(box.q, env.box_hole_offsets.p)  # the hole's frame: the box's, translated
    centre = quaternion_apply(quaternion_invert(box.q), env.peg.pose.p - hole)[:, 1:]
    head = info["peg_head_pos_at_hole"][:, 1:]
    return (torch.linalg.norm(head, dim=1) < 0.01) & (torch.linalg.norm(centre, dim=1) < 0.01)


MILESTONES: dict[str, tuple[tuple[str, Callable[[Any, dict], torch.Tensor]], ...]] = {
    "PickCube-v1": (("grasped", lambda env, info: info["is_grasped"]),
                    ("at_goal", lambda env, info: info["is_obj_placed"])),
    "StackCube-v1": (("grasped", lambda env, info: info["is_cubeA_grasped"]),
                     ("on_cube_b", lambda env, info: info["is_cubeA_on_cubeB"])),
    "PegInsertionSide-v1": (("grasped", lambda env, info: env.agent.is_grasping(env.peg, max_angle=20)),
                            ("aligned", _peg_aligned)),
}
"""Task id -> its milestones in order (BatchedEnv's `milestone/<name>`), each from the raw env and its step's info:
the stages of ManiSkill's own success checks and dense rewards."""


def resolve_sim_backend(sim_backend: str, device: str | torch.device = "cpu") -> str:
    """`auto` -> `physx_cuda` when the run's `device` is a CUDA device, else `physx_cpu` (so `--device cpu`
    simulates on the CPU even on a GPU machine)."""
    if sim_backend == "auto":
        return "physx_cuda" if torch.device(device).type == "cuda" and torch.cuda.is_available() else "physx_cpu"
    if sim_backend not in ("physx_cpu", "physx_cuda"):
        raise ValueError(f"env.sim_backend {sim_backend!r}: expected auto, physx_cpu or physx_cuda")
    if sim_backend == "physx_cuda" and not torch.cuda.is_available():
        raise ValueError(
            "env.sim_backend 'physx_cuda' needs CUDA, which is not available; use auto or physx_cpu"
        )
    return sim_backend


class ManiSkillEnv(PooledEnv):
    """A ManiSkill3 task as a BatchedEnv; picks the in-process or the worker-process implementation.

    Observations: obs_mode `state` -> `{"state": [B, D] float32}`; obs_mode `rgb` -> `rgb/<camera>`
    uint8 `[B, H, W, 3]` plus `state` (agent qpos/qvel and task extras, flattened); obs_mode `rgb+state`
    adds `privileged/state`, the `state` mode's vector (see OBS_MODES). `info["success"]`
    is bool `[B]`; other per-env info entries of ManiSkill (e.g. `fail`) are passed through, and the tasks of
    MILESTONES report their stages as `milestone/<name>`.

    Seeding follows BatchedEnv's rule: `reset(seed)` of all envs is reproducible, partial resets pass no
    seed to ManiSkill. The per-env mapping is ManiSkill's own: the GPU backend seeds the whole batch from
    `seed` (its episode initialisation runs under `torch.manual_seed(seed)`), CPU env i is a one-env
    ManiSkill seeded with `seed + i`. So one seed gives reproducible runs on each backend, but not the
    same initial states on both.
    """

    def __init__(self, cfg: EnvConfig, device: str | torch.device = "cpu") -> None:
        sim_backend = resolve_sim_backend(cfg.sim_backend, device)
        if sim_backend == "physx_cpu" and cfg.num_envs > 1:
            worker_cfg = dataclasses.replace(cfg, num_envs=1, sim_backend="physx_cpu")
            self._use(WorkerPool(_build_worker_env, worker_cfg, cfg.num_envs, device, "ManiSkill",
                                 num_processes=cfg.worker_processes))
        else:
            self._use(_RawManiSkill(cfg, sim_backend, device))


# --------------------------------------------------------------------------------------------------
# In-process: one raw ManiSkill env holding all envs (GPU), or the single env of a CPU process.


class _RawManiSkill(BatchedEnv):
    def __init__(self, cfg: EnvConfig, sim_backend: str, device: str | torch.device) -> None:
        gym = _import_mani_skill()
        self.num_envs = cfg.num_envs
        self.device = torch.device(device)
        self.max_episode_steps = cfg.max_episode_steps
        self.obs_mode = cfg.obs_mode
        if cfg.obs_mode not in OBS_MODES:
            raise ValueError(f"env.obs_mode {cfg.obs_mode!r}: the ManiSkill adapter supports {OBS_MODES}")
        kwargs = dict(cfg.kwargs)
        if sim_backend == "physx_cuda" and self.device.type == "cuda":
            # One GPU per torchrun rank: simulate and render on this process's GPU, not on ManiSkill's
            # default cuda:0 (`device` is `cuda:<LOCAL_RANK>` under torchrun, robotft.distributed).
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            sim_backend = f"physx_cuda:{index}"
            kwargs.setdefault("render_backend", f"cuda:{index}")
            enable_physx_gpu()
        self._env = gym.make(
            cfg.task,
            num_envs=cfg.num_envs,
            # ManiSkill's `rgb+state_dict` adds the privileged state (object poses) to the camera observation.
            obs_mode="rgb+state_dict" if cfg.obs_mode == "rgb+state" else cfg.obs_mode,
            control_mode=cfg.control_mode,
            reward_mode=cfg.reward_mode,
            sim_backend=sim_backend,
            render_mode="rgb_array",
            **kwargs,
        ).unwrapped
        self._randomizer = None
        if cfg.randomization.active_physical():
            from robotft.envs.maniskill_randomization import ManiSkillRandomizer

            self._randomizer = ManiSkillRandomizer(self._env, cfg.randomization, sim_backend)
        if abs(self._env.control_freq - cfg.control_hz) > 1e-6:
            warnings.warn(
                f"env.control_hz is {cfg.control_hz} but {cfg.task} runs at {self._env.control_freq} Hz; "
                f"the spec records {self._env.control_freq} Hz",
                stacklevel=2,
            )
        self._milestones = MILESTONES.get(cfg.task, ())
        self._elapsed = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        # Seeds the torch RNG under which unseeded resets initialise their episodes; reseeded by every
        # seeded reset. Fresh entropy until then, as ManiSkill's own unseeded start.
        # (numpy, so that drawing an episode seed is no tensor op: nothing to sync with a device)
        self._reset_stream = np.random.default_rng()
        self._camera_extra = self._camera_mode_extra_keys() if cfg.obs_mode == "rgb+state" else None
        raw, _ = self._env.reset()
        first = self._convert_obs(raw)
        # The flat `state` has no structure left; the unflattened dict names each of its dimensions.
        tree = self._env.get_obs(unflattened=True) if cfg.obs_mode == "state" else self._camera_tree(raw)
        self.spec = _make_spec(
            first, self._env.single_action_space, cfg.control_mode, self._env.control_freq, _state_names(tree)
        )
        if self._camera_extra is not None:
            self.spec.observations[PRIVILEGED_STATE] = dataclasses.replace(
                self.spec.observations[PRIVILEGED_STATE], names=_state_names(raw))

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        """A seeded reset goes to ManiSkill as one int (it seeds the batch from it). An unseeded reset,
        which is what partial resets are, passes no seed: ManiSkill then rebuilds no per-env RNGs (with a
        seed list it rebuilds one numpy RNG per env, twice, on every call, ~0.1 ms per env) and initialises
        the episodes under the torch RNG, which is seeded here, in a fork, from a stream that the last
        seeded reset seeded. So episodes after partial resets are reproducible from the seed, do not
        consume the caller's torch RNG (the policy's sampling noise), and differ between CPU workers."""
        options = {} if env_ids is None else {"env_idx": env_ids.to(self._env.device, torch.long)}
        if self._randomizer is not None:
            options.update(self._randomizer.reset_options(seed))
        if seed is not None:
            self._reset_stream = np.random.default_rng(seed)
            obs, _ = self._env.reset(seed=seed, options=options)
        else:
            episode_seed = int(self._reset_stream.integers(2**62))
            devices = [self._env.device] if self._env.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(episode_seed)
                obs, _ = self._env.reset(options=options)
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
        for name, reached in self._milestones:
            info[MILESTONE_PREFIX + name] = reached(self._env, raw_info).to(self.device, torch.bool)
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
        out["state"] = _flat_state(self._camera_tree(obs)).to(self.device, torch.float32)
        if self._camera_extra is not None:
            out[PRIVILEGED_STATE] = _flat_state(obs).to(self.device, torch.float32)
        return out

    def _camera_tree(self, obs: dict) -> dict:
        """The `agent` and `extra` parts of `obs` as the `rgb` mode gives them (no privileged extras)."""
        if self._camera_extra is None:
            return obs
        return {"agent": obs["agent"], "extra": {k: v for k, v in obs["extra"].items() if k in self._camera_extra}}

    def _camera_mode_extra_keys(self) -> set[str]:
        """The task's `extra` observation keys without privileged state: tasks decide that from
        `obs_mode_struct.use_state` in `_get_obs_extra`, so ask with it switched off once."""
        struct = self._env.obs_mode_struct
        saved = struct.state_dict
        struct.state_dict = False
        try:
            return set(self._env._get_obs_extra(self._env.get_info()))
        finally:
            struct.state_dict = saved


def _flat_state(tree: dict) -> torch.Tensor:
    """`agent` then `extra` leaves flattened into `[B, D]`, the order of ManiSkill's flat `state` mode."""
    return torch.cat([s for s in (_flatten(tree["agent"]), _flatten(tree["extra"])) if s is not None], dim=-1)


def _import_mani_skill() -> Any:
    """Import gymnasium with ManiSkill's tasks registered; a clear error when mani_skill is missing."""
    require("mani_skill.envs", "maniskill", "the maniskill env backend")  # registers the tasks with gymnasium
    gym = require("gymnasium", "maniskill", "the maniskill env backend")
    from mani_skill.utils.logging_utils import logger

    if not any(isinstance(f, _OncePerProcess) for f in logger.filters):
        logger.addFilter(_OncePerProcess())
    return gym


def enable_physx_gpu() -> None:
    """Load SAPIEN's PhysX GPU library before ManiSkill does, so that a machine that cannot fetch it gets an
    error saying what to do. SAPIEN downloads the library from GitHub the first time a GPU sim starts and stores
    it under `~/.sapien/physx/<version>/`; offline, that download fails with a bare connection error."""
    import sapien.physx as physx

    if physx.is_gpu_enabled():
        return
    folder = Path.home() / ".sapien" / "physx" / physx.version()
    try:
        physx.enable_gpu()
    except Exception as e:
        raise RuntimeError(
            f"ManiSkill's GPU sim (sim_backend physx_cuda) needs SAPIEN's PhysX GPU library in {folder}; loading "
            f"it failed ({type(e).__name__}: {e}). SAPIEN fetches it from GitHub on first use: on a machine without "
            f"GitHub access, download this platform's zip of "
            f"https://github.com/sapien-sim/physx-precompiled/releases/tag/{physx.version()} elsewhere and unzip "
            f"it into {folder}; or simulate on the CPU (--env.sim_backend physx_cpu)") from e


class _OncePerProcess(logging.Filter):
    """Pass each distinct ManiSkill warning once per process: on a machine without CUDA, every env creation
    warns that the `sapien_cuda` render device was not found and falls back to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


def _flatten(tree: dict) -> torch.Tensor | None:
    """Concatenate the leaves of a nested dict of `[B, ...]` tensors into `[B, D]` (insertion order)."""
    leaves = []
    for value in tree.values():
        if isinstance(value, dict):
            value = _flatten(value)
        if value is not None:
            leaves.append(value.reshape(value.shape[0], -1).float())
    return torch.cat(leaves, dim=-1) if leaves else None


def _state_names(tree: dict) -> tuple[str, ...]:
    """Per-dimension names of the flat `state` (`agent/qpos/0`, ..., `extra/tcp_pose/6`, `extra/goal_pos/0`),
    in `_flatten`'s order over the `agent` and `extra` parts of ManiSkill's unflattened observation, so a
    rig can map each named segment to a source (robotft.real_robot.rig)."""

    def walk(node: dict, prefix: str) -> list[str]:
        names = []
        for key, value in node.items():
            if isinstance(value, dict):
                names += walk(value, f"{prefix}{key}/")
            elif value is not None:
                size = int(np.prod(value.shape[1:]))
                names += [f"{prefix}{key}"] if value.ndim == 1 else [f"{prefix}{key}/{i}" for i in range(size)]
        return names

    return tuple(walk({k: tree[k] for k in ("agent", "extra") if k in tree}, ""))


def _make_spec(
    obs: Obs, action_space: Any, control_mode: str, control_hz: float, state_names: tuple[str, ...] = ()
) -> EnvSpec:
    features = {}
    for key, value in obs.items():
        shape, dtype = tuple(value.shape[1:]), str(value.dtype).removeprefix("torch.")
        if key.startswith("rgb/"):
            features[key] = FeatureSpec(key, shape, dtype, unit="rgb8", frame="camera")
        else:
            names = state_names if key == "state" and (len(state_names),) == shape else ()
            features[key] = FeatureSpec(key, shape, dtype, unit="mixed", frame="world", names=names)
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
# CPU, num_envs > 1: _RawManiSkills of one env each in worker processes (robotft.envs.workers).


def _build_worker_env(cfg: EnvConfig) -> BatchedEnv:
    """One env of a CPU worker process (module level: the worker pool pickles it by name)."""
    return _RawManiSkill(cfg, "physx_cpu", "cpu")
