"""Ray rollout workers on a local Ray cluster (2 CPUs, shared by the module): the same transitions as the
in-process collector, a killed worker replaced and its slice re-run, and `robotft finetune --rollout.backend ray`.
"""

import dataclasses
import os
import time

import pytest
import torch

from robotft.checkpoint import read_checkpoint
from robotft.config import EnvConfig, from_dict
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.finetune import FinetuneConfig, make_algorithm, make_critic, run_finetune
from robotft.policies.base import build_policy, policy_config_class
from robotft.rl.ppo import PPO, PPOConfig
from robotft.rl.rollout import (
    RayCollector,
    RolloutConfig,
    learner_weights,
    sampling_seed,
    worker_seed,
    worker_setup,
)
from robotft.runlog import read_metrics

ray = pytest.importorskip("ray")
# One xdist process runs the whole module, so the suite never starts two local Ray instances at once.
pytestmark = pytest.mark.xdist_group("ray")

TOY_NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=6, max_episode_steps=40, control_mode="velocity_2d",
                      reward_mode="dense", control_hz=10.0)

ENVS_PER_WORKER = 3
RL = PPOConfig(steps_per_iter=12, update_epochs=1, minibatch_size=36, critic_warmup_iters=0)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module (start-up takes several seconds here)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def learner(source, rollout: RolloutConfig) -> tuple[FinetuneConfig, PPO]:
    """The learner's PPO over the checkpoint's policy (no envs of its own), as run_finetune builds it."""
    ckpt = read_checkpoint(source)
    cfg = FinetuneConfig(source=str(source), algo="ppo", env=dataclasses.replace(TOY_NAV2D, num_envs=6), rl=RL,
                         rollout=rollout, seed=3)
    policy = build_policy(from_dict(policy_config_class(ckpt.config["policy"]["type"]), ckpt.config["policy"]),
                          ckpt.spec, ckpt.normalizer)
    policy.load_state_dict(ckpt.model_state)
    algo = make_algorithm(cfg.algo, policy, cfg)
    torch.manual_seed(0)
    return cfg, PPO(algo, make_critic(policy, ckpt.spec, ckpt.normalizer, cfg, algo), None, cfg.rl, seed=cfg.seed)


def in_process(ppo: PPO, num_envs: int, seed: int, iteration: int, sampling: int | None = None):
    """`PPO.collect` in this process on `num_envs` fresh toy envs, with the learner's weights."""
    policy_cfg = ppo.algo.policy.config
    env = ChunkedEnv(make_env(dataclasses.replace(TOY_NAV2D, num_envs=num_envs)), policy_cfg.obs_steps,
                     policy_cfg.act_steps)
    local = PPO(ppo.algo, ppo.critic, env, ppo.cfg, seed=seed)
    local.iteration = iteration
    if sampling is not None:
        torch.manual_seed(sampling)
    return local.collect()


