"""The fine-tuning benchmark on one task: success rate against env steps and against wall-clock for DPPO,
ReinFlow, Flow-SDE, residual PPO and Gaussian PPO from the same BC checkpoints, Gaussian PPO from scratch, and the
chains of filtered BC then residual PPO over it (`fbc_residual_ppo`, open loop, the method that doubled
PegInsertionSide's BC, and `fbc_residual_ppo_step`, the closed loop), over several seeds. Everything runs through
the real CLI with each algorithm's own defaults; the BC uses the task preset's recipe (controller, observation
history, horizons, steps).

Stages (each skipped when its output exists, so an interrupted benchmark continues where it stopped, and a
larger `--iterations` extends finished runs):
  motion-planned demos → diffusion, flow and Gaussian BC (shared by every seed; residual PPO wraps the diffusion
  BC in a zero residual itself), a freshly initialised Gaussian policy and, for the chains, one filtered-BC run
  from the diffusion BC (`--fbc-iterations`, seed 0, shared by both chains and their seeds) → one fine-tuning run
  per method and seed → a final evaluation of every BC and of every run's best checkpoint on `--final-episodes`
  (100) shared start states.
Writes `<out>/bench_rl.json` (per-run curves, final evaluations with 95% CIs, each run's paired comparison with
its BC on the same start states (a chain's: the diffusion BC it started from), the mean over seeds) and
`<out>/bench_rl.png` (success vs env steps and vs wall-clock, with 95% CI bands of the seeds' pooled
episodes), and prints the README table.

    python scripts/bench_rl.py --env maniskill/pick_cube --methods dppo,residual_ppo     # this machine
    python scripts/bench_rl.py --budget gpu --out runs/bench_rl_gpu   # ManiSkill GPU sim, hundreds of envs
    python scripts/bench_rl.py --budget smoke --out /tmp/bench_rl     # seconds per stage: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_pipeline import add_budget_args, apply_budget, run_stage  # noqa: E402

from robotft.runlog import read_metrics  # noqa: E402

BUDGETS = {
    "smoke": dict(demos=4, bc_steps=20, iterations=1, num_envs=1, steps_per_iter=5, eval_episodes=2, eval_every=1,
                  final_episodes=2, sim_backend="physx_cpu", device="cpu", fbc_iterations=1),
    "cpu": dict(demos=200, bc_steps=0, iterations=40, num_envs=4, steps_per_iter=0, eval_episodes=50,
                eval_every=10, final_episodes=100, sim_backend="physx_cpu", device="cpu", fbc_iterations=1000),
    "gpu": dict(demos=200, bc_steps=0, iterations=100, num_envs=256, steps_per_iter=25, eval_episodes=256,
                eval_every=10, final_episodes=256, sim_backend="physx_cuda", device="cuda", fbc_iterations=20),
}
"""`--budget` presets; any single flag overrides its field. `bc_steps` 0 takes the task recipe's, `steps_per_iter`
0 each algorithm's own. `fbc_iterations`: the chain's filtered-BC stage (4 chunks per env each; 1000 on 4 CPU envs is
the 128k env steps measured on PegInsertionSide)."""

METHODS = {
    "dppo": ("dppo", "diffusion_bc"),
    "reinflow": ("reinflow", "flow_bc"),
    "flow_sde": ("flow_sde", "flow_bc"),
    "residual_ppo": ("residual_ppo", "diffusion_bc"),
    "ppo_bc": ("ppo", "gaussian_bc"),
    "ppo_scratch": ("ppo", "gaussian_init"),
    "fbc_residual_ppo": ("residual_ppo", "filtered_bc"),
    "fbc_residual_ppo_step": ("residual_ppo_step", "filtered_bc"),
}
"""Method → (`--algo`, the checkpoint it starts from). Gaussian PPO runs from its BC and from scratch; the chains'
residual PPO (open loop, and closed loop: `residual_ppo_step`) from the filtered BC of the diffusion BC."""

FROM_SCRATCH_RL = ["--rl.logprob_reduction", "sum", "--rl.clip_eps", "0.2", "--rl.actor_lr", "3e-4", "--rl.critic_lr",
                   "3e-4", "--rl.update_epochs", "4", "--rl.target_kl", "0.1"]
"""Gaussian PPO from scratch runs on CleanRL's values (its defaults are DPPO's, for fine-tuning a BC)."""

BASELINE = {"filtered_bc": "diffusion_bc"}
"""A chain's run is compared with the BC its chain started from, not with its intermediate stage."""


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_budget_args(p, BUDGETS)
    p.add_argument("--out", default="runs/bench_rl")
    p.add_argument("--env", default="maniskill/pick_cube")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--baseline-reward", default="normalized_dense",
                   help="reward mode of Gaussian PPO from scratch (ManiSkill's PPO baseline uses normalized_dense; "
                        "the fine-tuning methods keep the task preset's reward)")
    args = apply_budget(p.parse_args(), BUDGETS)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown --methods {sorted(unknown)}; available: {list(METHODS)}")
    return args


