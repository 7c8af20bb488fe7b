"""BC pretraining: fit a policy to a demonstration dataset, evaluate it in simulation, checkpoint it.

`robotft pretrain --env maniskill/push_cube --policy diffusion_mlp --data demos.zarr --out runs/bc`.
Checkpoints go to `<out>/checkpoints/step_*` with `<out>/checkpoint` pointing at the newest; `--resume`
continues a killed run from there (weights, EMA, optimizer, LR schedule, RNG, step).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from robotft import checkpoint as ckpt_io
from robotft.config import EnvConfig, resolve_device, to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.datasets.sampler import SequenceSampler, infinite_batches
from robotft.datasets.store import ReplayBuffer
from robotft.distributed import DistContext, distributed
from robotft.evaluation import EVAL_SEED
from robotft.policies.base import Policy, PolicyConfig, build_policy
from robotft.policies.vision import image_encoder_without_file
from robotft.runlog import NullLogger, RunLogger, WandbConfig, capped_update, progress_bar
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec


@dataclasses.dataclass
class TrainConfig:
    """BC optimisation and bookkeeping."""

    steps: int = 2000
    """Gradient steps."""
    batch_size: int = 256
    """Samples (windows) per gradient step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (cosine decay after warm-up)."""
    weight_decay: float = 1e-6
    """AdamW weight decay."""
    warmup_steps: int = 100
    """Linear LR warm-up steps."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0 disables."""
    log_every: int = 50
    """Steps between TensorBoard scalars."""
    eval_every: int = 0
    """Steps between evaluations in simulation; 0 evaluates only at the end."""
    eval_episodes: int = 20
    """Episodes per evaluation; 0 disables evaluation."""
    eval_num_envs: int = 1
    """Parallel envs used for evaluation."""
    save_every: int = 500
    """Steps between checkpoints (the last step is always saved)."""
    seed: int = 0
    """Seed of sampling, initialisation and evaluation."""
    device: str = "auto"
    """`auto`, `cpu` or `cuda`."""


@dataclasses.dataclass
class PretrainConfig:
    """A BC pretraining run (saved as `run` in every checkpoint's config.json)."""

    data: str = ""
    """Dataset store path (zarr replay buffer)."""
    out: str = "runs/bc"
    """Run directory."""
    env: EnvConfig | None = dataclasses.field(default_factory=EnvConfig)
    """Simulated task used for evaluation (and whose spec must match the dataset's); None trains on the
    dataset alone (e.g. real-robot demonstrations): the observation and action specs come from the dataset
    and there is no evaluation."""
    rig: str = ""
    """Rig preset the policy will be deployed on (optional): checked up front to provide every observation
    key and the action the policy needs, as `robotft deploy` will check."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Optimisation, evaluation and checkpointing."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging (`--wandb` turns it on)."""


def fit_normalizer(buffer: ReplayBuffer, policy_cfg: PolicyConfig) -> Normalizer:
    """Statistics over the whole dataset for the policy's low-dim observation keys and the action."""
    modes = {}
    for key in policy_cfg.obs_keys:
        feat = buffer.features[key]
        modes[key] = "identity" if feat.dtype == "uint8" else policy_cfg.normalizer_mode
    modes["action"] = policy_cfg.normalizer_mode
    data = {k: buffer.array(k) for k in modes if modes[k] != "identity"}
    for k, m in modes.items():
        if m == "identity":
            data[k] = np.zeros((1, *buffer.features[k].shape), dtype=np.float32)
    return Normalizer.fit(data, modes)


