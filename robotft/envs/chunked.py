"""The Env of docs/design.md: chunked action execution, observation history and auto-reset on a BatchedEnv.

One `step` executes the first `act_steps` actions of a predicted `[B, horizon, act_dim]` chunk. Each
env's rewards are summed up to and including the step where its episode ended; the batched simulator
keeps stepping finished envs with the rest of the chunk (it cannot step a subset), and those outputs
are masked. At the end of the chunk finished envs are reset, their final history is kept in
`info["final_obs"]` for bootstrapping on truncation, and the returned history is the new episode's.

Plan anchors (`plan_every` K > 0), for a policy that plans a chunk every K env steps and acts on every step in
between (a closed-loop residual over an open-loop base): each observation also carries `plan/<key>`, the history
of every key as it was at the step the current plan was made (the episode's start, then every K steps), and
`plan_step` `[B, obs_steps, 1]`, the index of the current step in that plan (the episode's step count mod K,
repeated over the history axis). The policy re-derives its plan from the anchor, so it holds no per-env state and any number of envs,
evaluation envs included, can share it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from robotft.envs.base import MILESTONE_PREFIX, BatchedEnv, Obs
from robotft.envs.start_states import FailedStartReplay
from robotft.specs import EnvSpec


class PolicyShape(Protocol):
    """What a chunked env needs to know of the policy that acts on it (a `PolicyConfig`)."""

    obs_steps: int
    act_steps: int

    @property
    def plan_every(self) -> int: ...


PLAN_PREFIX = "plan/"
"""Prefix of the plan-anchor histories in an observation (`plan_every` > 0)."""
PLAN_STEP_KEY = "plan_step"
"""Observation key of the current step's index in the plan (`plan_every` > 0)."""