def _once(path: Path, name: str, argv: list[str], stages: dict) -> None:
    """Run a stage unless its checkpoint (or dataset) already exists."""
    if (path / "checkpoint").exists() or (path.suffix == ".zarr" and path.exists()):
        print(f"[{name}] exists: {path}", flush=True)
        return
    run_stage(name, argv, stages)


def _sources(args: argparse.Namespace, out: Path, stages: dict, needed: set[str]) -> dict[str, Path]:
    """The demos and the starting checkpoints the chosen methods need (BCs with the task recipe)."""
    demos = out / "demos.zarr"
    _once(demos, "generate", ["data", "generate", "--env", args.env, "--episodes", str(args.demos), "--out",
                              str(demos), "--seed", "0"], stages)
    common = ["--env", args.env, "--data", str(demos), "--train.eval_episodes", "0", "--train.device", args.device]
    steps = ["--steps", str(args.bc_steps)] if args.bc_steps else []
    paths = {name: out / name for name in ("diffusion_bc", "flow_bc", "gaussian_bc", "gaussian_init", "filtered_bc")}
    if "filtered_bc" in needed:  # the chain's first stage starts from the diffusion BC
        needed = needed | {"diffusion_bc"}
    for name, policy in (("diffusion_bc", "diffusion_mlp"), ("flow_bc", "flow_transformer"),
                         ("gaussian_bc", "gaussian_mlp")):
        if name in needed:
            _once(paths[name], f"pretrain_{name}",
                  ["pretrain", *common, "--policy", policy, *steps, "--out", str(paths[name])], stages)
    # Gaussian PPO from scratch: fresh weights; the demos only provide the normalizer's statistics.
    if "gaussian_init" in needed:
        _once(paths["gaussian_init"], "gaussian_init",
              ["pretrain", *common, "--policy", "gaussian_mlp", "--steps", "1", "--train.lr", "0", "--out",
               str(paths["gaussian_init"])], stages)
    # The chain's first stage: filtered BC with its defaults (the BC's demonstrations mixed in) from the diffusion BC.
    if "filtered_bc" in needed:
        fbc = ["finetune", "--from", str(paths["diffusion_bc"]), "--algo", "filtered_bc", "--out", str(paths["filtered_bc"]),
               "--iterations", str(args.fbc_iterations), "--env.num_envs", str(args.num_envs), "--env.sim_backend",
               args.sim_backend, "--device", args.device, "--eval_episodes", "0", "--seed", "0"]
        _finetune(fbc, "filtered_bc", paths["filtered_bc"], args.fbc_iterations, stages)
    return paths


def _finetune_argv(args: argparse.Namespace, algo: str, seed: int, source: Path, run: Path) -> list[str]:
    argv = ["finetune", "--from", str(source), "--algo", algo, "--out", str(run), "--iterations",
            str(args.iterations), "--env.num_envs", str(args.num_envs), "--env.sim_backend", args.sim_backend,
            "--device", args.device, "--eval_every", str(args.eval_every), "--eval_episodes", str(args.eval_episodes),
            "--seed", str(seed)]
    if args.steps_per_iter:
        argv += ["--rl.steps_per_iter", str(args.steps_per_iter)]
    if source.name == "gaussian_init":
        argv += ["--env.reward_mode", args.baseline_reward, *FROM_SCRATCH_RL]
    return argv


def _finetune(argv: list[str], name: str, run: Path, iterations: int, stages: dict) -> None:
    if (run / "checkpoint").exists():
        done = json.loads((run / "checkpoint" / "meta.json").read_text())["step"]
        if done >= iterations:
            print(f"[{name}] exists: {run}", flush=True)
            return
        argv = [*argv, "--resume"]
    run_stage(name, argv, stages)


def _final_eval(args: argparse.Namespace, checkpoint: Path, stages: dict) -> dict:
    """`robotft eval` of `checkpoint` on `final_episodes` shared start states (cached beside it)."""
    cache = checkpoint.parent / f"final_eval_{checkpoint.name}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    stdout = run_stage(f"eval_{checkpoint.parent.name}_{checkpoint.name}",
                       ["eval", str(checkpoint), "--episodes", str(args.final_episodes), "--num-envs",
                        str(min(args.num_envs, 4)), "--device", args.device, "--json"], stages)
    result = json.loads(stdout.strip().splitlines()[-1])
    cache.write_text(json.dumps(result))
    return result


def _vs_bc(final: dict, bc: dict) -> dict:
    """The fine-tuned checkpoint against its BC on the same start states (both evaluations share the seed)."""
    from robotft.evaluation import paired_comparison

    return paired_comparison(final["episode_success"], bc["episode_success"]).to_dict()


def _pooled_ci(rate: float, n: int) -> list[float]:
    from robotft.evaluation import wilson_interval

    return list(wilson_interval(round(rate * n), n))


