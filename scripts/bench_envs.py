"""Env throughput in env steps/s: the toy suite at several batch sizes, ManiSkill raw vs adapter.

    python scripts/bench_envs.py [--seconds 3] [--skip-maniskill]

The adapter overhead ratio is raw single-env steps/s divided by adapter (one env) steps/s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from robotft.config import EnvConfig
from robotft.envs.toy import ToyNavEnv


def steps_per_second(step: Callable[[], None], batch: int, seconds: float) -> float:
    """Call `step` (advancing `batch` envs) for about `seconds`, after a short warm-up."""
    for _ in range(3):
        step()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        n += 1
    return n * batch / (time.perf_counter() - start)


def bench_toy(seconds: float) -> None:
    for batch in (1, 64, 1024):
        env = ToyNavEnv(batch)
        env.reset(seed=0)
        action = torch.rand(batch, 2) * 2 - 1
        sps = steps_per_second(lambda e=env, a=action: e.step(a), batch, seconds)
        print(f"toy nav2d          B={batch:<5d} {sps:>12,.0f} steps/s")


def bench_maniskill(seconds: float) -> None:
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks

    from robotft.envs.maniskill import ManiSkillEnv

    # The episode limit is set high so no truncation happens inside the measurement.
    cfg = EnvConfig(type="maniskill", task="PushCube-v1", sim_backend="physx_cpu", max_episode_steps=10**9)
    action = torch.zeros(1, 7)

    raw = gym.make(
        cfg.task,
        num_envs=1,
        obs_mode=cfg.obs_mode,
        control_mode=cfg.control_mode,
        reward_mode=cfg.reward_mode,
        sim_backend="physx_cpu",
    ).unwrapped
    raw.reset(seed=0)
    raw_sps = steps_per_second(lambda: raw.step(action), 1, seconds)
    raw.close()
    print(f"maniskill raw      B=1     {raw_sps:>12,.0f} steps/s")

    with ManiSkillEnv(cfg) as env:
        env.reset(seed=0)
        one = steps_per_second(lambda: env.step(action), 1, seconds)
    print(f"maniskill adapter  B=1     {one:>12,.0f} steps/s  (raw / adapter = {raw_sps / one:.2f})")

    with ManiSkillEnv(EnvConfig(**{**cfg.__dict__, "num_envs": 2})) as env:
        env.reset(seed=0)
        two = steps_per_second(lambda: env.step(action.expand(2, -1)), 2, seconds)
    print(f"maniskill workers  B=2     {two:>12,.0f} steps/s  (x{two / one:.2f} over one env)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement time per case")
    parser.add_argument("--skip-maniskill", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_toy(args.seconds)
    if not args.skip_maniskill:
        bench_maniskill(args.seconds)


if __name__ == "__main__":
    main()
