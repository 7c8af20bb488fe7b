"""CPU speed of a DPPO fine-tuning iteration on ManiSkill PushCube with CPU worker envs: before / after, one run.

Both configurations fine-tune the same diffusion BC checkpoint (20-step DDPM, made here from motion-planned
demos) with the same envs, seed and rollout size; they differ only in what this script names:

  before  the older configuration: DPPO samples the 20-step DDPM chain and fine-tunes its last 10 steps,
          `DPPO.act` re-runs the network over the chain it sampled to score it (the older code path, restored
          here by a patch), one worker process per env (`--env.worker_processes` = num_envs) and one worker
          round trip per env step, the update on one thread (`--update_threads 1`), evaluation every 5
          iterations with DDPM's own posterior noise (`deterministic_sampler: model_std`).
  after   DDIM with 5 steps (the same network; `--policy.sampler ddim --policy.ddim_steps 5`), all 5 fine-tuned,
          log-probabilities from the sampling pass, the default worker processes (one per core) with one round
          trip per chunk, the update on every core (the default), evaluation before and after only, with the
          deterministic DDIM η = 0 chain from x_K = 0.

Both run with the workers' inference mode (it lives in the spawned worker processes, out of a patch's reach),
which makes `before` faster than the older code was: the measured speed-up is a lower bound.

Prints, and writes to `<out>/bench_finetune_speed.json`: per configuration the seconds per iteration (rollout
+ update, from the run's own log), the wall seconds per iteration including its evaluations, and the success
rate of the final checkpoint over `--final-episodes` seeded episodes (Wilson 95% CI) with the configuration's
own evaluation; and the ratios.

    python scripts/bench_finetune_speed.py --out runs/bench_speed                    # default budget
    python scripts/bench_finetune_speed.py --out /tmp/speed --demos 4 --bc-steps 20 --iterations 1 \\
        --final-episodes 2                                                         # smoke run of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

CONFIGS = {
    "before": dict(policy={"sampler": "ddpm", "deterministic_sampler": "model_std"}, ft_denoising_steps=10,
                   eval_every=5, one_process_per_env=True, update_threads=1, legacy=True),
    "after": dict(policy={"sampler": "ddim", "ddim_steps": "5", "deterministic_sampler": "ddim_eta0"},
                  ft_denoising_steps=5, eval_every=0, one_process_per_env=False, update_threads=0, legacy=False),
}
"""Configuration name → policy overrides at fine-tuning, DPPO's fine-tuned steps, evaluation period (0: before
and after only), whether each env gets its own worker process, the update's threads (0: every core) and whether
the older code paths (re-scoring in act, per-step worker messages) are restored."""


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_finetune_speed")
    p.add_argument("--env", default="maniskill/push_cube")
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--bc-steps", type=int, default=2000)
    p.add_argument("--num-envs", type=int, default=4, help="CPU worker envs")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--steps-per-iter", type=int, default=25)
    p.add_argument("--eval-episodes", type=int, default=20, help="episodes of each evaluation during a run")
    p.add_argument("--final-episodes", type=int, default=100, help="episodes to score each final checkpoint")
    p.add_argument("--configs", default="before,after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-only", action="store_true",
                   help="only time the policy's side of an iteration (act per chunk, one update) on recorded-size "
                        "inputs, without simulating: the part of the iteration these changes act on")
    return p.parse_args()


def _bc(args: argparse.Namespace, out: Path, stages: dict) -> Path:
    """Motion-planned demos and a diffusion BC (20-step DDPM preset), through the CLI; reused when present."""
    from bench_pipeline import run_stage

    demos, bc = out / "demos.zarr", out / "diffusion_bc"
    if not demos.exists():
        run_stage("generate", ["data", "generate", "--env", args.env, "--episodes", str(args.demos), "--out",
                               str(demos), "--seed", "0"], stages)
    if not (bc / "checkpoint").exists():
        run_stage("pretrain", ["pretrain", "--env", args.env, "--data", str(demos), "--policy", "diffusion_mlp",
                               "--steps", str(args.bc_steps), "--out", str(bc), "--train.eval_episodes", "0",
                               "--train.device", "cpu"], stages)
    return bc


class _Legacy:
    """The older code paths, restored for the `before` run: `DPPO.act` re-scores its chain with a second
    network pass, and `ChunkedEnv` steps CPU workers one message per env step."""

    def __enter__(self):
        from robotft.envs.chunked import ChunkedEnv
        from robotft.rl.algorithm import ActOutput
        from robotft.rl.dppo import DPPO

        self._act, self._chunk_step = DPPO.act, ChunkedEnv._step_chunk

        def act(algo, obs, deterministic=False):
            chain = algo.policy.sample_chain(obs, min_std=algo.cfg.min_sampling_std, deterministic=deterministic)
            sample = {"chain": chain.latents}
            import torch

            with torch.no_grad():
                logprob = algo.logprob(obs, sample)
            return ActOutput(actions=chain.actions, sample=sample, logprob=logprob)

        def step_chunk(env, chunk):
            return [env.env.step(chunk[:, t]) for t in range(env.act_steps)]

        DPPO.act, ChunkedEnv._step_chunk = act, step_chunk
        return self

    def __exit__(self, *exc):
        from robotft.envs.chunked import ChunkedEnv
        from robotft.rl.dppo import DPPO

        DPPO.act, ChunkedEnv._step_chunk = self._act, self._chunk_step


def _finetune(args: argparse.Namespace, name: str, bc: Path, run: Path) -> dict:
    import contextlib

    from robotft.finetune import FinetuneConfig, run_finetune
    from robotft.rl.dppo import DPPOConfig
    from robotft.rl.ppo import PPOConfig
    from robotft.runlog import read_metrics

    spec = CONFIGS[name]
    cfg = FinetuneConfig(source=str(bc), out=str(run), algo="dppo", seed=args.seed, device="cpu",
                         eval_episodes=args.eval_episodes,
                         eval_every=spec["eval_every"] or args.iterations,
                         save_every=args.iterations, update_threads=spec["update_threads"],
                         rl=PPOConfig(iterations=args.iterations, steps_per_iter=args.steps_per_iter),
                         dppo=DPPOConfig(ft_denoising_steps=spec["ft_denoising_steps"]))
    from robotft.checkpoint import read_checkpoint

    env = read_checkpoint(bc).env_config()
    processes = args.num_envs if spec["one_process_per_env"] else 0
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(env, num_envs=args.num_envs, sim_backend="physx_cpu",
                                                           worker_processes=processes))
    t0 = time.perf_counter()
    with _Legacy() if spec["legacy"] else contextlib.nullcontext():
        run_finetune(cfg, policy_overrides=spec["policy"])
    total = time.perf_counter() - t0
    rows = [r for r in read_metrics(run) if "train/update_seconds" in r]
    cumulative = [0] + [r["train/env_steps"] for r in rows]
    # rollout seconds = the iteration's env steps / its env steps per second
    iteration = [(cumulative[i + 1] - cumulative[i]) / r["train/env_steps_per_s"] + r["train/update_seconds"]
                 for i, r in enumerate(rows)]
    update = [r["train/update_seconds"] for r in rows]
    return {
        "iteration_seconds": sum(iteration) / len(iteration),
        "update_seconds": sum(update) / len(update),
        "wall_seconds_per_iteration": rows[-1]["train/wall_seconds"] / len(rows),
        "run_seconds": total,
    }


def _policy_side(args: argparse.Namespace, name: str, bc: Path) -> dict:
    """Seconds of `DPPO.act` per chunk for `num_envs` envs and of one PPO update over a rollout of
    `steps_per_iter` chunks, with the configuration's sampler, on one thread; no simulator."""
    import contextlib

    import torch

    from robotft.checkpoint import load_policy
    from robotft.config import apply_overrides
    from robotft.finetune import FinetuneConfig, make_algorithm, make_critic
    from robotft.policies.base import build_policy
    from robotft.rl.buffer import RolloutBuffer
    from robotft.rl.dppo import DPPOConfig
    from robotft.rl.ppo import PPO, PPOConfig
    from robotft.threads import torch_threads, update_threads

    torch.set_num_threads(1)
    spec_ = CONFIGS[name]
    base, ckpt = load_policy(bc)
    policy = build_policy(apply_overrides(base.config, spec_["policy"], prefix="policy."), ckpt.spec, ckpt.normalizer)
    policy.load_state_dict(base.state_dict())
    cfg = FinetuneConfig(algo="dppo", rl=PPOConfig(steps_per_iter=args.steps_per_iter, critic_warmup_iters=0,
                                                  target_kl=0.0),
                         dppo=DPPOConfig(ft_denoising_steps=spec_["ft_denoising_steps"]))
    algo = make_algorithm("dppo", policy, cfg)
    critic = make_critic(policy, ckpt.spec, ckpt.normalizer, cfg, algo)
    ppo = PPO(algo, critic, None, cfg.rl, device="cpu")
    dim = ckpt.spec.observations["state"].shape[0]
    obs = {"state": torch.randn(args.num_envs, policy.config.obs_steps, dim) * 0.1}
    buf = RolloutBuffer(args.steps_per_iter, args.num_envs, "cpu")
    policy.eval()
    with _Legacy() if spec_["legacy"] else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(args.steps_per_iter):
            with torch.no_grad():
                out = algo.act(obs)
                buf.add(obs, out.sample, out.logprob, critic(obs), torch.zeros(args.num_envs),
                        torch.zeros(args.num_envs, dtype=torch.bool))
        act_s = (time.perf_counter() - t0) / args.steps_per_iter
        t0 = time.perf_counter()
        with torch_threads(update_threads(spec_["update_threads"])):
            ppo.update(buf, torch.zeros(args.num_envs))
        update_s = time.perf_counter() - t0
    return {"act_seconds_per_chunk": act_s, "update_seconds": update_s}


