"""Evaluation: N episodes of a policy in a ChunkedEnv, success rate with a 95% confidence interval.

The same function evaluates during BC pretraining, during RL fine-tuning and in `robotft eval`, always
through `policy.predict_chunk(obs, deterministic=True)`: the training rollout's sampling path with
exploration noise off. A checkpoint therefore evaluates the same everywhere, with no extra flags.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from robotft.envs.base import Obs
from robotft.envs.chunked import ChunkedEnv
from robotft.optional import require

EVAL_SEED = 1_000_000
"""Seed of the evaluation start states shared by `pretrain`, `finetune` and `robotft eval` (by default), so
their success rates are measured on the same episodes and compare."""


@dataclass
class EvalResult:
    """Outcome of an evaluation run."""

    success_rate: float
    """Fraction of episodes that ended in success (ManiSkill's `success_at_end`: the success flag at each
    episode's last step; equal to `success_once` when success ends the episode, as in robotft's envs)."""
    ci95: tuple[float, float]
    """Wilson score interval of the success rate at 95%."""
    episodes: int
    mean_return: float
    mean_length: float
    """Mean episode length in env steps."""
    seconds: float
    env_steps: int
    success_once: float = float("nan")
    """Fraction of episodes that succeeded at any step (ManiSkill's `success_once`)."""
    success_at_end: float = float("nan")
    """Fraction of episodes successful at their last step (ManiSkill's `success_at_end`; = `success_rate`)."""
    seed: int = 0
    """Seed of the start states: episode r starts from the state of seed `seed + r`."""
    episode_success: tuple[bool, ...] = ()
    """Each episode's success at its end, in episode order: two evaluations with the same seed are paired episode
    by episode, and a failed episode r is replayed alone with `episodes=1, seed=seed + r`."""
    episode_length: tuple[int, ...] = ()
    """Each episode's length in env steps, in episode order."""
    milestones: tuple[str, ...] = ()
    """The task's milestones in the order a successful episode passes them (the env's `milestone/<name>` flags,
    e.g. PickCube's `grasped`, `at_goal`); empty when the env reports none."""
    episode_milestones: tuple[tuple[str, ...], ...] = ()
    """The milestones each episode reached at some step, in episode order (empty without milestones)."""

    @property
    def milestone_rates(self) -> dict[str, float]:
        """Fraction of the episodes that reached each milestone, in task order."""
        return {m: sum(m in reached for reached in self.episode_milestones) / self.episodes for m in self.milestones}

    @property
    def failure_stages(self) -> dict[str, int]:
        """The failed episodes counted by the furthest milestone they reached (`none`: not even the first), in task
        order: where a policy's failures stop (a PickCube policy that never grasps against one that grasps and
        never reaches the goal). Empty when the env reports no milestones."""
        if not self.milestones:
            return {}
        counts = dict.fromkeys(("none", *self.milestones), 0)
        for ok, reached in zip(self.episode_success, self.episode_milestones, strict=True):
            if not ok:
                counts[next((m for m in reversed(self.milestones) if m in reached), "none")] += 1
        return counts

    @property
    def failed_seeds(self) -> list[int]:
        """Start-state seeds of the episodes that failed (`robotft eval --seed S --episodes 1` replays one)."""
        return [self.seed + r for r, ok in enumerate(self.episode_success) if not ok]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        if self.milestones:
            d["milestone_rates"] = self.milestone_rates
            d["failure_stages"] = self.failure_stages
        return d


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927): well-behaved at 0% and 100%."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z**2 / n
    center = (p + z**2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


@dataclass
class PairedComparison:
    """Two evaluations on the same start states, compared start state by start state."""

    episodes: int
    """Start states both evaluations ran (paired by seed)."""
    success_rate: float
    """Success rate of the evaluated policy."""
    baseline_success_rate: float
    """Success rate of the baseline on the same start states."""
    difference: float
    """success_rate − baseline_success_rate."""
    ci95: tuple[float, float]
    """95% interval of the difference (Newcombe's square-and-add interval for paired proportions)."""
    only_this: int
    """Start states where the evaluated policy succeeded and the baseline failed."""
    only_baseline: int
    """Start states where the baseline succeeded and the evaluated policy failed."""
    p_value: float
    """Exact McNemar test of equal success rates, two-sided."""
    p_value_greater: float
    """Exact McNemar test, one-sided: the evaluated policy succeeds more often than the baseline."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def paired_comparison(success: Sequence[bool], baseline: Sequence[bool]) -> PairedComparison:
    """Compare two policies' outcomes on the same start states (`EvalResult.episode_success` of evaluations with one
    seed and episode count).

    Pairing removes the start states' own difficulty from the comparison: with a = both succeed, b = only this
    policy, c = only the baseline, d = neither, out of n, the difference is (b − c) / n and only the b + c
    discordant start states carry evidence. Exact McNemar test: under equal rates b ~ Binomial(b + c, ½).
    Interval: Newcombe (1998, Stat. Med. 17:2635, method 10), Wilson intervals [l₁, u₁] and [l₂, u₂] of the two
    rates combined as

        θ − √((p₁ − l₁)² − 2φ(p₁ − l₁)(u₂ − p₂) + (u₂ − p₂)²),   θ + √((p₂ − l₂)² − 2φ(p₂ − l₂)(u₁ − p₁) + (u₁ − p₁)²),

    φ the continuity-corrected correlation of the two outcomes: (ad − bc − n/2) / √((a+b)(c+d)(a+c)(b+d)) when
    ad − bc > n/2, 0 when 0 ≤ ad − bc ≤ n/2, (ad − bc) / √(...) when negative.
    """
    if len(success) != len(baseline) or not success:
        raise ValueError(f"paired comparison needs the outcomes of the same start states: got {len(success)} and "
                         f"{len(baseline)} episodes")
    n = len(success)
    pairs = [(bool(x), bool(y)) for x, y in zip(success, baseline, strict=True)]
    a, b, c = pairs.count((True, True)), pairs.count((True, False)), pairs.count((False, True))
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson_interval(a + b, n), wilson_interval(a + c, n)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    phi = 0.0 if margins == 0 or 0 <= cross <= n / 2 else (cross - n / 2 if cross > 0 else cross) / math.sqrt(margins)
    theta = p1 - p2
    # max(0, ·): each radicand is ≥ (x − y)² ≥ 0 since |φ| ≤ 1; it guards rounding at φ = 1 only.
    low = theta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = theta + math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    m = b + c
    greater = sum(math.comb(m, k) for k in range(b, m + 1)) / 2**m
    two_sided = min(1.0, 2 * sum(math.comb(m, k) for k in range(min(b, c) + 1)) / 2**m)
    return PairedComparison(episodes=n, success_rate=p1, baseline_success_rate=p2, difference=theta,
                            ci95=(low, high), only_this=b, only_baseline=c, p_value=two_sided,
                            p_value_greater=greater)


@torch.no_grad()
def evaluate(
    act: Callable[[Obs], torch.Tensor],
    env: ChunkedEnv,
    episodes: int,
    seed: int = 0,
    video_path: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Run `episodes` episodes. `act(obs) -> [B, H, act_dim]`.

    The first n = min(num_envs, episodes) envs each run an equal share, ceil(episodes / n), of the episodes
    (so short episodes do not crowd out long ones), taken round-robin; the first `episodes` results count.
    Episode r (in that order) starts from the state of seed `seed + r` (ChunkedEnv.reset's
    `seed_every_episode`), so an evaluation's start states do not depend on the number of envs it runs on.
    Envs beyond the first n step with the batch (a batched simulator cannot step a subset) but are not
    counted, so 20 episodes on 256 training envs take about one episode's time, not 256 episodes. The
    bookkeeping stays on the env's device (one host read per chunk: whether every count is full).

    Whatever the policy draws from torch's global generator (a sampler that is not a function of the observation,
    such as DDPM's own, `deterministic_sampler: model_std`) is seeded with `seed` for the evaluation, and the
    caller's generator state restored after it: the same checkpoint, seed and number of envs give the same
    numbers, a paired comparison's two policies draw the same noise, and an evaluation in the middle of a training
    run leaves that run's random stream as it was.

    `video_path`: env 0's episodes as one MP4 each, `<stem>_ep<k><suffix>` beside it, rendered after every
    env step (the control rate, the video's fps) from the first frame to the one that ended the episode.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        return _run_episodes(act, env, episodes, seed, video_path, progress)


def _run_episodes(
    act: Callable[[Obs], torch.Tensor],
    env: ChunkedEnv,
    episodes: int,
    seed: int,
    video_path: str | Path | None,
    progress: Callable[[int], None] | None,
) -> EvalResult:
    """`evaluate`'s episodes, under the generator state it set."""
    b, dev = env.num_envs, env.device
    n = min(b, episodes)
    quota = math.ceil(episodes / n)
    rows = torch.arange(n, device=dev)
    count = torch.zeros(n, dtype=torch.long, device=dev)
    success = torch.zeros(n, quota, dtype=torch.bool, device=dev)
    success_once = torch.zeros(n, quota, dtype=torch.bool, device=dev)
    returns = torch.zeros(n, quota, device=dev)
    lengths = torch.zeros(n, quota, dtype=torch.long, device=dev)
    milestones: dict[str, torch.Tensor] = {}  # name -> [n, quota] reached, filled as the env first reports each
    video = _EpisodeVideos(video_path, env, quota) if video_path is not None else None
    t0 = time.perf_counter()
    env_steps = 0
    obs = env.reset(seed=seed, seed_every_episode=True)
    if video is not None:
        video.start()
    while True:
        obs, _, _, _, info = env.step(act(obs), render_env=0 if video is not None else None)
        env_steps += int(info["steps"])
        record = info["done"][:n] & (count < quota)
        slot = count.clamp(max=quota - 1)
        for name in info["milestones"]:
            milestones.setdefault(name, torch.zeros(n, quota, dtype=torch.bool, device=dev))
        for table, value in ((success, info["success"]), (success_once, info["success_once"]),
                             (returns, info["episode_return"]), (lengths, info["episode_length"]),
                             *((milestones[m], reached) for m, reached in info["milestones"].items())):
            table[rows, slot] = torch.where(record, value[:n].to(table.dtype), table[rows, slot])
        count += record.long()
        if video is not None:
            video.add(info["frames"], bool(info["done"][0]))
        if progress is not None:
            progress(int(record.sum()))
        if int(count.min()) >= quota:
            break
    order = slice(0, episodes)  # episode j of env i is result i + j * n (round robin)
    success_list = success.T.reshape(-1)[order].cpu()
    once_list = success_once.T.reshape(-1)[order].cpu()
    length_list = lengths.T.reshape(-1)[order].cpu()
    reached = {m: table.T.reshape(-1)[order].tolist() for m, table in milestones.items()}
    successes = int(success_list.sum())
    return EvalResult(
        success_rate=successes / episodes,
        ci95=wilson_interval(successes, episodes),
        episodes=episodes,
        mean_return=float(returns.T.reshape(-1)[order].mean()),
        mean_length=float(length_list.float().mean()),
        seconds=time.perf_counter() - t0,
        env_steps=env_steps,
        success_once=int(once_list.sum()) / episodes,
        success_at_end=successes / episodes,
        seed=seed,
        episode_success=tuple(bool(x) for x in success_list),
        episode_length=tuple(int(x) for x in length_list),
        milestones=tuple(milestones),
        episode_milestones=tuple(tuple(m for m in milestones if reached[m][r]) for r in range(episodes))
        if milestones else (),
    )


