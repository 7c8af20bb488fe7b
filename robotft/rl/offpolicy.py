"""The off-policy core beside the PPO core: chunk-level replay, a LayerNorm Q ensemble, a configurable UTD ratio.

Read top to bottom: `collect` rolls the policy out for `steps_per_iter` chunks in every env and adds every executed
chunk to the replay buffer (robotft.rl.replay; truncation keeps the final observation to bootstrap from), then
`update` takes `utd × (new transitions)` critic steps, each on a minibatch that is half online data and half
demonstrations when a dataset store is given (RLPD's symmetric sampling, Ball et al. 2023, arXiv 2302.02948, §3),
with the n-step soft Bellman target

    y = R + γ^m (1 - d) (min_{j ∈ subset} Q̄_j(s', a') - α log π(a'|s')),   a' ~ π(·|s'),

(SAC, Haarnoja et al. 2018; min over a random subset of the target ensemble, REDQ; the entropy term is optional,
`backup_entropy`), Polyak-averaged targets, and an actor step every `actor_every` critic steps. What is acted, what
the critic's action is and how the actor learns come from an `OffPolicyAlgorithm` (dsrl, pa_rl, residual_sac,
filtered_bc).

Starting points, from the fine-tuning papers: the Q-function starts from scratch on top of the BC policy (PORL's
policy-only initialisation, the default: no offline pessimism to unlearn); `warmup_steps` first fills the buffer
with rollouts of the initial policy (WSRL, Zhou et al. 2024, arXiv 2412.07762: a small warm-up instead of keeping
the offline data); `critic_warmup_iters` trains only the critic at the start so the actor does not follow a random
Q; `critic_pretrain_steps` fits the critic on the demonstrations alone before any rollout, and
`conservative_weight` adds Cal-QL's calibrated conservative term to the critic's loss (robotft.rl.conservative),
so that a critic fitted to demonstrations, all of them successes, does not rate every action as one.
"""

from __future__ import annotations

import abc
import copy
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from robotft.envs.base import Obs
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.start_states import (
    RESTART_SEED_STRIDE,
    FailedStartReplay,
    fresh_start_seed,
    require_seeded_start_states,
)
from robotft.policies.base import Policy
from robotft.rl.conservative import conservative_penalty
from robotft.rl.q_ensemble import QEnsemble, polyak, subset_min
from robotft.rl.replay import ChunkReplayBuffer, ReplayBatch

SOURCE_DEMOS = "source"
"""`offpolicy.demo_data` value naming the source checkpoint's own BC dataset (robotft.checkpoint.training_dataset)."""


