"""Teacher-student distillation with DAgger: a state policy labels what a camera policy sees.

`robotft distill --teacher runs/push_cube/dppo --policy diffusion_unet_rgb --env maniskill/push_cube_distill
--out runs/distill [--rig real_robot/franka_d435.yaml]`

A fine-tuned policy reads the simulator's privileged state (object poses); a rig has cameras and the robot's
own state. DAgger (Ross, Gordon & Bagnell 2011, arXiv 1011.0686, Algorithm 3.1) turns the first into the
second. Round i (i = 1..N):

1. roll out the mixture π_i = β_i π* + (1 - β_i) π̂_i in the simulator: at each chunk boundary the chunk
   executed next comes from the teacher π* with probability β_i, else from the student π̂_i;
   β_i = β_1 · p^(i-1) (`beta0`, `beta_decay`; β_1 = 1 makes round 1 pure teacher rollouts);
2. label every visited step with the teacher's action chunk: the teacher reads the privileged observation of
   the same env step (`privileged/<key>` when the env provides it, see `DistillConfig.teacher_keys`), the
   student's observation keys are stored with the labels in a dataset store (robotft.datasets.store,
   `<out>/data/round_XXX.zarr`: the student keys, `action` = the label's first action, `teacher_chunk`);
3. D ← D ∪ D_i (the union of all rounds' stores) and train π̂_{i+1} on D (behaviour cloning of the
   teacher's chunks, continuing from π̂_i);
4. evaluate π̂_{i+1} through robotft.evaluation.evaluate, the path of `robotft eval`.

The student sees only its own `obs_keys`; with `--rig` these must be what that rig provides (checked before
anything is trained, robotft.real_robot.rig.check_rig), so the distilled checkpoint is deployable there.
Visual domain randomization (camera pose, field of view, light, colours) comes from the env's
`randomization` config (robotft.envs.maniskill_randomization). Checkpoints go to `<out>/checkpoints/step_*`
(one per round), the best student by evaluation success to `<out>/best`; `--resume` continues after the
newest completed round.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
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
from robotft.datasets.sampler import infinite_batches
from robotft.datasets.store import DatasetWriter, ReplayBuffer
from robotft.envs.base import BatchedEnv, Obs
from robotft.envs.chunked import ChunkedEnv
from robotft.evaluation import EvalResult, evaluate
from robotft.policies.base import Policy, PolicyConfig, build_policy
from robotft.runlog import RunLogger, progress_bar
from robotft.specs import EnvSpec, FeatureSpec

PRIVILEGED_PREFIX = "privileged/"
"""Env observation keys under this prefix hold what only the simulator knows (for the teacher)."""
LABEL_KEY = "teacher_chunk"
"""Dataset key of the teacher's action chunk `[H_teacher, act_dim]` at each visited step."""


@dataclasses.dataclass
class DistillConfig:
    """A DAgger distillation run (saved as `run` in every checkpoint's config.json)."""

    teacher: str = ""
    """Teacher checkpoint (or run directory): a policy on the simulator's state."""
    out: str = "runs/distill"
    """Run directory."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """Simulated task providing the student's keys and the teacher's (e.g. ManiSkill obs_mode `rgb+state`)."""
    rig: str = ""
    """Rig preset (`real_robot/franka_d435.yaml`) whose observations the student must be limited to; empty:
    no rig check."""
    teacher_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Teacher observation key -> env key it is read from; unlisted keys read `privileged/<key>` when the env
    provides it, else `<key>`."""
    rounds: int = 5
    """DAgger iterations N (each: collect, aggregate, train, evaluate)."""
    episodes_per_round: int = 20
    """Episodes collected per round."""
    beta0: float = 1.0
    """β_1: probability that the teacher acts at a chunk boundary in the first round."""
    beta_decay: float = 0.5
    """p of β_i = β_1 p^(i-1) (Ross et al. 2011, Sec. 3)."""
    steps_per_round: int = 1000
    """Gradient steps on the aggregated dataset after each round's collection."""
    batch_size: int = 64
    """Samples per gradient step."""
    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 1e-6
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0 disables."""
    eval_episodes: int = 20
    """Student evaluation episodes after every round (and of the teacher once, at the start); 0 disables."""
    seed: int = 0
    """Seed of rollouts, mixing, training and evaluation."""
    device: str = "auto"
    """`auto`, `cpu` or `cuda`."""

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.episodes_per_round < 1 or self.steps_per_round < 0 or self.batch_size < 1:
            raise ValueError(
                f"distill: rounds, episodes_per_round and batch_size must be >= 1 and steps_per_round >= 0, got "
                f"{self.rounds}, {self.episodes_per_round}, {self.batch_size}, {self.steps_per_round}"
            )
        if not (0 <= self.beta0 <= 1 and 0 <= self.beta_decay <= 1):
            raise ValueError(f"distill: beta0 and beta_decay must be in [0, 1], got {self.beta0}, {self.beta_decay}")

    def beta(self, round_index: int) -> float:
        """β of 0-based round `round_index`."""
        return self.beta0 * self.beta_decay**round_index


# -- who reads what ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Views:
    """How the teacher's and the student's observations are cut from the env's."""

    teacher: dict[str, str]
    """Teacher key -> env key."""
    student: list[str]
    """Student keys (the env provides them under the same names)."""

    def for_teacher(self, obs: Obs) -> Obs:
        return {k: obs[env_key] for k, env_key in self.teacher.items()}

    def for_student(self, obs: Obs) -> Obs:
        return {k: obs[k] for k in self.student}


