"""Benchmark of the off-policy fine-tuning algorithms against DPPO from the same BC checkpoint (issue #13):
env steps and wall-clock each needs to reach 90% of DPPO's final success, on the hard tasks of the fine-tuning
benchmark, over several seeds. Everything runs through the real CLI.

Per task: motion-planned (or scripted) demos → one diffusion BC (DDPM, as DPPO fine-tunes it) shared by every run →
DPPO, DSRL (the same network decoded with DDIM η = 0: `--policy.sampler ddim`), PA-RL, residual SAC (a residual
wrapped around the BC at the start), filtered BC alone and with the demonstrations mixed in, and continued BC on
the demonstrations (the control for filtered BC), one run per method and seed. Stages whose output exists are
skipped, so an interrupted benchmark continues where it stopped.

The threshold is 0.9 × DPPO's final evaluation success (mean over seeds); for every algorithm the first evaluation
whose mean success reaches it gives `env_steps_to_target` and `wall_seconds_to_target`, and `env_step_ratio` is
that over DPPO's own. The target: the best off-policy method reaches it with ≤ 1/5 of DPPO's env steps. Where the
BC already scores 0.9 × DPPO's final, every method meets that threshold before its first update and the ratio says
nothing, so a second threshold counts DPPO's gain instead: the BC's success plus 0.9 × (DPPO's final − the BC's),
with `gain_env_steps_to_target`, `gain_wall_seconds_to_target` and `gain_env_step_ratio`.
Writes `<out>/bench_offpolicy.json` and `<out>/bench_offpolicy_<task>.png` (success vs env steps and wall-clock).

    python scripts/bench_offpolicy.py --budget gpu --out runs/bench_offpolicy_gpu      # ManiSkill GPU sim
    python scripts/bench_offpolicy.py --budget cpu --envs maniskill/pick_cube          # hours on 2 cores
    python scripts/bench_offpolicy.py --budget smoke --seeds 0 --out /tmp/bench_off    # checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_pipeline import add_budget_args, apply_budget, run_stage  # noqa: E402
from bench_rl import _curve, _mean_curve, _once, _plot  # noqa: E402

BUDGETS = {
    "smoke": dict(demos=4, bc_steps=20, iterations=1, offpolicy_iterations=1, num_envs=1, steps_per_iter=5,
                  offpolicy_steps_per_iter=5, utd=0.2, eval_episodes=2, eval_every=1, offpolicy_eval_every=1,
                  sim_backend="physx_cpu", device="cpu"),
    "cpu": dict(demos=100, bc_steps=3000, iterations=8, offpolicy_iterations=40, num_envs=2, steps_per_iter=25,
                offpolicy_steps_per_iter=5, utd=1.0, eval_episodes=20, eval_every=4, offpolicy_eval_every=10,
                sim_backend="physx_cpu", device="cpu"),
    "gpu": dict(demos=100, bc_steps=20000, iterations=100, offpolicy_iterations=100, num_envs=256, steps_per_iter=25,
                offpolicy_steps_per_iter=5, utd=0.25, eval_episodes=256, eval_every=10, offpolicy_eval_every=5,
                sim_backend="physx_cuda", device="cuda"),
}
"""`--budget` presets; any single flag overrides its field. Off-policy runs collect fewer chunks per iteration
(`offpolicy_steps_per_iter`) and update `utd` critic steps per collected chunk."""

DEMOS = "{demos}"
"""Stands for the task's demonstration store in `ALGORITHMS`' flags."""
MIXED_DEMOS = ["--offpolicy.demo_data", DEMOS, "--offpolicy.utd", "8"]
ALGORITHMS = {
    "dppo": ["--algo", "dppo"],
    "dsrl": ["--algo", "dsrl", "--policy.sampler", "ddim"],
    "pa_rl": ["--algo", "pa_rl"],
    "residual_sac": ["--algo", "residual_sac"],
    "filtered_bc": ["--algo", "filtered_bc", "--offpolicy.demo_data", ""],
    "filtered_bc_demos": ["--algo", "filtered_bc", *MIXED_DEMOS],
    "continued_bc": ["--algo", "filtered_bc", *MIXED_DEMOS, "--offpolicy.demo_ratio", "1"],
}
"""Method → its flags (they override the budget's); every run starts from the task's diffusion BC checkpoint.
`filtered_bc` trains on its successful rollouts alone (its default mixes the BC's demonstrations in);
`filtered_bc_demos` mixes the demonstrations into filtered BC's minibatches with 8 BC steps per collected chunk;
`continued_bc` takes the same steps on the demonstrations alone, the control that tells what the rollouts add to
an under-trained BC."""
TASKS = ("maniskill/pick_cube", "maniskill/stack_cube", "robosuite/pick_place_can")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_budget_args(p, BUDGETS)
    p.add_argument("--out", default="runs/bench_offpolicy")
    p.add_argument("--envs", default=",".join(TASKS), help="comma-separated env presets")
    p.add_argument("--algos", default=",".join(ALGORITHMS), help="comma-separated subset of " + ",".join(ALGORITHMS))
    p.add_argument("--seeds", default="0,1,2")
    args = apply_budget(p.parse_args(), BUDGETS)
    unknown = set(args.algos.split(",")) - set(ALGORITHMS)
    if unknown or "dppo" not in args.algos.split(","):
        p.error(f"--algos must include dppo (the reference) and name only {list(ALGORITHMS)}")
    return args


def _source(args: argparse.Namespace, env: str, out: Path, stages: dict) -> tuple[Path, Path]:
    """The task's demos and its diffusion BC checkpoint."""
    demos = out / "demos.zarr"
    _once(demos, f"{env}:generate", ["data", "generate", "--env", env, "--episodes", str(args.demos), "--out",
                                     str(demos), "--seed", "0"], stages)
    bc = out / "diffusion_bc"
    _once(bc, f"{env}:pretrain", ["pretrain", "--env", env, "--data", str(demos), "--policy", "diffusion_mlp",
                                  "--steps", str(args.bc_steps), "--out", str(bc), "--train.eval_episodes", "0",
                                  "--train.device", args.device], stages)
    return demos, bc


def _finetune(args: argparse.Namespace, env: str, method: str, seed: int, demos: Path, source: Path, run: Path,
              stages: dict) -> None:
    offpolicy = method != "dppo"
    iterations = args.offpolicy_iterations if offpolicy else args.iterations
    argv = ["finetune", "--from", str(source), "--out", str(run), "--iterations", str(iterations),
            "--env.num_envs", str(args.num_envs), "--env.sim_backend", args.sim_backend, "--device", args.device,
            "--eval_every", str(args.offpolicy_eval_every if offpolicy else args.eval_every),
            "--eval_episodes", str(args.eval_episodes), "--seed", str(seed)]
    if offpolicy:
        argv += ["--offpolicy.steps_per_iter", str(args.offpolicy_steps_per_iter), "--offpolicy.utd", str(args.utd)]
    else:
        argv += ["--rl.steps_per_iter", str(args.steps_per_iter)]
    argv += [str(demos) if flag == DEMOS else flag for flag in ALGORITHMS[method]]
    if (run / "checkpoint").exists():
        done = json.loads((run / "checkpoint" / "meta.json").read_text())["step"]
        if done >= iterations:
            print(f"[{env} {method} seed {seed}] exists: {run}", flush=True)
            return
        argv.append("--resume")
    run_stage(f"{env}:{method}_seed{seed}", argv, stages)


def to_target(mean_curve: list[dict], target: float | None, prefix: str = "") -> dict:
    """The first evaluation whose mean success reaches `target`: its env steps and wall seconds (None if never, or
    if there is no target or it is 0: DPPO never succeeded or never gained, so there is nothing to reach)."""
    for point in mean_curve:
        if target and point["success_mean"] >= target:
            return {f"{prefix}env_steps_to_target": point["env_steps"],
                    f"{prefix}wall_seconds_to_target": point["wall_seconds"]}
    return {f"{prefix}env_steps_to_target": None, f"{prefix}wall_seconds_to_target": None}


def thresholds(dppo_curve: list[dict]) -> dict[str, float | None]:
    """The two success thresholds from DPPO's mean curve: 0.9 × its final success (key "") and its start plus 0.9
    of its gain (key "gain_"; None where DPPO did not improve on its start, so there is no gain to reach)."""
    start, final = dppo_curve[0]["success_mean"], dppo_curve[-1]["success_mean"]
    return {"": 0.9 * final, "gain_": start + 0.9 * (final - start) if final > start else None}


def with_ratios(summary: dict, targets: dict[str, float | None]) -> None:
    """Adds each algorithm's env steps and wall seconds to each threshold, and its env steps over DPPO's (None
    where DPPO's start already meets the threshold: there is no env-step count to divide by)."""
    for prefix, target in targets.items():
        for res in summary.values():
            res.update(to_target(res["mean_curve"], target, prefix))
        ref = summary["dppo"][f"{prefix}env_steps_to_target"]
        for res in summary.values():
            steps = res[f"{prefix}env_steps_to_target"]
            res[f"{prefix}env_step_ratio"] = None if steps is None or not ref else steps / ref


def main() -> None:
    args = _parse()
    root = Path(args.out).resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    stages: dict = {}
    t0 = time.perf_counter()
    tasks = {}
    for env in args.envs.split(","):
        out = root / env.replace("/", "_")
        out.mkdir(parents=True, exist_ok=True)
        demos, source = _source(args, env, out, stages)
        summary = {}
        for method in args.algos.split(","):
            runs = {seed: out / f"{method}_seed{seed}" for seed in seeds}
            for seed, run in runs.items():
                _finetune(args, env, method, seed, demos, source, run, stages)
            curves = {seed: _curve(run) for seed, run in runs.items()}
            summary[method] = {"curves": curves, "mean_curve": _mean_curve(list(curves.values()), args.eval_episodes)}
        dppo_curve = summary["dppo"]["mean_curve"]
        targets = thresholds(dppo_curve)
        with_ratios(summary, targets)
        tasks[env] = {"target_success": targets[""], "gain_target_success": targets["gain_"],
                      "bc_success": dppo_curve[0]["success_mean"], "dppo_final_success": dppo_curve[-1]["success_mean"],
                      "algorithms": summary}
        _plot(summary, out.parent / f"bench_offpolicy_{out.name}.png",
              f"{env}: off-policy vs DPPO from one BC ({args.demos} demos), {len(seeds)} seeds")
    result = {"budget": vars(args), "stages": stages, "total_seconds": round(time.perf_counter() - t0, 1),
              "tasks": tasks}
    (root / "bench_offpolicy.json").write_text(json.dumps(result, indent=2))
    for env, task in tasks.items():
        gain = task["gain_target_success"]
        print(f"\n{env}: BC {task['bc_success']:.2f}, DPPO's final {task['dppo_final_success']:.2f}; targets "
              f"{task['target_success']:.2f} (0.9 x DPPO's final) and "
              + (f"{gain:.2f} (BC + 0.9 x DPPO's gain)" if gain is not None else "none for the gain (DPPO gained nothing)"))
        for prefix, name in (("", "0.9 x final"), ("gain_", "0.9 x gain")):
            print(f"{name:<18}{'start':>7}{'end':>7}{'env steps':>11}{'to target':>11}{'wall s':>9}{'ratio':>7}")
            for algo, res in task["algorithms"].items():
                first, last = res["mean_curve"][0], res["mean_curve"][-1]
                ratio = "-" if res[f"{prefix}env_step_ratio"] is None else f"{res[f'{prefix}env_step_ratio']:.2f}"
                reached, wall = res[f"{prefix}env_steps_to_target"], res[f"{prefix}wall_seconds_to_target"]
                print(f"{algo:<18}{first['success_mean']:>7.2f}{last['success_mean']:>7.2f}{last['env_steps']:>11}"
                      f"{reached if reached is not None else '-':>11}{wall or '-':>9}{ratio:>7}")
    print(f"\nwrote {root / 'bench_offpolicy.json'}")


if __name__ == "__main__":
    main()
