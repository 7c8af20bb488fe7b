"""Share of rollout time spent in reset handling at many envs, on CPU, with the stand-in of ManiSkill's GPU env.

The stand-in (tests/maniskill_standin.py) has ManiSkill 3.0.1's reset semantics and their cost: a seed list
rebuilds one numpy RNG per env, twice, per call. robotft's real ManiSkill adapter and ChunkedEnv drive it, with
a small DPPO policy sampling, through the PPO core's `collect`. Two seeding modes:

  unseeded   partial resets pass no seed (robotft's rule since the GPU-path fixes)
  seed-list  every partial reset passes one seed per env (the older adapter), restored here by a patch

Prints one JSON line per mode: rollout seconds, seconds inside partial resets, their share, host syncs per chunk.

    python scripts/bench_standin_rollout.py --num-envs 1024 --chunks 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def _legacy_reset(self, seed=None, env_ids=None):
    """The older `_RawManiSkill.reset`: a seed list of length num_envs on every seeded call, partial or not."""
    options = {} if env_ids is None else {"env_idx": env_ids.to(self._env.device, torch.long)}
    seeds = None if seed is None else [seed + i for i in range(self.num_envs)]
    obs, _ = self._env.reset(seed=seeds, options=options)
    ids = slice(None) if env_ids is None else env_ids.to(self.device, torch.long)
    self._elapsed[ids] = 0
    return self._convert_obs(obs)


def _measure(num_envs: int, chunks: int, legacy: bool) -> dict:
    import maniskill_standin
    from host_syncs import HostSyncCounter

    import robotft.envs.maniskill as adapter
    from robotft.config import EnvConfig
    from robotft.datasets.normalizer import Normalizer
    from robotft.envs.chunked import ChunkedEnv
    from robotft.envs.factory import make_env
    from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig
    from robotft.rl.critic import ValueCritic
    from robotft.rl.dppo import DPPO, DPPOConfig
    from robotft.rl.ppo import PPO, PPOConfig

    adapter.resolve_sim_backend = lambda backend, device="cpu": "physx_cuda"
    env_id = maniskill_standin.register()
    env = make_env(EnvConfig(type="maniskill", task=env_id, num_envs=num_envs, max_episode_steps=12,
                             control_mode="pd_ee_delta_pos"))
    chunked = ChunkedEnv(env, obs_steps=1, act_steps=4)
    if legacy:
        seed_base = [0]

        def reset_done(ids, _c=chunked):
            seed_base[0] += num_envs  # the older rule: seed + k * num_envs for the k-th partial reset
            obs = _legacy_reset(env._impl, seed=seed_base[0], env_ids=ids)
            for k, hist in _c._pad({k: v[ids] for k, v in obs.items()}).items():
                _c._history[k][ids] = hist
            _c._episode_return[ids] = 0.0
            _c._episode_length[ids] = 0
            _c._success_once[ids] = False

        chunked._reset_done = reset_done
    reset_s = [0.0]
    inner = chunked._reset_done

    def timed(ids):
        t = time.perf_counter()
        inner(ids)
        reset_s[0] += time.perf_counter() - t

    chunked._reset_done = timed
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    norm = Normalizer.fit({"state": rng.normal(size=(64, 6)) * 0.2, "action": rng.uniform(-1, 1, (64, 2))},
                          {"state": "meanstd", "action": "minmax"})
    policy = DiffusionPolicy(DiffusionPolicyConfig(obs_steps=1, horizon_steps=4, act_steps=4, hidden_dims=(64, 64),
                                                   num_train_timesteps=10, ema_decay=0.0), env.spec, norm)
    ppo = PPO(DPPO(policy, DPPOConfig(ft_denoising_steps=4)), ValueCritic(["state"], 6, norm, hidden_dims=(64,)),
              chunked, PPOConfig(steps_per_iter=chunks), seed=0)
    ppo.collect()  # warm-up; the first rollout also does the full reset
    reset_s[0] = 0.0
    t = time.perf_counter()
    with HostSyncCounter() as counter:
        _, _, stats = ppo.collect()
    total = time.perf_counter() - t
    env.close()
    return {"mode": "seed-list" if legacy else "unseeded", "num_envs": num_envs, "chunks": chunks,
            "episodes": stats.episodes, "rollout_seconds": round(total, 3), "reset_seconds": round(reset_s[0], 3),
            "reset_share": round(reset_s[0] / total, 4), "host_syncs_per_chunk": counter.count / chunks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-envs", type=int, default=1024)
    p.add_argument("--chunks", type=int, default=20)
    args = p.parse_args()
    for legacy in (False, True):
        print(json.dumps(_measure(args.num_envs, args.chunks, legacy)), flush=True)


if __name__ == "__main__":
    main()
