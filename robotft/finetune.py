"""RL fine-tuning of a pretrained policy in simulation: `robotft finetune --from CKPT --algo dppo`.

Loads the policy from a checkpoint, wraps it in the chosen algorithm, runs the PPO core on parallel envs,
evaluates before, during and after fine-tuning through the same `evaluate` path as `robotft eval`, logs to
TensorBoard, writes a learning-curve PNG and checkpoints that `robotft eval` loads with no extra flags.
`--resume` continues a killed run from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from tqdm import tqdm

from robotft import checkpoint as ckpt_io
from robotft.config import EnvConfig, from_dict, resolve_device, to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.distributed import DistContext, distributed
from robotft.envs.chunked import ChunkedEnv
from robotft.evaluation import EVAL_SEED, EvalResult, evaluate
from robotft.policies.base import Policy, build_policy, policy_config_class
from robotft.rl.algorithm import Algorithm, registered_algorithms
from robotft.rl.critic import ValueCritic
from robotft.rl.kl_monitor import KLMonitorConfig, KLToBase
from robotft.rl.offpolicy import OffPolicyAlgorithm, OffPolicyConfig
from robotft.rl.ppo import PPO, PPOConfig
from robotft.rl.rollout import RolloutConfig
from robotft.rl.shaping import check_shaping_env
from robotft.runlog import (
    NullLogger,
    RunLogger,
    WandbConfig,
    capped_update,
    plot_curves,
    progress_bar,
    read_metrics,
)
from robotft.specs import EnvSpec, check_policy_fits_env
from robotft.threads import torch_threads, update_threads

ALGORITHMS: dict[str, type[Algorithm] | type[OffPolicyAlgorithm]] = registered_algorithms()
"""`--algo` name → algorithm class (each registered by its own file in robotft/rl); each reads the FinetuneConfig
section of the same name. Off-policy algorithms (`core = "offpolicy"`) run in robotft.finetune_offpolicy."""


@dataclasses.dataclass
class FinetuneRunConfig:
    """An RL fine-tuning run (saved as `run` in every checkpoint's config.json); `FinetuneConfig` adds one
    section per registered algorithm."""

    source: str = ""
    """Checkpoint (or run directory) to start from (`--from`)."""
    out: str = "runs/finetune"
    """Run directory."""
    algo: str = "dppo"
    """Fine-tuning algorithm: one of ALGORITHMS."""
    env: EnvConfig | None = None
    """Training env; defaults to the checkpoint's env."""
    rl: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    """The PPO core shared by the on-policy algorithms."""
    offpolicy: OffPolicyConfig = dataclasses.field(default_factory=OffPolicyConfig)
    """The off-policy core (dsrl, pa_rl, residual_sac, filtered_bc); their iterations are `rl.iterations`."""
    kl_to_base: KLMonitorConfig = dataclasses.field(default_factory=KLMonitorConfig)
    """The `train/kl_to_base` monitor (robotft.rl.kl_monitor), logged by every algorithm."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Where rollouts run: in this process (default) or on Ray env workers (robotft.rl.rollout)."""
    eval_every: int = 5
    """Iterations between evaluations (also evaluated before the first and after the last)."""
    eval_episodes: int = 20
    """Episodes per evaluation; 0 disables evaluation."""
    eval_num_envs: int = 0
    """Parallel evaluation envs; 0 evaluates on the training envs themselves (each ManiSkill CPU worker holds
    ~0.5 GB, so separate evaluation workers would double the memory), which then start fresh episodes.
    With `rollout.backend ray` the training envs are remote: 0 then evaluates on `rollout.envs_per_worker`
    envs in the learner's process."""
    save_every: int = 5
    """Iterations between checkpoints (the last is always saved)."""
    update_threads: int = 0
    """Torch CPU threads during updates, when the simulator workers wait (rollouts keep the process's one
    thread: robotft.threads); 0: `$ROBOTFT_UPDATE_THREADS` where it is set, else every available core, shared
    among the ranks on this machine."""
    seed: int = 0
    """Seed of rollouts and sampling (evaluations always use the shared evaluation start states)."""
    device: str = "auto"
    """`auto`, `cpu` or `cuda`."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging (`--wandb` turns it on)."""

    def __post_init__(self) -> None:
        if self.update_threads < 0:
            raise ValueError(f"update_threads must be >= 0 (0: every available core), got {self.update_threads}")

    @classmethod
    def for_algorithm(cls, algo: str, **fields: Any) -> Any:
        """A config for `--algo algo` whose `rl.` section holds that algorithm's own defaults (its
        `rl_defaults`, from its paper) instead of the PPO core's; `fields` set the other fields. Apply user
        overrides on top of the result, so that a flag the user passes always wins."""
        if algo not in ALGORITHMS:
            raise ValueError(f"unknown --algo {algo!r}; available: {list(ALGORITHMS)}")
        rl = PPOConfig(**ALGORITHMS[algo].rl_defaults)
        offpolicy = OffPolicyConfig(**getattr(ALGORITHMS[algo], "offpolicy_defaults", {}))
        return cls(algo=algo, rl=rl, offpolicy=offpolicy, **fields)


FinetuneConfig = dataclasses.make_dataclass(
    "FinetuneConfig",
    [(name, algo.config_cls, dataclasses.field(default_factory=algo.config_cls)) for name, algo in ALGORITHMS.items()],
    bases=(FinetuneRunConfig,),
    namespace={"__doc__": "An RL fine-tuning run: the run's fields plus one section per registered algorithm "
                          "(`--dppo.*`, `--reinflow.*`, ...), read by the algorithm of the same name.",
               "__module__": __name__},
)
"""FinetuneRunConfig plus a field per registered algorithm: `cfg.dppo` is a DPPOConfig, and so on."""


def make_algorithm(name: str, policy: Policy, cfg: FinetuneConfig) -> Algorithm | OffPolicyAlgorithm:
    """The algorithm `--algo name` over `policy`, configured by the FinetuneConfig section of the same name
    (and `rl.logprob_reduction`)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown --algo {name!r}; available: {list(ALGORITHMS)}")
    algo = ALGORITHMS[name](policy, getattr(cfg, name))
    algo.logprob_reduction = cfg.rl.logprob_reduction
    return algo


def make_critic(policy: Policy, spec: EnvSpec, normalizer: Normalizer, cfg: FinetuneConfig,
                algo: Algorithm) -> ValueCritic:
    """The value critic over the policy's low-dim observation history (plus the algorithm's extra input).

    Camera keys are left out: the critic is only used in training, where the simulator's state is at hand,
    and an MLP on raw pixels would learn nothing useful (an asymmetric actor-critic)."""
    keys = [k for k in policy.config.obs_keys if not k.startswith(("rgb/", "depth/"))]
    if not keys:
        raise ValueError(f"the critic needs a low-dim observation key beside the cameras; policy.obs_keys are "
                         f"{policy.config.obs_keys} (add `state`)")
    obs_dim = sum(int(np.prod(spec.observations[k].shape)) for k in keys)
    return ValueCritic(keys, obs_dim * policy.config.obs_steps, normalizer,
                       hidden_dims=cfg.rl.critic_hidden, extra_dim=algo.critic_extra_dim)


def run_finetune(cfg: FinetuneConfig, policy_overrides: dict[str, str] | None = None, resume: bool = False) -> Path:
    """Fine-tune and checkpoint. Returns the run directory.

    Under torchrun every rank collects from its own envs (seeded by rank) and gradients are averaged across
    ranks (robotft.distributed); rank 0 evaluates and writes checkpoints and logs."""
    if getattr(ALGORITHMS.get(cfg.algo), "core", "ppo") == "offpolicy":
        from robotft.finetune_offpolicy import run_offpolicy_finetune

        if cfg.rl.potential_shaping:
            raise ValueError(f"rl.potential_shaping shapes the PPO core's rewards; --algo {cfg.algo} runs on the "
                             "off-policy core, which does not use it")

        return run_offpolicy_finetune(cfg, policy_overrides, resume)
    if cfg.rollout.backend == "ray" and cfg.rl.reward_scale:
        raise ValueError("rl.reward_scale is not supported with rollout.backend ray: the running return "
                         "statistics would differ between workers; use rollout.backend inprocess")
    with distributed(resolve_device(cfg.device)) as ctx:
        return _finetune(cfg, policy_overrides, resume, ctx)


@dataclasses.dataclass
class RunStart:
    """What a fine-tuning run starts from: its source checkpoint (the run's newest when resuming), the policy built
    from it and the `--algo` algorithm over that policy."""

    cfg: FinetuneConfig
    """The run config with `env` resolved (the checkpoint's env unless one was given)."""
    source: ckpt_io.Checkpoint
    origin: str
    """The pretrained checkpoint the run started from, also after any number of resumes."""
    resuming: bool
    previous: Path | None
    """The run's checkpoint being resumed."""
    algo: Algorithm | OffPolicyAlgorithm
    policy: Policy
    """The policy the algorithm trains (`algo.policy`): the checkpoint's, or a residual or noise-steered wrapper
    around it that the algorithm built."""


def load_start(cfg: FinetuneConfig, policy_overrides: dict[str, str] | None, resume: bool,
               device: torch.device | str) -> RunStart:
    """Read the source (or, with `resume`, the run's newest checkpoint), build its policy and the run's algorithm
    over it, on `device`; `policy_overrides` apply to a fresh run only (a resumed policy keeps what it was trained
    with)."""
    from robotft.config import apply_overrides

    out = Path(cfg.out)
    previous = ckpt_io.resume_checkpoint(out) if resume else None
    resuming = previous is not None
    if resume and not resuming:
        print(f"--resume: no checkpoint in {out} yet, starting from {cfg.source}", file=sys.stderr)
    source = ckpt_io.read_checkpoint(previous if resuming else cfg.source)
    # Absolute, so that a later run started from another directory still follows the chain back (training_dataset).
    started_from = str(source.path.resolve())
    origin = source.meta.get("source", started_from) if resuming else started_from
    cfg = dataclasses.replace(cfg, env=cfg.env or source.env_config())
    if cfg.env is None:
        raise ValueError(f"{source.path}: was trained without a simulator (no env in config.json); set the run's env")
    policy_cfg = from_dict(policy_config_class(source.config["policy"]["type"]), source.config["policy"])
    if policy_overrides and not resuming:
        policy_cfg = apply_overrides(policy_cfg, policy_overrides, prefix="policy.")
    policy = build_policy(policy_cfg, source.spec, source.normalizer)
    ckpt_io.load_weights(policy, source)
    algo = make_algorithm(cfg.algo, policy.to(device), cfg)
    # Residual PPO, residual SAC and DSRL wrap a plain base policy in a fresh (CPU) module.
    return RunStart(cfg, source, origin, resuming, previous, algo, algo.policy.to(device))


def _finetune(cfg: FinetuneConfig, policy_overrides: dict[str, str] | None, resume: bool, ctx: DistContext) -> Path:
    from robotft.envs.factory import make_env

    device = ctx.device(resolve_device(cfg.device))
    seed = ctx.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    out = Path(cfg.out)
    start = load_start(cfg, policy_overrides, resume, device)
    cfg, source, origin, resuming, policy = start.cfg, start.source, start.origin, start.resuming, start.policy
    env_cfg, previous, algo = cfg.env, start.previous, start.algo
    if cfg.rl.potential_shaping:
        check_shaping_env(env_cfg)

    # With Ray the training envs live on the workers; the learner only holds evaluation envs (rank 0).
    env = make_env(env_cfg, device=device) if cfg.rollout.backend == "inprocess" else None
    if env is not None:
        check_policy_fits_env(source.spec, env.spec, str(source.path))
    chunked = ChunkedEnv.for_policy(env, policy.config) if env is not None else None
    eval_env = env
    if ctx.is_main and cfg.eval_episodes > 0 and (cfg.eval_num_envs or env is None):
        num_eval = cfg.eval_num_envs or cfg.rollout.envs_per_worker
        eval_env = make_env(dataclasses.replace(env_cfg, num_envs=num_eval), device=device)
    chunked_eval = ChunkedEnv.for_policy(eval_env, policy.config) if eval_env is not None else None
    critic = make_critic(policy, source.spec, source.normalizer, cfg, algo).to(device)
    ppo = PPO(algo, critic, chunked, cfg.rl, seed=seed, dist=ctx, device=device)
    kl_monitor = KLToBase(policy, cfg.kl_to_base if ctx.is_main else KLMonitorConfig(num_obs=0))
    if resuming:
        ppo.load_state_dict(source.training_state()["ppo"])
        kl_monitor.load_state_dict(source.training_state().get("kl_to_base"))
        if ppo.iteration >= cfg.rl.iterations:
            raise ValueError(f"{previous} is at iteration {ppo.iteration} and --iterations is {cfg.rl.iterations}: "
                             "nothing to resume (raise --iterations to train longer)")
        print(f"resuming {out} from iteration {ppo.iteration}", file=sys.stderr)
    ctx.broadcast_parameters([*policy.state_dict().values(), *critic.state_dict().values(),
                              *algo.actor_parameters()])
    if ctx.rank > 0:  # each rank its own action-sampling stream; rank 0's is the single-process one
        torch.manual_seed(seed + ppo.iteration)
    collector = None
    if cfg.rollout.backend == "ray":
        from robotft.rl.rollout import RayCollector, worker_setup

        collector = RayCollector(cfg.rollout, worker_setup(cfg, policy.config, source.spec, source.normalizer), seed)
    # Wall-clock seconds of fine-tuning so far, continued across resumes (the x axis of success vs wall-clock).
    wall_offset = float(source.meta.get("wall_seconds", 0.0)) if resuming else 0.0
    t_start = time.perf_counter()

    def wall_seconds() -> float:
        return wall_offset + time.perf_counter() - t_start

    run_config = {"stage": "finetune", **to_dict(cfg)}
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"run": run_config, "policy": to_dict(policy.config)}, indent=2))

    def run_eval() -> EvalResult:
        result = evaluate_policy(policy, chunked_eval, cfg.eval_episodes)
        if eval_env is env:
            ppo.restart_episodes()  # evaluation left the shared envs mid-episode
        return result

    def checkpoint_contents(metrics: dict[str, Any]) -> dict[str, Any]:
        return dict(
            model_state=policy.state_dict(),
            config={"policy": to_dict(policy.config), "env": to_dict(env_cfg), "spec": source.spec.to_dict(),
                    "run": run_config},
            normalizer=source.normalizer,
            meta={"stage": "finetune", "step": ppo.iteration, "env_steps": ppo.env_steps, "metrics": metrics,
                  "algo": cfg.algo, "source": origin, "wall_seconds": wall_seconds()},
            training_state={"ppo": ppo.state_dict(), "kl_to_base": kl_monitor.state_dict()},
        )

    def save(metrics: dict[str, Any]) -> None:
        ckpt_io.save_run_checkpoint(out, ppo.iteration, **checkpoint_contents(metrics))

    def evaluate_and_keep_best(when: str) -> dict[str, Any]:
        return log_eval_and_keep_best(log, ppo.env_steps, run_eval(), when, wall_seconds(), out, checkpoint_contents)

    metrics: dict[str, Any] = {}
    try:
        logger = (RunLogger(out, resume_step=ppo.env_steps if resuming else None, wandb=cfg.wandb, config=run_config)
                  if ctx.is_main else NullLogger())
        with logger as log:
            if ctx.is_main and cfg.eval_episodes > 0 and ppo.iteration == 0:
                metrics = evaluate_and_keep_best("before fine-tuning")
            # Rollouts of the starting policy: those collected up to the first actor update.
            start_rollouts = StartingRollouts(metrics.get("success_rate"), ppo.first_actor_iteration)
            threads = update_threads(cfg.update_threads)  # resolved once: a bad $ROBOTFT_UPDATE_THREADS fails here
            bar = progress_bar(range(ppo.iteration, cfg.rl.iterations), desc=f"finetune[{cfg.algo}]",
                               initial=ppo.iteration, total=cfg.rl.iterations, disable=not ctx.is_main)
            warned_kl_stop = False  # once per run: the metric train/actor_steps records every iteration
            for _ in bar:
                buf, next_value, stats = ppo.collect() if collector is None else collector.collect(ppo)
                warning = start_rollouts.observe(ppo.iteration, stats.successes, stats.episodes, ppo.algo)
                if warning and ctx.is_main:
                    tqdm.write(warning, file=sys.stderr)
                kl_to_base = kl_monitor.estimate(buf.obs)  # the policy that collected this rollout
                t0 = time.perf_counter()
                with torch_threads(threads):
                    update = ppo.update(buf, next_value, signal=stats.signal)
                update_s = time.perf_counter() - t0
                if update["actor_skipped_no_signal"] and ctx.is_main:
                    tqdm.write(no_signal_message(ppo.iteration, stats.signal), file=sys.stderr)
                kl_warning = kl_stop_message(ppo.iteration, update, cfg.rl)
                if kl_warning and not warned_kl_stop and ctx.is_main:
                    tqdm.write(kl_warning, file=sys.stderr)
                    warned_kl_stop = True
                log.log(ppo.env_steps, iteration_scalars(update, stats, kl_to_base, update_s, ppo.env_steps,
                                                         wall_seconds()))
                last = ppo.iteration == cfg.rl.iterations
                if ctx.is_main and cfg.eval_episodes > 0 and (last or ppo.iteration % cfg.eval_every == 0):
                    metrics = evaluate_and_keep_best(f"iteration {ppo.iteration}")
                # KL is ~1e-4 per update: scientific notation. `eval` is the last evaluation's success rate
                # (the rollouts' own success, noisy and exploring, is `train/success_rate` in the logs).
                bar.set_postfix(eval=f"{metrics['success_rate']:.2f}" if metrics else "-",
                                kl=f"{update.get('approx_kl', 0.0):.1e}")
                if ctx.is_main and (last or ppo.iteration % cfg.save_every == 0):
                    save(metrics)
            bar.close()
    finally:
        if collector is not None:
            collector.close()
        if env is not None:
            env.close()
        if eval_env is not None and eval_env is not env:
            eval_env.close()
    if ctx.is_main:
        write_learning_curve(out)
    return out


