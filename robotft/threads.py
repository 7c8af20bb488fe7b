"""Torch CPU threads: one per process while simulator workers step on the same cores, every core while they wait.

Fine-tuning alternates between a rollout, where simulator worker processes step on the machine's cores while the
learner samples actions, and an update, where the workers wait for the next command (blocked on a pipe, using no
CPU). Multi-threaded OpenMP in the learner slows down about tenfold when it competes with the workers, so the
process default is one thread (`ROBOTFT_NUM_THREADS`); the update has the cores to itself and gets them all
(PushCube DPPO update with a 1.2M-parameter MLP on 2 cores: 1.09 s -> 0.59 s). Processes that update at the same
time on one machine without knowing of each other (several runs, a parallel test suite) would oversubscribe the
cores the same way; `ROBOTFT_UPDATE_THREADS` caps what each takes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_count_from_environment(name: str) -> int | None:
    """The positive thread count in environment variable `name`, None where it is unset or empty; any other
    value is refused by name (a typo must not silently change how fast every run goes)."""
    configured = os.environ.get(name, "").strip()
    if not configured:
        return None
    if not configured.isdecimal() or int(configured) < 1:
        raise ValueError(f"{name} must be a positive integer, got {configured!r}")
    return int(configured)


def process_threads() -> int:
    """The process's default torch CPU threads: `$ROBOTFT_NUM_THREADS`, else 1."""
    return thread_count_from_environment("ROBOTFT_NUM_THREADS") or 1


def update_threads(requested: int) -> int:
    """Threads for an update: `requested`; with 0, `$ROBOTFT_UPDATE_THREADS` where it is set, else the available
    cores shared among this machine's ranks (torchrun's `LOCAL_WORLD_SIZE`: ranks update at the same time)."""
    if requested > 0:
        return requested
    configured = thread_count_from_environment("ROBOTFT_UPDATE_THREADS")
    if configured is not None:
        return configured
    return max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch CPU threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