@dataclass
class OffPolicyConfig:
    """Hyper-parameters of the off-policy core (`--offpolicy.X`); `--iterations` (rl.iterations) counts
    collect-then-update cycles."""

    steps_per_iter: int = 4
    """Chunks collected per env per iteration."""
    utd: float = 1.0
    """Update-to-data ratio: critic gradient steps per collected chunk transition (RLPD uses 5-20 with one env;
    with many parallel envs a ratio below 1 is usual)."""
    batch_size: int = 256
    """Transitions per gradient step (online and demonstrations together)."""
    buffer_size: int = 200_000
    """Replay capacity in chunk transitions (rounded up to a multiple of env.num_envs)."""
    gamma: float = 0.99
    """Discount per chunk."""
    n_step: int = 1
    """n of the n-step return; the walk stops at the end of an episode."""
    reward_offset: float = 0.0
    """Added to every chunk transition's reward (online and demonstrations) when the critic learns from it; -1
    turns a sparse success reward that ends the episode into a cost per chunk until success, so Q measures the
    time to success instead of a 0/1 outcome the entropy bonus can swamp (DSRL's robomimic runs, reward - 1).
    Only where success is the sole termination: where failures end episodes too (the toy's collisions), a cost
    per chunk pays the policy to fail early."""
    tau: float = 0.005
    """Polyak rate of the target critics."""
    critic_lr: float = 3e-4
    """Learning rate of the Q ensemble."""
    num_critics: int = 2
    """Q ensemble size E (RLPD uses 10)."""
    num_min: int = 2
    """Members the target takes the minimum over (a random subset when smaller than E)."""
    critic_hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of each Q network (LayerNorm after each)."""
    backup_entropy: bool = True
    """Subtract α log π(a'|s') in the critic's target (SAC's soft backup). False keeps the entropy term in the
    actor's objective only, so Q estimates the return itself: under a sparse success reward, with truncated
    episodes that bootstrap, the soft backup adds α·H per chunk over an unbounded horizon and Q can outgrow the
    largest return (the `backup_entropy` switch of RLPD's and REDQ's reference code)."""
    actor_every: int = 1
    """Critic steps per actor step (delayed policy updates)."""
    max_grad_norm: float = 10.0
    """Gradient norm clip of the critic; 0 disables it."""
    warmup_steps: int = 0
    """WSRL warm-up: chunks per env collected with the initial policy before the first iteration (count as env
    steps)."""
    critic_warmup_iters: int = 0
    """Iterations at the start that train only the critic."""
    critic_pretrain_steps: int = 0
    """Critic gradient steps on the demonstrations alone before the first rollout (needs `demo_data`); 0 keeps
    PORL's from-scratch Q."""
    demo_data: str = ""
    """A dataset store (demonstrations, or deployments recorded with `robotft deploy --record`) mixed into every
    minibatch; `source`: the store the source checkpoint's policy was behaviour-cloned on (followed back through
    fine-tuning runs; online data only where none is recorded); empty: online data only."""
    demo_ratio: float = 0.5
    """Fraction of each minibatch drawn from `demo_data` (RLPD's symmetric sampling: 0.5). 1 trains on the
    demonstrations alone: with `filtered_bc`, continued BC on the same update schedule, the control that tells what
    the rollouts add from what more BC steps add."""
    conservative_weight: float = 0.0
    """α of CQL's conservative term in the critic's loss, α · (log Σ_a exp Q(s, a) - Q(s, a_data)) over random
    and policy actions (robotft.rl.conservative), in pre-training and online alike; 0 turns it off (PORL's
    unregularised Q). Cal-QL's and DPPO's robomimic runs use 5."""
    conservative_random: int = 4
    """Uniform random critic actions per observation in the conservative term (in [-1, 1], the normalized
    action range)."""
    calibrated: bool = True
    """Cal-QL: the conservative term never pushes a policy action's Q below the data's Monte-Carlo
    return-to-go; False is plain CQL."""
    retry_failed_starts: int = 0
    """Times a start state whose rollout failed is tried again in later rollouts (robotft.envs.start_states:
    Prioritized Level Replay's replay of the states worth learning from); 0 starts every episode from a fresh
    state. Training start states are then seeded from a range no evaluation uses."""
    retry_prob: float = 0.5
    """With `retry_failed_starts`: probability that a new episode replays a waiting failed start state."""

    def __post_init__(self) -> None:
        for name in ("steps_per_iter", "batch_size", "buffer_size", "n_step", "num_critics", "num_min",
                     "actor_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"offpolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.utd <= 0:
            raise ValueError(f"offpolicy.utd must be > 0, got {self.utd}")
        if not 0 < self.gamma <= 1 or not 0 < self.tau <= 1:
            raise ValueError(f"offpolicy.gamma and offpolicy.tau must be in (0, 1], got {self.gamma}, {self.tau}")
        if not 0 <= self.demo_ratio <= 1:
            raise ValueError(f"offpolicy.demo_ratio must be in [0, 1], got {self.demo_ratio}")
        if self.demo_ratio == 1 and not self.demo_data:
            raise ValueError("offpolicy.demo_ratio 1 (demonstrations only) needs offpolicy.demo_data (a dataset store)")
        if min(self.warmup_steps, self.critic_warmup_iters, self.critic_pretrain_steps) < 0:
            raise ValueError("offpolicy.warmup_steps, critic_warmup_iters and critic_pretrain_steps must be >= 0")
        if self.critic_pretrain_steps and not self.demo_data:
            raise ValueError("offpolicy.critic_pretrain_steps needs offpolicy.demo_data (a dataset store)")
        if self.retry_failed_starts < 0 or not 0 < self.retry_prob <= 1:
            raise ValueError(f"offpolicy.retry_failed_starts must be >= 0 and offpolicy.retry_prob in (0, 1], got "
                             f"{self.retry_failed_starts} and {self.retry_prob}")
        if self.conservative_weight < 0 or self.conservative_random < 1:
            raise ValueError(f"offpolicy.conservative_weight must be >= 0 and offpolicy.conservative_random >= 1, "
                             f"got {self.conservative_weight} and {self.conservative_random}")


class OffPolicyAlgorithm(abc.ABC):
    """What an off-policy algorithm tells the core: how it acts, what the critic's action is, how its actor learns.

    `policy` is what is checkpointed and evaluated (`predict_chunk`); for DSRL and residual SAC it wraps the frozen
    base the run started from."""

    name: str
    core = "offpolicy"
    """Which fine-tuning loop runs this algorithm (robotft.finetune)."""
    rl_defaults: ClassVar[dict[str, Any]] = {}
    """The PPO core's `rl.` defaults (robotft.finetune.FinetuneConfig.for_algorithm): none apply here."""
    offpolicy_defaults: ClassVar[dict[str, Any]] = {}
    """This algorithm's own values for the off-policy core's `offpolicy.` fields (FinetuneConfig.for_algorithm)."""
    policy: Policy
    action_dim: int
    """Width of the critic's action input."""
    uses_critic: bool = True
    """False for algorithms that learn without a Q-function (filtered BC): the core then trains no critic."""
    only_successful: bool = False
    """The actor learns only from transitions of successful episodes (filtered BC)."""
    target_is_policy_sample: bool = True
    """`target_action` is a plain sample of the current policy, so the conservative term takes the Bellman
    target's a' as its policy sample at s' instead of drawing another (False where the target is chosen: PA-RL's
    best of N)."""
    critic: QEnsemble | None = None
    """The core's critic, set when the core is built (PA-RL acts with it)."""

    def attach_critic(self, critic: QEnsemble | None) -> None:
        """Called once by the core with its critic, before any rollout or resume."""
        self.critic = critic

    @abc.abstractmethod
    def act(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(chunk [B, H, A] env units, critic action [B, action_dim])` for a batch of histories (no gradients)."""

    def warmup_act(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """The initial policy's action, for WSRL's warm-up rollouts; by default `act`."""
        return self.act(obs)

    @abc.abstractmethod
    def critic_action_from_chunk(self, chunk: torch.Tensor) -> torch.Tensor | None:
        """Critic actions `[N, action_dim]` of chunks from a dataset store (env units), or None when the critic's
        action cannot be recovered from a chunk (DSRL acts in noise space): then demonstrations are not mixed."""

    def target_action(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(a' [N, action_dim], log π(a'|s') [N] or None)` for the Bellman target (no gradients needed)."""
        raise NotImplementedError(f"{self.name} trains no critic")

    def policy_action(self, obs: Obs) -> torch.Tensor:
        """`[N, action_dim]` one sample of the current policy's critic action per observation (no gradients), where
        the conservative term pushes Q down; by default the Bellman target's action."""
        return self.target_action(obs)[0]

    def alpha(self) -> float:
        """The entropy coefficient of the soft target (0: a plain Bellman target)."""
        return 0.0

    @abc.abstractmethod
    def update_actor(self, batch: ReplayBatch, critic: QEnsemble | None) -> dict[str, float]:
        """One actor step on `batch` against the current critic (None when `uses_critic` is False)."""

    def state_dict(self) -> dict[str, Any]:
        """Actor optimizer, temperature and any other state beyond the policy's weights, for resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore `state_dict()`."""


def executed_action(policy: Policy, chunk: torch.Tensor) -> torch.Tensor:
    """The critic's action for a chunk `[N, H, A]` env units: its executed `act_steps`, normalized and flattened,
    `[N, act_steps · A]` (so demonstrations and recorded deployments enter the critic unchanged)."""
    return policy.normalizer.normalize("action", chunk[:, : policy.config.act_steps]).flatten(1)


@dataclass
class CollectStats:
    """What one `collect` call saw."""

    env_steps: int
    episodes: int
    successes: int
    episode_returns: list[float]
    seconds: float
    replayed_starts: int = 0
    """Episodes started from a failed start state again (`retry_failed_starts`)."""
    replays_ended: int = 0
    """Episodes that replayed a failed start state and ended in this collect."""
    replays_solved: int = 0
    """... of which succeeded."""


def concat_batches(a: ReplayBatch, b: ReplayBatch) -> ReplayBatch:
    """One minibatch of the rows of `a` then `b`."""
    return ReplayBatch(
        obs={k: torch.cat([a.obs[k], b.obs[k]]) for k in a.obs},
        action=torch.cat([a.action, b.action]), chunk=torch.cat([a.chunk, b.chunk]),
        reward=torch.cat([a.reward, b.reward]), discount=torch.cat([a.discount, b.discount]),
        next_obs={k: torch.cat([a.next_obs[k], b.next_obs[k]]) for k in a.next_obs},
        success=torch.cat([a.success, b.success]),
        return_to_go=None if a.return_to_go is None else torch.cat([a.return_to_go, b.return_to_go]),
    )


class OffPolicy:
    """Collects chunk transitions into a replay buffer and updates a Q ensemble and an OffPolicyAlgorithm."""

    def __init__(self, algo: OffPolicyAlgorithm, critic: QEnsemble | None, env: ChunkedEnv, cfg: OffPolicyConfig,
                 seed: int = 0, demos: ChunkReplayBuffer | None = None) -> None:
        self.algo, self.critic, self.env, self.cfg = algo, critic, env, cfg
        self.device = env.device
        if cfg.retry_failed_starts:
            require_seeded_start_states("offpolicy.retry_failed_starts", self.device)
        self.target = copy.deepcopy(critic).requires_grad_(False) if critic is not None else None
        self.critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr) if critic is not None else None
        self.replay = ChunkReplayBuffer(cfg.buffer_size, env.num_envs, self.device)
        self.demos = demos
        algo.attach_critic(critic)  # PA-RL re-ranks its rollouts' chunks with it; DSRL-NA distils from it
        if demos is not None:
            action = algo.critic_action_from_chunk(demos.data["chunk"])
            if action is None:
                raise ValueError(f"--algo {algo.name} acts in a space demonstrations do not record (the critic's "
                                 f"action is not a chunk): leave offpolicy.demo_data empty")
            demos.data["action"] = action.to(demos.device)
        self.iteration = 0
        self.env_steps = 0
        self.updates = 0
        self.seed = seed
        self._obs: Obs | None = None
        self._gen = torch.Generator().manual_seed(seed)
        self.start_states = (FailedStartReplay(cfg.retry_failed_starts, cfg.retry_prob, seed)
                             if cfg.retry_failed_starts else None)

    # -- rollout ----------------------------------------------------------------------------------

    @torch.no_grad()
    def collect(self, steps: int | None = None, warmup: bool = False) -> CollectStats:
        """Roll out `steps` (default `steps_per_iter`) chunks per env into the replay buffer."""
        env = self.env
        if self._obs is None:
            self.replay.end_streams()  # the envs restart: earlier episodes end where they stopped
            if self.start_states is not None:
                self.start_states.abandon_in_progress()
                self._obs = env.reset(start_states=self.start_states)
            else:
                offset = RESTART_SEED_STRIDE // 2 if warmup else 0  # warm-up rollouts run before iteration 0's
                self._obs = env.reset(seed=fresh_start_seed(self.seed, self.iteration) + offset)
        replayed_before = self.start_states.replayed if self.start_states is not None else 0
        t0 = time.perf_counter()
        episodes = successes = env_steps = replays_ended = replays_solved = 0
        returns: list[float] = []
        self.algo.policy.eval()
        for _ in range(steps or self.cfg.steps_per_iter):
            obs = self._obs
            chunk, action = self.algo.warmup_act(obs) if warmup else self.algo.act(obs)
            next_obs, reward, terminated, truncated, info = env.step(chunk)
            done = terminated | truncated
            self.replay.add(obs, action, chunk, reward, info["final_obs"], terminated, done, info["success"])
            self._obs = next_obs
            env_steps += int(info["steps"])
            if done.any():
                episodes += int(done.sum())
                successes += int((info["success"] & done).sum())
                returns += info["episode_return"][done].tolist()
                if self.start_states is not None:
                    for i in done.nonzero().squeeze(-1).tolist():
                        solved = bool(info["success"][i])
                        if self.start_states.report(int(info["start_seed"][i]), solved):
                            replays_ended += 1
                            replays_solved += solved
        self.env_steps += env_steps
        replayed = self.start_states.replayed - replayed_before if self.start_states is not None else 0
        return CollectStats(env_steps, episodes, successes, returns, time.perf_counter() - t0, replayed,
                            replays_ended, replays_solved)

    def restart_episodes(self) -> None:
        """Start fresh episodes at the next `collect` (after an evaluation stepped the training envs)."""
        self._obs = None

    # -- update -----------------------------------------------------------------------------------

    def sample(self, n: int, only_successful: bool = False) -> ReplayBatch | None:
        """A minibatch of `n` transitions: a `demo_ratio` share from the demonstrations when there are any
        (RLPD), the rest from the online buffer; None when nothing qualifies yet."""
        cfg = self.cfg
        parts = []
        n_demo = round(n * cfg.demo_ratio) if self.demos is not None else 0
        if len(self.replay) == 0:
            n_demo = n if self.demos is not None else 0
        for buf, k in ((self.replay, n - n_demo), (self.demos, n_demo)):
            if buf is None or k == 0 or len(buf) == 0:
                continue
            idx = buf.sample_indices(k, self._gen, only_success=only_successful)
            if idx.numel():
                parts.append(buf.batch(idx, cfg.n_step, cfg.gamma, cfg.reward_offset,
                                       return_to_go=cfg.conservative_weight > 0 and cfg.calibrated))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else concat_batches(*parts)

    def update(self, num_updates: int | None = None, train_actor: bool | None = None) -> dict[str, float]:
        """`num_updates` (default utd × the last iteration's transitions) critic steps with actor steps every
        `actor_every`; returns mean metrics."""
        cfg = self.cfg
        if num_updates is None:
            num_updates = max(1, round(cfg.utd * cfg.steps_per_iter * self.env.num_envs))
        if train_actor is None:
            train_actor = self.iteration >= cfg.critic_warmup_iters
        metrics: dict[str, list[float]] = {}
        self.algo.policy.eval()  # the rollouts' mode; nothing the actors train here depends on train mode
        for _ in range(num_updates):
            step: dict[str, float] = {}
            batch = None
            if self.critic is not None:
                batch = self.sample(cfg.batch_size)
                if batch is None:
                    break
                step.update(self._critic_step(batch))
            self.updates += 1
            if train_actor and self.updates % cfg.actor_every == 0:
                if self.algo.only_successful:
                    batch = self.sample(cfg.batch_size, only_successful=True)
                if batch is None:
                    break  # nothing to learn from yet (filtered BC before the first success)
                step.update(self.algo.update_actor(batch, self.critic))
            for k, v in step.items():
                metrics.setdefault(k, []).append(v)
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        out["updates"] = float(self.updates)
        out["actor_trained"] = float(train_actor)
        out["replay_size"] = float(len(self.replay))
        return out

    def _critic_step(self, batch: ReplayBatch) -> dict[str, float]:
        """One step on Σ_j mean (Q_j(s, a) - y)² with the soft n-step target y of the module docstring, plus
        `conservative_weight` × the conservative term of each critic."""
        cfg, critic = self.cfg, self.critic
        target, next_action = self.td_target(batch)
        q = critic(batch.obs, batch.action)
        td_loss = ((q - target[None]) ** 2).mean(dim=1).sum()
        loss, metrics = td_loss, {}
        if cfg.conservative_weight > 0:
            penalty = self._conservative_penalty(batch, q, next_action)
            loss = td_loss + cfg.conservative_weight * penalty.sum()
            metrics["conservative_penalty"] = penalty.mean().item()
        self.critic_opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
        self.critic_opt.step()
        polyak(self.target, critic, cfg.tau)
        return {"critic_loss": td_loss.item() / q.shape[0], "q_mean": q.mean().item(), "target_mean": target.mean().item(),
                **metrics}

    def _conservative_penalty(self, batch: ReplayBatch, q_data: torch.Tensor, next_action: torch.Tensor) -> torch.Tensor:
        """`[E]` the conservative term of each critic on `batch` (robotft.rl.conservative.conservative_penalty);
        `next_action` the Bellman target's a', reused as the policy's sample at s' where it is one."""
        with torch.no_grad():
            if not self.algo.target_is_policy_sample:
                next_action = self.algo.policy_action(batch.next_obs)
            policy_action = torch.stack([self.algo.policy_action(batch.obs), next_action], dim=1)
        size = (len(batch), self.cfg.conservative_random, batch.action.shape[1])
        random_action = torch.rand(size, generator=self._gen).to(self.device) * 2 - 1
        return conservative_penalty(self.critic, batch.obs, q_data, policy_action, random_action,
                                    batch.return_to_go)

    @torch.no_grad()
    def td_target(self, batch: ReplayBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`(y, a')`: y = R + γ^m (1 - d) (min_{j ∈ subset} Q̄_j(s', a') - α log π(a'|s')), a' ~ π(·|s'); the
        entropy term only with `backup_entropy` and a stochastic actor."""
        next_action, next_logprob = self.algo.target_action(batch.next_obs)
        q_next = subset_min(self.target(batch.next_obs, next_action), self.cfg.num_min, self._gen)
        if next_logprob is not None and self.cfg.backup_entropy:
            q_next = q_next - self.algo.alpha() * next_logprob
        return batch.reward + batch.discount * q_next, next_action

    def pretrain_critic(self, steps: int) -> dict[str, float]:
        """`steps` critic steps on the demonstrations alone (before any rollout); their mean metrics."""
        if self.critic is None:
            return {}
        return self.update(steps, train_actor=False)

    # -- resume -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "replay": self.replay.state_dict(),
            "iteration": self.iteration, "env_steps": self.env_steps, "updates": self.updates,
            "algo": self.algo.state_dict(),
            "torch_rng": torch.get_rng_state(), "sample_rng": self._gen.get_state(),
        }
        if self.start_states is not None:
            state["start_states"] = self.start_states.state_dict()
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), target=self.target.state_dict(),
                         critic_opt=self.critic_opt.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.replay.load_state_dict(state["replay"])
        self.iteration, self.env_steps = int(state["iteration"]), int(state["env_steps"])
        self.updates = int(state["updates"])
        self.algo.load_state_dict(state["algo"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.target.load_state_dict(state["target"])
            self.critic_opt.load_state_dict(state["critic_opt"])
        torch.set_rng_state(state["torch_rng"])
        self._gen.set_state(state["sample_rng"])
        if self.start_states is not None and "start_states" in state:
            self.start_states.load_state_dict(state["start_states"])
        self._obs = None