@dataclasses.dataclass
class StartingRollouts:
    """Warns once when the starting policy's exploring rollouts succeed far less often than the same policy with
    noise off: RL then learns from failures the noise made. Measured: DPPO from a StackCube BC at 46% (noise off)
    collected rollouts at 0-17% and no update raised it; from a BC trained on DART-replayed demos (78%) the
    rollouts kept 46-58% and DPPO took it to 88%."""

    noise_off_success: float | None
    """Success rate of the evaluation before fine-tuning (None: not evaluated, nothing to compare with)."""
    last_iteration: int
    """The iteration whose rollout is the last one before the first actor update (`PPO.first_actor_iteration`)."""
    successes: int = 0
    episodes: int = 0

    MIN_EPISODES: ClassVar[int] = 10
    """Fewer finished episodes than this say too little to warn on."""

    def observe(self, iteration: int, successes: int, episodes: int, algo: Algorithm) -> str | None:
        """Count the rollout collected at `iteration`; at the last one before the first actor update, the warning
        if the rollouts succeeded in less than half the noise-off rate (which is at least 0.2), else None."""
        if self.noise_off_success is None or iteration > self.last_iteration:
            return None
        self.successes += successes
        self.episodes += episodes
        if iteration < self.last_iteration or self.episodes < self.MIN_EPISODES or self.noise_off_success < 0.2:
            return None
        rate = self.successes / self.episodes
        if rate >= 0.5 * self.noise_off_success:
            return None
        noise = f"less noise ({algo.exploration_flags}), " if algo.exploration_flags else ""
        return (f"warning: the exploring rollouts succeeded in {rate:.0%} of {self.episodes} episodes, the same policy "
                f"with noise off in {self.noise_off_success:.0%}: exploration noise breaks this policy, and RL learns "
                f"little from failures the noise made. Try {noise}a BC that tolerates noise (demos replayed with DART "
                f"noise, docs/finetuning.md) or --algo residual_ppo")