def check_dataset_matches_env(buffer: ReplayBuffer, env_spec: EnvSpec, policy_cfg: PolicyConfig) -> None:
    """Refuse to train on data whose observation or action layout differs from the env's."""
    problems = []
    for key in policy_cfg.obs_keys:
        if key not in buffer.features:
            problems.append(f"dataset has no observation key {key!r} (has {sorted(buffer.features)})")
            continue
        if key in env_spec.observations and env_spec.observations[key].shape != buffer.features[key].shape:
            problems.append(
                f"{key!r}: dataset shape {buffer.features[key].shape} != env shape {env_spec.observations[key].shape}"
            )
    if env_spec.action is not None:
        if buffer.features["action"].shape != (env_spec.action.dim,):
            problems.append(
                f"action: dataset shape {buffer.features['action'].shape} != env action dim {env_spec.action.dim}"
            )
        ds_mode = buffer.action_spec.control_mode if buffer.action_spec else None
        if ds_mode and ds_mode != env_spec.action.control_mode:
            problems.append(f"control mode: dataset {ds_mode!r} != env {env_spec.action.control_mode!r}")
    if problems:
        raise ValueError(f"dataset {buffer.path} does not match the env: " + "; ".join(problems))


def dataset_spec(buffer: ReplayBuffer, policy_cfg: PolicyConfig) -> EnvSpec:
    """The spec of a policy trained on `buffer` without a simulator: the dataset's observation features for
    the policy's keys and its recorded action spec; a dataset that records none (e.g. a LeRobot recording)
    gets control mode `unknown`, the data's per-dimension [min, max] as bounds and its fps as control rate."""
    missing = [k for k in policy_cfg.obs_keys if k not in buffer.features]
    if missing:
        raise ValueError(f"dataset {buffer.path} has no observation keys {missing} that policy.obs_keys names "
                         f"(has {sorted(buffer.features)})")
    action = buffer.action_spec
    if action is None:
        a = buffer.array("action")
        action = ActionSpec("unknown", a.shape[1], tuple(map(float, a.min(0))), tuple(map(float, a.max(0))),
                            control_hz=buffer.fps)
    return EnvSpec(observations={k: buffer.features[k] for k in policy_cfg.obs_keys}, action=action)


def check_env_provides(env_spec: EnvSpec, policy_cfg: PolicyConfig, env_name: str) -> None:
    """Evaluation feeds the policy from the env: every key the policy reads must be one the env provides."""
    missing = [k for k in policy_cfg.obs_keys if k not in env_spec.observations]
    if missing:
        raise ValueError(f"env {env_name!r} provides no observation {missing} that policy.obs_keys names "
                         f"(it provides {sorted(env_spec.observations)}); evaluation would fail after training "
                         "(turn it off with --train.eval_episodes 0, or pick another env or obs_keys)")


def run_pretrain(cfg: PretrainConfig, policy_cfg: PolicyConfig, resume: bool = False,
                 overwrite: bool = False) -> Path:
    """Train, evaluate and checkpoint. Returns the run directory.

    `resume` continues the run at `cfg.out`; `overwrite` replaces it; without either an existing run is
    refused (robotft.checkpoint.prepare_run_dir). Under torchrun every rank trains on its shard of the dataset
    with gradients averaged across ranks; `train.batch_size` is the global batch (robotft.distributed). Rank 0
    writes checkpoints and logs."""
    with distributed(resolve_device(cfg.train.device)) as ctx:
        return _pretrain(cfg, policy_cfg, resume, overwrite, ctx)


