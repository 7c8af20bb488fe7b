"""The GPU fine-tuning path, measured: ManiSkill `physx_cuda` PushCube with many envs, a few DPPO iterations.

Run by scripts/gpu_check.sh (which also tries two ranks under torchrun). A diffusion policy of the shipped
preset's size with random weights (speed, not learning, is measured) samples and trains through the PPO core
exactly as `robotft finetune` does. Prints one JSON line:
  env_steps_per_s (rollout, policy included), update_seconds per iteration, iteration_seconds,
  host_syncs_per_chunk (synchronising ops on CUDA tensors, counted with a TorchDispatchMode over one rollout),
  reset_seconds_per_iteration (partial resets), optimizer_steps per iteration, the sim and render devices.
Under torchrun every rank runs the same and rank 0 prints, with `world_size` and each rank's device.

    python scripts/gpu_check.py --num-envs 256 --iterations 3
    torchrun --nproc_per_node 2 scripts/gpu_check.py --num-envs 128 --iterations 2
    python scripts/gpu_check.py --standin --num-envs 1024   # the stand-in env on CUDA: policy and update only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal}


class CudaSyncCounter(TorchDispatchMode):
    """Counts ops that make the host wait for the GPU: scalar reads, nonzero, mask selection, and copies of a CUDA
    tensor to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        on_cuda = isinstance(first, torch.Tensor) and first.is_cuda
        packet = func.overloadpacket
        if on_cuda and packet in SYNC_OPS:
            self.count += 1
        elif on_cuda and packet in (aten.index, aten.index_put, aten.index_put_):
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        elif on_cuda and packet is aten._to_copy and str(kwargs.get("device", "")) == "cpu":
            self.count += 1
        return func(*args, **kwargs)