def evaluate_policy(policy: Policy, env: ChunkedEnv, episodes: int) -> EvalResult:
    """`episodes` episodes of `policy` with noise off on the shared evaluation start states, with progress."""
    policy.eval()
    with progress_bar(total=episodes, desc="evaluate", unit="episode", leave=False) as bar:
        return evaluate(lambda o: policy.predict_chunk(o, deterministic=True), env, episodes, seed=EVAL_SEED,
                        progress=capped_update(bar))


def no_signal_message(iteration: int, rollout_signal: bool) -> str:
    """Why iteration `iteration`'s actor update was skipped (rl.skip_no_signal): the rollout had no success and a
    constant reward, or (`rollout_signal` True: per-start-state groups) every group's episodes ended alike."""
    if rollout_signal:
        return (f"iteration {iteration}: every start state's group of episodes had equal returns (rl.group_size), "
                "so no learning signal: the actor was not updated (rl.skip_no_signal)")
    return (f"iteration {iteration}: no success and a constant reward in the rollout, so no learning signal: the "
            "actor was not updated (rl.skip_no_signal); consider a dense reward or a stronger starting policy")


def kl_stop_message(iteration: int, update: dict[str, float], rl: PPOConfig) -> str | None:
    """A warning when iteration `iteration`'s update stopped at `rl.target_kl` after at most one actor step: a
    single step at `rl.actor_lr` already moves the policy past the KL limit, so each update is one minibatch's
    gradient step and the rest of the rollout goes unused (a BC policy with a small exploration std does this
    at learning rates sized for a policy trained from scratch)."""
    if not update.get("kl_early_stop") or update.get("actor_steps", 0) > 1:
        return None
    return (f"iteration {iteration}: the update stopped at the KL limit (rl.target_kl {rl.target_kl:g}; the stopping "
            f"minibatch's KL {update['stop_kl']:.3g}) after {update['actor_steps']:.0f} actor step(s) "
            f"(rl.update_epochs {rl.update_epochs}): one step at rl.actor_lr {rl.actor_lr:g} moves this policy past "
            "the limit; a smaller rl.actor_lr or a larger rl.target_kl lets an update use more of its rollout "
            "(train/actor_steps records each iteration)")