class ChunkedEnv:
    """Wrap `env` so observations are histories `[B, obs_steps, *shape]` and actions are chunks.

    Seeding (BatchedEnv.reset's rule): `reset(seed)` seeds every env; the partial resets of finished envs
    pass no seed, and the simulator continues the random streams that seed determined, so a whole run is
    reproducible from one seed and an auto-reset costs no re-seeding (on ManiSkill's GPU backend a seed
    list rebuilds one RNG per env on every call). `reset(seed, seed_every_episode=True)` (evaluation) seeds the
    partial resets too, so that start states do not depend on the number of envs; with `group_size` G the envs
    form groups of G consecutive envs whose k-th episodes share a start state (group-relative advantages per start
    state). `reset(start_states=S)` (training rollouts that replay failed start states) takes every episode's seed
    from `S.next_seed()`.
    """

    def __init__(self, env: BatchedEnv, obs_steps: int, act_steps: int, plan_every: int = 0) -> None:
        if obs_steps < 1 or act_steps < 1:
            raise ValueError(f"obs_steps and act_steps must be >= 1, got {obs_steps} and {act_steps}")
        if plan_every < 0 or (plan_every and plan_every % act_steps):
            raise ValueError(f"plan_every must be 0 or a positive multiple of act_steps ({act_steps}), got {plan_every}")
        if env.spec.action is None:
            raise ValueError(f"{type(env).__name__} declares no action spec; ChunkedEnv needs act_dim")
        self.env = env
        self.obs_steps = obs_steps
        self.act_steps = act_steps
        self.plan_every = plan_every
        """Env steps between plan anchors; 0: observations carry none (see the module docstring)."""
        self._history: Obs = {}
        self._anchor: Obs = {}
        """Per key the history at the step the current plan was made (`plan_every` > 0)."""
        self._episode_return = torch.zeros(env.num_envs, device=env.device)
        self._episode_length = torch.zeros(env.num_envs, dtype=torch.long, device=env.device)
        self._success_once = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
        self._milestones: dict[str, torch.Tensor] = {}
        """Milestone name -> `[B]` bool: reached at some step of each env's current episode (task order)."""
        self._episode_seed: int | None = None
        """`seed` of a `reset(seed, seed_every_episode=True)`; None: partial resets are not seeded."""
        self._episodes_started = [0] * env.num_envs
        self._group_size = 1
        self._start_states: FailedStartReplay | None = None
        self._start_seed = torch.full((env.num_envs,), -1, dtype=torch.long)
        """The seed each env's current episode started from; -1 where it was not seeded."""

    @classmethod
    def for_policy(cls, env: BatchedEnv, config: PolicyShape) -> ChunkedEnv:
        """The chunked env a policy of `config` runs on: its history, executed steps and plan anchors."""
        return cls(env, config.obs_steps, config.act_steps, config.plan_every)

    @property
    def num_envs(self) -> int:
        return self.env.num_envs

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def spec(self) -> EnvSpec:
        return self.env.spec

    @property
    def act_dim(self) -> int:
        return self.env.spec.action.dim

    @property
    def max_episode_steps(self) -> int:
        """Episode limit in env steps (not chunks)."""
        return self.env.max_episode_steps

    def reset(self, seed: int | None = None, seed_every_episode: bool = False,
              start_states: FailedStartReplay | None = None, group_size: int = 1) -> Obs:
        """Reset every env; returns histories `[B, obs_steps, *shape]` padded with the first frame.

        With `seed_every_episode`, the k-th episode that env i starts (k = 0 for this reset) is seeded with
        `seed + i + k * num_envs`: episode r of a round-robin count over the envs (evaluation's) starts from the
        state of seed `seed + r` whatever the number of envs, on every adapter that gives env i of a reset the
        seed `seed + i` (CPU worker processes, the toy suite, MuJoCo, robosuite). ManiSkill's GPU backend seeds
        a batch from its first seed, so there the start states still depend on the number of envs. Costs one
        reset call per finished env. `group_size` G (with `seed_every_episode`; G divides num_envs) seeds the
        k-th episode of env i with `seed + i // G + k * num_envs / G`: each group of G consecutive envs runs its
        episodes from the same start states (one more reset call per env here). With `start_states` (no `seed`),
        every episode, these first ones included, starts from the seed `start_states.next_seed()` gives, one
        reset call per env."""
        if seed_every_episode and seed is None:
            raise ValueError("seed_every_episode needs a seed")
        if start_states is not None and seed is not None:
            raise ValueError("reset takes a seed or start_states, not both")
        if group_size != 1 and (not seed_every_episode or group_size < 1 or self.num_envs % group_size):
            raise ValueError(f"group_size {group_size} needs seed_every_episode and must divide num_envs "
                             f"({self.num_envs})")
        self._episode_seed = seed if seed_every_episode else None
        self._start_states = start_states
        self._group_size = group_size
        self._episodes_started = [1] * self.num_envs
        obs = self.env.reset(seed=seed)
        if seed is None:
            self._start_seed.fill_(-1)
        else:
            self._start_seed = seed + torch.arange(self.num_envs)
        if start_states is not None:
            for i in range(self.num_envs):
                obs = self._reset_from(i, start_states.next_seed())
        elif group_size > 1:
            for i in range(self.num_envs):
                obs = self._reset_from(i, self._episode_start_seed(i, 0))
        self._history = self._pad(obs)
        self._episode_return.zero_()
        self._episode_length.zero_()
        self._success_once.zero_()
        for reached in self._milestones.values():
            reached.zero_()
        self._anchor = {k: v.clone() for k, v in self._history.items()} if self.plan_every else {}
        return self._observation()

    def step(
        self, action_chunk: torch.Tensor, render_env: int | None = None
    ) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Execute `action_chunk[:, :act_steps]` (chunk `[B, horizon >= act_steps, act_dim]`).

        Returns `(obs, reward [B] float32, terminated [B] bool, truncated [B] bool, info)`; `obs` are the
        histories after the chunk, of the new episode for envs that finished and were reset. `info`:
        `done`, `success` (at each env's last valid step: ManiSkill's `success_at_end`), `success_once` (at
        any step of the episode so far, ManiSkill's `success_once`), `start_seed` (`[B]` long, the seed each
        env's episode started from, -1 where it was not seeded), `final_obs` (histories when each env
        finished; equal to `obs` for envs not done), `last_reward` (`[B]`, the reward of each env's last valid
        step: the dense reward measured on the state the chunk ended in), `episode_return` and `episode_length`
        (env steps; valid where `done`), `milestones` (name -> `[B]` bool: whether the episode so far has reached each
        of the env's `milestone/<name>` stages, in task order; empty when the env reports none), `steps` (env steps
        executed, `B * act_steps`). With `render_env` = i, also
        `frames`: env i rendered after each of its env steps in this chunk up to and including the one that
        ended its episode (`[H, W, 3]` uint8 numpy arrays, control rate; videos only, it reads the device).
        """
        if not self._history:
            raise RuntimeError("ChunkedEnv.step called before reset")
        chunk = self._check_chunk(action_chunk)
        B, dev = self.num_envs, self.device
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        reward_sum = torch.zeros(B, device=dev)
        last_reward = torch.zeros(B, device=dev)
        terminated = torch.zeros(B, dtype=torch.bool, device=dev)
        truncated = torch.zeros(B, dtype=torch.bool, device=dev)
        success = torch.zeros(B, dtype=torch.bool, device=dev)
        frames = []
        # Rendering needs the env between steps; otherwise the whole chunk goes to the env at once.
        results = self._step_chunk(chunk) if render_env is None else None
        for t in range(self.act_steps):
            obs, reward, term, trunc, info = results[t] if results is not None else self.env.step(chunk[:, t])
            reward_sum += torch.where(alive, reward.float(), 0.0)
            last_reward = torch.where(alive, reward.float(), last_reward)
            self._episode_length += alive.long()
            success = torch.where(alive, info["success"].bool(), success)
            self._success_once |= alive & info["success"].bool()
            self._record_milestones(info, alive)
            terminated |= alive & term
            truncated |= alive & trunc
            self._push(obs, alive)
            if render_env is not None and bool(alive[render_env]):
                frame = self.env.render_env(render_env)
                if frame is not None:
                    frames.append(frame.cpu().numpy())
            alive = alive & ~(term | trunc)
        done = ~alive
        self._episode_return += reward_sum
        info = {
            "done": done,
            "success": success,
            "success_once": self._success_once.clone(),
            "start_seed": self._start_seed.clone(),
            "final_obs": self._advance_plan(),
            "last_reward": last_reward,
            "episode_return": self._episode_return.clone(),
            "episode_length": self._episode_length.clone(),
            "milestones": {name: reached.clone() for name, reached in self._milestones.items()},
            "steps": B * self.act_steps,
        }
        if render_env is not None:
            info["frames"] = frames
        # One host sync per chunk: the ids of the finished envs (ManiSkill's partial reset takes indices).
        ids = done.nonzero().squeeze(-1)
        if ids.numel():
            self._reset_done(ids)
        return self._observation(), reward_sum, terminated, truncated, info

    def render_rgb(self) -> torch.Tensor | None:
        """`[B, H, W, 3]` uint8 frame of the wrapped env, or None when it cannot render."""
        return self.env.render_rgb()

    def render_env(self, i: int) -> torch.Tensor | None:
        """`[H, W, 3]` uint8 frame of env `i` alone, or None when the env cannot render."""
        return self.env.render_env(i)

    def close(self) -> None:
        self.env.close()

    def _step_chunk(self, chunk: torch.Tensor) -> list[tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
        """The env's results for the chunk's first `act_steps` actions (BatchedEnv.step_chunk: one worker round
        trip per chunk where the env runs in worker processes)."""
        return self.env.step_chunk(chunk[:, : self.act_steps])

    def _record_milestones(self, info: dict, alive: torch.Tensor) -> None:
        """OR one step's `milestone/<name>` flags of the `alive` envs into their episodes' milestones."""
        for key, flag in info.items():
            if key.startswith(MILESTONE_PREFIX):
                name = key[len(MILESTONE_PREFIX):]
                if name not in self._milestones:
                    self._milestones[name] = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
                self._milestones[name] |= alive & flag.to(self.device).bool()

    def _check_chunk(self, action_chunk: torch.Tensor) -> torch.Tensor:
        shape = tuple(action_chunk.shape)
        if (
            action_chunk.ndim != 3
            or shape[0] != self.num_envs
            or shape[1] < self.act_steps
            or shape[2] != self.act_dim
        ):
            raise ValueError(
                f"action chunk has shape {list(shape)}; expected [num_envs={self.num_envs}, "
                f"horizon>={self.act_steps} (act_steps), act_dim={self.act_dim}]"
            )
        return action_chunk.to(self.device)

    def _observation(self) -> Obs:
        """A copy of the histories, with the plan anchors and the plan step when `plan_every` > 0."""
        obs = {k: v.clone() for k, v in self._history.items()}
        if self.plan_every:
            obs.update({PLAN_PREFIX + k: v.clone() for k, v in self._anchor.items()})
            step = (self._episode_length % self.plan_every).to(torch.float32)[:, None, None]
            obs[PLAN_STEP_KEY] = step.expand(-1, self.obs_steps, 1).clone()
        return obs

    def _advance_plan(self) -> Obs:
        """Where the episode's step count reached a multiple of K, the current history becomes the anchor of a new
        plan. Returns the observation at this point (each env's final one, for envs that finished)."""
        if self.plan_every:
            due = self._episode_length % self.plan_every == 0
            for k, hist in self._history.items():
                mask = due.view(-1, *([1] * (hist.ndim - 1)))
                self._anchor[k] = torch.where(mask, hist, self._anchor[k])
        return self._observation()

    def _pad(self, obs: Obs) -> Obs:
        """History of a fresh episode: the first frame repeated `obs_steps` times."""
        return {k: v.unsqueeze(1).repeat_interleave(self.obs_steps, dim=1) for k, v in obs.items()}

    def _push(self, obs: Obs, alive: torch.Tensor) -> None:
        """Append one frame to the histories of the `alive` envs (finished envs keep their final one)."""
        for k, frame in obs.items():
            rolled = torch.cat([self._history[k][:, 1:], frame.unsqueeze(1)], dim=1)
            mask = alive.view(-1, *([1] * (rolled.ndim - 1)))
            self._history[k] = torch.where(mask, rolled, self._history[k])

    def _episode_start_seed(self, i: int, k: int) -> int:
        """The seed of env i's k-th episode since a `reset(seed, seed_every_episode=True, group_size=G)`."""
        groups = self.num_envs // self._group_size
        return self._episode_seed + i // self._group_size + k * groups

    def _reset_from(self, i: int, seed: int) -> Obs:
        """Reset env `i` alone to the start state of `seed` (env i of a reset gets `seed + i`)."""
        self._start_seed[i] = seed
        return self.env.reset(seed=seed - i, env_ids=torch.tensor([i], device=self.device))

    def _reset_done(self, ids: torch.Tensor) -> None:
        if self._start_states is not None:
            for i in ids.tolist():
                obs = self._reset_from(i, self._start_states.next_seed())
        elif self._episode_seed is None:
            obs = self.env.reset(seed=None, env_ids=ids)
            self._start_seed[ids.cpu()] = -1
        else:
            for i in ids.tolist():
                obs = self._reset_from(i, self._episode_start_seed(i, self._episodes_started[i]))
                self._episodes_started[i] += 1
        for k, hist in self._pad({k: v[ids] for k, v in obs.items()}).items():
            self._history[k][ids] = hist
            if self.plan_every:
                self._anchor[k][ids] = hist
        self._episode_return[ids] = 0.0
        self._episode_length[ids] = 0
        self._success_once[ids] = False
        for reached in self._milestones.values():
            reached[ids] = False
