"""Benchmark of the walking skeleton on ManiSkill PushCube (CPU by default; GPU with --device cuda).

Runs demo generation → diffusion BC → eval → DPPO → eval through the real CLI and prints, and writes to
`<out>/bench.json` and `<out>/bench.png`:
  demo generation seconds (per demo), BC samples/s, fine-tuning env steps/s and update seconds per
  iteration, success rate vs env steps (before/during/after DPPO), wall time and peak memory per stage
  (proportional set size of the stage's whole process tree, simulator workers included).

    python scripts/bench_pipeline.py --out runs/bench --demos 100 --bc-steps 3000 --iterations 40
    python scripts/bench_pipeline.py --device cuda --num-envs 256 --sim-backend physx_cuda ...  (GPU)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from robotft.runlog import plot_curves, read_metrics  # noqa: E402


def _descendants(pid: int) -> list[int]:
    """`pid` and all its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _tree_pss_mb(pid: int) -> float:
    """Proportional set size of a process tree: shared pages (torch, simulator libraries) counted once."""
    total_kb = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total_kb += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total_kb / 1024


def add_budget_args(p: argparse.ArgumentParser, budgets: dict[str, dict]) -> None:
    """`--budget NAME` and one `--field` flag per field of the `cpu` budget, overriding the chosen budget's."""
    p.add_argument("--budget", choices=list(budgets), default="cpu")
    for field, default in budgets["cpu"].items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=None,
                       help=f"overrides the budget's {field} (cpu budget: {default})")


def apply_budget(args: argparse.Namespace, budgets: dict[str, dict]) -> argparse.Namespace:
    """Fill every budget field the command line left unset from the chosen `--budget`."""
    for field, value in budgets[args.budget].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    return args


def run_stage(name: str, argv: list[str], stages: dict) -> str:
    """Run one CLI stage; record wall seconds and the peak memory (PSS of its process tree, sampled)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "robotft.cli", *argv], stdout=out, stderr=err, text=True,
                                cwd=REPO)
        peak_mb = 0.0
        while proc.poll() is None:
            peak_mb = max(peak_mb, _tree_pss_mb(proc.pid))
            time.sleep(1.0)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(stderr[-5000:])
        raise SystemExit(f"stage {name} failed with exit code {proc.returncode}")
    stages[name] = {"seconds": round(seconds, 1), "peak_pss_mb": round(peak_mb)}
    print(f"[{name}] {seconds:.1f} s, peak memory {peak_mb:.0f} MB (PSS of the process tree)", flush=True)
    return stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_pipeline")
    p.add_argument("--env", default="maniskill/push_cube")
    p.add_argument("--demos", type=int, default=100)
    p.add_argument("--bc-steps", type=int, default=3000)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--steps-per-iter", type=int, default=50)
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--device", default="auto")
    p.add_argument("--sim-backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages: dict = {}
    t_start = time.perf_counter()

    demos = out / "demos.zarr"
    gen = json.loads(run_stage("generate", ["data", "generate", "--env", args.env, "--episodes", str(args.demos),
                                            "--out", str(demos), "--overwrite", "--seed", str(args.seed)],
                               stages).strip().splitlines()[-1])
    run_stage("pretrain", ["pretrain", "--env", args.env, "--policy", "diffusion_mlp", "--data", str(demos),
                           "--steps", str(args.bc_steps), "--out", str(out / "bc"), "--train.eval_episodes", "0",
                           "--train.device", args.device, "--seed", str(args.seed)], stages)
    bc_rows = [r for r in read_metrics(out / "bc") if "train/samples_per_s" in r]
    common_eval = ["--episodes", str(args.eval_episodes), "--json", "--device", args.device,
                   "--num-envs", str(min(args.num_envs, args.eval_episodes))]
    before = json.loads(run_stage("eval_bc", ["eval", str(out / "bc"), *common_eval], stages).splitlines()[-1])
    run_stage("finetune", ["finetune", "--from", str(out / "bc"), "--algo", "dppo", "--iterations",
                           str(args.iterations), "--out", str(out / "dppo"), "--env.num_envs", str(args.num_envs),
                           "--env.sim_backend", args.sim_backend, "--rl.steps_per_iter", str(args.steps_per_iter),
                           "--device", args.device, "--eval_every", str(max(1, args.iterations // 8)),
                           "--eval_episodes", str(args.eval_episodes), "--seed", str(args.seed)], stages)
    after = json.loads(run_stage("eval_dppo", ["eval", str(out / "dppo"), *common_eval], stages).splitlines()[-1])

    ft_rows = read_metrics(out / "dppo")
    train_rows = [r for r in ft_rows if "train/env_steps_per_s" in r]
    curve = [(r["step"], r["eval/success_rate"], r["eval/ci95_low"], r["eval/ci95_high"])
             for r in ft_rows if "eval/success_rate" in r]
    result = {
        "env": args.env,
        "budget": vars(args),
        "demo_generation": {"seconds": gen.get("seconds"), "seconds_per_demo": gen["seconds"] / max(1, args.demos),
                            **{k: gen[k] for k in ("planned", "kept") if k in gen}},
        "bc_samples_per_s": sum(r["train/samples_per_s"] for r in bc_rows) / max(1, len(bc_rows)),
        "finetune_env_steps_per_s": sum(r["train/env_steps_per_s"] for r in train_rows) / max(1, len(train_rows)),
        "finetune_update_seconds_per_iter": sum(r["train/update_seconds"] for r in train_rows)
        / max(1, len(train_rows)),
        "success_before": before,
        "success_after": after,
        "success_vs_env_steps": [{"env_steps": s, "success_rate": y, "ci95": [lo, hi]} for s, y, lo, hi in curve],
        "stages": stages,
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "peak_pss_mb": max(s["peak_pss_mb"] for s in stages.values()),
    }
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    if curve:
        xs = [c[0] for c in curve]
        plot_curves({"DPPO eval success": (xs, [c[1] for c in curve])}, out / "bench.png", xlabel="env steps",
                    ylabel="success rate", title=f"{args.env}: DPPO from diffusion BC ({args.demos} demos)",
                    bands={"DPPO eval success": ([c[2] for c in curve], [c[3] for c in curve])})
    print(json.dumps({k: v for k, v in result.items() if k not in ("success_vs_env_steps", "budget")}, indent=2))


if __name__ == "__main__":
    main()