def iteration_scalars(update: dict[str, float], stats: Any, kl_to_base: float, update_seconds: float,
                      env_steps: int, wall_seconds: float) -> dict[str, float]:
    """The `train/` scalars of one iteration of either core: its update's metrics and its rollout's `stats`
    (`env_steps`, `seconds`, `episodes`, `successes`, `episode_returns`)."""
    scalars = {f"train/{k}": v for k, v in update.items()}
    scalars.update({
        "train/kl_to_base": kl_to_base,
        "train/env_steps_per_s": stats.env_steps / max(stats.seconds, 1e-9),
        "train/update_seconds": update_seconds,
        "train/env_steps": env_steps,
        "train/wall_seconds": wall_seconds,
    })
    if stats.episodes:
        scalars["train/success_rate"] = stats.successes / stats.episodes
        scalars["train/episode_return"] = float(np.mean(stats.episode_returns))
    return scalars


def log_eval_and_keep_best(log: RunLogger, env_steps: int, result: EvalResult, when: str, wall_seconds: float,
                           out: Path, contents: Any) -> dict[str, Any]:
    """Log an evaluation and write `out/best` (from `contents(metrics)`, the checkpoint's save arguments) when its
    success rate is the best of the run so far. Returns the metrics stored in checkpoints."""
    metrics = _log_eval(log, env_steps, result, when, wall_seconds)
    if ckpt_io.save_best_checkpoint(out, result.success_rate, **contents(metrics)) is not None:
        tqdm.write(f"best so far: {out / ckpt_io.BEST_DIR} (success {result.success_rate:.2f})", file=sys.stderr)
    return metrics


