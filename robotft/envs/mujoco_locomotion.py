"""gymnasium MuJoCo locomotion (Hopper-v5, Walker2d-v5, HalfCheetah-v5) behind the BatchedEnv contract.

The dense-reward suite that DPPO (Ren et al. 2024, arXiv 2409.00588) and ReinFlow (Zhang et al. 2025,
arXiv 2505.22094) report on. Each env is one `gym.make(task)` MuJoCo model; `num_envs` of them step one
after the other in this process (one step of these envs is ~0.1-0.3 ms, too cheap for worker processes to
pay off on a few cores; docs/environment.md measured SyncVectorEnv beating AsyncVectorEnv). The loop over the
bare envs is gymnasium's `SyncVectorEnv.step` without its per-step info merging, autoreset bookkeeping and
wrappers (TimeLimit, OrderEnforcing, checker), which cost 40-60% on top of a Hopper step here against a
target adapter overhead of 10% (scripts/bench_env_overhead.py).

- Observation `{"state": [B, D] float32}`: gymnasium's vector (joint positions without the root's x,
  then joint velocities), cast from float64.
- Action `[B, act_dim]` in [-1, 1]: joint torques as fractions of each actuator's gear (`joint_torque`).
- Reward: gymnasium's dense reward (forward velocity + healthy bonus - control cost).
- `terminated`: the robot became unhealthy (fell); HalfCheetah never terminates. `truncated`: a step
  counter reached `cfg.max_episode_steps`. They stay apart so PPO bootstraps the value only on truncation.
- `info["success"]`: the episode's return so far has reached a threshold: `cfg.kwargs["success_return"]`,
  else gymnasium's registered `reward_threshold` (Hopper 3800, HalfCheetah 4800, both for 1000-step
  episodes); Walker2d has none, so there success stays False unless a threshold is given. Success does not
  end the episode.
- No auto-reset here (gymnasium's autoreset modes do not apply): a finished env stepped again (ChunkedEnv
  steps the whole batch to the end of a chunk) keeps simulating, and those outputs are meaningless by the
  BatchedEnv contract; the step that ended the episode returned the final observation, which ChunkedEnv
  keeps for bootstrapping before it calls `reset(seed, env_ids)`.
- Domain randomization (`cfg.randomization`), applied at each reset from the nominal model values:
  `friction_scale` (every geom's friction), `mass_scale` (every body's mass and inertia, i.e. density),
  `camera_fov_range` (the free render camera's `vis.global_.fovy`) and `light_scale` (`light_diffuse`).
  There are no objects and the render camera is the free camera, so object pose and camera position
  randomization are not available here (make_env refuses them).

gymnasium and mujoco are imported lazily (`pip install robotft[mujoco]`).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from robotft.config import DomainRandomizationConfig, EnvConfig
from robotft.envs.base import BatchedEnv, Obs
from robotft.optional import require
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

TASKS = ("Hopper-v5", "Walker2d-v5", "HalfCheetah-v5")
CONTROL_MODE = "joint_torque"
_DR_STREAM = 0xD0A1
"""Mixed into the randomization seeds so they never equal gymnasium's own reset seeds."""