def _final_success(args: argparse.Namespace, name: str, run: Path) -> dict:
    """The final checkpoint over `final_episodes` seeded episodes, evaluated as the configuration evaluates."""
    from robotft.checkpoint import load_policy
    from robotft.envs.chunked import ChunkedEnv
    from robotft.envs.factory import make_env
    from robotft.evaluation import evaluate

    policy, ckpt = load_policy(run)
    env_cfg = ckpt.env_config()
    env = make_env(dataclasses.replace(env_cfg, num_envs=args.num_envs, sim_backend="physx_cpu"))
    try:
        chunked = ChunkedEnv.for_policy(env, policy.config)
        with _Legacy() if CONFIGS[name]["legacy"] else _nothing():
            result = evaluate(lambda o: policy.predict_chunk(o, deterministic=True), chunked, args.final_episodes,
                              seed=12_345)
    finally:
        env.close()
    return {"success_rate": result.success_rate, "ci95": list(result.ci95), "episodes": result.episodes}


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def main() -> None:
    from robotft.cli import set_cpu_threads

    set_cpu_threads()  # as `robotft finetune` runs: one thread outside updates
    args = _parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages: dict = {}
    bc = _bc(args, out, stages)
    results: dict = {"args": vars(args), "stages": stages}
    if args.policy_only:
        for name in args.configs.split(","):
            results[name] = _policy_side(args, name, bc)
            print(f"[{name}] {json.dumps(results[name])}", flush=True)
        b, a = results["before"], results["after"]
        print(f"act per chunk {b['act_seconds_per_chunk'] * 1e3:.1f} ms -> {a['act_seconds_per_chunk'] * 1e3:.1f} ms "
              f"({b['act_seconds_per_chunk'] / a['act_seconds_per_chunk']:.2f}x); update {b['update_seconds']:.2f} s "
              f"-> {a['update_seconds']:.2f} s ({b['update_seconds'] / a['update_seconds']:.2f}x)", flush=True)
        (out / "bench_policy_side.json").write_text(json.dumps(results, indent=2))
        return
    for name in args.configs.split(","):
        run = out / name
        print(f"[{name}] fine-tuning {args.iterations} iterations ...", flush=True)
        results[name] = _finetune(args, name, bc, run)
        results[name]["final"] = _final_success(args, name, run)
        print(f"[{name}] {json.dumps(results[name])}", flush=True)
        (out / "bench_finetune_speed.json").write_text(json.dumps(results, indent=2))
    if "before" in results and "after" in results:
        b, a = results["before"], results["after"]
        results["speedup_iteration"] = b["iteration_seconds"] / a["iteration_seconds"]
        results["speedup_wall_per_iteration"] = b["wall_seconds_per_iteration"] / a["wall_seconds_per_iteration"]
        print(f"iteration (rollout + update): {b['iteration_seconds']:.2f} s -> {a['iteration_seconds']:.2f} s "
              f"({results['speedup_iteration']:.2f}x); wall per iteration with evaluations: "
              f"{b['wall_seconds_per_iteration']:.2f} s -> {a['wall_seconds_per_iteration']:.2f} s "
              f"({results['speedup_wall_per_iteration']:.2f}x); final success {b['final']['success_rate']:.2f} "
              f"{b['final']['ci95']} -> {a['final']['success_rate']:.2f} {a['final']['ci95']}", flush=True)
    (out / "bench_finetune_speed.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