def free_cpus_after_release(at_least: float, timeout_s: float = 120.0) -> float:
    """The cluster's free CPUs once they reach `at_least`, or after `timeout_s`: Ray frees a killed actor's
    resources asynchronously, so a count read straight after a close can still include them (an exited
    driver's actors took over 30 s to go with another test process on the same 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return ray.available_resources().get("CPU", 0)


def collector_for(ppo_cfg: FinetuneConfig, ppo: PPO) -> RayCollector:
    return RayCollector(ppo_cfg.rollout, worker_setup(ppo_cfg, ppo.algo.policy.config, ppo.algo.policy.spec,
                                                      ppo.algo.policy.normalizer), ppo_cfg.seed)


@pytest.fixture(scope="module")
def two_workers(cluster, weak_gaussian_bc):
    """A learner and a collector with 2 workers of 3 envs each (workers take seconds to start: shared)."""
    rollout = RolloutConfig(backend="ray", num_workers=2, envs_per_worker=ENVS_PER_WORKER, cpus_per_worker=0.5)
    cfg, ppo = learner(weak_gaussian_bc, rollout)
    collector = collector_for(cfg, ppo)
    yield cfg, ppo, collector
    collector.close()


def test_ray_workers_collect_what_the_in_process_collector_does(two_workers):
    cfg, ppo, collector = two_workers
    rollout = cfg.rollout
    ppo.iteration = 0
    buf, next_value, stats = collector.collect(ppo)
    # The same number of transitions as one process stepping all 6 envs, from the same initial states.
    ref_buf, _, ref_stats = in_process(ppo, rollout.num_envs, cfg.seed, iteration=0)
    assert buf.rewards.shape == ref_buf.rewards.shape == (RL.steps_per_iter, rollout.num_envs)
    assert stats.env_steps == ref_stats.env_steps == ppo.env_steps == RL.steps_per_iter * 6 * 4
    assert torch.equal(buf.obs["state"][0], ref_buf.obs["state"][0])
    # With the same seeds, each worker's slice is exactly the in-process collector on that worker's envs.
    for w in range(rollout.num_workers):
        part, part_next, part_stats = in_process(ppo, ENVS_PER_WORKER, worker_seed(cfg.seed, w, ENVS_PER_WORKER), 0,
                                                 sampling_seed(worker_seed(cfg.seed, w, ENVS_PER_WORKER), w, 0))
        cols = slice(w * ENVS_PER_WORKER, (w + 1) * ENVS_PER_WORKER)
        # (close, not bit-equal: the worker runs torch on one thread, this process maybe on more)
        assert torch.equal(buf.dones[:, cols], part.dones)
        for name in ("rewards", "values", "logprobs"):
            torch.testing.assert_close(getattr(buf, name)[:, cols], getattr(part, name), msg=name)
        for key, value in part.samples.items():
            torch.testing.assert_close(buf.samples[key][:, cols], value, msg=key)
        torch.testing.assert_close(buf.obs["state"][:, cols], part.obs["state"])
        torch.testing.assert_close(next_value[cols], part_next)
    assert stats.episodes > 0
    # The merged buffer feeds the PPO core's update like an in-process one.
    assert "value_loss" in ppo.update(buf, next_value)


def test_killed_worker_is_replaced_and_its_slice_rerun(two_workers):
    cfg, ppo, collector = two_workers
    ppo.iteration = 1
    doomed = collector.workers[0]
    collector.submit(1, learner_weights(ppo))
    ray.kill(doomed, no_restart=True)  # mid-rollout: its slice of iteration 1 is lost
    slices = collector.gather()
    assert collector.replacements == 1 and collector.workers[0] is not doomed
    assert [s["rewards"].shape for s in slices] == [(RL.steps_per_iter, ENVS_PER_WORKER)] * 2
    # The replacement re-ran the slice from fresh envs, reproducibly: the in-process collector on new envs.
    seed = worker_seed(cfg.seed, 0, ENVS_PER_WORKER)
    ref, ref_next, _ = in_process(ppo, ENVS_PER_WORKER, seed, 1, sampling_seed(seed, 0, 1))
    torch.testing.assert_close(slices[0]["rewards"], ref.rewards)
    torch.testing.assert_close(slices[0]["next_value"], ref_next)
    ppo.iteration = 2
    _, _, stats = collector.collect(ppo)  # the run goes on with the replacement
    assert stats.env_steps == RL.steps_per_iter * cfg.rollout.num_envs * 4


def test_a_worker_failing_beyond_max_restarts_stops_the_run(cluster, weak_gaussian_bc):
    rollout = RolloutConfig(backend="ray", num_workers=1, envs_per_worker=2, cpus_per_worker=0.5, max_restarts=0)
    cfg, ppo = learner(weak_gaussian_bc, rollout)
    free_cpus = ray.available_resources().get("CPU", 0)
    collector = collector_for(cfg, ppo)
    try:
        collector.submit(0, learner_weights(ppo))
        ray.kill(collector.workers[0], no_restart=True)
        with pytest.raises(RuntimeError, match=r"rollout worker 0 failed 1 times .*max_restarts=0"):
            collector.gather()
    finally:
        collector.close()
    # (at least: an earlier test's killed worker may still have been releasing its CPU when `free_cpus` was read)
    assert free_cpus_after_release(free_cpus) >= free_cpus, "the failed run left its worker behind"


def test_cli_finetune_on_ray_workers(cluster, cli, weak_gaussian_bc, tmp_path, monkeypatch):
    """`robotft finetune --rollout.backend ray --rollout.address ...` joins the cluster, trains and evaluates."""
    # A client joins a token-authenticated cluster with RAY_AUTH_MODE=token (the token is in ~/.ray), which
    # ray.init set in this process after the session's CLI environment was captured.
    monkeypatch.setattr(cli, "env", {**cli.env, **{k: v for k, v in os.environ.items() if k.startswith("RAY_")}})
    out = tmp_path / "ft"
    free_cpus = ray.available_resources().get("CPU", 0)
    cli.run("finetune", "--from", weak_gaussian_bc, "--algo", "ppo", "--iterations", 2, "--out", out,
            "--rollout.backend", "ray", "--rollout.address", cluster, "--rollout.num_workers", 2,
            "--rollout.envs_per_worker", 4, "--rollout.cpus_per_worker", 0.5, "--rl.steps_per_iter", 5,
            "--rl.minibatch_size", 20, "--rl.update_epochs", 2, "--rl.critic_warmup_iters", 1,
            "--eval_episodes", 4, "--eval_every", 2, cwd=tmp_path, timeout=600)
    ckpt = read_checkpoint(out)
    assert ckpt.meta["step"] == 2 and ckpt.meta["env_steps"] == 2 * 5 * 8 * 4
    assert ckpt.config["run"]["rollout"]["backend"] == "ray"
    rows = read_metrics(out)
    assert [r["train/env_steps"] for r in rows if "train/env_steps" in r] == [160, 320]
    assert sum("eval/success_rate" in r for r in rows) == 2  # before fine-tuning and after the last iteration
    assert free_cpus_after_release(free_cpus) >= free_cpus, "the run left workers behind"


def test_rollout_config_is_validated():
    with pytest.raises(ValueError, match="rollout.backend 'slurm'"):
        RolloutConfig(backend="slurm")
    with pytest.raises(ValueError, match="rollout.num_workers must be >= 1"):
        RolloutConfig(backend="ray", num_workers=0)
    assert RolloutConfig(num_workers=3, envs_per_worker=4).num_envs == 12
    cfg = FinetuneConfig(source="unused", rollout=RolloutConfig(backend="ray"), rl=PPOConfig(reward_scale=True))
    with pytest.raises(ValueError, match="rl.reward_scale is not supported with rollout.backend ray"):
        run_finetune(cfg)