def resolve_views(cfg: DistillConfig, teacher_cfg: PolicyConfig, teacher_spec: EnvSpec,
                  student_cfg: PolicyConfig, env_spec: EnvSpec) -> Views:
    """Match the teacher's and the student's keys to the env's; every mismatch in one error."""
    problems = []
    teacher = {}
    for key in teacher_cfg.obs_keys:
        env_key = cfg.teacher_keys.get(key) or (
            PRIVILEGED_PREFIX + key if PRIVILEGED_PREFIX + key in env_spec.observations else key)
        teacher[key] = env_key
        have, want = env_spec.observations.get(env_key), teacher_spec.observations.get(key)
        if have is None:
            problems.append(f"the teacher reads {key!r} from env key {env_key!r}, which the env does not provide "
                            f"(env keys: {sorted(env_spec.observations)}; set distill.teacher_keys or an env "
                            "obs_mode with privileged state, e.g. ManiSkill's rgb+state)")
        elif want is not None and have.shape != want.shape:
            problems.append(f"teacher key {key!r}: the checkpoint's shape {want.shape} != env key {env_key!r} "
                            f"shape {have.shape}")
    for key in student_cfg.obs_keys:
        if key.startswith(PRIVILEGED_PREFIX):
            problems.append(f"student key {key!r} is privileged simulator state; a student sees what a rig sees")
        elif key not in env_spec.observations:
            problems.append(f"student key {key!r} is not an env observation (env keys: "
                            f"{sorted(k for k in env_spec.observations if not k.startswith(PRIVILEGED_PREFIX))}; "
                            "set --policy.obs_keys)")
    if not any(k.startswith(("rgb/", "depth/")) for k in student_cfg.obs_keys):
        problems.append(f"the student's obs_keys {student_cfg.obs_keys} have no camera key (rgb/<camera>)")
    t_act, s_act = teacher_spec.action, env_spec.action
    if t_act is not None and s_act is not None and (t_act.control_mode, t_act.dim) != (s_act.control_mode, s_act.dim):
        problems.append(f"action: the teacher acts in {t_act.control_mode} (dim {t_act.dim}), the env in "
                        f"{s_act.control_mode} (dim {s_act.dim})")
    if student_cfg.horizon_steps > teacher_cfg.horizon_steps:
        problems.append(f"the student predicts {student_cfg.horizon_steps} steps, the teacher's chunks have "
                        f"{teacher_cfg.horizon_steps}: set --policy.horizon_steps <= {teacher_cfg.horizon_steps}")
    if problems:
        raise ValueError(f"distill: teacher {cfg.teacher} and student cannot share env {cfg.env.task!r}: "
                         + "; ".join(problems))
    return Views(teacher=teacher, student=list(student_cfg.obs_keys))


