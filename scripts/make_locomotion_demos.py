"""Locomotion demonstrations from an expert that robotft trains itself (gymnasium MuJoCo, Gaussian PPO).

    python scripts/make_locomotion_demos.py --env mujoco/hopper --minutes 5 --episodes 20 --out runs/hopper

1. Random-action rollouts give the normalizer its statistics (`<out>/random.zarr`).
2. A freshly initialised `gaussian_mlp` checkpoint (BC with learning rate 0) is trained from scratch with
   `--algo ppo` (robotft.rl.gaussian_ppo) in chunks of iterations until the time budget is spent
   (`<out>/expert`).
3. The expert's mean action (exploration noise off) is rolled out with `record_rollouts` into the
   dataset store `<out>/demos.zarr`: every episode is kept, its return is in the `reward` column.

Prints one JSON line: the expert's mean return, training env steps and seconds, and the dataset path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from robotft.checkpoint import load_policy, read_checkpoint
from robotft.config import ConfigError, find_preset, from_dict, load_env_config, load_yaml, to_dict
from robotft.datasets.recording import record_rollouts, rollout_features
from robotft.datasets.store import DatasetWriter, ReplayBuffer
from robotft.envs.base import Obs
from robotft.envs.factory import make_env
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.policies.base import Policy, policy_config_class
from robotft.pretrain import PretrainConfig, TrainConfig, run_pretrain


class UniformExpert:
    """Uniformly random actions within the action bounds (for normalizer statistics)."""

    def __init__(self, low: tuple[float, ...], high: tuple[float, ...], seed: int) -> None:
        self.low, self.high = torch.tensor(low), torch.tensor(high)
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self, env_ids: torch.Tensor, obs: Obs) -> None:
        pass

    def __call__(self, obs: Obs) -> torch.Tensor:
        u = torch.rand(obs["state"].shape[0], self.low.numel(), generator=self.generator)
        return self.low + u * (self.high - self.low)


class ChunkExpert:
    """A chunked policy as a per-step expert: plans a chunk, executes its first `act_steps` actions open-loop,
    re-plans (the same execution as ChunkedEnv). Needs `obs_steps == 1`."""

    def __init__(self, policy: Policy, num_envs: int) -> None:
        if policy.config.obs_steps != 1:
            raise ValueError(f"ChunkExpert needs a policy with obs_steps 1, got {policy.config.obs_steps}")
        self.policy = policy
        self.act_steps = policy.config.act_steps
        self.chunk: torch.Tensor | None = None
        self.index = torch.full((num_envs,), self.act_steps, dtype=torch.long)

    def reset(self, env_ids: torch.Tensor, obs: Obs) -> None:
        self.index[env_ids.cpu()] = self.act_steps

    @torch.no_grad()
    def __call__(self, obs: Obs) -> torch.Tensor:
        stale = self.index >= self.act_steps
        if stale.any():
            fresh = self.policy.predict_chunk({k: v.unsqueeze(1) for k, v in obs.items()}, deterministic=True)
            self.chunk = fresh if self.chunk is None else torch.where(stale.view(-1, 1, 1), fresh, self.chunk)
            self.index[stale] = 0
        action = self.chunk[torch.arange(len(self.index)), self.index]
        self.index += 1
        return action


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="mujoco/hopper", help="env preset (mujoco/hopper, mujoco/walker2d, ...)")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget for PPO training")
    p.add_argument("--episodes", type=int, default=20, help="demonstrations to record")
    p.add_argument("--num-envs", type=int, default=8, help="parallel training envs")
    p.add_argument("--iterations-per-round", type=int, default=5, help="PPO iterations between budget checks")
    p.add_argument("--out", default="runs/locomotion", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    env_cfg = dataclasses.replace(load_env_config(args.env), num_envs=args.num_envs)
    policy_data = load_yaml(find_preset("policies", "gaussian_mlp"))
    policy_cfg = from_dict(policy_config_class(policy_data["type"]), policy_data)
    # Locomotion reacts at every control step; one-step chunks are CleanRL's PPO setting.
    policy_cfg = dataclasses.replace(policy_cfg, horizon_steps=1, act_steps=1, log_std_init=-0.5)

    random_store = out / "random.zarr"
    if not random_store.exists():
        _record(env_cfg, lambda env: UniformExpert(env.spec.action.low, env.spec.action.high, args.seed),
                20, random_store, "uniform random actions", args.seed)

    init = out / "init"
    if not (init / "checkpoint").exists():
        train = TrainConfig(steps=1, lr=0.0, batch_size=64, eval_every=0, save_every=1, seed=args.seed, device="cpu")
        run_pretrain(PretrainConfig(data=str(random_store), out=str(init), env=env_cfg, train=train), policy_cfg)

    expert_dir = out / "expert"
    cfg = FinetuneConfig(source=str(init), out=str(expert_dir), algo="ppo", env=env_cfg, seed=args.seed,
                         eval_every=10**9, eval_episodes=0, save_every=args.iterations_per_round, device="cpu")
    # CleanRL's continuous-action PPO settings (2048 steps per rollout, lr 3e-4, clip 0.2, reward scaling).
    rl = cfg.rl
    rl.steps_per_iter = max(1, 2048 // args.num_envs)
    rl.actor_lr, rl.critic_lr, rl.clip_eps = 3e-4, 3e-4, 0.2
    rl.minibatch_size, rl.update_epochs, rl.critic_warmup_iters = 64, 10, 0
    rl.reward_scale, rl.target_kl, rl.max_grad_norm, rl.critic_hidden = True, 0.0, 0.5, (64, 64)
    t0 = time.perf_counter()
    resume = False
    while time.perf_counter() - t0 < args.minutes * 60:
        rl.iterations = (read_checkpoint(expert_dir).meta["step"] if resume else 0) + args.iterations_per_round
        run_finetune(cfg, resume=resume)
        resume = True
    train_seconds = time.perf_counter() - t0
    meta = read_checkpoint(expert_dir).meta

    policy, _ = load_policy(expert_dir, device="cpu")
    policy.eval()
    demos = out / "demos.zarr"
    stats = _record(env_cfg, lambda env: ChunkExpert(policy, env.num_envs), args.episodes, demos,
                    f"gaussian PPO expert {expert_dir}", args.seed + 10**6, overwrite=True)
    buffer = ReplayBuffer.open(demos)
    returns = [float(buffer.episode(i)["reward"].sum()) for i in range(buffer.n_episodes)]
    print(json.dumps({
        "env": args.env, "expert_mean_return": sum(returns) / len(returns), "expert_returns": returns,
        "mean_episode_length": float(buffer.episode_lengths.mean()),
        "train_env_steps": meta["env_steps"], "train_iterations": meta["step"], "train_seconds": train_seconds,
        "record_seconds": stats["seconds"], "demos": str(demos), "expert": str(expert_dir),
    }))


def _record(env_cfg, make_expert, episodes: int, path: Path, source: str, seed: int, overwrite: bool = False) -> dict:
    env = make_env(dataclasses.replace(env_cfg, num_envs=min(episodes, env_cfg.num_envs)), device="cpu")
    try:
        with DatasetWriter(path, rollout_features(env.spec), fps=env.spec.action.control_hz, action_spec=env.spec.action,
                           env=to_dict(env_cfg), source=source, mode="overwrite" if overwrite else "create") as writer:
            return record_rollouts(env, make_expert(env), episodes, writer, seed=seed, only_success=False,
                                   task=env_cfg.task)
    finally:
        env.close()


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        raise SystemExit(f"make_locomotion_demos: {e}") from None