def _pretrain(cfg: PretrainConfig, policy_cfg: PolicyConfig, resume: bool, overwrite: bool,
              ctx: DistContext) -> Path:
    from robotft.envs.factory import make_env

    device = ctx.device(resolve_device(cfg.train.device))
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    out = Path(cfg.out)
    buffer = ReplayBuffer.open(cfg.data)
    for key in (*policy_cfg.obs_keys, "action"):  # read (and cache) the low-dim data before writing anything
        if key in buffer.features and buffer.features[key].dtype != "uint8":
            x = buffer.array(key)
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                step = int(np.argmax(~np.isfinite(x.reshape(len(x), -1)).all(axis=1)))
                raise ValueError(f"{buffer.path}: data/{key} has NaN or inf at step {step}, expected finite values")
    evaluating = cfg.env is not None and cfg.train.eval_episodes > 0
    if cfg.env is None:
        spec = dataset_spec(buffer, policy_cfg)
    else:
        env_spec = _env_spec(cfg.env)
        check_dataset_matches_env(buffer, env_spec, policy_cfg)
        if evaluating:
            check_env_provides(env_spec, policy_cfg, f"{cfg.env.type}/{cfg.env.task}")
        spec = EnvSpec(observations={k: _with_env_names(buffer.features[k], env_spec.observations.get(k))
                                     for k in policy_cfg.obs_keys}, action=env_spec.action)
    if cfg.rig:
        from robotft.real_robot.rig import load_rig, require_compatible

        require_compatible(load_rig(cfg.rig), spec, policy_cfg.obs_keys, f"trained on {cfg.data}")
    if ctx.is_main:
        ckpt_io.prepare_run_dir(out, "pretrain", resume=resume, overwrite=overwrite)

    start_step = 0
    resume_state = None
    previous = ckpt_io.resume_checkpoint(out) if resume else None
    if previous is not None:
        prev = ckpt_io.read_checkpoint(previous)
        built = dataclasses.replace(policy_cfg, image_encoder=image_encoder_without_file(policy_cfg.image_encoder))
        _check_same_policy_config(prev.config["policy"], to_dict(built), previous)
        resume_state = prev.training_state()
        normalizer = prev.normalizer
        start_step = int(prev.meta["step"])
        if start_step >= cfg.train.steps:
            raise ValueError(f"{previous} is at step {start_step} and --steps is {cfg.train.steps}: nothing to "
                             "resume (raise --steps to train longer)")
        print(f"resuming {out} from step {start_step}", file=sys.stderr)
    else:
        if resume:
            print(f"--resume: no checkpoint in {out} yet, starting from step 0", file=sys.stderr)
        normalizer = fit_normalizer(buffer, policy_cfg)
    policy = build_policy(policy_cfg, spec, normalizer).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    from diffusers.optimization import get_cosine_schedule_with_warmup

    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.train.warmup_steps, cfg.train.steps)
    if resume_state is not None:
        policy.load_state_dict(resume_state["policy"])
        optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        torch.set_rng_state(resume_state["torch_rng"])
    ctx.broadcast_parameters(policy.state_dict().values())
    if ctx.rank > 0:  # each rank its own noise/timestep stream; rank 0's is the single-process one
        torch.manual_seed(ctx.seed(cfg.train.seed) + start_step)

    sampler = SequenceSampler(buffer, policy_cfg.obs_keys, policy_cfg.obs_steps, policy_cfg.horizon_steps)
    batches = infinite_batches(sampler, cfg.train.batch_size, cfg.train.seed + start_step, ctx.rank, ctx.world_size)
    run_config = {"stage": "pretrain", **to_dict(cfg)}
    env_dict = to_dict(cfg.env) if cfg.env is not None else None
    if ctx.is_main:
        ckpt_io.atomic_write_text(out / "config.json",
                                  json.dumps({"run": run_config, "policy": to_dict(policy.config)}, indent=2))

    dataset_path = str(Path(cfg.data).resolve())

    def save(step: int, metrics: dict[str, Any]) -> None:
        ckpt_io.save_run_checkpoint(
            out,
            step,
            model_state=policy.export_state_dict(),
            config={"policy": to_dict(policy.config), "env": env_dict, "spec": spec.to_dict(), "run": run_config},
            normalizer=normalizer,
            # The dataset's absolute path: a fine-tuning run started elsewhere finds it (training_dataset).
            meta={"stage": "pretrain", "step": step, "env_steps": 0, "metrics": metrics, "dataset": dataset_path},
            training_state={
                "policy": policy.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
            },
        )

    metrics: dict[str, Any] = {}
    logger = (RunLogger(out, resume_step=start_step if previous is not None else None, wandb=cfg.wandb,
                        config={"run": run_config, "policy": to_dict(policy.config)})
              if ctx.is_main else NullLogger())
    with logger as log:
        bar = progress_bar(range(start_step, cfg.train.steps), desc="pretrain", initial=start_step,
                           total=cfg.train.steps, disable=not ctx.is_main)
        t0, last_log = time.perf_counter(), start_step
        for step in bar:
            policy.train()
            batch = _to_device(next(batches), device)
            loss, loss_metrics = policy.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            ctx.all_reduce_gradients(policy.parameters())
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            policy.on_train_step_end()
            done = step + 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                elapsed = time.perf_counter() - t0
                rate = (done - last_log) * cfg.train.batch_size / max(elapsed, 1e-9)
                t0, last_log = time.perf_counter(), done
                mean_loss = ctx.mean(loss.item())
                log.log(done, {"train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0],
                               "train/samples_per_s": rate, **{f"train/{k}": v for k, v in loss_metrics.items()}})
                bar.set_postfix(loss=f"{mean_loss:.4f}")
            last = done == cfg.train.steps
            if ctx.is_main and (done % cfg.train.save_every == 0 or last):
                save(done, metrics)  # before evaluating: an evaluation error must not lose the training
            want_eval = ctx.is_main and evaluating and (
                last or (cfg.train.eval_every > 0 and done % cfg.train.eval_every == 0)
            )
            if want_eval:
                result = evaluate_in_env(policy, cfg.env, cfg.train.eval_episodes, cfg.train.eval_num_envs,
                                         EVAL_SEED, device, make_env)
                metrics = {"success_rate": result.success_rate, "ci95": list(result.ci95),
                           "mean_return": result.mean_return}
                log.log(done, {"eval/success_rate": result.success_rate, "eval/mean_return": result.mean_return,
                               **{f"eval/milestone/{m}": rate for m, rate in result.milestone_rates.items()}})
                tqdm.write(f"step {done}: success {result.success_rate:.2f} "
                           f"(95% CI {result.ci95[0]:.2f}-{result.ci95[1]:.2f})", file=sys.stderr)
                if done % cfg.train.save_every == 0 or last:
                    save(done, metrics)  # again, now with the evaluation's metrics
        bar.close()
    return out


