"""The fine-tuning loop of the off-policy algorithms (`robotft finetune --algo dsrl | pa_rl | residual_sac |
filtered_bc`), beside the PPO family's in robotft.finetune.

Same envs, evaluation path (`robotft.evaluation.evaluate`), logging (TensorBoard + metrics.jsonl), checkpoints and
`robotft eval` as the PPO family. One iteration (`--iterations`) collects `offpolicy.steps_per_iter` chunks per env
into the replay buffer and then updates (robotft.rl.offpolicy); `eval/success_rate` is logged before the first and
after the last iteration. The replay buffer is saved in each checkpoint's training state, so `--resume` continues
with the same buffer, counters and optimizers.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from robotft import checkpoint as ckpt_io
from robotft.config import resolve_device, to_dict
from robotft.envs.chunked import ChunkedEnv
from robotft.evaluation import EvalResult
from robotft.policies.base import Policy
from robotft.rl.kl_monitor import KLToBase
from robotft.rl.offpolicy import SOURCE_DEMOS, OffPolicy, OffPolicyAlgorithm
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import store_transitions
from robotft.runlog import RunLogger, progress_bar
from robotft.specs import check_policy_fits_env
from robotft.threads import torch_threads, update_threads

if TYPE_CHECKING:
    from robotft.finetune import FinetuneConfig
    from robotft.specs import EnvSpec


PRETRAIN_BLOCK = 100
"""Critic pre-training steps between progress updates."""


def make_q_ensemble(policy: Policy, spec: EnvSpec, algo: OffPolicyAlgorithm, cfg: FinetuneConfig) -> QEnsemble:
    """The Q ensemble over the policy's low-dim observation history and the algorithm's critic action (camera keys
    are left out: the critic is only used in training, where the simulator's state is at hand)."""
    keys = [k for k in policy.config.obs_keys if not k.startswith(("rgb/", "depth/"))]
    if not keys:
        raise ValueError(f"the critic needs a low-dim observation key beside the cameras; policy.obs_keys are "
                         f"{policy.config.obs_keys} (add `state`)")
    obs_dim = sum(int(np.prod(spec.observations[k].shape)) for k in keys) * policy.config.obs_steps
    o = cfg.offpolicy
    return QEnsemble(keys, obs_dim, algo.action_dim, policy.normalizer, hidden_dims=o.critic_hidden,
                     ensemble=o.num_critics)


def source_demos(source: ckpt_io.Checkpoint) -> str:
    """`offpolicy.demo_data source`: the dataset store `source`'s policy was behaviour-cloned on, or "" (online
    data only, said on stderr) where none is recorded, it no longer exists, or it records no outcome to learn from
    (neither `reward` nor `success`)."""
    from robotft.datasets.store import ReplayBuffer

    store = ckpt_io.training_dataset(source)
    if not store:
        why = "no BC dataset is recorded for it"
    elif not Path(store).exists():
        why = f"its dataset {store} does not exist here"
    elif not {"reward", "success"} & set(ReplayBuffer.open(store).features):
        why = f"its dataset {store} has neither a 'reward' nor a 'success' key"
    else:
        return store
    print(f"offpolicy.demo_data source: {source.path}: {why}; training on online data only (pass "
          "--offpolicy.demo_data STORE to mix demonstrations in)", file=sys.stderr)
    return ""


def run_offpolicy_finetune(cfg: FinetuneConfig, policy_overrides: dict[str, str] | None = None,
                           resume: bool = False) -> Path:
    """Fine-tune with an off-policy algorithm and checkpoint. Returns the run directory."""
    from robotft.envs.factory import make_env
    from robotft.finetune import (
        evaluate_policy,
        iteration_scalars,
        load_start,
        log_eval_and_keep_best,
        write_learning_curve,
    )

    if cfg.rollout.backend != "inprocess":
        raise ValueError(f"--algo {cfg.algo} collects in this process; rollout.backend {cfg.rollout.backend!r} "
                         "is for the PPO family")
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    out = Path(cfg.out)
    start = load_start(cfg, policy_overrides, resume, device)
    cfg, source, origin, resuming, policy = start.cfg, start.source, start.origin, start.resuming, start.policy
    env_cfg, previous, algo = cfg.env, start.previous, start.algo
    o = policy.config
    if cfg.offpolicy.demo_data == SOURCE_DEMOS:
        cfg = dataclasses.replace(cfg, offpolicy=dataclasses.replace(cfg.offpolicy, demo_data=source_demos(source)))

    env = make_env(env_cfg, device=device)
    check_policy_fits_env(source.spec, env.spec, str(source.path))
    chunked = ChunkedEnv.for_policy(env, o)
    eval_env = env
    if cfg.eval_episodes > 0 and cfg.eval_num_envs:
        eval_env = make_env(dataclasses.replace(env_cfg, num_envs=cfg.eval_num_envs), device=device)
    chunked_eval = ChunkedEnv.for_policy(eval_env, o)
    critic = make_q_ensemble(policy, source.spec, algo, cfg).to(device) if algo.uses_critic else None
    demos = None
    if cfg.offpolicy.demo_data:
        demos, info = store_transitions(cfg.offpolicy.demo_data, [k for k in o.obs_keys], o.obs_steps,
                                        o.horizon_steps, o.act_steps, device=chunked.device)
        print(f"demonstrations: {info['episodes']} episodes, {info['transitions']} chunk transitions, "
              f"success {info['success_rate']:.2f} ({cfg.offpolicy.demo_data})", file=sys.stderr)
    learner = OffPolicy(algo, critic, chunked, cfg.offpolicy, seed=cfg.seed, demos=demos)
    kl_monitor = KLToBase(policy, cfg.kl_to_base)
    if resuming:
        state = source.training_state()
        learner.load_state_dict(state["offpolicy"])
        kl_monitor.load_state_dict(state.get("kl_to_base"))
        if learner.iteration >= cfg.rl.iterations:
            raise ValueError(f"{previous} is at iteration {learner.iteration} and --iterations is "
                             f"{cfg.rl.iterations}: nothing to resume (raise --iterations to train longer)")
        print(f"resuming {out} from iteration {learner.iteration} ({len(learner.replay)} transitions in the "
              f"replay buffer)", file=sys.stderr)
    wall_offset = float(source.meta.get("wall_seconds", 0.0)) if resuming else 0.0
    t_start = time.perf_counter()

    def wall_seconds() -> float:
        return wall_offset + time.perf_counter() - t_start

    run_config = {"stage": "finetune", **to_dict(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"run": run_config, "policy": to_dict(o)}, indent=2))

    def run_eval() -> EvalResult:
        result = evaluate_policy(policy, chunked_eval, cfg.eval_episodes)
        if eval_env is env:
            learner.restart_episodes()  # evaluation left the shared envs mid-episode
        return result

    def checkpoint_contents(metrics: dict[str, Any], with_state: bool = True) -> dict[str, Any]:
        return dict(
            model_state=policy.state_dict(),
            config={"policy": to_dict(o), "env": to_dict(env_cfg), "spec": source.spec.to_dict(), "run": run_config},
            normalizer=source.normalizer,
            meta={"stage": "finetune", "step": learner.iteration, "env_steps": learner.env_steps,
                  "metrics": metrics, "algo": cfg.algo, "source": origin, "wall_seconds": wall_seconds()},
            # The best checkpoint is for evaluation and deployment: it does not carry the replay buffer.
            training_state={"offpolicy": learner.state_dict(), "kl_to_base": kl_monitor.state_dict()}
            if with_state else None,
        )

    def save(metrics: dict[str, Any]) -> None:
        ckpt_io.save_run_checkpoint(out, learner.iteration, **checkpoint_contents(metrics))

    def evaluate_and_keep_best(when: str) -> dict[str, Any]:
        return log_eval_and_keep_best(log, learner.env_steps, run_eval(), when, wall_seconds(), out,
                                      lambda metrics: checkpoint_contents(metrics, with_state=False))

    metrics: dict[str, Any] = {}
    try:
        with RunLogger(out, resume_step=learner.env_steps if resuming else None, wandb=cfg.wandb,
                       config=run_config) as log:
            if learner.iteration == 0:
                if cfg.eval_episodes > 0:
                    metrics = evaluate_and_keep_best("before fine-tuning")
                _warm_start(learner, log)
            threads = update_threads(cfg.update_threads)  # resolved once: a bad $ROBOTFT_UPDATE_THREADS fails here
            bar = progress_bar(range(learner.iteration, cfg.rl.iterations), desc=f"finetune[{cfg.algo}]",
                               initial=learner.iteration, total=cfg.rl.iterations)
            for _ in bar:
                stats = learner.collect()
                kl = kl_monitor.estimate(learner.replay.recent_obs(chunked.num_envs * cfg.offpolicy.steps_per_iter))
                t0 = time.perf_counter()
                with torch_threads(threads):
                    update = learner.update()
                learner.iteration += 1
                scalars = iteration_scalars(update, stats, kl, time.perf_counter() - t0, learner.env_steps,
                                            wall_seconds())
                if learner.start_states is not None:
                    scalars["train/replayed_starts"] = float(stats.replayed_starts)
                    scalars["train/failed_starts_waiting"] = float(learner.start_states.waiting)
                    if stats.replays_ended:
                        scalars["train/replay_success_rate"] = stats.replays_solved / stats.replays_ended
                log.log(learner.env_steps, scalars)
                last = learner.iteration == cfg.rl.iterations
                if cfg.eval_episodes > 0 and (last or learner.iteration % cfg.eval_every == 0):
                    metrics = evaluate_and_keep_best(f"iteration {learner.iteration}")
                # `eval` is the last evaluation's success rate (the rollouts' own is train/success_rate).
                bar.set_postfix(eval=f"{metrics['success_rate']:.2f}" if metrics else "-",
                                q=f"{update.get('q_mean', float('nan')):.2f}")
                if last or learner.iteration % cfg.save_every == 0:
                    save(metrics)
            bar.close()
    finally:
        env.close()
        if eval_env is not env:
            eval_env.close()
    write_learning_curve(out)
    return out