def _curve(run: Path) -> list[dict]:
    return [{"env_steps": r["step"], "wall_seconds": round(r["eval/wall_seconds"], 1),
             "success_rate": r["eval/success_rate"], "ci95": [r["eval/ci95_low"], r["eval/ci95_high"]]}
            for r in read_metrics(run) if "eval/success_rate" in r]


def _mean_curve(curves: list[list[dict]], episodes: int) -> list[dict]:
    """Mean, min/max and the 95% Wilson interval of the pooled episodes over seeds at each evaluation (seeds
    evaluate at the same iterations, `episodes` each)."""
    n = min(len(c) for c in curves)
    out = []
    for i in range(n):
        mean = float(np.mean([c[i]["success_rate"] for c in curves]))
        out.append({"env_steps": curves[0][i]["env_steps"],
                    "wall_seconds": float(np.mean([c[i]["wall_seconds"] for c in curves])),
                    "success_mean": mean, "ci95": _pooled_ci(mean, episodes * len(curves)),
                    "success_min": min(c[i]["success_rate"] for c in curves),
                    "success_max": max(c[i]["success_rate"] for c in curves)})
    return out


def _plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for algo, result in summary.items():
        curve = result["mean_curve"]
        for ax, x_key in zip(axes, ("env_steps", "wall_seconds"), strict=True):
            x = [p[x_key] for p in curve]
            (line,) = ax.plot(x, [p["success_mean"] for p in curve], marker="o", label=algo)
            ax.fill_between(x, [p["ci95"][0] for p in curve], [p["ci95"][1] for p in curve],
                            color=line.get_color(), alpha=0.15)
    axes[0].set(xlabel="env steps", ylabel="eval success rate (mean over seeds, 95% CI band)")
    axes[1].set(xlabel="wall-clock seconds of fine-tuning")
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = _parse()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages: dict = {}
    t0 = time.perf_counter()
    methods = args.methods.split(",")
    sources = _sources(args, out, stages, {METHODS[m][1] for m in methods})
    seeds = [int(s) for s in args.seeds.split(",")]
    summary = {}
    for method in methods:
        algo, source = METHODS[method]
        runs = {seed: out / f"{method}_seed{seed}" for seed in seeds}
        commands = {}
        for seed, run in runs.items():
            argv = _finetune_argv(args, algo, seed, sources[source], run)
            commands[seed] = "robotft " + " ".join(argv)
            _finetune(argv, f"{method}_seed{seed}", run, args.iterations, stages)
        curves = {seed: _curve(run) for seed, run in runs.items()}
        finals = {seed: _final_eval(args, run / "best", stages) for seed, run in runs.items()}
        reward = json.loads((runs[seeds[0]] / "config.json").read_text())["run"]["env"]["reward_mode"]
        baseline = BASELINE.get(source, source)
        bc = _final_eval(args, sources[baseline], stages)
        summary[method] = {"algo": algo, "source": source, "baseline": baseline, "bc": bc, "curves": curves,
                           "final_best": finals,
                           "vs_bc": {seed: _vs_bc(final, bc) for seed, final in finals.items()},
                           "reward_mode": reward, "commands": commands,
                           "mean_curve": _mean_curve(list(curves.values()), args.eval_episodes)}
    result = {"env": args.env, "budget": vars(args), "stages": stages,
              "total_seconds": round(time.perf_counter() - t0, 1), "methods": summary}
    (out / "bench_rl.json").write_text(json.dumps(result, indent=2))
    _plot(summary, out / "bench_rl.png", f"{args.env}: fine-tuning from BC ({args.demos} demos), "
          f"{len(seeds)} seeds, {args.num_envs} envs")
    print("\n| task | method | BC success (95% CI) | fine-tuned, best checkpoint (95% CI) | paired difference "
          "(95% CI), McNemar p | env steps | wall s | reward |")
    print("|---|---|---|---|---|---|---|---|")
    for method, res in summary.items():
        bc, last = res["bc"], res["mean_curve"][-1]
        for seed, final in res["final_best"].items():
            gain = res["vs_bc"][seed]
            print(f"| {args.env} | {method} (seed {seed}) | {bc['success_rate']:.2f} ({bc['ci95'][0]:.2f}-"
                  f"{bc['ci95'][1]:.2f}) | {final['success_rate']:.2f} ({final['ci95'][0]:.2f}-{final['ci95'][1]:.2f})"
                  f" | {gain['difference']:+.2f} ({gain['ci95'][0]:+.2f} to {gain['ci95'][1]:+.2f}), "
                  f"{gain['p_value']:.2g} | {last['env_steps']} | {last['wall_seconds']:.0f} | {res['reward_mode']} |")
    print(f"\nwrote {out / 'bench_rl.json'} and {out / 'bench_rl.png'}")


if __name__ == "__main__":
    main()