def _log_eval(log: RunLogger, env_steps: int, result: EvalResult, when: str, wall_seconds: float) -> dict[str, Any]:
    log.log(env_steps, {"eval/success_rate": result.success_rate, "eval/mean_return": result.mean_return,
                        "eval/ci95_low": result.ci95[0], "eval/ci95_high": result.ci95[1],
                        "eval/success_once": result.success_once, "eval/wall_seconds": wall_seconds,
                        **{f"eval/milestone/{m}": rate for m, rate in result.milestone_rates.items()}})
    tqdm.write(f"{when}: success {result.success_rate:.2f} (95% CI {result.ci95[0]:.2f}-{result.ci95[1]:.2f}, "
               f"{result.episodes} episodes)", file=sys.stderr)
    return {"success_rate": result.success_rate, "ci95": list(result.ci95), "mean_return": result.mean_return}


def write_learning_curve(run_dir: str | Path) -> Path | None:
    """`<run>/learning_curve.png`: evaluation success rate (with 95% CI) against env steps."""
    rows = [r for r in read_metrics(run_dir) if "eval/success_rate" in r]
    if not rows:
        return None
    x = [r["step"] for r in rows]
    y = [r["eval/success_rate"] for r in rows]
    band = ([r["eval/ci95_low"] for r in rows], [r["eval/ci95_high"] for r in rows])
    return plot_curves({"eval success": (x, y)}, Path(run_dir) / "learning_curve.png", xlabel="env steps",
                       ylabel="success rate", title=f"fine-tuning: {Path(run_dir).name}", bands={"eval success": band})
