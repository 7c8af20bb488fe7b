"""Kill -9 at random moments: the shared loop of the fault-injection tests (tests/test_fault_injection.py,
tests/real_robot/test_deploy_kill.py) and of scripts/fault_injection.sh, which runs them with more kills.

`ROBOTFT_KILLS` sets the kills per command (default 5, the CI budget); `ROBOTFT_KILL_SEED` the moments.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

KILLS = int(os.environ.get("ROBOTFT_KILLS", "5"))
SEED = int(os.environ.get("ROBOTFT_KILL_SEED", "0"))
TALLY: collections.Counter = collections.Counter()
"""`(command, outcome) -> count` over the session; printed by the tests' terminal summary."""


def robotft_argv(*args: str | os.PathLike) -> list[str]:
    """`python -m robotft.cli ARGS` with the interpreter running the tests (the worktree's code first)."""
    return [sys.executable, "-m", "robotft.cli", *map(str, args)]


def kill_series(
    name: str,
    argv_for: Callable[[int], Sequence[str]],
    check: Callable[[int, str], None],
    window_s: tuple[float, float],
    cwd: Path,
    kills: int = KILLS,
    ready: Callable[[], bool] | None = None,
) -> collections.Counter:
    """Run `argv_for(i)` for i in range(kills), SIGKILL it at a uniform random moment in `window_s` seconds
    after start (or after `ready()` first holds: skips a slow start-up), unless it finished first, then call
    `check(i, outcome)` to assert what it left is intact. Outcomes: `killed`, or `finished rc=N`. Returns the
    tally of outcomes."""
    rng = random.Random(f"{SEED}-{name}")
    tally: collections.Counter = collections.Counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("ROBOTFT_DEBUG", None)
    for i in range(kills):
        at = rng.uniform(*window_s)
        log = cwd / f"{name}-{i}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(argv_for(i)), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
            give_up = time.monotonic() + 300
            while ready is not None and proc.poll() is None and not ready() and time.monotonic() < give_up:
                time.sleep(0.01)
            deadline = time.monotonic() + at
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        outcome = "killed" if proc.returncode == -signal.SIGKILL else f"finished rc={proc.returncode}"
        tally[outcome] += 1
        TALLY[(name, outcome)] += 1
        try:
            check(i, outcome)
        except AssertionError as e:
            raise AssertionError(f"{name} #{i} ({outcome} at {at:.2f} s): {e}\n--- log ---\n"
                                 f"{log.read_text()[-3000:]}") from e
    return tally
