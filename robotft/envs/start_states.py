"""Start states for training rollouts: start states whose rollout failed are tried again.

Prioritized Level Replay (Jiang, Grefenstette & Rocktäschel 2021, arXiv 2010.03934) draws training levels by their
learning potential instead of uniformly. Under a sparse success reward the start states with potential are those the
policy solves sometimes but not always (learnability p(1 - p), Rutherford et al. 2024, arXiv 2408.15099): a state it
always solves adds a demonstration of what it already does, one it never solves adds nothing. A failed start state
is the cheapest estimate of p < 1, so `FailedStartReplay` queues it and replays it, up to `retries` times, with
probability `replay_prob` per new episode; a success or the last retry takes it off the queue. Fresh start states
come from seeds 10⁹ and up, far above the evaluations' (the shared start states count up from
robotft.evaluation.EVAL_SEED = 10⁶, `robotft eval --seed S` from S), so that training never replays an
evaluation's start state.

A start state is named by the seed its env is reset with (ChunkedEnv's `start_states`): exact on every adapter that
resets one env from a seed alone (CPU ManiSkill, robosuite, MuJoCo, the toy suite).
"""

from __future__ import annotations

from collections import deque

import torch

FRESH_SEED_BASE = 1_000_000_000
"""First seed of the fresh start states: training restarts (`fresh_start_seed`) and FailedStartReplay's fresh
states (run seed s counts up from FRESH_SEED_BASE + s · FRESH_SEEDS_PER_RUN) lie in [FRESH_SEED_BASE, 2 ·
FRESH_SEED_BASE)."""
FRESH_SEEDS_PER_RUN = 1_000_000
RESTART_SEED_STRIDE = 10_000
"""Seeds between the restarts of two iterations: room for every env's first episode, or a grouped rollout's."""


def fresh_start_seed(run_seed: int, iteration: int) -> int:
    """The seed the training envs restart from at `iteration` (env i, or group i, takes it + i), above the
    evaluations' seeds however long the run. Linear in `run_seed`, so that a Ray worker, whose seed is the run's
    plus its first env's id (robotft.rl.rollout.worker_seed), restarts its envs from the seeds those envs get in
    one process."""
    return FRESH_SEED_BASE + (run_seed + RESTART_SEED_STRIDE * iteration) % FRESH_SEED_BASE


def require_seeded_start_states(option: str, device: torch.device) -> None:
    """Refuse `option`, which names a start state by the seed one env is reset with, for envs on `device` when a
    seed does not name one there: a GPU simulator seeds a batch, not an env."""
    if device.type != "cpu":
        raise ValueError(f"{option} names start states by the seed one env is reset with, which names one only for "
                         f"envs simulated on CPU; these envs are on {device}")


class FailedStartReplay:
    """The start-state seed of each new training episode: a failed one again with probability `replay_prob`, else a
    fresh one."""

    def __init__(self, retries: int, replay_prob: float, seed: int = 0) -> None:
        """`retries`: how often a failed start state is tried again (>= 1); `replay_prob`: the probability in
        (0, 1] that a new episode replays the oldest waiting failed state when one waits; `seed`: the run's seed
        (which fresh seeds and which draws)."""
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        if not 0 < replay_prob <= 1:
            raise ValueError(f"replay_prob must be in (0, 1], got {replay_prob}")
        self.retries, self.replay_prob = retries, replay_prob
        self.first_fresh = FRESH_SEED_BASE + (seed % 1000) * FRESH_SEEDS_PER_RUN
        self.fresh_drawn = 0
        self._waiting: deque[int] = deque()
        """Failed start states to replay, oldest first."""
        self._tries: dict[int, int] = {}
        """Episodes started so far from each start state that is waiting or being replayed."""
        self._gen = torch.Generator().manual_seed(seed)
        self.replayed = 0
        """Episodes that replayed a failed start state (over the run)."""

    @property
    def waiting(self) -> int:
        """Failed start states waiting to be replayed."""
        return len(self._waiting)

    def next_seed(self) -> int:
        """The seed of a new episode's start state."""
        if self._waiting and float(torch.rand((), generator=self._gen)) < self.replay_prob:
            seed = self._waiting.popleft()
            self._tries[seed] += 1
            self.replayed += 1
            return seed
        if self.fresh_drawn >= FRESH_SEEDS_PER_RUN:
            raise RuntimeError(f"FailedStartReplay drew all {FRESH_SEEDS_PER_RUN} fresh start states of its run seed")
        self.fresh_drawn += 1
        return self.first_fresh + self.fresh_drawn - 1

    def report(self, seed: int, success: bool) -> bool:
        """An episode from start state `seed` ended; a failure queues it for another try while tries are left.
        Returns whether that episode replayed a failed start state."""
        tries = self._tries.pop(seed, 1)
        if not success and tries <= self.retries:
            self._tries[seed] = tries
            self._waiting.append(seed)
        return tries > 1

    def abandon_in_progress(self) -> None:
        """The envs restart (an evaluation ran on them) and every episode in progress ends unreported: a replay cut
        off this way did not fail, so its start state goes back to the front of the queue with its try uncounted.
        An abandoned fresh start state is dropped: nothing is known about it."""
        queued = set(self._waiting)
        for seed in [s for s in self._tries if s not in queued][::-1]:
            self._tries[seed] -= 1
            self._waiting.appendleft(seed)

    def state_dict(self) -> dict:
        return {"first_fresh": self.first_fresh, "fresh_drawn": self.fresh_drawn, "waiting": list(self._waiting),
                "tries": [[s, n] for s, n in self._tries.items()], "replayed": self.replayed,
                "rng": self._gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.first_fresh, self.fresh_drawn = int(state["first_fresh"]), int(state["fresh_drawn"])
        self.replayed = int(state["replayed"])
        self._waiting = deque(int(s) for s in state["waiting"])
        self._tries = {int(s): int(n) for s, n in state["tries"]}
        self._gen.set_state(state["rng"])
