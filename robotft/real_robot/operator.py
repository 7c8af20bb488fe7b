"""Teleoperated evaluation: who starts each episode, decides its outcome, and can stop or take over.

- `KeyboardOperator`: a person at the terminal. Keys (read without blocking, one character each):
  `g` or Enter start, `s` success, `f` failure, `a` abort (the episode is not scored), `r` reset (before
  a start: the arm goes home again; during an episode: it is aborted),
  `t` take over / give back (the policy pauses; a SpaceMouse, where one is present, drives the arm),
  space or `x` the software stop (the safety layer holds the arm), `q` quit after this episode.
- `SceneJudge` (`--no-operator`): no person; each episode starts at once and ends in success when the
  simulated scene satisfies the rig's success predicate (e.g. the cube within the goal radius), or in
  a timeout. Refused on a real robot, where the scene cannot be read.

Outcomes are tallied into a success rate with a Wilson 95% interval (robotft.evaluation).
"""

from __future__ import annotations

import abc
import importlib.util
import os
import select
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from robotft.evaluation import wilson_interval
from robotft.optional import require
from robotft.real_robot.rig import SuccessConfig

OUTCOMES = ("success", "failure", "timeout", "abort", "stopped")
"""Episode outcomes; `success`, `failure` and `timeout` are scored, `abort` and `stopped` are not."""
SCORED = ("success", "failure", "timeout")
KEYS = {
    "g": "start",
    "\n": "start",
    "\r": "start",
    "s": "success",
    "f": "failure",
    "a": "abort",
    "r": "reset",
    "t": "takeover",
    " ": "stop",
    "x": "stop",
    "q": "quit",
}
"""Keyboard character -> operator event."""


class Operator(abc.ABC):
    """Source of episode starts, outcomes and interventions for the runner."""

    can_teleoperate = False
    """True when `teleop_action` can drive the arm during a take-over."""

    @abc.abstractmethod
    def wait_start(self, episode: int, reset: Callable[[], None]) -> bool:
        """Block until the operator starts `episode`; False when they quit instead. `reset()` resets the
        rig again (arm home, a simulated scene re-randomized) when the operator asks for it."""

    @abc.abstractmethod
    def poll(self) -> list[str]:
        """Events since the last call (never blocks): `success`, `failure`, `abort`, `reset`, `takeover`,
        `stop`, `quit`."""

    def judge(self, objects: dict[str, Any], robot: Any = None) -> str | None:
        """The outcome read from the scene (`objects`: name -> pose; `robot`: the latest `RobotState`),
        or None to let the episode run."""
        return None

    def label_timeout(self) -> str:
        """The outcome of an episode that ran out of time."""
        return "timeout"

    def teleop_action(self, action_dim: int) -> np.ndarray | None:
        """During a take-over, the operator's action (env units); None: hold the arm."""
        return None

    def close(self) -> None:  # noqa: B027 - only terminal operators hold resources
        """Restore whatever the operator changed (terminal modes, devices)."""


class SceneJudge(Operator):
    """`--no-operator`: episodes start at once; success comes from the simulated scene."""

    def __init__(self, success: SuccessConfig) -> None:
        self.success = success

    def wait_start(self, episode: int, reset: Callable[[], None]) -> bool:
        return True

    def poll(self) -> list[str]:
        return []

    def judge(self, objects: dict[str, Any], robot: Any = None) -> str | None:
        s = self.success
        for name in (s.object, s.goal):
            if name not in objects:
                raise KeyError(
                    f"success predicate: the scene has no object {name!r}; it has {sorted(objects)}"
                )
        axes = 2 if s.axes == "xy" else 3
        dist = float(
            np.linalg.norm(np.asarray(objects[s.object].pos)[:axes] - np.asarray(objects[s.goal].pos)[:axes])
        )
        if dist >= s.radius_m:
            return None
        if s.max_joint_speed_rad_s is not None:
            if robot is None:
                raise ValueError("success predicate: the arm must be at rest, and no robot state was given")
            if float(np.max(np.abs(robot.joint_velocities))) > s.max_joint_speed_rad_s:
                return None
        return "success"


