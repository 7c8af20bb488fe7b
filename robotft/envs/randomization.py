"""Simulator-agnostic domain randomization: observation noise, action noise and action latency.

A real rig's sensors are noisy, its actuators do not execute exactly what was commanded, and commands
arrive late (inference, network, controller queues). `RandomizedEnv` reproduces these around any
BatchedEnv, per `DomainRandomizationConfig` (Peng et al. 2018, arXiv 1710.06537, randomize latency and
observation noise this way; Tan et al. 2018, arXiv 1804.10332, show latency matters most for transfer).
Physical randomization (friction, mass, poses, cameras, light) lives in each adapter.
"""

from __future__ import annotations

import torch

from robotft.config import DomainRandomizationConfig
from robotft.envs.base import BatchedEnv, Obs

_IMAGE_PREFIXES = ("rgb/", "depth/")


class RandomizedEnv(BatchedEnv):
    """`env` with the generic parts of `cfg` applied; everything else passes through unchanged.

    - Action latency: at each reset env i draws k_i uniformly from `action_latency_steps`; the action
      the simulator executes at step t is the one commanded at step t - k_i, and for the first k_i steps
      of an episode it is the midpoint of the action bounds.
    - Action noise: N(0, action_noise_std²) added to the executed action, which is then clipped to the
      action bounds.
    - Observation noise: N(0, obs_noise_std²) added to every floating-point observation except images.

    Draws come from one generator that `reset(seed)` reseeds, so seeded runs are reproducible.
    """

    def __init__(self, env: BatchedEnv, cfg: DomainRandomizationConfig) -> None:
        if env.spec.action is None:
            raise ValueError(f"{type(env).__name__} declares no action spec; RandomizedEnv needs its bounds")
        self.env = env
        self.cfg = cfg
        self.num_envs = env.num_envs
        self.device = env.device
        self.spec = env.spec
        self.max_episode_steps = env.max_episode_steps
        self._low = torch.tensor(env.spec.action.low, dtype=torch.float32, device=self.device)
        self._high = torch.tensor(env.spec.action.high, dtype=torch.float32, device=self.device)
        self._generator = torch.Generator().manual_seed(0)
        self._latency = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        # Commanded actions, newest first: _queue[:, k] is the action commanded k steps ago.
        self._queue = self._neutral().repeat(self.num_envs, cfg.action_latency_steps[1] + 1, 1)
        self._obs: Obs = {}

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        if env_ids is not None and not self._obs:
            raise RuntimeError("RandomizedEnv: reset all envs (env_ids=None) before a partial reset")
        if seed is not None:
            self._generator.manual_seed(seed)
        ids = torch.arange(self.num_envs, device=self.device) if env_ids is None else env_ids.to(self.device)
        lo, hi = self.cfg.action_latency_steps
        self._latency[ids] = torch.randint(lo, hi + 1, (len(ids),), generator=self._generator).to(self.device)
        self._queue[ids] = self._neutral()
        fresh = self._noisy(self.env.reset(seed=seed, env_ids=env_ids))
        if env_ids is None:
            self._obs = fresh
        else:
            for k, v in fresh.items():
                self._obs[k][ids] = v[ids]
        return {k: v.clone() for k, v in self._obs.items()}

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        self._queue = torch.cat([action.to(self.device, torch.float32).unsqueeze(1), self._queue[:, :-1]], dim=1)
        executed = self._queue[torch.arange(self.num_envs, device=self.device), self._latency]
        if self.cfg.action_noise_std > 0:
            executed = executed + self._randn(executed.shape) * self.cfg.action_noise_std
            executed = torch.maximum(torch.minimum(executed, self._high), self._low)
        obs, reward, terminated, truncated, info = self.env.step(executed)
        self._obs = self._noisy(obs)
        return {k: v.clone() for k, v in self._obs.items()}, reward, terminated, truncated, info

    def render_rgb(self) -> torch.Tensor | None:
        return self.env.render_rgb()

    def close(self) -> None:
        self.env.close()

    def _neutral(self) -> torch.Tensor:
        """`[1, 1, act_dim]` midpoint of the action bounds: zero for the usual symmetric bounds."""
        return ((self._low + self._high) / 2).view(1, 1, -1)

    def _randn(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=self._generator).to(self.device)

    def _noisy(self, obs: Obs) -> Obs:
        if self.cfg.obs_noise_std <= 0:  # copies: in-place partial resets must not write into the sim's buffers
            return {k: v.clone() for k, v in obs.items()}
        return {
            k: v + self._randn(v.shape) * self.cfg.obs_noise_std
            if v.is_floating_point() and not k.startswith(_IMAGE_PREFIXES) else v
            for k, v in obs.items()
        }