def student_spec(env_spec: EnvSpec, student_keys: list[str]) -> EnvSpec:
    """What the student's checkpoint declares: its own keys and the env's action."""
    return EnvSpec(observations={k: env_spec.observations[k] for k in student_keys}, action=env_spec.action)


def check_student_on_rig(rig_name: str, spec: EnvSpec, student_keys: list[str]) -> None:
    """Refuse, before training, a student whose keys (or actions) the rig cannot provide (or execute)."""
    from robotft.real_robot.rig import RigMismatchError, check_rig, load_rig

    rig = load_rig(rig_name)
    problems = check_rig(rig, spec, student_keys)
    if problems:
        provided = [o.key for o in rig.observations]
        raise RigMismatchError(
            f"distill --rig {rig_name}: the student could not run on rig {rig.name or rig_name!r}: "
            + "; ".join(problems) + f". The rig provides {provided}; choose student obs_keys (--policy.obs_keys) "
            "and an env whose cameras and state segments it covers"
        )


# -- collection -------------------------------------------------------------------------------------


class History:
    """Per-env observation histories `[B, T, ...]` of the env keys in use, padded with an episode's first frame."""

    def __init__(self, obs: Obs, keys: list[str], steps: int) -> None:
        self.steps = steps
        self.frames = {k: obs[k].unsqueeze(1).repeat_interleave(steps, dim=1) for k in keys}

    def push(self, obs: Obs) -> None:
        for k, h in self.frames.items():
            self.frames[k] = torch.cat([h[:, 1:], obs[k].unsqueeze(1)], dim=1)

    def restart(self, obs: Obs, ids: torch.Tensor) -> None:
        for k, h in self.frames.items():
            h[ids] = obs[k][ids].unsqueeze(1).repeat_interleave(self.steps, dim=1)

    def last(self, steps: int) -> Obs:
        return {k: h[:, self.steps - steps:] for k, h in self.frames.items()}


@dataclasses.dataclass
class RoundStats:
    episodes: int = 0
    successes: int = 0
    env_steps: int = 0
    teacher_chunks: int = 0
    student_chunks: int = 0


def collect_round(env: BatchedEnv, teacher: Policy, student: Policy | None, views: Views, beta: float,
                  episodes: int, writer: DatasetWriter, seed: int, act_steps: int, desc: str = "") -> RoundStats:
    """Roll out the β-mixture for `episodes` complete episodes; write each with the teacher's labels.

    At a chunk boundary env b executes the teacher's chunk with probability `beta` (always when `student` is
    None), else the student's; `act_steps` actions of it run before the next boundary. Every env step is
    labelled with the teacher's chunk for that step's observation."""
    gen = torch.Generator().manual_seed(seed)
    B, dev = env.num_envs, env.device
    obs_steps = max(teacher.config.obs_steps, student.config.obs_steps if student else 1)
    keys = sorted({*views.teacher.values(), *views.student})
    resets = 0
    hist = History(env.reset(seed=seed), keys, obs_steps)
    buffers: list[dict[str, list[np.ndarray]]] = [_empty_episode(views) for _ in range(B)]
    plan = torch.zeros(B, act_steps, env.spec.action.dim, device=dev)
    cursor = torch.full((B,), act_steps, dtype=torch.long)
    stats = RoundStats()
    bar = progress_bar(total=episodes, desc=desc or "rollouts", leave=False, disable=not desc)
    while stats.episodes < episodes:
        with torch.no_grad():
            label = teacher.predict_chunk(views.for_teacher(hist.last(teacher.config.obs_steps)))
            replan = cursor >= act_steps
            if replan.any():
                use_teacher = torch.rand(B, generator=gen) < beta if student is not None else torch.ones(B, dtype=torch.bool)
                chunk = label[:, :act_steps]
                if student is not None and (replan & ~use_teacher).any():
                    own = student.predict_chunk(views.for_student(hist.last(student.config.obs_steps)))
                    chunk = torch.where(use_teacher.to(dev)[:, None, None], chunk, own[:, :act_steps])
                plan[replan.to(dev)] = chunk[replan.to(dev)]
                cursor[replan] = 0
                stats.teacher_chunks += int((replan & use_teacher).sum())
                stats.student_chunks += int((replan & ~use_teacher).sum())
        current = hist.last(1)
        for b in range(B):
            for k in views.student:
                buffers[b][k].append(current[k][b, 0].cpu().numpy())
            buffers[b][LABEL_KEY].append(label[b].cpu().numpy())
        action = plan[torch.arange(B, device=dev), cursor.to(dev)]
        cursor += 1
        obs, _, terminated, truncated, info = env.step(action)
        stats.env_steps += B
        hist.push(obs)
        done = (terminated | truncated).cpu()
        if done.any():
            ids = done.nonzero().squeeze(-1)
            for b in ids.tolist():
                if stats.episodes < episodes:
                    _write_episode(writer, buffers[b], views)
                    stats.episodes += 1
                    stats.successes += int(info["success"][b])
                    bar.update(1)
                buffers[b] = _empty_episode(views)
            resets += 1
            hist.restart(env.reset(seed=seed + resets * B, env_ids=ids.to(dev)), ids.to(dev))
            cursor[ids] = act_steps
    bar.close()
    return stats