def _check_same_policy_config(saved: dict[str, Any], requested: dict[str, Any], where: Path) -> None:
    """A resumed run must rebuild the policy it saved; name the fields that differ."""
    # Fields left empty in the request are filled in when a policy is built (a residual policy's `base`).
    diff = sorted(
        k for k in set(saved) | set(requested)
        if saved.get(k) != requested.get(k) and requested.get(k) not in (None, "", {}, [])
    )
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {requested.get(k)!r}" for k in diff)
        raise ValueError(f"cannot resume from {where}: the policy config differs ({detail}); "
                         "resume with the same --policy and --policy.* flags")


def evaluate_in_env(policy: Policy, env_cfg: EnvConfig, episodes: int, num_envs: int, seed: int,
                    device: str, make_env) -> Any:
    from robotft.envs.chunked import ChunkedEnv
    from robotft.evaluation import evaluate

    env = make_env(dataclasses.replace(env_cfg, num_envs=num_envs), device=device)
    try:
        chunked = ChunkedEnv.for_policy(env, policy.config)
        policy.eval()
        with progress_bar(total=episodes, desc="evaluate", unit="episode", leave=False) as bar:
            return evaluate(lambda o: policy.predict_chunk(o, deterministic=True), chunked, episodes, seed=seed,
                            progress=capped_update(bar))
    finally:
        env.close()


def _with_env_names(feature: FeatureSpec, env_feature: FeatureSpec | None) -> FeatureSpec:
    """The dataset's feature, with the env's per-dimension names when the dataset has none (imported
    ManiSkill trajectories do not record them), so that the checkpoint names each state dimension for
    the rig that deploys it (robotft.real_robot.rig)."""
    if feature.names or env_feature is None or not env_feature.names or env_feature.shape != feature.shape:
        return feature
    return dataclasses.replace(feature, names=env_feature.names)


def _env_spec(env_cfg: EnvConfig) -> EnvSpec:
    """The env's spec, from a one-env instance (cheap for every backend but rendering ones)."""
    from robotft.envs.factory import make_env

    env = make_env(dataclasses.replace(env_cfg, num_envs=1), device="cpu")
    try:
        return env.spec
    finally:
        env.close()


def _to_device(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return batch

