"""The in-process many-env fine-tuning path on CPU (ManiSkill GPU semantics from the stand-in env): host syncs
per rollout chunk and per update step do not grow with num_envs, the denoising loops compile as one graph,
and `rl.num_minibatches` fixes the optimizer steps per iteration at 1024 envs."""

import numpy as np
import pytest
import torch

from robotft.config import EnvConfig
from robotft.datasets.normalizer import Normalizer
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig
from robotft.policies.flow import FlowPolicy, FlowPolicyConfig
from robotft.rl.critic import ValueCritic
from robotft.rl.dppo import DPPO, DPPOConfig
from robotft.rl.ppo import PPO, PPOConfig

pytest.importorskip("mani_skill")
import maniskill_standin  # noqa: E402
from host_syncs import HostSyncCounter  # noqa: E402

pytestmark = pytest.mark.gpu_semantics


def _standin_env(monkeypatch, num_envs: int) -> ChunkedEnv:
    env_id = maniskill_standin.register()
    monkeypatch.setattr("robotft.envs.maniskill.resolve_sim_backend", lambda backend, device="cpu": "physx_cuda")
    cfg = EnvConfig(type="maniskill", task=env_id, num_envs=num_envs, max_episode_steps=8,
                    control_mode="pd_ee_delta_pos")
    return ChunkedEnv(make_env(cfg), obs_steps=1, act_steps=4)


def _count_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    """A list that grows by one at every `optimizer.step()`."""
    steps, original = [], optimizer.step

    def step(*args, **kwargs):
        steps.append(1)
        return original(*args, **kwargs)

    optimizer.step = step
    return steps


def _dppo_ppo(env: ChunkedEnv, **rl) -> PPO:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    norm = Normalizer.fit({"state": rng.normal(size=(64, 6)) * 0.2, "action": rng.uniform(-1, 1, (64, 2))},
                          {"state": "meanstd", "action": "minmax"})
    policy = DiffusionPolicy(DiffusionPolicyConfig(obs_steps=1, horizon_steps=4, act_steps=4, hidden_dims=(32, 32),
                                                   num_train_timesteps=10, ema_decay=0.0), env.spec, norm)
    algo = DPPO(policy, DPPOConfig(ft_denoising_steps=4))
    critic = ValueCritic(["state"], 6, norm, hidden_dims=(32,))
    cfg = PPOConfig(**{"steps_per_iter": 4, "update_epochs": 1, "critic_warmup_iters": 0, "target_kl": 0.0, **rl})
    return PPO(algo, critic, env, cfg, seed=0)


def test_host_syncs_per_chunk_and_per_update_step_do_not_grow_with_num_envs(monkeypatch):
    per_chunk, per_step = {}, {}
    for num_envs in (8, 64, 256):
        env = _standin_env(monkeypatch, num_envs)
        try:
            ppo = _dppo_ppo(env, num_minibatches=2)
            ppo.collect()  # the first rollout resets every env
            with HostSyncCounter() as rollout:
                buf, next_value, stats = ppo.collect()
            assert stats.episodes > 0  # partial resets happened inside the counted rollout
            steps = _count_steps(ppo.actor_opt)
            update = HostSyncCounter()
            update.skip(ppo.actor_opt)
            update.skip(ppo.critic_opt)
            with update:
                ppo.update(buf, next_value)
        finally:
            env.close()
        per_chunk[num_envs] = rollout.count / ppo.cfg.steps_per_iter
        per_step[num_envs] = update.count / len(steps)
    print("host syncs per chunk", per_chunk, "per update step", per_step, rollout.ops, update.ops)
    assert len(set(per_chunk.values())) == 1, per_chunk
    assert len(set(per_step.values())) == 1, per_step
    assert per_chunk[8] <= 5, f"{per_chunk[8]} host syncs per rollout chunk ({rollout.ops})"
    assert per_step[8] <= 12, f"{per_step[8]} host syncs per update step ({update.ops})"


