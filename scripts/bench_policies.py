"""Policy speed: BC training throughput and `predict_chunk` latency of every robotft policy preset, side by side
with LeRobot's DiffusionPolicy on the same synthetic data.

    .venv/bin/python scripts/bench_policies.py --out bench_policies.json

Every policy sees the same shapes: state-only observations (`--obs-dim`, `--obs-steps`), chunks of `--horizon`
actions of `--act-dim`, batches of `--batch-size`. Training throughput (samples/s) times full optimizer
steps (loss, backward, gradient clipping, AdamW, EMA where kept), as `robotft pretrain` runs them, on tensors
already in memory (no data loading). Latency is one `predict_chunk` call at batch 1, the median over
`--latency-calls` calls after warm-up. One torch thread for everything (`torch.set_num_threads(1)`), CPU.
The policies are measured in `--rounds` interleaved rounds and the medians over rounds reported, so load
from other processes on a shared machine slows all of them alike rather than whichever ran at the time.
Times are the calling thread's CPU time (`time.thread_time`; with one torch thread all the work runs on it),
which leaves out the time the process waits for a core on a loaded machine; wall-clock figures are in the
JSON too (on an idle machine the two agree).

LeRobot's DiffusionPolicy (lerobot 0.4.4) refuses a robot state alone (it wants an image or an environment
state), so its `--obs-dim` state is split into `observation.state` (the first obs_dim - `--env-state-dim`
entries) and `observation.environment_state` (the rest): the same numbers condition it. It is built with
robotft's diffusion_unet preset widths (64/128/256, kernel 5, 8 groups, time embedding 64), and with
`--lerobot-default` also with its default UNet (`down_dims` 512/1024/2048); both
with the same horizon, observation steps, action dim, batch size and 20 DDPM steps (train and inference) as
robotft's diffusion presets. Its training step is `policy.forward(batch)` and its chunk is
`policy.diffusion.generate_actions` (what `predict_action_chunk` calls once its observation queue is full);
LeRobot 0.4 normalizes in separate processors, so its timings exclude normalization while robotft's include it.
Ratios are robotft / LeRobot against the matched-width LeRobot UNet: throughput above 1 and latency below 1
mean robotft is faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from robotft.config import REPO_ROOT, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy, policy_config_class
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

# (row name, preset, config overrides)
ROBOTFT_POLICIES = [
    ("diffusion_mlp", "diffusion_mlp", {}),
    ("diffusion_unet", "diffusion_unet", {}),
    ("gaussian_mlp", "gaussian_mlp", {}),
    ("flow_transformer K=1", "flow_transformer", {"num_steps": 1}),
    ("flow_transformer K=4", "flow_transformer", {"num_steps": 4}),
    ("flow_transformer K=10", "flow_transformer", {"num_steps": 10}),
    ("flow_meanflow K=1", "flow_meanflow", {"num_steps": 1}),
]
DENOISING_STEPS = 20  # robotft's diffusion presets: 20-step DDPM


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--obs-dim", type=int, default=25, help="state dimension")
    p.add_argument("--act-dim", type=int, default=7, help="action dimension")
    p.add_argument("--env-state-dim", type=int, default=7, help="LeRobot: state entries given as environment state")
    p.add_argument("--obs-steps", type=int, default=1, help="observation history length")
    p.add_argument("--horizon", type=int, default=8, help="chunk length (a multiple of 8 for LeRobot's UNet)")
    p.add_argument("--batch-size", type=int, default=256, help="BC batch size")
    p.add_argument("--train-steps", type=int, default=10, help="timed optimizer steps per policy")
    p.add_argument("--latency-calls", type=int, default=50, help="timed predict_chunk calls per policy")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps/calls before each timing")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (medians reported)")
    p.add_argument("--lerobot-default", action="store_true",
                   help="also time LeRobot's default UNet (250M parameters: minutes per step on one CPU thread; "
                        "timed with 2 steps and 3 calls)")
    p.add_argument("--out", default="bench_policies.json", help="JSON results file")
    return p.parse_args()


def synthetic_data(args: argparse.Namespace, n: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"state": rng.normal(size=(n, args.obs_dim)).astype(np.float32),
            "action": rng.uniform(-1, 1, size=(n, args.act_dim)).astype(np.float32)}


def train_batch(args: argparse.Namespace, data: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(state [B, T_o, D], action [B, H, A])` windows cut from the synthetic arrays."""
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(data["state"]) - args.horizon, size=args.batch_size)
    state = np.stack([data["state"][s : s + args.obs_steps] for s in starts])
    action = np.stack([data["action"][s : s + args.horizon] for s in starts])
    return torch.from_numpy(state), torch.from_numpy(action)


@dataclasses.dataclass
class Candidate:
    """One policy under test: a BC optimizer step and a batch-1 chunk prediction, both closures."""

    name: str
    module: torch.nn.Module
    step: Callable[[], None]
    chunk: Callable[[], object]
    params: int


