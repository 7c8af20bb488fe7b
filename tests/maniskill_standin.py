"""A batched stand-in for ManiSkill 3.0.1's raw GPU env (`gym.make(task, num_envs=B, sim_backend="physx_cuda")
.unwrapped`), so that robotft's in-process multi-env path runs on a CPU-only machine.

What is copied from ManiSkill's `BaseEnv` (mani_skill/envs/sapien_env.py), line for line in behaviour:
- `reset(seed, options)`: `options["env_idx"]` resets only those envs; a seed (int or list) sets the main
  and episode seeds, and the episode initialisation then runs under `torch.manual_seed(episode_seed[0])` in a
  fork of the torch RNG (sapien_env.py:946-948): the whole reset batch is seeded from the first seed. A seed
  list rebuilds one numpy RNG per env for the main and the episode RNG (`BatchedRNG.from_seeds`), as
  ManiSkill does, so its cost is here too. With no seed the initialisation draws from the global torch RNG.
- `step(action)`: elapsed steps +1, `info` with `success`, `fail`, `elapsed_steps`; `terminated` is
  `success | fail`; `truncated` is always False (the raw env has no time limit: ManiSkill's
  `TimeLimitWrapper` adds it from `elapsed_steps`). No auto-reset: `ManiSkillVectorEnv` does that.
- attributes the adapters read: `num_envs`, `device`, `control_freq`, `single_action_space`,
  `elapsed_steps`, `reconfiguration_freq`, `get_obs(unflattened=True)`, `render()`.
- its tensors live on the sim device: `cuda:<i>` for `sim_backend="physx_cuda:<i>"` (what robotft's adapter
  passes when the run's device is CUDA) on a machine with CUDA, the CPU otherwise, so CPU tests stay on the CPU.

The task is a point pushed to a goal on a plane (2-D position, velocity-free, action = displacement), so a
policy can succeed and fail. Register it with `register()` and build it through `gym.make` as the adapter does.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

ENV_ID = "RobotftStandIn-v1"
ACT_DIM = 2
STEP_SIZE = 0.05
GOAL_RADIUS = 0.05


class BatchedStandInEnv(gym.Env):
    """`num_envs` point-pushing envs in one batch with ManiSkill's raw-env reset/step semantics (module doc)."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, num_envs: int = 1, obs_mode: str = "state", control_mode: str = "pd_ee_delta_pos",
                 reward_mode: str = "dense", sim_backend: str = "physx_cuda", render_mode: str | None = None,
                 render_backend: str | None = None, init: str = "random", **kwargs) -> None:
        """`init`: `random` draws initial states with torch (ManiSkill's tasks); `indexed` makes them a function
        of the env index and its episode count, so two runs with different reset seeding can be compared."""
        if obs_mode != "state":
            raise ValueError(f"the stand-in env has only obs_mode 'state', got {obs_mode!r}")
        self.num_envs = num_envs
        indexed_cuda = sim_backend.startswith("physx_cuda:") and torch.cuda.is_available()
        self.device = torch.device(sim_backend.replace("physx_", "") if indexed_cuda else "cpu")
        self.control_freq = 20.0
        self.reward_mode = reward_mode
        self.reconfiguration_freq = 0
        self.render_mode = render_mode
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (ACT_DIM,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (num_envs, ACT_DIM), np.float32)
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (6,), np.float32)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (num_envs, 6), np.float32)
        self._elapsed_steps = torch.zeros(num_envs, dtype=torch.int32, device=self.device)
        self._pos = torch.zeros(num_envs, 2, device=self.device)
        self._goal = torch.zeros(num_envs, 2, device=self.device)
        self._init = init
        self._episodes = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self._main_seed = None
        self._episode_seed = np.zeros(num_envs, dtype=np.int64)
        self.seeds_received: list = []
        """Every `seed` argument `reset` got, in order (tests read it)."""
        self.reset_batches: list[int] = []
        """How many envs each `reset` call reset."""

    @property
    def elapsed_steps(self) -> torch.Tensor:
        return self._elapsed_steps

    # -- ManiSkill's reset -------------------------------------------------------------------------

    def reset(self, seed=None, options=None):
        options = options or {}
        self.seeds_received.append(seed)
        env_idx = options.get("env_idx", torch.arange(self.num_envs))
        env_idx = torch.as_tensor(env_idx, dtype=torch.long, device=self.device)
        self.reset_batches.append(len(env_idx))
        self._set_main_rng(seed)
        self._set_episode_rng(seed)
        self._elapsed_steps[env_idx] = 0
        if seed is not None:
            with torch.random.fork_rng():
                torch.manual_seed(int(self._episode_seed[0]))
                self._initialize_episode(env_idx)
        else:
            self._initialize_episode(env_idx)
        info = self.get_info()
        return self.get_obs(), info | {"reconfigure": False}

    def _set_main_rng(self, seed) -> None:
        if seed is None:
            if self._main_seed is not None:
                return
            seed = np.random.RandomState().randint(2**31, size=(self.num_envs,))
        if not np.iterable(seed):
            seed = [seed]
        seed = list(seed)
        if len(seed) == 1 and self.num_envs > 1:
            seed = seed + np.random.RandomState(seed[0]).randint(2**31, size=(self.num_envs - 1,)).tolist()
        self._main_seed = seed
        self._main_rngs = [np.random.RandomState(s) for s in seed]  # BatchedRNG.from_seeds: one RNG per env

    def _set_episode_rng(self, seed) -> None:
        if seed is None:
            return
        if not np.iterable(seed):
            seed = [seed]
        episode_seed = np.asarray(seed, dtype=np.int64)
        if len(episode_seed) == 1 and self.num_envs > 1:
            extra = np.random.RandomState(episode_seed[0]).randint(2**31, size=(self.num_envs - 1,))
            episode_seed = np.concatenate((episode_seed, extra))
        self._episode_seed = episode_seed
        self._episode_rngs = [np.random.RandomState(s) for s in episode_seed]

    def _initialize_episode(self, env_idx: torch.Tensor) -> None:
        """The task's initial states, drawn with torch for the reset batch (as ManiSkill's GPU tasks do)."""
        b = len(env_idx)
        self._episodes[env_idx] += 1
        if self._init == "indexed":
            phase = (env_idx * 7 + self._episodes[env_idx] * 3).float()
            self._pos[env_idx] = torch.stack([phase.sin(), phase.cos()], dim=-1) * 0.2
            self._goal[env_idx] = torch.stack([(phase * 1.3).cos(), (phase * 0.7).sin()], dim=-1) * 0.2
            return
        self._pos[env_idx] = torch.rand(b, 2, device=self.device) * 0.4 - 0.2
        self._goal[env_idx] = torch.rand(b, 2, device=self.device) * 0.4 - 0.2

    # -- ManiSkill's step --------------------------------------------------------------------------

    def step(self, action):
        action = torch.as_tensor(action, dtype=torch.float32, device=self.device).reshape(self.num_envs, ACT_DIM)
        self._pos = self._pos + action.clamp(-1, 1) * STEP_SIZE
        self._elapsed_steps += 1
        info = self.get_info()
        dist = (self._goal - self._pos).norm(dim=-1)
        if self.reward_mode == "sparse":
            reward = info["success"].float()
        else:
            reward = 1 - torch.tanh(5 * dist) + info["success"].float()
        terminated = info["success"] | info["fail"]
        return self.get_obs(), reward, terminated, torch.zeros(self.num_envs, dtype=torch.bool, device=self.device), info

    def get_info(self) -> dict:
        dist = (self._goal - self._pos).norm(dim=-1)
        return {
            "success": dist < GOAL_RADIUS,
            "fail": self._pos.abs().max(dim=-1).values > 0.5,
            "elapsed_steps": self._elapsed_steps.clone(),
        }

    def get_obs(self, info=None, unflattened: bool = False):
        tree = {"agent": {"qpos": self._pos.clone()},
                "extra": {"goal_pos": self._goal.clone(), "to_goal": self._goal - self._pos}}
        if unflattened:
            return tree
        return torch.cat([tree["agent"]["qpos"], tree["extra"]["goal_pos"], tree["extra"]["to_goal"]], dim=-1)

    def render(self) -> torch.Tensor:
        """`[B, 16, 16, 3]` uint8: the point white, the goal red."""
        img = torch.zeros(self.num_envs, 16, 16, 3, dtype=torch.uint8, device=self.device)
        rows = torch.arange(self.num_envs, device=self.device)
        for pos, channel in ((self._pos, slice(None)), (self._goal, 0)):
            px = ((pos + 0.5) * 16).long().clamp(0, 15)
            img[rows, px[:, 1], px[:, 0], channel] = 255
        return img

    def close(self) -> None:
        pass


def register() -> str:
    """Register the stand-in with gymnasium (idempotent); returns its env id."""
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point=BatchedStandInEnv, disable_env_checker=True, order_enforce=False)
    return ENV_ID
