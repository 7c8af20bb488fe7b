"""Record episodes of a scripted expert (or any policy with the same interface) into a dataset."""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import torch

from robotft.datasets.store import DatasetWriter
from robotft.envs.base import BatchedEnv, Obs
from robotft.runlog import progress_bar
from robotft.specs import EnvSpec, FeatureSpec


class Expert(Protocol):
    """A batched controller: told when envs reset, then asked for one action per env per step."""

    def reset(self, env_ids: torch.Tensor, obs: Obs) -> None:
        """Envs `env_ids` (long tensor) were just reset; `obs` holds the observations of all envs."""

    def __call__(self, obs: Obs) -> torch.Tensor:
        """Actions `[B, act_dim]` for all envs, in env units."""


def rollout_features(spec: EnvSpec) -> dict[str, FeatureSpec]:
    """The features `record_rollouts` writes for an env: its observations, `action`, `reward`, `success`."""
    if spec.action is None:
        raise ValueError("rollout_features: the env spec has no action spec")
    return {
        **spec.observations,
        "action": FeatureSpec("action", (spec.action.dim,), "float32", unit="env", frame=spec.action.frame),
        "reward": FeatureSpec("reward", (), "float32"),
        "success": FeatureSpec("success", (), "bool"),
    }


def record_rollouts(
    env: BatchedEnv,
    expert: Expert,
    n_episodes: int,
    writer: DatasetWriter,
    seed: int = 0,
    only_success: bool = True,
    task: str = "",
    progress: bool = True,
    max_attempts: int | None = None,
) -> dict[str, Any]:
    """Run `expert` in `env` until `n_episodes` episodes are written to `writer` (not finalized here).

    Each episode stores, per step t: the observation before the action (every key of
    `env.spec.observations`), `action`, `reward` (float32) and `success` (bool). An episode counts as
    successful when `info["success"]` is true at its last step. With `only_success`, failed episodes
    are dropped. Gives up after `max_attempts` finished episodes (default `10 * n_episodes`).
    Reset seeds never repeat: reset call k seeds env i with `seed + k * num_envs + i`.

    Returns `{"attempted", "kept", "success_rate", "seconds"}`.
    """
    if n_episodes < 1:
        raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
    max_attempts = 10 * n_episodes if max_attempts is None else max_attempts
    obs_keys = list(env.spec.observations)
    n = env.num_envs
    t0 = time.perf_counter()
    attempted = successes = kept = 0
    resets = 0
    # Per env, the steps of the episode in progress: list of per-step dicts of numpy values.
    steps: list[list[dict[str, np.ndarray]]] = [[] for _ in range(n)]
    all_ids = torch.arange(n, device=env.device)
    obs = env.reset(seed=seed)
    expert.reset(all_ids, obs)
    bar = progress_bar(total=n_episodes, desc="recording", unit="episode", disable=not progress)
    try:
        while kept < n_episodes and attempted < max_attempts:
            action = expert(obs)
            if action.shape != (n, writer.features["action"].shape[0]):
                raise ValueError(
                    f"expert returned actions of shape {tuple(action.shape)}, expected "
                    f"({n}, {writer.features['action'].shape[0]})"
                )
            obs_np = {k: obs[k].detach().cpu().numpy() for k in obs_keys}
            obs, reward, terminated, truncated, info = env.step(action)
            act_np = action.detach().cpu().numpy()
            rew_np = reward.detach().cpu().numpy()
            succ_np = info["success"].detach().cpu().numpy()
            for i in range(n):
                step = {k: obs_np[k][i] for k in obs_keys}
                step.update(action=act_np[i], reward=rew_np[i], success=succ_np[i])
                steps[i].append(step)
            done = (terminated | truncated).detach().cpu().numpy()
            if not done.any():
                continue
            for i in np.flatnonzero(done):
                episode, steps[i] = steps[i], []
                attempted += 1
                success = bool(episode[-1]["success"])
                successes += success
                if kept < n_episodes and (success or not only_success):
                    writer.add_episode(_stack(episode), task=task)
                    kept += 1
                    bar.update(1)
            done_ids = torch.as_tensor(np.flatnonzero(done), device=env.device)
            resets += 1
            obs = env.reset(seed=seed + resets * n, env_ids=done_ids)
            expert.reset(done_ids, obs)
    finally:
        bar.close()
    return {
        "attempted": attempted,
        "kept": kept,
        "success_rate": successes / attempted if attempted else 0.0,
        "seconds": time.perf_counter() - t0,
    }


def _stack(episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """List of per-step dicts → dict of `[T, ...]` arrays."""
    return {k: np.stack([s[k] for s in episode]) for k in episode[0]}
