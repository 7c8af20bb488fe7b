"""Rollout throughput (env steps/s) on ManiSkill PushCube (CPU sim) with 1, 2 and 4 workers: in-process
worker processes vs Ray actors, measured in the same run.

    python scripts/bench_rollout_scaling.py [--workers 1 2 4] [--chunks 25] [--out bench_rollout_scaling.json]

Each case runs the PPO core's `collect` (policy inference, values, env steps) with a Gaussian MLP policy of
random weights (throughput does not depend on them): in-process, `env.num_envs = N` ManiSkill worker
processes stepped over pipes by the learner (N = 1 simulates in the learner's process); Ray, N actors of one
env each, every one running the policy on its own env (robotft.rl.rollout). One warm-up rollout (env
creation, first reset) is excluded; the next `--repeats` rollouts of `--chunks` chunks per env are timed.
Prints a table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from robotft.config import EnvConfig, find_preset, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.finetune import FinetuneConfig, make_algorithm, make_critic
from robotft.policies.base import build_policy, policy_config_class
from robotft.rl.ppo import PPO, PPOConfig
from robotft.rl.rollout import RayCollector, RolloutConfig, worker_setup

ENV = EnvConfig(type="maniskill", task="PushCube-v1", sim_backend="physx_cpu", control_mode="pd_ee_delta_pose",
                reward_mode="sparse", max_episode_steps=100)


def learner(chunks: int) -> tuple[FinetuneConfig, PPO]:
    """A Gaussian-MLP PPO learner for PushCube with a normalizer over plausible state and action ranges."""
    env = make_env(ENV)
    spec = env.spec
    env.close()
    data = load_yaml(find_preset("policies", "gaussian_mlp"))
    policy_cfg = from_dict(policy_config_class(data["type"]), data)
    rng = np.random.default_rng(0)
    state_dim, act_dim = spec.observations["state"].shape[0], spec.action.dim
    normalizer = Normalizer.fit({"state": rng.normal(size=(256, state_dim)),
                                 "action": rng.uniform(-1, 1, size=(256, act_dim))},
                                {"state": "minmax", "action": "minmax"})
    policy = build_policy(policy_cfg, spec, normalizer)
    cfg = FinetuneConfig(algo="ppo", env=ENV, rl=PPOConfig(steps_per_iter=chunks), device="cpu")
    algo = make_algorithm(cfg.algo, policy, cfg)
    return cfg, PPO(algo, make_critic(policy, spec, normalizer, cfg, algo), None, cfg.rl, device="cpu")


def timed(collect, repeats: int) -> float:
    """Env steps/s over `repeats` rollouts after one warm-up rollout."""
    collect()
    steps, seconds = 0, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, _, stats = collect()
        seconds += time.perf_counter() - t0
        steps += stats.env_steps
    return steps / seconds


def bench_inprocess(cfg: FinetuneConfig, ppo: PPO, workers: int, repeats: int) -> float:
    env = make_env(dataclasses.replace(ENV, num_envs=workers))
    try:
        policy_cfg = ppo.algo.policy.config
        local = PPO(ppo.algo, ppo.critic, ChunkedEnv.for_policy(env, policy_cfg), cfg.rl)
        return timed(local.collect, repeats)
    finally:
        env.close()


def bench_ray(cfg: FinetuneConfig, ppo: PPO, workers: int, repeats: int) -> float:
    rollout = RolloutConfig(backend="ray", num_workers=workers, envs_per_worker=1, cpus_per_worker=1.0)
    cfg = dataclasses.replace(cfg, rollout=rollout)
    policy = ppo.algo.policy
    collector = RayCollector(rollout, worker_setup(cfg, policy.config, policy.spec, policy.normalizer), seed=0)
    try:
        return timed(lambda: collector.collect(ppo), repeats)
    finally:
        collector.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunks", type=int, default=25, help="chunks per env per rollout (4 env steps each)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rollouts per case")
    parser.add_argument("--out", default="bench_rollout_scaling.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import ray

    # Ray may schedule more actors than this machine has cores: the case with 4 workers must start on 2.
    ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
    cfg, ppo = learner(args.chunks)
    rows = []
    for n in args.workers:
        for backend, bench in (("inprocess", bench_inprocess), ("ray", bench_ray)):
            sps = bench(cfg, ppo, n, args.repeats)
            rows.append({"workers": n, "backend": backend, "env_steps_per_s": sps})
            print(f"{backend:>9s}  workers={n}  {sps:8.1f} env steps/s", flush=True)
    ray.shutdown()
    base = {r["backend"]: r["env_steps_per_s"] for r in rows if r["workers"] == args.workers[0]}
    print(f"\nPushCube-v1 state, CPU sim, {args.chunks} chunks x 4 steps per env per rollout, {args.repeats} rollouts")
    print(f"{'workers':>7s} | {'in-process steps/s':>20s} | {'Ray steps/s':>20s} | {'Ray / in-process':>16s}")
    for n in args.workers:
        by = {r["backend"]: r["env_steps_per_s"] for r in rows if r["workers"] == n}
        cells = [f"{by[b]:.1f} (x{by[b] / base[b]:.2f})" for b in ("inprocess", "ray")]
        print(f"{n:>7d} | {cells[0]:>20s} | {cells[1]:>20s} | {by['ray'] / by['inprocess']:>16.2f}")
    result = {"task": ENV.task, "chunks": args.chunks, "repeats": args.repeats, "machine": platform.node(),
              "cpus": os.cpu_count(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
