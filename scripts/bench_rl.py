"""Benchmark of the RL fine-tuning algorithms on one ManiSkill task (issue #4): success rate against env steps
and against wall-clock for DPPO, ReinFlow, Flow-SDE and residual PPO from the same BC checkpoints, and
Gaussian PPO from scratch, over several seeds. Everything runs through the real CLI.

Stages (each skipped when its output exists, so an interrupted benchmark continues where it stopped):
  motion-planned demos → diffusion BC and flow BC (shared by every seed) → a zero-initialised residual on the
  diffusion BC and a freshly initialised Gaussian policy → one fine-tuning run per algorithm and seed.
Writes `<out>/bench_rl.json` (per-run curves and the mean over seeds) and `<out>/bench_rl.png` (two panels:
success vs env steps and vs wall-clock), and prints the table.

    python scripts/bench_rl.py --budget cpu                      # this machine: 2 worker envs, minutes per run
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

from bench_pipeline import run_stage  # noqa: E402

from robotft.runlog import read_metrics  # noqa: E402

BUDGETS = {
    "smoke": dict(demos=4, bc_steps=20, iterations=1, num_envs=1, steps_per_iter=5, eval_episodes=2, eval_every=1,
                  sim_backend="physx_cpu", device="cpu"),
    "cpu": dict(demos=100, bc_steps=3000, iterations=8, num_envs=2, steps_per_iter=25, eval_episodes=20,
                eval_every=4, sim_backend="physx_cpu", device="cpu"),
    "gpu": dict(demos=100, bc_steps=20000, iterations=100, num_envs=256, steps_per_iter=25, eval_episodes=256,
                eval_every=10, sim_backend="physx_cuda", device="cuda"),
}
"""`--budget` presets; any single flag overrides its field."""

ALGORITHMS = {
    "dppo": "diffusion_bc",
    "reinflow": "flow_bc",
    "flow_sde": "flow_bc",
    "residual_ppo": "residual",
    "ppo": "gaussian_init",
}
"""Algorithm → the checkpoint it starts from (the first three share their BC; Gaussian PPO is from scratch)."""


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", choices=list(BUDGETS), default="cpu")
    p.add_argument("--out", default="runs/bench_rl")
    p.add_argument("--env", default="maniskill/pick_cube")
    p.add_argument("--algos", default=",".join(ALGORITHMS), help="comma-separated subset of " + ",".join(ALGORITHMS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--baseline-reward", default="normalized_dense",
                   help="reward mode of Gaussian PPO from scratch (ManiSkill's PPO baseline uses normalized_dense; "
                        "the fine-tuning methods keep the task preset's reward)")
    for field, default in BUDGETS["cpu"].items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=None,
                       help=f"overrides the budget's {field} (cpu budget: {default})")
    args = p.parse_args()
    for field, value in BUDGETS[args.budget].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    unknown = set(args.algos.split(",")) - set(ALGORITHMS)
    if unknown:
        p.error(f"unknown --algos {sorted(unknown)}; available: {list(ALGORITHMS)}")
    return args


def _once(path: Path, name: str, argv: list[str], stages: dict) -> None:
    """Run a stage unless its checkpoint (or dataset) already exists."""
    if (path / "checkpoint").exists() or (path.suffix == ".zarr" and path.exists()):
        print(f"[{name}] exists: {path}", flush=True)
        return
    run_stage(name, argv, stages)


def _sources(args: argparse.Namespace, out: Path, stages: dict) -> dict[str, Path]:
    """The demos and the four starting checkpoints."""
    demos = out / "demos.zarr"
    _once(demos, "generate", ["data", "generate", "--env", args.env, "--episodes", str(args.demos), "--out",
                              str(demos), "--seed", "0"], stages)
    common = ["--env", args.env, "--data", str(demos), "--train.eval_episodes", "0", "--train.device", args.device]
    paths = {name: out / name for name in ("diffusion_bc", "flow_bc", "residual", "gaussian_init")}
    _once(paths["diffusion_bc"], "pretrain_diffusion",
          ["pretrain", *common, "--policy", "diffusion_mlp", "--steps", str(args.bc_steps), "--out",
           str(paths["diffusion_bc"])], stages)
    _once(paths["flow_bc"], "pretrain_flow",
          ["pretrain", *common, "--policy", "flow_transformer", "--steps", str(args.bc_steps), "--out",
           str(paths["flow_bc"])], stages)
    # ResiP: a zero-initialised residual over the diffusion BC (one step at learning rate 0 writes it).
    preset = out / "residual.yaml"
    preset.write_text(f"type: residual\nbase_checkpoint: {paths['diffusion_bc']}\nobs_steps: 1\nhorizon_steps: 4\n"
                      "act_steps: 4\nhidden_dims: [256, 256]\n")
    _once(paths["residual"], "residual_init",
          ["pretrain", *common, "--policy", str(preset), "--steps", "1", "--train.lr", "0", "--out",
           str(paths["residual"])], stages)
    # Gaussian PPO from scratch: fresh weights; the demos only provide the normalizer's statistics.
    _once(paths["gaussian_init"], "gaussian_init",
          ["pretrain", *common, "--policy", "gaussian_mlp", "--steps", "1", "--train.lr", "0", "--out",
           str(paths["gaussian_init"])], stages)
    return paths


def _finetune(args: argparse.Namespace, algo: str, seed: int, source: Path, run: Path, stages: dict) -> None:
    argv = ["finetune", "--from", str(source), "--algo", algo, "--out", str(run), "--iterations",
            str(args.iterations), "--env.num_envs", str(args.num_envs), "--env.sim_backend", args.sim_backend,
            "--rl.steps_per_iter", str(args.steps_per_iter), "--device", args.device, "--eval_every",
            str(args.eval_every), "--eval_episodes", str(args.eval_episodes), "--seed", str(seed)]
    if algo == "ppo":
        argv += ["--env.reward_mode", args.baseline_reward]
    if (run / "checkpoint").exists():
        done = json.loads((run / "checkpoint" / "meta.json").read_text())["step"]
        if done >= args.iterations:
            print(f"[{algo} seed {seed}] exists: {run}", flush=True)
            return
        argv.append("--resume")
    run_stage(f"{algo}_seed{seed}", argv, stages)


def _curve(run: Path) -> list[dict]:
    return [{"env_steps": r["step"], "wall_seconds": round(r["eval/wall_seconds"], 1),
             "success_rate": r["eval/success_rate"], "ci95": [r["eval/ci95_low"], r["eval/ci95_high"]]}
            for r in read_metrics(run) if "eval/success_rate" in r]


def _mean_curve(curves: list[list[dict]]) -> list[dict]:
    """Mean and min/max over seeds at each evaluation (seeds evaluate at the same iterations)."""
    n = min(len(c) for c in curves)
    return [{"env_steps": curves[0][i]["env_steps"],
             "wall_seconds": float(np.mean([c[i]["wall_seconds"] for c in curves])),
             "success_mean": float(np.mean([c[i]["success_rate"] for c in curves])),
             "success_min": min(c[i]["success_rate"] for c in curves),
             "success_max": max(c[i]["success_rate"] for c in curves)} for i in range(n)]


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
            ax.fill_between(x, [p["success_min"] for p in curve], [p["success_max"] for p in curve],
                            color=line.get_color(), alpha=0.15)
    axes[0].set(xlabel="env steps", ylabel="eval success rate (mean over seeds, min-max band)")
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
    sources = _sources(args, out, stages)
    seeds = [int(s) for s in args.seeds.split(",")]
    summary = {}
    for algo in args.algos.split(","):
        runs = {seed: out / f"{algo}_seed{seed}" for seed in seeds}
        for seed, run in runs.items():
            _finetune(args, algo, seed, sources[ALGORITHMS[algo]], run, stages)
        curves = {seed: _curve(run) for seed, run in runs.items()}
        summary[algo] = {"source": ALGORITHMS[algo], "curves": curves,
                         "mean_curve": _mean_curve(list(curves.values()))}
    result = {"env": args.env, "budget": vars(args), "stages": stages,
              "total_seconds": round(time.perf_counter() - t0, 1), "algorithms": summary}
    (out / "bench_rl.json").write_text(json.dumps(result, indent=2))
    _plot(summary, out / "bench_rl.png", f"{args.env}: fine-tuning from BC ({args.demos} demos), "
          f"{len(seeds)} seeds, {args.num_envs} envs")
    print(f"\n{'algorithm':<14}{'start':>8}{'end':>8}{'min-max end':>14}{'env steps':>11}{'wall s':>9}")
    for algo, res in summary.items():
        first, last = res["mean_curve"][0], res["mean_curve"][-1]
        print(f"{algo:<14}{first['success_mean']:>8.2f}{last['success_mean']:>8.2f}"
              f"{last['success_min']:>7.2f}-{last['success_max']:<6.2f}{last['env_steps']:>11}"
              f"{last['wall_seconds']:>9.0f}")
    print(f"\nwrote {out / 'bench_rl.json'} and {out / 'bench_rl.png'}")


if __name__ == "__main__":
    main()
