"""The one PPO core every fine-tuning algorithm runs on (Schulman et al. 2017, arXiv 1707.06347).

Read top to bottom: `collect` rolls the policy out for `steps_per_iter` chunks in every env, folding the
critic's value of the final observation into the reward on truncation; `update` computes GAE and runs
clipped-objective epochs over minibatches with a clipped value loss, gradient clipping and a KL early
stop. During the first `critic_warmup_iters` iterations only the critic trains. What is sampled and how it
is scored comes from an `Algorithm` (robotft.rl.algorithm); its `critic_extra(obs, sample)` (residual PPO:
the base action) is fed to the critic as V(obs, extra). Two options change the objective:
critic-free group-relative advantages (`group_advantages`) and the dual-clip surrogate (`dual_clip`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from robotft.distributed import DistContext
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.start_states import fresh_start_seed, require_seeded_start_states
from robotft.rl.algorithm import Algorithm
from robotft.rl.buffer import RolloutBuffer, RunningRewardScaler, compute_gae
from robotft.rl.critic import ValueCritic
from robotft.rl.shaping import PotentialShaping

LOGPROB_REDUCTIONS = ("mean", "sum", "none")
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class PPOConfig:
    """Hyper-parameters of the PPO core (per-chunk MDP: one transition = one executed chunk)."""

    iterations: int = 20
    """Training iterations (collect + update)."""
    steps_per_iter: int = 50
    """Chunks collected per env per iteration."""
    gamma: float = 0.99
    """Discount per chunk."""
    gae_lambda: float = 0.95
    """GAE λ."""
    update_epochs: int = 10
    """Passes over the rollout per iteration."""
    minibatch_size: int = 50
    """Chunks per gradient step (capped at the rollout size); used when `num_minibatches` is 0."""
    num_minibatches: int = 0
    """When > 0, each epoch splits the rollout's n chunks into this many minibatches of n // num_minibatches
    (ManiSkill's PPO baseline), so an iteration takes `update_epochs × num_minibatches` optimizer steps at any
    num_envs; 0 keeps the fixed `minibatch_size` (whose step count grows with num_envs: 2,560 steps per
    iteration at 256 envs with the defaults). Recommended for hundreds of envs (docs/distributed.md)."""
    actor_lr: float = 3e-5
    """Learning rate of the trained policy parameters."""
    critic_lr: float = 1e-3
    """Learning rate of the critic."""
    clip_eps: float = 0.01
    """PPO ratio clip range (DPPO uses 0.01 on its per-dimension mean log-ratio)."""
    clip_value: float = 0.0
    """Value-loss clip range around the old value; 0 disables clipping."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    target_kl: float = 1.0
    """Stop the epoch loop when the approximate KL exceeds this; 0 disables the early stop."""
    max_grad_norm: float = 1.0
    """Gradient norm clip for actor and critic."""
    critic_warmup_iters: int = 3
    """Iterations at the start that train only the critic."""
    reward_scale: bool = False
    """Divide rewards by the running std of the discounted return. Off by default: with a sparse success
    reward and CPU-sized rollouts the running std is tiny and noisy, and the scaled returns made the critic's
    loss spike by 100x and DPPO collapse on PushCube; useful with dense rewards of arbitrary scale."""
    norm_adv: bool = True
    """Normalize advantages over the batch."""
    bootstrap_on_success: bool = False
    """Treat a success that ends the episode as an absorbing state worth V(final obs), as ManiSkill's PPO
    baseline does, instead of the end of all reward. With a dense reward that stops at success, an
    episodic return otherwise pays the policy to hover near the goal without ever succeeding."""
    potential_shaping: bool = False
    """Train on the sparse success reward shaped by the env's dense reward as a potential (robotft.rl.shaping;
    Ng et al. 1999): each chunk earns 1 at success plus γΦ(s') − Φ(s), Φ the dense reward of the state reached.
    The returns stay the sparse ones, so what is optimal does not change, but credit for progress (reaching,
    grasping, lifting) or its loss arrives at the chunk that made it. Needs an env whose dense reward is measured
    on the state (ManiSkill's `dense`/`normalized_dense`, robosuite's `dense`, the toy suite's
    `normalized_dense`)."""
    critic_hidden: tuple[int, ...] = (256, 256, 256)
    """Critic MLP widths."""
    group_advantages: bool = False
    """Critic-free, group-relative advantages (GRPO, Shao et al. 2024, arXiv 2402.03300, §4.1.2, outcome
    supervision) instead of GAE: every iteration resets all envs, and each chunk's advantage is its episode's
    undiscounted return normalized over the episodes that ended in the rollout, (R - mean R) / (std R + 1e-8);
    chunks of episodes still running when the rollout ends get advantage 0. The group is the rollout's batch
    of episodes (fresh resets, so they share the start-state distribution). Make `steps_per_iter` at least
    the episode length in chunks. The critic is not trained, `critic_warmup_iters` and `norm_adv` are
    ignored, and truncation is not bootstrapped."""
    group_size: int = 0
    """With `group_advantages`: groups of `group_size` envs run their episodes from the same start states, and an
    episode's return is normalized within its start state's group of finished episodes (GRPO's group of G samples
    per prompt, as embodied GRPO resets G envs to one initial state: SimpleVLA-RL, Li et al. 2025, arXiv
    2509.09674; RLinf). A start state whose group all succeeded or all failed gives advantage 0 (nothing to
    learn there), and the update trains on the chunks of the other episodes only (DAPO's filter of uniform
    groups, Yu et al. 2025, arXiv 2503.14476). Must divide `num_envs`; needs envs that reset one env from a
    seed (CPU) and in-process rollouts in one process. 0: the rollout's whole batch is the group."""
    logprob_reduction: str = "mean"
    """How a scored transition's per-entry log-densities become one log-probability: `mean` (DPPO's and
    ReinFlow's per-dimension normalization, for which a clip range of ~0.01 is published) or `sum` (the exact
    joint density of the entries, as CleanRL's Gaussian PPO; clip ranges ~0.2) or `none`: every entry is its own
    ratio, clipped on its own (RLinf's `token_level`; clip ranges ~0.2). A coherent shift δ of a Gaussian mean
    with std s moves each entry's log-ratio by ~δ/s with a random sign, so their mean moves by only ~δ/(s·sqrt(E))
    over E entries: with the same clip, `mean` lets a shift grow about sqrt(E) times larger than `none` does
    before anything is clipped."""
    lr_schedule: str = "constant"
    """Actor and critic learning-rate schedule over `iterations`: `constant`, or `cosine` (linear warm-up over
    `lr_warmup_iters`, then cosine decay towards `actor_min_lr` / `critic_min_lr`, reached one iteration after the
    last)."""
    lr_warmup_iters: int = 0
    """Iterations of linear learning-rate warm-up (`cosine` schedule)."""
    actor_min_lr: float = 0.0
    """Actor learning rate at the end of the cosine schedule."""
    critic_min_lr: float = 0.0
    """Critic learning rate at the end of the cosine schedule."""
    reward_clip: float = 0.0
    """Clip each chunk reward to [-c, c] after any scaling (before truncation bootstrapping); 0 disables it."""
    skip_no_signal: bool = True
    """Do not update the actor from a rollout without a learning signal: no success and the same env reward at
    every step (e.g. a sparse reward never reached). Normalized advantages of such a rollout are the critic's
    noise scaled to unit variance, which moves the policy at random. The critic still trains."""
    dual_clip: float = 0.0
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): for A < 0 the clipped surrogate is bounded
    by c · A, so a huge ratio on a bad action cannot blow up the loss. c > 1 (the paper uses 3); 0 disables."""
    compile: bool = False
    """`torch.compile` the policy's networks and the critic (rollout sampling and update alike). Pays a
    compile time at the first iterations; worth it on a GPU with hundreds of envs."""
    cuda_graphs: bool = False
    """Compile with CUDA graphs (`mode="reduce-overhead"`), which replays each network call as one graph
    launch. CUDA only: refused on another device. Implies `compile`."""
    bf16: bool = False
    """bfloat16 autocast of the network forward passes in rollout sampling and in the update (optimizer state
    and log-density arithmetic stay float32). The networks' outputs carry bf16 rounding into the
    log-probability ratios, which DPPO's clip ranges of 1e-3 to 1e-2 may not tolerate: compare with a float32
    run first. On CPU bf16 is usually slower."""

    def __post_init__(self) -> None:
        for name in ("iterations", "steps_per_iter", "update_epochs", "minibatch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_minibatches < 0:
            raise ValueError(f"rl.num_minibatches must be >= 0 (0: use rl.minibatch_size), got {self.num_minibatches}")
        if not 0.0 < self.gamma <= 1.0 or not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"rl.gamma must be in (0, 1] and rl.gae_lambda in [0, 1]; got {self.gamma}, {self.gae_lambda}")
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ValueError(f"rl.dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        if self.logprob_reduction not in LOGPROB_REDUCTIONS:
            raise ValueError(f"rl.logprob_reduction must be one of {LOGPROB_REDUCTIONS}, got {self.logprob_reduction!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"rl.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        for name in ("actor_lr", "critic_lr", "clip_eps"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"rl.{name} must be > 0, got {getattr(self, name)}")
        for name in ("lr_warmup_iters", "critic_warmup_iters", "actor_min_lr", "critic_min_lr", "reward_clip",
                     "target_kl", "max_grad_norm", "clip_value", "vf_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"rl.{name} must be >= 0, got {getattr(self, name)}")
        if self.group_size < 0 or (self.group_size and not self.group_advantages):
            raise ValueError(f"rl.group_size must be >= 0 and needs rl.group_advantages, got {self.group_size}")
        if self.group_advantages and (self.reward_scale or self.bootstrap_on_success or self.potential_shaping):
            raise ValueError("rl.group_advantages uses raw episode returns: turn off rl.reward_scale, "
                             "rl.bootstrap_on_success and rl.potential_shaping")
        if self.potential_shaping and self.bootstrap_on_success:
            raise ValueError("rl.potential_shaping ends a successful episode with its success reward (Φ = 0 at the "
                             "end); turn off rl.bootstrap_on_success, which would add a bootstrapped value to it")


@dataclass
class RolloutStats:
    """What one `collect` call saw."""

    env_steps: int
    episodes: int
    successes: int
    episode_returns: list[float]
    seconds: float
    signal: bool = True
    """Whether the rollout carries a learning signal: a success, or env rewards that differ between steps."""


class PPO:
    """Collects chunked rollouts from a ChunkedEnv and updates an Algorithm's policy and a critic.

    Under torchrun (`dist`, robotft.distributed) every rank collects from its own envs, and the update
    averages gradients across ranks and normalizes advantages, scales rewards and checks the KL over all
    ranks' data: W ranks of `num_envs` envs and `minibatch_size` chunks take the steps that one process with
    W·num_envs envs and W·minibatch_size chunks would take (DD-PPO, Wijmans et al. 2020, arXiv 1911.00357).
    `env` may be None when something else collects the rollouts (robotft.rl.rollout); then `device`
    says where the learner's tensors live."""

    def __init__(self, algo: Algorithm, critic: ValueCritic, env: ChunkedEnv | None, cfg: PPOConfig, seed: int = 0,
                 dist: DistContext | None = None, device: torch.device | str | None = None):
        self.algo, self.critic, self.env, self.cfg = algo, critic, env, cfg
        self.dist = dist or DistContext()
        self.device = env.device if env is not None else torch.device(device or "cpu")
        self.actor_opt = torch.optim.AdamW(algo.actor_parameters(), lr=cfg.actor_lr, weight_decay=0.0)
        self.critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
        num_envs = env.num_envs if env is not None else 1
        self.reward_scaler = RunningRewardScaler(num_envs, cfg.gamma, self.device, dist=self.dist)
        self.shaping = PotentialShaping(num_envs, cfg.gamma, self.device) if cfg.potential_shaping else None
        self.iteration = 0
        self.env_steps = 0
        self.seed = seed
        self._obs = None
        if cfg.group_size:
            self._check_groups(env)
        if cfg.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"rl.cuda_graphs needs a CUDA device; this run is on {self.device} (drop the flag)")
        if cfg.compile or cfg.cuda_graphs:
            # Module.compile swaps each module's forward for the compiled one in place: sampling, scoring and
            # the critic all go through it.
            mode = "reduce-overhead" if cfg.cuda_graphs else None
            for module in [*algo.policy.children(), critic]:
                module.compile(mode=mode)

    def _check_groups(self, env: ChunkedEnv | None) -> None:
        """`rl.group_size` seeds each env's episodes (ChunkedEnv.reset's `group_size`): refuse where that cannot
        give a group one start state."""
        g = self.cfg.group_size
        if env is None or self.dist.enabled:
            raise ValueError("rl.group_size needs in-process rollouts in one process (no rollout workers, no "
                             "torchrun): the groups' start states are seeded env by env there")
        if env.num_envs % g:
            raise ValueError(f"rl.group_size {g} must divide env.num_envs {env.num_envs}")
        require_seeded_start_states("rl.group_size", env.device)

    def _autocast(self):
        """bf16 autocast of forward passes when `rl.bf16` is on (a no-op context otherwise)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def minibatch_size(self, n: int) -> int:
        """Chunks per gradient step for a rollout of `n` chunks (`num_minibatches` or `minibatch_size`)."""
        if self.cfg.num_minibatches > 0:
            return max(1, n // self.cfg.num_minibatches)
        return min(self.cfg.minibatch_size, n)

    # -- rollout ----------------------------------------------------------------------------------

    @torch.no_grad()
    def collect(self) -> tuple[RolloutBuffer, torch.Tensor, RolloutStats]:
        """Roll out `steps_per_iter` chunks per env. Returns the buffer, V(s_T) `[B]` and stats."""
        cfg, env = self.cfg, self.env
        # Restarts draw fresh start states, never the evaluation's (start_states.py).
        if cfg.group_size:  # every iteration
            self._obs = env.reset(seed=fresh_start_seed(self.seed, self.iteration), seed_every_episode=True,
                                  group_size=cfg.group_size)
        elif self._obs is None or cfg.group_advantages:
            self._obs = env.reset(seed=fresh_start_seed(self.seed, self.iteration))
            if self.shaping is not None:
                self.shaping.restart()
        buf = RolloutBuffer(cfg.steps_per_iter, env.num_envs, self.device)
        t0 = time.perf_counter()
        steps = 0
        # Episode statistics stay on the device until the rollout ends: no host sync per chunk for them.
        episodes = torch.zeros((), dtype=torch.long, device=self.device)
        successes = torch.zeros((), dtype=torch.long, device=self.device)
        ended_returns, ended, ended_seeds = [], [], []
        reward_lo = reward_hi = None
        self.algo.policy.eval()
        for _ in range(cfg.steps_per_iter):
            obs = self._obs
            with self._autocast():
                out = self.algo.act(obs, deterministic=False)
                value = self._value(obs, out.sample).float()
            next_obs, reward, terminated, truncated, info = env.step(out.actions)
            done = terminated | truncated
            reward_lo = reward.min() if reward_lo is None else torch.minimum(reward_lo, reward.min())
            reward_hi = reward.max() if reward_hi is None else torch.maximum(reward_hi, reward.max())
            if self.shaping is not None:
                reward = self.shaping(info, terminated, truncated)
            if cfg.reward_scale:
                reward = self.reward_scaler(reward, done)
            if cfg.reward_clip > 0:
                reward = reward.clamp(-cfg.reward_clip, cfg.reward_clip)
            # Truncation is not termination: bootstrap from the value of the observation it stopped at.
            bootstrap = truncated & ~terminated
            if cfg.bootstrap_on_success:
                bootstrap = bootstrap | (terminated & info["success"])
            if bootstrap.any() and not cfg.group_advantages:
                with self._autocast():
                    final_value = self._value(info["final_obs"]).float()
                reward = reward + cfg.gamma * final_value * bootstrap.float()
            buf.add(obs, out.sample, out.logprob.float(), value, reward, done)
            self._obs = next_obs
            steps += int(info["steps"])
            episodes += done.sum()
            successes += (info["success"] & done).sum()
            ended_returns.append(info["episode_return"])
            ended.append(done)
            if cfg.group_size:
                ended_seeds.append(torch.where(done.cpu(), info["start_seed"], -1))
        with self._autocast():
            next_value = self._value(self._obs).float()
        returns = torch.stack(ended_returns)[torch.stack(ended)].tolist() if ended else []
        varied = float(reward_hi > reward_lo) if reward_lo is not None else 0.0
        steps, episodes, successes, varied = (int(v) for v in self.dist.sum([steps, int(episodes), int(successes),
                                                                              varied]))
        returns = self.dist.gather_lists(returns)
        self.env_steps += steps
        if cfg.group_size:
            buf.start_seeds = torch.stack(ended_seeds)
        stats = RolloutStats(steps, episodes, successes, returns, time.perf_counter() - t0,
                             signal=successes > 0 or varied > 0)
        return buf, next_value, stats

    def _value(self, obs, sample: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """V(obs, algo.critic_extra(obs, sample)); `sample` is None when bootstrapping."""
        return self.critic(obs, self.algo.critic_extra(obs, sample))

    def restart_episodes(self) -> None:
        """Start fresh episodes at the next `collect` (after something else stepped the envs)."""
        self._obs = None

    # -- update -----------------------------------------------------------------------------------

    def update(self, buf: RolloutBuffer, next_value: torch.Tensor, signal: bool = True) -> dict[str, float]:
        """GAE, then clipped PPO epochs. Returns mean metrics over the gradient steps taken.

        `signal`: whether the rollout carried a learning signal (RolloutStats.signal); without one the actor
        is not updated when `rl.skip_no_signal` is on."""
        cfg, algo = self.cfg, self.algo
        actor_lr, critic_lr = self.learning_rates()
        for group in self.actor_opt.param_groups:
            group["lr"] = actor_lr
        for group in self.critic_opt.param_groups:
            group["lr"] = critic_lr
        if cfg.group_advantages:
            advantages = group_relative_advantages(buf.rewards, buf.dones, dist=self.dist, groups=buf.start_seeds)
            returns = torch.zeros_like(advantages)  # no critic to train
        else:
            advantages, returns = compute_gae(
                buf.rewards, buf.values, buf.dones, next_value, cfg.gamma, cfg.gae_lambda
            )
        flat = buf.flat()
        obs, samples = flat["obs"], flat["samples"]
        old_logp, old_values = flat["logprobs"], flat["values"]
        advantages, returns = advantages.reshape(-1), returns.reshape(-1)
        informative = None
        if cfg.group_size:  # only episodes whose start state's group had mixed outcomes carry a gradient
            keep = advantages != 0
            informative = float(keep.float().mean())
            signal = signal and bool(keep.any())
            if keep.any():
                obs, samples = {k: v[keep] for k, v in obs.items()}, {k: v[keep] for k, v in samples.items()}
                old_logp, old_values = old_logp[keep], old_values[keep]
                advantages, returns = advantages[keep], returns[keep]
        n = advantages.shape[0]
        mb = self.minibatch_size(n)
        train_critic = not cfg.group_advantages
        train_actor = self.iteration >= self.first_actor_iteration
        skipped_no_signal = train_actor and cfg.skip_no_signal and not signal
        train_actor = train_actor and not skipped_no_signal
        weights = algo.advantage_weights().to(self.device)
        clip = algo.clip_coefs(cfg.clip_eps).to(self.device)
        metrics: dict[str, list[float]] = {}
        # Scored in the mode the rollouts were sampled in (eval): train mode would turn on the image encoder's
        # random crops, a different distribution than the one the old log-probabilities came from.
        self.algo.policy.eval()
        stop = False
        actor_steps = 0
        # Without a critic (group-relative advantages) a skipped actor leaves nothing to train.
        for _epoch in range(cfg.update_epochs if train_critic or train_actor else 0):
            perm = torch.randperm(n, device=self.device)
            for start in range(0, n - mb + 1, mb):
                idx = perm[start : start + mb]
                mb_obs = {k: v[idx] for k, v in obs.items()}
                mb_samples = {k: v[idx] for k, v in samples.items()}
                loss = torch.zeros((), device=self.device)
                step_metrics = {}
                if train_critic:
                    with self._autocast():
                        v_loss = self._value_loss(mb_obs, returns[idx], old_values[idx], mb_samples)
                    loss = cfg.vf_coef * v_loss
                    step_metrics["value_loss"] = v_loss.item()
                if train_actor:
                    with self._autocast():
                        pg_loss, kl, pg_metrics = self._policy_loss(
                            mb_obs, mb_samples, old_logp[idx], advantages[idx], weights, clip
                        )
                        extra, extra_metrics = algo.extra_loss(mb_obs, mb_samples)
                    loss = loss + pg_loss + extra
                    step_metrics.update(pg_metrics, **extra_metrics)
                    # Every rank stops on the same minibatch: the KL of the global minibatch decides.
                    batch_kl = self.dist.mean(kl)
                    if cfg.target_kl > 0 and batch_kl > cfg.target_kl:
                        # The stopping minibatch takes no step, so its KL is not in the averages below; it is
                        # what tells a user why an update ended after a few steps.
                        stop = True
                        metrics["stop_kl"] = [batch_kl]
                        break
                self.actor_opt.zero_grad(set_to_none=True)
                self.critic_opt.zero_grad(set_to_none=True)
                loss.backward()
                self.dist.all_reduce_gradients([*self.critic.parameters(), *algo.actor_parameters()])
                nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.critic_opt.step()
                if train_actor:
                    step_metrics["actor_grad_norm"] = float(
                        nn.utils.clip_grad_norm_(algo.actor_parameters(), cfg.max_grad_norm)
                    )
                    self.actor_opt.step()
                    actor_steps += 1
                for k, v in step_metrics.items():
                    metrics.setdefault(k, []).append(v)
            if stop:
                break
        self.iteration += 1
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        if train_critic:
            out["explained_variance"] = explained_variance(buf.values.reshape(-1), returns)
        out["kl_early_stop"] = float(stop)
        out["actor_trained"] = float(train_actor)
        out["actor_steps"] = float(actor_steps)
        out["actor_skipped_no_signal"] = float(skipped_no_signal)
        if informative is not None:
            out["informative_fraction"] = informative
        out["actor_lr"], out["critic_lr"] = actor_lr, critic_lr
        return out

    @property
    def first_actor_iteration(self) -> int:
        """The iteration of the first actor update: after the critic warm-up, or at once without a critic
        (group-relative advantages)."""
        return 0 if self.cfg.group_advantages else self.cfg.critic_warmup_iters

    def learning_rates(self) -> tuple[float, float]:
        """(actor, critic) learning rates of the current iteration under `rl.lr_schedule`."""
        cfg = self.cfg
        if cfg.lr_schedule == "constant":
            return cfg.actor_lr, cfg.critic_lr
        return (cosine_with_warmup(self.iteration, cfg.iterations, cfg.lr_warmup_iters, cfg.actor_lr, cfg.actor_min_lr),
                cosine_with_warmup(self.iteration, cfg.iterations, cfg.lr_warmup_iters, cfg.critic_lr,
                                   cfg.critic_min_lr))

    def _value_loss(self, obs, returns: torch.Tensor, old_values: torch.Tensor, samples=None) -> torch.Tensor:
        """0.5 (V - R)², optionally clipped around the old value (PPO2's clipped value loss)."""
        values = self._value(obs, samples)
        unclipped = (values - returns) ** 2
        if self.cfg.clip_value <= 0:
            return 0.5 * unclipped.mean()
        clipped_v = old_values + (values - old_values).clamp(-self.cfg.clip_value, self.cfg.clip_value)
        return 0.5 * torch.max(unclipped, (clipped_v - returns) ** 2).mean()

    def _policy_loss(self, obs, samples, old_logp, adv, weights, clip):
        """Clipped surrogate per scored transition: max(-A w_k r_k, -A w_k clip(r_k, 1±ε_k)), mean; with
        `dual_clip` c, entries with A < 0 are capped at -c A w_k (Ye et al. 2020)."""
        if self.cfg.norm_adv and not self.cfg.group_advantages and adv.numel() > 1:
            mean, std = self.dist.mean_std(adv)
            adv = (adv - mean) / (std + 1e-8)
        new_logp = self.algo.logprob(obs, samples).float()
        # Under `logprob_reduction: none` each of the K transitions has E entry columns (transition-major).
        entries = new_logp.shape[1] // weights.shape[0]
        weights, clip = weights.repeat_interleave(entries), clip.repeat_interleave(entries)
        logratio = new_logp - old_logp
        ratio = logratio.exp()
        adv_k = adv[:, None] * weights[None, :]
        pg1 = -adv_k * ratio
        pg2 = -adv_k * torch.clamp(ratio, 1 - clip[None, :], 1 + clip[None, :])
        pg = torch.max(pg1, pg2)
        if self.cfg.dual_clip > 0:
            pg = torch.where(adv_k < 0, torch.min(pg, -self.cfg.dual_clip * adv_k), pg)
        pg_loss = pg.mean()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).mean().item()
            clipfrac = ((ratio - 1).abs() > clip[None, :]).float().mean().item()
        return pg_loss, approx_kl, {
            "policy_loss": pg_loss.item(),
            "approx_kl": approx_kl,
            "clip_fraction": clipfrac,
            "ratio_mean": ratio.mean().item(),
        }

    # -- resume -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "critic": self.critic.state_dict(),
            "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "reward_scaler": self.reward_scaler.state_dict(),
            "iteration": self.iteration,
            "env_steps": self.env_steps,
            "algo": self.algo.state_dict(),
            "torch_rng": torch.get_rng_state(),
            # The rollout's sampling noise is drawn on the device: resume it there too.
            **({"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        self.reward_scaler.load_state_dict(state["reward_scaler"])
        self.iteration = int(state["iteration"])
        self.env_steps = int(state["env_steps"])
        self.algo.load_state_dict(state["algo"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)


def group_relative_advantages(rewards: torch.Tensor, dones: torch.Tensor, eps: float = 1e-8,
                              dist: DistContext | None = None, groups: torch.Tensor | None = None) -> torch.Tensor:
    """`[T, B]` GRPO outcome advantages (Shao et al. 2024, arXiv 2402.03300, §4.1.2) for a rollout that began
    with a reset of every env: each chunk gets (R_e - mean R) / (std R + eps), R_e the undiscounted return of
    its episode and the statistics over the episodes that ended in the rollout; chunks of unfinished episodes
    get 0. `rewards`, `dones`: `[T, B]`. Under torchrun (`dist`) the group is every rank's episodes.

    `groups` (`[T, B]` long, read where `dones`: the start state of the episode that ended there): the
    statistics are each group's instead, over its finished episodes; a group of one episode, or whose
    returns are all equal, gives its chunks 0."""
    if groups is not None:
        groups = groups.to(rewards.device)
    num_steps = rewards.shape[0]
    to_go, finished = torch.zeros_like(rewards), torch.zeros_like(dones, dtype=torch.bool)
    next_to_go, next_finished = torch.zeros_like(rewards[0]), torch.zeros_like(finished[0])
    group_of = torch.zeros_like(dones, dtype=torch.long)
    next_group = torch.zeros_like(group_of[0])
    for t in reversed(range(num_steps)):  # reward-to-go within the episode, and whether the episode ends
        done = dones[t].bool()
        next_to_go = rewards[t] + torch.where(done, 0.0, next_to_go)
        next_finished = done | next_finished
        to_go[t], finished[t] = next_to_go, next_finished
        if groups is not None:
            next_group = torch.where(done, groups[t], next_group)
            group_of[t] = next_group
    episode_return, starts = torch.zeros_like(rewards), torch.ones_like(finished)
    starts[1:] = dones[:-1].bool()
    current = to_go[0]
    for t in range(num_steps):  # the return-to-go at an episode's first chunk is its return
        current = torch.where(starts[t], to_go[t], current)
        episode_return[t] = current
    if groups is not None:
        return _per_group_advantages(episode_return, group_of, starts & finished, finished, eps)
    group = episode_return[starts & finished]
    dist = dist or DistContext()
    n = int(dist.sum([float(group.numel())])[0])  # the same on every rank, so all take the same branch
    if n == 0:
        return torch.zeros_like(rewards)
    if n == 1:
        mean, std = dist.moments(group)[0], torch.ones((), device=rewards.device)
    else:
        mean, std = dist.mean_std(group)
    return torch.where(finished, (episode_return - mean) / (std + eps), 0.0)


def _per_group_advantages(episode_return: torch.Tensor, group_of: torch.Tensor, first_chunk: torch.Tensor,
                          finished: torch.Tensor, eps: float) -> torch.Tensor:
    """(R_e - mean_g R) / (std_g R + eps) per chunk of a finished episode e of group g (unbiased std over the
    group's finished episodes, as torch.std); 0 for groups of one or of equal returns."""
    ids, inverse = torch.unique(group_of[first_chunk], return_inverse=True)
    returns = episode_return[first_chunk]
    count = torch.zeros(len(ids), device=returns.device).index_add_(0, inverse, torch.ones_like(returns))
    mean = torch.zeros_like(count).index_add_(0, inverse, returns) / count
    var = torch.zeros_like(count).index_add_(0, inverse, (returns - mean[inverse]) ** 2) / (count - 1).clamp(min=1)
    std = var.sqrt()
    varied = std > 1e-6 * (1 + mean.abs())  # float rounding must not turn equal returns into unit advantages
    advantages = torch.zeros_like(episode_return)
    g = torch.searchsorted(ids, group_of[finished])
    advantages[finished] = torch.where(varied[g], (episode_return[finished] - mean[g]) / (std[g] + eps), 0.0)
    return advantages


def cosine_with_warmup(iteration: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Learning rate at `iteration` (0-based) of `total`: linear warm-up to `peak` over the first `warmup`
    iterations (peak · (i + 1) / (warmup + 1)), then cosine decay (Loshchilov & Hutter 2017, arXiv 1608.03983)
    floor + ½ (peak - floor)(1 + cos(π p)), p going from 0 after the warm-up to 1 one iteration after the last,
    so that the last iteration still learns (at floor 0 it would not move the policy)."""
    if iteration < warmup:
        return peak * (iteration + 1) / (warmup + 1)
    span = max(total - warmup, 1)
    progress = min(max(iteration - warmup, 0) / span, 1.0)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var[target - pred] / Var[target]: 1 is a perfect critic, <= 0 is no better than a constant."""
    var = target.var()
    if var.item() == 0:
        return float("nan")
    return float(1 - (target - pred).var() / var)