class _EpisodeVideos:
    """Env 0's episodes of an evaluation, one MP4 per episode at the env's control rate."""

    def __init__(self, path: str | Path, env: ChunkedEnv, quota: int) -> None:
        self.path, self.env, self.quota = Path(path), env, quota
        if self.path.suffix in ("", ".mp4"):
            # Checked before the first episode: without its ffmpeg plugin, imageio picks another writer by
            # elimination and fails at the first video with an unrelated error.
            require("imageio_ffmpeg", None, f"writing evaluation videos ({self.path})", what="imageio-ffmpeg",
                    install="pip install imageio-ffmpeg")
        self.fps = float(env.spec.action.control_hz) if env.spec.action is not None else 10.0
        self.frames: list[np.ndarray] = []
        self.written = 0

    def start(self) -> None:
        """Begin an episode with the frame of its initial state."""
        frame = self.env.render_env(0)
        self.frames = [] if frame is None else [frame.cpu().numpy()]

    def add(self, frames: list[np.ndarray], episode_ended: bool) -> None:
        self.frames += frames
        if episode_ended:
            if self.written < self.quota and len(self.frames) > 1:  # only complete episodes are written
                self._write()
            self.start()

    def _write(self) -> None:
        import imageio

        out = self.path.with_name(f"{self.path.stem}_ep{self.written}{self.path.suffix or '.mp4'}")
        out.parent.mkdir(parents=True, exist_ok=True)
        imageio.mimsave(str(out), self.frames, fps=self.fps)
        self.written += 1