def _policy(spec, device):
    from robotft.config import REPO_ROOT, from_dict, load_yaml
    from robotft.datasets.normalizer import Normalizer
    from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig

    rng = np.random.default_rng(0)
    dim = spec.observations["state"].shape[0]
    low, high = np.asarray(spec.action.low), np.asarray(spec.action.high)
    norm = Normalizer.fit({"state": rng.normal(size=(256, dim)), "action": rng.uniform(low, high, (256, low.size))},
                          {"state": "minmax", "action": "minmax"})
    cfg = from_dict(DiffusionPolicyConfig, load_yaml(REPO_ROOT / "policies" / "diffusion_mlp.yaml"))
    return DiffusionPolicy(cfg, spec, norm).to(device)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _use_standin() -> None:
    """Route robotft's ManiSkill adapter to the CPU stand-in of ManiSkill's GPU env (tests/maniskill_standin.py)."""
    sys.path.insert(0, str(REPO / "tests"))
    import maniskill_standin

    import robotft.envs.maniskill as adapter

    maniskill_standin.register()
    adapter.resolve_sim_backend = lambda backend, device="cpu": "physx_cuda"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-envs", type=int, default=256)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--steps-per-iter", type=int, default=25)
    p.add_argument("--num-minibatches", type=int, default=16)
    p.add_argument("--standin", action="store_true",
                   help="the batched stand-in env of tests/ instead of ManiSkill, on CUDA when there is one: the "
                        "policy, the update and the host syncs measured where ManiSkill's GPU sim cannot run (and, "
                        "without a GPU, a dry run of this script whose figures are not worth reading)")
    args = p.parse_args()
    if args.standin:
        _use_standin()
    elif not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device: the GPU check needs one"}))
        raise SystemExit(2)

    from robotft.config import EnvConfig
    from robotft.distributed import distributed
    from robotft.envs.chunked import ChunkedEnv
    from robotft.envs.factory import make_env
    from robotft.finetune import FinetuneConfig, make_critic
    from robotft.rl.dppo import DPPO, DPPOConfig
    from robotft.rl.ppo import PPO, PPOConfig

    base = "cuda" if torch.cuda.is_available() else "cpu"
    task = "RobotftStandIn-v1" if args.standin else "PushCube-v1"
    with distributed(base) as ctx:
        device = torch.device(ctx.device(base))
        torch.manual_seed(ctx.seed(0))
        t0 = time.perf_counter()
        try:
            env = make_env(EnvConfig(type="maniskill", task=task, num_envs=args.num_envs,
                                     sim_backend="physx_cuda", control_mode="pd_ee_delta_pose",
                                     reward_mode="sparse", max_episode_steps=100), device=str(device))
        except Exception as e:  # noqa: BLE001 - reported as this script's one JSON line
            print(json.dumps({"ok": False, "env": task, "error": f"{type(e).__name__}: {e}"[:900]}), flush=True)
            raise SystemExit(3) from e
        env_build_s = time.perf_counter() - t0
        raw = env._impl._env
        policy = _policy(env.spec, device)
        algo = DPPO(policy, DPPOConfig())
        rl = PPOConfig(iterations=args.iterations, steps_per_iter=args.steps_per_iter, critic_warmup_iters=0,
                       num_minibatches=args.num_minibatches, target_kl=0.0)
        fcfg = FinetuneConfig(rl=rl)
        critic = make_critic(policy, env.spec, policy.normalizer, fcfg, algo).to(device)
        chunked = ChunkedEnv.for_policy(env, policy.config)
        ppo = PPO(algo, critic, chunked, rl, seed=ctx.seed(0), dist=ctx)
        steps = []
        original_step = ppo.actor_opt.step
        ppo.actor_opt.step = lambda *a, **k: steps.append(1) or original_step(*a, **k)
        reset_s = [0.0]
        original_reset = chunked._reset_done

        def timed_reset(ids):
            _sync(device)
            t = time.perf_counter()
            original_reset(ids)
            _sync(device)
            reset_s[0] += time.perf_counter() - t

        chunked._reset_done = timed_reset
        collect_s, update_s, env_steps = [], [], 0
        for _ in range(args.iterations):
            _sync(device)
            t = time.perf_counter()
            buf, next_value, stats = ppo.collect()
            _sync(device)
            collect_s.append(time.perf_counter() - t)
            env_steps += stats.env_steps
            t = time.perf_counter()
            ppo.update(buf, next_value)
            _sync(device)
            update_s.append(time.perf_counter() - t)
        with CudaSyncCounter() as counter:
            ppo.collect()
        warm = slice(1, None) if args.iterations > 1 else slice(None)  # the first iteration warms up kernels
        result = {
            "ok": True,
            "env": task,
            "world_size": ctx.world_size,
            "num_envs_per_rank": args.num_envs,
            "device": str(device),
            "sim_device": str(raw.device),
            "render_device": str(getattr(getattr(raw, "backend", None), "render_device", None)),
            "env_build_seconds": round(env_build_s, 1),
            "env_steps_per_s": round(env_steps / max(sum(collect_s), 1e-9), 1),
            "rollout_seconds": [round(s, 2) for s in collect_s],
            "update_seconds": [round(s, 2) for s in update_s],
            "iteration_seconds": round(float(np.mean([c + u for c, u in zip(collect_s[warm], update_s[warm],
                                                                                strict=True)])), 2),
            "reset_seconds_per_iteration": round(reset_s[0] / args.iterations, 3),
            "optimizer_steps_per_iteration": len(steps) // args.iterations,
            "host_syncs_per_chunk": round(counter.count / args.steps_per_iter, 2),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (stand-in dry run)",
        }
        per_rank = [result["device"], result["sim_device"], result["render_device"]]
        if ctx.enabled:
            import torch.distributed as dist

            gathered = [None] * ctx.world_size
            dist.all_gather_object(gathered, per_rank)
            result["rank_devices"] = gathered
        if ctx.is_main:
            print(json.dumps(result), flush=True)
        env.close()


if __name__ == "__main__":
    main()