def test_optimizer_steps_per_iteration_at_1024_envs(monkeypatch):
    """num_minibatches fixes the optimizer steps per iteration (epochs × minibatches) at 1024 envs; the fixed
    minibatch_size of 50 chunks would take n // 50 per epoch."""
    env = _standin_env(monkeypatch, 1024)
    try:
        counts = {}
        for name, rl in (("num_minibatches", dict(num_minibatches=4)), ("minibatch_size", dict(minibatch_size=50))):
            ppo = _dppo_ppo(env, steps_per_iter=2, update_epochs=2, **rl)
            ppo.restart_episodes()
            buf, next_value, _ = ppo.collect()
            steps = _count_steps(ppo.actor_opt)
            ppo.update(buf, next_value)
            counts[name] = len(steps)
    finally:
        env.close()
    n = 1024 * 2
    assert counts == {"num_minibatches": 2 * 4, "minibatch_size": 2 * (n // 50)}


def _fullgraph(fn):
    try:
        return torch.compile(fn, fullgraph=True, backend="eager")
    except RuntimeError as e:  # pragma: no cover - torch builds without dynamo
        pytest.skip(f"torch.compile unavailable here: {e}")


def test_diffusion_sampling_loop_compiles_as_one_graph():
    """The whole DPPO sampling pass (chain, per-entry log-densities, actions) traces with fullgraph=True: no
    graph break, so no host sync, inside the denoising loop; and it computes what eager mode computes."""
    from tiny_specs import tiny_spec_and_normalizer

    torch.manual_seed(0)
    spec, norm = tiny_spec_and_normalizer()
    policy = DiffusionPolicy(DiffusionPolicyConfig(obs_steps=1, horizon_steps=4, act_steps=2, hidden_dims=(32, 32),
                                                   num_train_timesteps=10), spec, norm)
    policy.enable_finetuning(4)
    obs = {"state": torch.randn(6, 1, 3)}

    def sample(obs):
        chain = policy.sample_chain(obs, min_std=0.1, deterministic=True, logprob_min_std=0.08)
        return chain.latents, chain.elementwise_logprob, chain.actions

    def predict(obs):
        return policy.predict_chunk(obs, deterministic=True)

    for fn in (sample, predict):
        torch.manual_seed(1)  # the same initial noise x_K for both
        eager = fn(obs)
        torch.manual_seed(1)
        compiled = _fullgraph(fn)(obs)
        for a, b in zip(eager if isinstance(eager, tuple) else (eager,),
                        compiled if isinstance(compiled, tuple) else (compiled,), strict=True):
            torch.testing.assert_close(a, b)


def test_flow_sampling_loop_compiles_as_one_graph():
    from tiny_specs import tiny_spec_and_normalizer

    torch.manual_seed(0)
    spec, norm = tiny_spec_and_normalizer()
    policy = FlowPolicy(FlowPolicyConfig(obs_steps=1, horizon_steps=4, act_steps=2, width=32, num_heads=2,
                                         num_layers=1, num_steps=4), spec, norm).eval()
    obs = {"state": torch.randn(6, 1, 3)}

    def sample(obs):
        chain = policy.sample_chain(obs, noise_std=0.1, deterministic=True, generator=None)
        return chain.latents, chain.logprob

    torch.manual_seed(1)
    eager = sample(obs)
    torch.manual_seed(1)
    compiled = _fullgraph(sample)(obs)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)


def test_dppo_act_returns_the_logprobs_of_the_chain_it_sampled():
    """act's log-probabilities come from the sampling pass; re-scoring the chain gives the same values."""
    from tiny_specs import tiny_spec_and_normalizer

    torch.manual_seed(0)
    spec, norm = tiny_spec_and_normalizer()
    for sampler in ("ddpm", "ddim"):
        policy = DiffusionPolicy(DiffusionPolicyConfig(obs_steps=1, horizon_steps=4, act_steps=2,
                                                       hidden_dims=(32, 32), num_train_timesteps=10,
                                                       sampler=sampler, ddim_steps=5), spec, norm)
        algo = DPPO(policy, DPPOConfig(ft_denoising_steps=3, min_sampling_std=0.1, min_logprob_std=0.05))
        obs = {"state": torch.randn(7, 1, 3)}
        for deterministic in (False, True):
            out = algo.act(obs, deterministic=deterministic)
            with torch.no_grad():
                rescored = algo.logprob(obs, out.sample)
            torch.testing.assert_close(out.logprob, rescored, rtol=1e-5, atol=1e-5)


def test_cuda_graphs_are_refused_off_cuda(monkeypatch):
    env = _standin_env(monkeypatch, 4)
    try:
        with pytest.raises(ValueError, match="rl.cuda_graphs needs a CUDA device"):
            _dppo_ppo(env, cuda_graphs=True)
    finally:
        env.close()


def test_gpu_check_script_reports_its_figures_with_the_standin_env():
    """`scripts/gpu_check.py --standin` (what gpu_check.sh runs on a GPU where ManiSkill's GPU sim cannot start)
    prints one JSON line whose optimizer steps follow `update_epochs x num_minibatches`, on the CPU here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(repo / "scripts" / "gpu_check.py"), "--standin", "--num-envs", "8",
                          "--iterations", "1", "--steps-per-iter", "4", "--num-minibatches", "2"],
                         capture_output=True, text=True, timeout=300, cwd=repo)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["env"] == "RobotftStandIn-v1" and result["num_envs_per_rank"] == 8
    assert result["optimizer_steps_per_iteration"] == PPOConfig().update_epochs * 2
    assert result["env_steps_per_s"] > 0 and len(result["update_seconds"]) == 1
