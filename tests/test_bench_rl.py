"""scripts/bench_rl.py: Gaussian PPO from scratch runs on CleanRL's values, from its BC on the algorithm's defaults."""

import importlib.util
import sys
from pathlib import Path

from robotft.config import apply_overrides, parse_override_args
from robotft.finetune import FinetuneConfig


def _bench_rl():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_rl.py"
    spec = importlib.util.spec_from_file_location("bench_rl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scratch_runs_get_cleanrl_values_and_bc_runs_the_defaults(tmp_path, monkeypatch):
    bench = _bench_rl()
    monkeypatch.setattr(sys, "argv", ["bench_rl.py", "--budget", "smoke"])
    args = bench._parse()
    rl = {}
    for source in ("gaussian_init", "gaussian_bc"):
        argv = bench._finetune_argv(args, "ppo", 0, tmp_path / source, tmp_path / f"run_{source}")
        flags = {k: v for k, v in parse_override_args(argv[1:]).items() if k.startswith("rl.")}  # argv[0]: finetune
        rl[source] = apply_overrides(FinetuneConfig.for_algorithm("ppo"), flags).rl
    scratch, from_bc = rl["gaussian_init"], rl["gaussian_bc"]
    assert (scratch.logprob_reduction, scratch.clip_eps, scratch.actor_lr, scratch.target_kl) == ("sum", 0.2, 3e-4, 0.1)
    assert (from_bc.logprob_reduction, from_bc.clip_eps, from_bc.actor_lr, from_bc.target_kl) == ("mean", 0.01, 1e-4, 1.0)