def _empty_episode(views: Views) -> dict[str, list[np.ndarray]]:
    return {k: [] for k in [*views.student, LABEL_KEY]}


def _write_episode(writer: DatasetWriter, buffer: dict[str, list[np.ndarray]], views: Views) -> None:
    episode = {k: np.stack(v) for k, v in buffer.items()}
    episode["action"] = episode[LABEL_KEY][:, 0]
    writer.add_episode(episode)


def dataset_features(spec: EnvSpec, teacher_horizon: int) -> dict[str, FeatureSpec]:
    """The student's observation features, the label's first action and the full label chunk."""
    action = spec.action
    return {
        **spec.observations,
        "action": FeatureSpec("action", (action.dim,), "float32", unit="env", frame=action.frame),
        LABEL_KEY: FeatureSpec(LABEL_KEY, (teacher_horizon, action.dim), "float32", unit="env", frame=action.frame),
    }


# -- training ---------------------------------------------------------------------------------------


class LabelledWindows(torch.utils.data.Dataset):
    """One round's store as BC samples: the student's observation window ending at step t (the episode's first
    frame repeated before its start) and the teacher's chunk labelled at t, cut to the student's horizon:
    `{"obs": {key: [obs_steps, *shape]}, "action": [H_student, act_dim]}`. The store is read into memory once
    (a round's images are tens of MB), so that training does not wait on zarr reads."""

    def __init__(self, buffer: ReplayBuffer, policy_cfg: PolicyConfig) -> None:
        self.arrays = {k: np.asarray(buffer.array(k)) for k in policy_cfg.obs_keys}
        self.labels = np.asarray(buffer.array(LABEL_KEY), dtype=np.float32)[:, : policy_cfg.horizon_steps]
        starts = np.concatenate([[0], buffer.episode_ends[:-1]])
        self.episode_start = np.repeat(starts, buffer.episode_ends - starts)
        self.offsets = np.arange(-policy_cfg.obs_steps + 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        idx = np.maximum(i + self.offsets, self.episode_start[i])
        return {"obs": {k: a[idx] for k, a in self.arrays.items()}, "action": self.labels[i]}


def fit_student_normalizer(buffer: ReplayBuffer, policy_cfg: PolicyConfig) -> Normalizer:
    """Statistics of the student's low-dim keys and of the teacher's labels (images pass through)."""
    modes = {k: "identity" if buffer.features[k].dtype == "uint8" else policy_cfg.normalizer_mode
             for k in policy_cfg.obs_keys}
    modes["action"] = policy_cfg.normalizer_mode
    data = {k: np.asarray(buffer.array(k)) for k, m in modes.items() if m != "identity" and k != "action"}
    data["action"] = np.asarray(buffer.array(LABEL_KEY)).reshape(-1, buffer.features["action"].shape[0])
    for k, m in modes.items():
        if m == "identity":
            data[k] = np.zeros((1, *buffer.features[k].shape), dtype=np.float32)
    return Normalizer.fit(data, modes)


def train_student(policy: Policy, optimizer: torch.optim.Optimizer, stores: list[Path], cfg: DistillConfig,
                  seed: int, device: str, desc: str = "student") -> float:
    """`cfg.steps_per_round` BC steps on the union of the round stores, with a progress bar labelled `desc`;
    returns the mean loss."""
    data = torch.utils.data.ConcatDataset([LabelledWindows(ReplayBuffer.open(p), policy.config) for p in stores])
    batches = infinite_batches(data, cfg.batch_size, seed)
    policy.train()
    losses = []
    for _ in progress_bar(range(cfg.steps_per_round), desc=f"{desc} training", leave=False):
        batch = _to_device(next(batches), device)
        loss, _ = policy.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        optimizer.step()
        policy.on_train_step_end()
        losses.append(loss.item())
    policy.eval()
    return float(np.mean(losses)) if losses else float("nan")


def _to_device(batch: Any, device: str) -> Any:
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch.to(device) if isinstance(batch, torch.Tensor) else batch


# -- the run ----------------------------------------------------------------------------------------


def evaluate_policy(policy: Policy, view, env: BatchedEnv, episodes: int, seed: int) -> EvalResult:
    """`episodes` episodes of `policy` reading `view(obs)`, through the path of `robotft eval`."""
    chunked = ChunkedEnv.for_policy(env, policy.config)
    policy.eval()
    return evaluate(lambda o: policy.predict_chunk(view(o), deterministic=True), chunked, episodes, seed=seed)


def run_distill(cfg: DistillConfig, student_cfg: PolicyConfig, resume: bool = False) -> Path:
    """Distill `cfg.teacher` into a `student_cfg` policy; returns the run directory."""
    from robotft.envs.factory import make_env

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    out = Path(cfg.out)
    teacher, teacher_ckpt = ckpt_io.load_policy(cfg.teacher, device=device)
    env = make_env(cfg.env, device=device)
    try:
        views = resolve_views(cfg, teacher.config, teacher_ckpt.spec, student_cfg, env.spec)
        spec = student_spec(env.spec, views.student)
        if cfg.rig:
            check_student_on_rig(cfg.rig, spec, views.student)
        return _distill(cfg, student_cfg, teacher, teacher_ckpt, env, views, spec, out, device, resume)
    finally:
        env.close()


def _distill(cfg: DistillConfig, student_cfg: PolicyConfig, teacher: Policy, teacher_ckpt: ckpt_io.Checkpoint,
             env: BatchedEnv, views: Views, spec: EnvSpec, out: Path, device: str, resume: bool) -> Path:
    previous = ckpt_io.resume_checkpoint(out) if resume else None
    if resume and previous is None:
        print(f"--resume: no checkpoint in {out} yet, starting from round 1", file=sys.stderr)
    run_config = {"stage": "distill", **to_dict(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"run": run_config, "policy": to_dict(student_cfg)}, indent=2))
    act_steps = student_cfg.act_steps
    student: Policy | None = None
    optimizer = None
    start_round, env_steps, teacher_success = 0, 0, None
    if previous is not None:
        prev = ckpt_io.read_checkpoint(previous)
        student = build_policy(student_cfg, spec, prev.normalizer).to(device)
        state = prev.training_state()
        student.load_state_dict(state["policy"])
        optimizer = _optimizer(student, cfg)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        start_round, env_steps = int(prev.meta["round"]), int(prev.meta["env_steps"])
        teacher_success = prev.meta.get("teacher_success")
        if start_round >= cfg.rounds:
            raise ValueError(f"{previous} finished round {start_round} and --rounds is {cfg.rounds}: nothing to "
                             "resume (raise --rounds to distill longer)")
        print(f"resuming {out} after round {start_round}", file=sys.stderr)
    for stale in (out / "data").glob("*.tmp-*"):  # a round whose collection was killed
        shutil.rmtree(stale, ignore_errors=True)
    stores = [_store_path(out, r) for r in range(start_round)]
    for p in stores:
        if not p.exists():
            raise ValueError(f"cannot resume {out}: round store {p} is missing")

    with RunLogger(out, resume_step=env_steps if previous is not None else None) as log:
        if teacher_success is None and cfg.eval_episodes > 0:
            result = evaluate_policy(teacher, views.for_teacher, env, cfg.eval_episodes, cfg.seed + 1_000_000)
            teacher_success = result.success_rate
            log.log(0, {"eval/teacher_success_rate": result.success_rate})
            tqdm.write(f"teacher: success {result.success_rate:.2f} (95% CI {result.ci95[0]:.2f}-"
                       f"{result.ci95[1]:.2f}, {result.episodes} episodes)", file=sys.stderr)
        bar = progress_bar(range(start_round, cfg.rounds), desc="distill", initial=start_round, total=cfg.rounds)
        for r in bar:
            beta = cfg.beta(r) if student is not None else 1.0
            t0 = time.perf_counter()
            with DatasetWriter(_store_path(out, r), dataset_features(spec, teacher.config.horizon_steps),
                               fps=spec.action.control_hz or 1.0, action_spec=spec.action, env=to_dict(cfg.env),
                               source=f"DAgger round {r + 1} of {cfg.teacher}", mode="overwrite") as writer:
                stats = collect_round(env, teacher, student, views, beta, cfg.episodes_per_round, writer,
                                      cfg.seed + 7919 * r, act_steps, desc=f"round {r + 1} rollouts (β {beta:.2f})")
            collect_s = time.perf_counter() - t0
            env_steps += stats.env_steps
            stores.append(_store_path(out, r))
            if student is None:
                normalizer = fit_student_normalizer(ReplayBuffer.open(stores[0]), student_cfg)
                student = build_policy(student_cfg, spec, normalizer).to(device)
                optimizer = _optimizer(student, cfg)
            t0 = time.perf_counter()
            loss = train_student(student, optimizer, stores, cfg, cfg.seed + r, device, desc=f"round {r + 1}")
            train_s = time.perf_counter() - t0
            scalars = {"distill/beta": beta, "distill/rollout_success_rate": stats.successes / stats.episodes,
                       "distill/dataset_steps": sum(ReplayBuffer.open(p).n_steps for p in stores),
                       "distill/student_chunk_fraction": stats.student_chunks / max(1, stats.student_chunks +
                                                                                     stats.teacher_chunks),
                       "distill/collect_seconds": collect_s, "distill/train_seconds": train_s,
                       "train/loss": loss, "train/env_steps": env_steps}
            metrics: dict[str, Any] = {"teacher_success_rate": teacher_success}
            if cfg.eval_episodes > 0:
                result = evaluate_policy(student, views.for_student, env, cfg.eval_episodes, cfg.seed + 1_000_000)
                metrics.update(success_rate=result.success_rate, ci95=list(result.ci95),
                               mean_return=result.mean_return, episodes=result.episodes)
                scalars.update({"eval/success_rate": result.success_rate, "eval/ci95_low": result.ci95[0],
                                "eval/ci95_high": result.ci95[1]})
                tqdm.write(f"round {r + 1}: β {beta:.2f}, {scalars['distill/dataset_steps']} labelled steps, "
                           f"student success {result.success_rate:.2f} (95% CI {result.ci95[0]:.2f}-"
                           f"{result.ci95[1]:.2f}), teacher {teacher_success}", file=sys.stderr)
            log.log(env_steps, scalars)
            bar.set_postfix(beta=f"{beta:.2f}", sr=f"{metrics.get('success_rate', float('nan')):.2f}")
            saved = {
                "model_state": student.export_state_dict(),
                "config": {"policy": to_dict(student.config), "env": to_dict(cfg.env), "spec": spec.to_dict(),
                           "run": run_config},
                "normalizer": student.normalizer,
                "meta": {"stage": "distill", "step": r + 1, "round": r + 1, "env_steps": env_steps, "beta": beta,
                         "metrics": metrics, "teacher": str(teacher_ckpt.path), "teacher_success": teacher_success,
                         "rig": cfg.rig},
            }
            ckpt_io.save_run_checkpoint(out, r + 1, **saved, training_state={
                "policy": student.state_dict(), "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()})
            if "success_rate" in metrics:  # DAgger returns the best student on validation (Ross et al., Alg. 3.1)
                ckpt_io.save_best_checkpoint(out, metrics["success_rate"], **saved)
        bar.close()
    return out


def _optimizer(policy: Policy, cfg: DistillConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _store_path(out: Path, round_index: int) -> Path:
    return out / "data" / f"round_{round_index:03d}.zarr"
