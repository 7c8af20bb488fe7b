"""Adapter overhead: env steps/s of each robotft adapter next to its raw simulator, in the same run.

    python scripts/bench_env_overhead.py [--seconds 2] [--rounds 3] [--many 16] [--skip maniskill,robosuite]

"raw" steps the very simulator objects the adapter built (gymnasium's unwrapped MuJoCo env, ManiSkill's
unwrapped env, robosuite's env) directly with numpy/torch actions, one after the other in this process:
the cost of the simulation alone. "adapter" steps the BatchedEnv with a `[B, act_dim]` torch action.
ratio = raw steps/s / adapter steps/s (target <= 1.1). Where the adapter runs one env per worker
process (ManiSkill and robosuite on CPU with B > 1), the raw column is still sequential, so a ratio below
1 is the workers' parallel speedup net of their pipe overhead. In-process cases are timed in this process's
CPU time (`cpu` clock), which other processes' load on a shared machine barely moves; cases with worker
processes need wall-clock time (`wall`). Rounds alternate raw and adapter and the best round of each counts.
B = many: MuJoCo only (SyncVectorEnv); ManiSkill's many-env backend needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from robotft.config import EnvConfig, load_env_config

ROWS: list[tuple[str, int, str, float, float]] = []
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def steps_per_second(step: Callable[[], None], batch: int, seconds: float, clock: Callable[[], float]) -> float:
    """Call `step` (advancing `batch` envs) for about `seconds` of `clock` after a short warm-up."""
    for _ in range(3):
        step()
    n, start = 0, clock()
    while clock() - start < seconds:
        step()
        n += 1
    return n * batch / (clock() - start)


def compare(name: str, batch: int, raw: Callable[[], None], adapter: Callable[[], None], seconds: float,
            rounds: int, clock: str = "cpu") -> None:
    raw_best = adapter_best = 0.0
    for _ in range(rounds):
        raw_best = max(raw_best, steps_per_second(raw, batch, seconds, CLOCKS[clock]))
        adapter_best = max(adapter_best, steps_per_second(adapter, batch, seconds, CLOCKS[clock]))
    ROWS.append((name, batch, clock, raw_best, adapter_best))
    print(f"{name:<22} B={batch:<4d} ({clock}) raw {raw_best:>9,.0f}  adapter {adapter_best:>9,.0f} steps/s  "
          f"ratio {raw_best / adapter_best:.2f}", flush=True)


def bench_mujoco(batches: list[int], seconds: float, rounds: int) -> None:
    from robotft.envs.mujoco_locomotion import MujocoLocomotionEnv

    # No termination, no time limit inside the measurement: resets would cost more than steps.
    base = dataclasses.replace(load_env_config("mujoco/hopper"), max_episode_steps=10**9,
                               kwargs={"terminate_when_unhealthy": False})
    for b in batches:
        env = MujocoLocomotionEnv(dataclasses.replace(base, num_envs=b))
        env.reset(seed=0)
        raw_envs = env.envs
        action = torch.zeros(b, 3)
        action_np = np.zeros(3, dtype=np.float32)

        def raw_step(envs=raw_envs, a=action_np) -> None:
            for e in envs:
                e.step(a)

        compare("mujoco Hopper-v5", b, raw_step, lambda env=env, a=action: env.step(a), seconds, rounds)
        env.close()


def bench_maniskill(batches: list[int], seconds: float, rounds: int) -> None:
    from robotft.envs.maniskill import ManiSkillEnv, _RawManiSkill

    cfg = EnvConfig(type="maniskill", task="PushCube-v1", sim_backend="physx_cpu", max_episode_steps=10**9)
    raw_envs = []
    for b in batches:
        while len(raw_envs) < b:
            raw_envs.append(_RawManiSkill(cfg, "physx_cpu", "cpu")._env)
            raw_envs[-1].reset(seed=len(raw_envs))
        action, batch_action = torch.zeros(1, 7), torch.zeros(b, 7)

        def raw_step(envs=raw_envs[:b], a=action) -> None:
            for e in envs:
                e.step(a)

        with ManiSkillEnv(dataclasses.replace(cfg, num_envs=b)) as env:
            env.reset(seed=0)
            compare("maniskill PushCube-v1", b, raw_step, lambda env=env, a=batch_action: env.step(a),
                    seconds, rounds, "cpu" if b == 1 else "wall")
    for e in raw_envs:
        e.close()


def bench_robosuite(batches: list[int], seconds: float, rounds: int) -> None:
    from robotft.envs.robosuite import RobosuiteEnv, _SingleRobosuite

    cfg = dataclasses.replace(load_env_config("robosuite/lift"), max_episode_steps=10**9)
    raw_envs = []
    for b in batches:
        while len(raw_envs) < b:
            raw_envs.append(_SingleRobosuite(cfg, "cpu")._env)
            raw_envs[-1].reset()
        action, batch_action = np.zeros(7), torch.zeros(b, 7)

        def raw_step(envs=raw_envs[:b], a=action) -> None:
            for e in envs:
                e.step(a)

        with RobosuiteEnv(dataclasses.replace(cfg, num_envs=b)) as env:
            env.reset(seed=0)
            compare("robosuite Lift", b, raw_step, lambda env=env, a=batch_action: env.step(a), seconds, rounds,
                    "cpu" if b == 1 else "wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measurement time per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating raw/adapter rounds; the best counts")
    parser.add_argument("--many", type=int, default=16, help="the 'many envs' batch size (MuJoCo)")
    parser.add_argument("--skip", default="", help="comma-separated: mujoco, maniskill, robosuite")
    args = parser.parse_args()
    torch.set_num_threads(1)
    skip = set(filter(None, args.skip.split(",")))
    if "mujoco" not in skip:
        bench_mujoco([1, 2, args.many], args.seconds, args.rounds)
    if "maniskill" not in skip:
        bench_maniskill([1, 2], args.seconds, args.rounds)
    if "robosuite" not in skip:
        bench_robosuite([1, 2], args.seconds, args.rounds)
    print("\n| adapter | envs | clock | raw steps/s | adapter steps/s | raw / adapter |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for name, b, clock, raw, adapter in ROWS:
        print(f"| {name} | {b} | {clock} | {raw:,.0f} | {adapter:,.0f} | {raw / adapter:.2f} |")


if __name__ == "__main__":
    main()
