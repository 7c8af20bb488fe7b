"""Shared fixtures: `cli` runs the `robotft` console script as a subprocess (end-to-end tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# MuJoCo fixes its OpenGL backend when it is first imported, and mani_skill imports mujoco: without this,
# a ManiSkill test that runs first leaves MuJoCo on GLFW (no display here) and every later simulated
# camera fails with "gladLoadGL error". EGL renders headless (robotft.real_robot.sim_scene.import_mujoco).
os.environ.setdefault("MUJOCO_GL", "egl")


def _console_script() -> str:
    """The `robotft` script next to the running interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "robotft"
    if here.is_file():
        return str(here)
    found = shutil.which("robotft")
    if found is None:
        pytest.skip("the robotft console script is not installed (pip install -e .)")
    return found


def describe(argv, rc, stdout: str, stderr: str, limit: int = 4000) -> str:
    """An assertion message: the command, its exit status and the tails of its output."""
    cmd = " ".join(map(str, argv)) if isinstance(argv, (list, tuple)) else str(argv)
    return (
        f"`{cmd}` exited {rc}\n--- stdout (tail) ---\n{stdout[-limit:]}\n"
        f"--- stderr (tail) ---\n{stderr[-limit:]}"
    )


class Cli:
    """Runs `robotft ...` in a subprocess with unbuffered output and one torch thread per process."""

    def __init__(self) -> None:
        self.exe = _console_script()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Error paths are tested through their exit status; a debug traceback would change it.
        env.pop("ROBOTFT_DEBUG", None)
        # Several torch processes on a few shared cores oversubscribe badly (10-20x slower BC steps);
        # one intra-op thread each keeps these tiny runs fast. An explicit setting wins.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        self.env = env

    describe = staticmethod(describe)

    def run(
        self,
        *args: str | os.PathLike,
        cwd: str | os.PathLike,
        timeout: float = 600,
        expect_rc: int | None = 0,
    ) -> subprocess.CompletedProcess:
        """Run to completion; with `expect_rc` set, fail (showing stderr) on any other exit status."""
        argv = [self.exe, *map(str, args)]
        proc = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if expect_rc is not None:
            assert proc.returncode == expect_rc, describe(
                proc.args, proc.returncode, proc.stdout, proc.stderr
            )
        return proc

    def popen(self, *args: str | os.PathLike, cwd: str | os.PathLike, log_dir: Path) -> subprocess.Popen:
        """Start in the background; stdout/stderr go to files (a full pipe would stall tqdm)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [self.exe, *map(str, args)]
        with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
            return subprocess.Popen(argv, cwd=cwd, env=self.env, stdout=out, stderr=err)


@pytest.fixture(scope="session")
def cli() -> Cli:
    return Cli()