def trainable(module: torch.nn.Module) -> int:
    """Trained parameters (an EMA copy is not counted)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def robotft_candidate(args, data, state, action, name: str, preset: str, overrides: dict) -> Candidate:
    raw = load_yaml(REPO_ROOT / "policies" / f"{preset}.yaml")
    raw.update(obs_steps=args.obs_steps, horizon_steps=args.horizon, act_steps=min(4, args.horizon), **overrides)
    config = from_dict(policy_config_class(raw["type"]), raw)
    spec = EnvSpec({"state": FeatureSpec("state", (args.obs_dim,), "float32")},
                   ActionSpec("bench", args.act_dim, (-1.0,) * args.act_dim, (1.0,) * args.act_dim))
    normalizer = Normalizer.fit(data, {"state": config.normalizer_mode, "action": config.normalizer_mode})
    torch.manual_seed(0)
    policy = build_policy(config, spec, normalizer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    batch = {"obs": {"state": state}, "action": action}
    obs = {"state": state[:1]}

    def step() -> None:
        loss, _ = policy.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        policy.on_train_step_end()

    return Candidate(name, policy, step, lambda: policy.predict_chunk(obs), trainable(policy))


def lerobot_candidate(args, state, action, name: str, widths: dict | None) -> Candidate:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    robot_dim = args.obs_dim - args.env_state_dim
    config = DiffusionConfig(
        n_obs_steps=args.obs_steps, horizon=args.horizon, n_action_steps=min(4, args.horizon),
        input_features={
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(robot_dim,)),
            "observation.environment_state": PolicyFeature(type=FeatureType.ENV, shape=(args.env_state_dim,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(args.act_dim,))},
        num_train_timesteps=DENOISING_STEPS, num_inference_steps=DENOISING_STEPS, device="cpu", **(widths or {}),
    )
    torch.manual_seed(0)
    policy = DiffusionPolicy(config)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    obs = {"observation.state": state[..., :robot_dim], "observation.environment_state": state[..., robot_dim:]}
    batch = {**obs, "action": action, "action_is_pad": torch.zeros(action.shape[:2], dtype=torch.bool)}
    obs1 = {k: v[:1] for k, v in obs.items()}

    def step() -> None:
        loss, _ = policy.forward(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()

    @torch.no_grad()
    def chunk() -> torch.Tensor:
        return policy.diffusion.generate_actions(obs1)

    return Candidate(name, policy, step, chunk, trainable(policy))


def measure(c: Candidate, train_steps: int, calls: int, warmup: int, batch_size: int) -> dict[str, float]:
    """Samples/s over `train_steps` optimizer steps and the median ms of `calls` chunk predictions, each after
    `warmup` untimed repetitions; by the calling thread's CPU time (`cpu_*`) and by the wall clock (`wall_*`)."""
    c.module.train()
    for _ in range(warmup):
        c.step()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for _ in range(train_steps):
        c.step()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    out = {"cpu_samples_per_s": train_steps * batch_size / cpu, "wall_samples_per_s": train_steps * batch_size / wall}
    c.module.eval()
    for _ in range(warmup):
        c.chunk()
    cpu_ms, wall_ms = [], []
    for _ in range(calls):
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        c.chunk()
        cpu_ms.append(1000 * (time.thread_time() - cpu0))
        wall_ms.append(1000 * (time.perf_counter() - wall0))
    return {**out, "cpu_latency_ms": statistics.median(cpu_ms), "wall_latency_ms": statistics.median(wall_ms)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    data = synthetic_data(args)
    state, action = train_batch(args, data)
    reference = "lerobot diffusion (robotft widths)"
    matched = {"down_dims": (64, 128, 256), "kernel_size": 5, "n_groups": 8, "diffusion_step_embed_dim": 64}
    candidates = [robotft_candidate(args, data, state, action, *row) for row in ROBOTFT_POLICIES]
    candidates.append(lerobot_candidate(args, state, action, reference, matched))
    # Interleaved rounds, medians over rounds: load from other processes on the machine hits all policies alike.
    samples: dict[str, list[dict[str, float]]] = {c.name: [] for c in candidates}
    for r in range(args.rounds):
        for c in candidates:
            m = measure(c, args.train_steps, args.latency_calls, args.warmup, args.batch_size)
            samples[c.name].append(m)
            print(f"round {r + 1}/{args.rounds} {c.name}: {m['cpu_samples_per_s']:,.0f} samples/s, "
                  f"{m['cpu_latency_ms']:.2f} ms (CPU time; wall {m['wall_samples_per_s']:,.0f}, "
                  f"{m['wall_latency_ms']:.2f})", flush=True)
    rows = {
        c.name: {"params": c.params, "rounds": samples[c.name],
                 **{k: statistics.median(m[k] for m in samples[c.name]) for k in samples[c.name][0]}}
        for c in candidates
    }
    if args.lerobot_default:
        big = lerobot_candidate(args, state, action, "lerobot diffusion (default)", None)
        rows[big.name] = {"params": big.params, **measure(big, 2, 3, 1, args.batch_size)}

    ref = rows[reference]
    print(f"\nCPU, 1 thread, batch {args.batch_size}, horizon {args.horizon}, obs {args.obs_steps}x{args.obs_dim}, "
          f"act {args.act_dim}, {DENOISING_STEPS} diffusion steps, median of {args.rounds} rounds, by thread CPU "
          f"time (wall clock in the JSON); ratios robotft / {reference}")
    header = (f"{'policy':36s} {'params':>10s} {'train samples/s':>16s} {'ratio':>7s} "
              f"{'latency ms':>11s} {'ratio':>7s}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        for kind in ("cpu", "wall"):
            r[f"{kind}_train_ratio_vs_lerobot"] = r[f"{kind}_samples_per_s"] / ref[f"{kind}_samples_per_s"]
            r[f"{kind}_latency_ratio_vs_lerobot"] = r[f"{kind}_latency_ms"] / ref[f"{kind}_latency_ms"]
        print(f"{name:36s} {r['params']:>10,d} {r['cpu_samples_per_s']:>16,.0f} {r['cpu_train_ratio_vs_lerobot']:>7.2f} "
              f"{r['cpu_latency_ms']:>11.2f} {r['cpu_latency_ratio_vs_lerobot']:>7.2f}")
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "threads": 1,
              "denoising_steps": DENOISING_STEPS, "reference": reference, "policies": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