class MujocoLocomotionEnv(BatchedEnv):
    """`cfg.num_envs` copies of a gymnasium MuJoCo locomotion task; tensors on `device`.

    `reset(seed)` seeds env i with `seed + i` (its initial-state noise and its randomization draws), so a
    seeded reset followed by the same actions gives identical trajectories.
    """

    def __init__(self, cfg: EnvConfig, device: str | torch.device = "cpu") -> None:
        gym = _import_gymnasium()
        if cfg.task not in TASKS:
            raise ValueError(f"env.task {cfg.task!r}: the mujoco backend runs {list(TASKS)}")
        if cfg.obs_mode != "state" or cfg.reward_mode != "dense":
            raise ValueError(
                f"env.obs_mode {cfg.obs_mode!r} / env.reward_mode {cfg.reward_mode!r}: the mujoco locomotion "
                "tasks have state observations and a dense reward only (obs_mode: state, reward_mode: dense)"
            )
        if cfg.control_mode != CONTROL_MODE:
            raise ValueError(
                f"env.control_mode {cfg.control_mode!r}: the mujoco locomotion tasks are torque-controlled; "
                f"set control_mode: {CONTROL_MODE}"
            )
        kwargs = dict(cfg.kwargs)
        self.success_return: float | None = kwargs.pop("success_return", gym.spec(cfg.task).reward_threshold)
        self.num_envs = cfg.num_envs
        self.device = torch.device(device)
        self.max_episode_steps = cfg.max_episode_steps
        self.randomization = cfg.randomization
        self.envs = [
            gym.make(cfg.task, render_mode="rgb_array", disable_env_checker=True, **kwargs).unwrapped
            for _ in range(cfg.num_envs)
        ]
        """The bare gymnasium MuJoCo envs (no wrappers), stepped directly."""
        self.models = [env.model for env in self.envs]
        """The MuJoCo model of each env (its randomized values are read from here)."""
        self._nominal = [_physical_values(m) for m in self.models]
        self._dr_rngs = [np.random.default_rng([i, _DR_STREAM]) for i in range(self.num_envs)]
        # Per-step bookkeeping in numpy, converted once: a torch op costs more than a numpy op on [B] arrays.
        self._return = np.zeros(self.num_envs)
        self._elapsed = np.zeros(self.num_envs, dtype=np.int64)
        self._threshold = np.inf if self.success_return is None else self.success_return
        space = self.envs[0].action_space
        obs_dim = int(np.prod(self.envs[0].observation_space.shape))
        self._obs = np.zeros((self.num_envs, obs_dim), dtype=np.float32)
        self._reward = np.zeros(self.num_envs, dtype=np.float32)
        self._terminated = np.zeros(self.num_envs, dtype=bool)
        dt = float(self.envs[0].dt)
        if abs(1.0 / dt - cfg.control_hz) > 1e-6:
            warnings.warn(
                f"env.control_hz is {cfg.control_hz} but {cfg.task} runs at {1.0 / dt:g} Hz; the spec records "
                f"{1.0 / dt:g} Hz",
                stacklevel=2,
            )
        self.spec = EnvSpec(
            observations={"state": FeatureSpec("state", (obs_dim,), "float32", unit="mixed", frame="world")},
            action=ActionSpec(
                CONTROL_MODE,
                int(space.shape[0]),
                tuple(float(x) for x in space.low),
                tuple(float(x) for x in space.high),
                control_hz=1.0 / dt,
                frame="joint",
            ),
        )

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        ids = range(self.num_envs) if env_ids is None else [int(i) for i in env_ids]
        for i in ids:
            if seed is not None:
                self._dr_rngs[i] = np.random.default_rng([seed + i, _DR_STREAM])
            _randomize(self.models[i], self._nominal[i], self.randomization, self._dr_rngs[i])
            self._obs[i], _ = self.envs[i].reset(seed=None if seed is None else seed + i)
            self._return[i] = 0.0
            self._elapsed[i] = 0
        return {"state": self._tensor(self._obs.copy())}

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if tuple(action.shape) != (self.num_envs, self.spec.action.dim):
            raise ValueError(
                f"mujoco step: action must be [{self.num_envs}, {self.spec.action.dim}], got {list(action.shape)}"
            )
        actions = action.detach().cpu().numpy()
        for i, env in enumerate(self.envs):
            self._obs[i], self._reward[i], self._terminated[i], _, _ = env.step(actions[i])
        self._return += self._reward
        self._elapsed += 1
        return (
            {"state": self._tensor(self._obs.copy())},
            self._tensor(self._reward.copy()),
            self._tensor(self._terminated.copy()),
            self._tensor(self._elapsed >= self.max_episode_steps),
            {"success": self._tensor(self._return >= self._threshold)},
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def render_rgb(self) -> torch.Tensor | None:
        try:
            frames = [env.render() for env in self.envs]
        except Exception:  # noqa: BLE001 - no OpenGL backend (MUJOCO_GL=egl/osmesa) on this machine
            return None
        return self._tensor(np.stack(frames))

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _import_gymnasium() -> Any:
    require("mujoco", "mujoco", "the mujoco env backend")
    return require("gymnasium", "mujoco", "the mujoco env backend")


def _physical_values(model: Any) -> dict[str, np.ndarray]:
    """Copies of the model arrays that randomization scales, taken before any randomization."""
    return {
        "geom_friction": model.geom_friction.copy(),
        "body_mass": model.body_mass.copy(),
        "body_inertia": model.body_inertia.copy(),
        "light_diffuse": model.light_diffuse.copy(),
        "fovy": np.array(model.vis.global_.fovy),
    }


def _randomize(model: Any, nominal: dict[str, np.ndarray], cfg: DomainRandomizationConfig,
               rng: np.random.Generator) -> None:
    """Write nominal values scaled by fresh draws into `model` (one factor per quantity per episode).

    Always draws the same number of values, so a field's setting never shifts another field's draws."""
    friction, mass, fov, light = (rng.uniform(*r) for r in (
        cfg.friction_scale, cfg.mass_scale, cfg.camera_fov_range, cfg.light_scale))
    model.geom_friction[:] = nominal["geom_friction"] * friction
    # Scaling mass and inertia together keeps each body's shape and mass distribution (a density change).
    model.body_mass[:] = nominal["body_mass"] * mass
    model.body_inertia[:] = nominal["body_inertia"] * mass
    model.light_diffuse[:] = nominal["light_diffuse"] * light
    model.vis.global_.fovy = float(nominal["fovy"] + fov)