class KeyboardOperator(Operator):
    """A person at the terminal; see the module docstring for the keys.

    Reads `stream` (default stdin) without blocking: in cbreak mode when it is a terminal, so single key
    presses arrive without Enter; any readable file descriptor (a pipe) works too.
    """

    def __init__(self, stream: IO | None = None, out: IO | None = None, spacemouse: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self.out = out if out is not None else sys.stderr
        self._fd = self.stream.fileno()
        self._pending: list[str] = []
        """Events read together with the one that ended a wait (`g` then space typed quickly arrive in one read):
        they are the next events, never dropped."""
        self._saved_tty: Any = None
        if os.isatty(self._fd):
            import termios
            import tty

            self._saved_tty = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        self._spacemouse = SpaceMouse() if spacemouse and SpaceMouse.available() else None
        self.can_teleoperate = self._spacemouse is not None
        self._say(
            "keys: g/Enter start, s success, f failure, a abort, r reset, t take over, space/x STOP, q quit"
            + ("" if self._spacemouse else " (no SpaceMouse: take-over holds the arm)")
        )

    def _say(self, text: str) -> None:
        print(f"[operator] {text}", file=self.out, flush=True)

    def _read(self, timeout_s: float) -> list[str]:
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        if not ready:
            return []
        data = os.read(self._fd, 64).decode(errors="ignore").lower()
        if not data:
            raise EOFError("operator input closed")
        return [KEYS[c] for c in data if c in KEYS]

    def _next_event(self, timeout_s: float) -> str | None:
        """The next event: the oldest pending one, else the first typed within `timeout_s` (None: nothing)."""
        if not self._pending:
            self._pending = self._read(timeout_s)
        return self._pending.pop(0) if self._pending else None

    def wait_start(self, episode: int, reset: Callable[[], None]) -> bool:
        self._say(f"episode {episode}: reset the scene, then press g to start (r: arm home again, q: quit)")
        while True:
            event = self._next_event(0.1)
            if event == "start":
                return True
            if event == "quit":
                return False
            if event == "reset":
                reset()

    def poll(self) -> list[str]:
        events, self._pending = self._pending or self._read(0.0), []
        return events

    def label_timeout(self) -> str:
        self._say("time is up: press s (success), f (failure) or a (abort)")
        while True:
            event = self._next_event(0.1)
            if event in ("success", "failure", "abort"):
                return event

    def teleop_action(self, action_dim: int) -> np.ndarray | None:
        return None if self._spacemouse is None else self._spacemouse.action(action_dim)

    def close(self) -> None:
        if self._saved_tty is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved_tty)
            self._saved_tty = None
        if self._spacemouse is not None:
            self._spacemouse.close()


class SpaceMouse:
    """A 3Dconnexion SpaceMouse through `pyspacemouse` (imported lazily, only when installed).

    Its 6-DoF reading in [-1, 1] becomes a `pd_ee_delta_pose` action `[x, y, z, roll, pitch, yaw, gripper]`;
    the left button closes the gripper, the right one opens it.
    """

    def __init__(self) -> None:
        pyspacemouse = require("pyspacemouse", None, "SpaceMouse take-over", install="pip install pyspacemouse")
        self._lib = pyspacemouse
        if not pyspacemouse.open():
            raise RuntimeError("pyspacemouse found no SpaceMouse (is it plugged in and readable?)")
        self._gripper = 1.0

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("pyspacemouse") is not None

    def action(self, action_dim: int) -> np.ndarray | None:
        if action_dim != 7:
            return None  # only pd_ee_delta_pose is teleoperated
        s = self._lib.read()
        if s.buttons and s.buttons[0]:
            self._gripper = -1.0
        elif len(s.buttons) > 1 and s.buttons[1]:
            self._gripper = 1.0
        return np.array([s.x, s.y, s.z, s.roll, s.pitch, s.yaw, self._gripper], dtype=np.float64)

    def close(self) -> None:
        self._lib.close()


@dataclass
class Tally:
    """Outcomes of a deployment session and the success rate over the scored episodes."""

    outcomes: list[str] = field(default_factory=list)
    """Outcome of each episode, in order."""

    def add(self, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        self.outcomes.append(outcome)

    @property
    def scored(self) -> int:
        """Episodes that count: success, failure, timeout (a timeout is a failure)."""
        return sum(o in SCORED for o in self.outcomes)

    @property
    def successes(self) -> int:
        return self.outcomes.count("success")

    @property
    def success_rate(self) -> float:
        return self.successes / self.scored if self.scored else 0.0

    @property
    def ci95(self) -> tuple[float, float]:
        """Wilson score interval at 95% (Wilson 1927) over the scored episodes."""
        return wilson_interval(self.successes, self.scored)

    def to_dict(self) -> dict[str, Any]:
        return {
            "success_rate": self.success_rate,
            "ci95": list(self.ci95),
            "episodes": len(self.outcomes),
            "scored": self.scored,
            "counts": {o: self.outcomes.count(o) for o in OUTCOMES},
            "outcomes": list(self.outcomes),
        }
