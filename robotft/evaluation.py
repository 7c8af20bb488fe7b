"""Evaluation: N episodes of a policy in a ChunkedEnv, success rate with a 95% confidence interval.

The same function evaluates during BC pretraining, during RL fine-tuning and in `robotft eval`, always
through `policy.predict_chunk(obs, deterministic=True)`: the training rollout's sampling path with
exploration noise off. A checkpoint therefore evaluates the same everywhere, with no extra flags.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from robotft.envs.base import Obs
from robotft.envs.chunked import ChunkedEnv

EVAL_SEED = 1_000_000
"""Seed of the evaluation start states shared by `pretrain`, `finetune` and `robotft eval` (by default), so
their success rates are measured on the same episodes and compare."""


@dataclass
class EvalResult:
    """Outcome of an evaluation run."""

    success_rate: float
    ci95: tuple[float, float]
    """Wilson score interval of the success rate at 95%."""
    episodes: int
    mean_return: float
    mean_length: float
    """Mean episode length in env steps."""
    seconds: float
    env_steps: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927): well-behaved at 0% and 100%."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z**2 / n
    center = (p + z**2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


@torch.no_grad()
def evaluate(
    act: Callable[[Obs], torch.Tensor],
    env: ChunkedEnv,
    episodes: int,
    seed: int = 0,
    video_path: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Run `episodes` episodes. `act(obs) -> [B, H, act_dim]`. Each env runs an equal share of the
    episodes (so short episodes do not crowd out long ones); the first `episodes` results count."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    b = env.num_envs
    quota = math.ceil(episodes / b)
    per_env: list[list[tuple[bool, float, int]]] = [[] for _ in range(b)]
    frames: list[np.ndarray] = []
    t0 = time.perf_counter()
    env_steps = 0
    obs = env.reset(seed=seed)
    while min(len(r) for r in per_env) < quota:
        obs, _, _, _, info = env.step(act(obs))
        env_steps += int(info["steps"])
        if video_path is not None and len(per_env[0]) < quota:
            frame = env.render_rgb()
            if frame is not None:
                frames.append(frame[0].cpu().numpy())
        done = info["done"].cpu()
        for i in torch.nonzero(done).flatten().tolist():
            if len(per_env[i]) < quota:
                per_env[i].append(
                    (bool(info["success"][i]), float(info["episode_return"][i]), int(info["episode_length"][i]))
                )
                if progress is not None:
                    progress(1)
    results = [r for env_results in zip(*per_env, strict=False) for r in env_results][:episodes]
    successes = sum(r[0] for r in results)
    if video_path is not None and frames:
        import imageio

        Path(video_path).parent.mkdir(parents=True, exist_ok=True)
        imageio.mimsave(str(video_path), frames, fps=10)
    return EvalResult(
        success_rate=successes / len(results),
        ci95=wilson_interval(successes, len(results)),
        episodes=len(results),
        mean_return=float(np.mean([r[1] for r in results])),
        mean_length=float(np.mean([r[2] for r in results])),
        seconds=time.perf_counter() - t0,
        env_steps=env_steps,
    )