def _warm_start(learner: OffPolicy, log: RunLogger) -> None:
    """Before the first iteration: fit the critic on the demonstrations (`critic_pretrain_steps`, logging the
    means of the last `PRETRAIN_BLOCK` steps) and fill the buffer with WSRL's warm-up rollouts of the initial
    policy (`warmup_steps`)."""
    cfg = learner.cfg
    if cfg.critic_pretrain_steps:
        bar = progress_bar(total=cfg.critic_pretrain_steps, desc="critic pre-training")
        for start in range(0, cfg.critic_pretrain_steps, PRETRAIN_BLOCK):
            steps = min(PRETRAIN_BLOCK, cfg.critic_pretrain_steps - start)
            metrics = learner.pretrain_critic(steps)
            bar.update(steps)
            bar.set_postfix(q=f"{metrics.get('q_mean', float('nan')):.2f}",
                            loss=f"{metrics.get('critic_loss', float('nan')):.3g}")
        bar.close()
        log.log(learner.env_steps, {f"warmup/{k}": v for k, v in metrics.items()})
    if cfg.warmup_steps:
        stats = learner.collect(cfg.warmup_steps, warmup=True)
        scalars = {"warmup/env_steps": float(learner.env_steps)}
        if stats.episodes:
            scalars["warmup/success_rate"] = stats.successes / stats.episodes
        log.log(learner.env_steps, scalars)
