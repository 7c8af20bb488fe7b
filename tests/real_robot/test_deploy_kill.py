"""Kill -9 at random moments of `robotft deploy --record --append` on the simulated rig: the recording at the path
is always a valid store, and it keeps every episode the session had finished (each is committed on its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_injection import kill_series, robotft_argv
from test_deploy import make_checkpoint

from robotft.datasets.store import ReplayBuffer, validate_store

pytest.importorskip("mujoco")


def test_deploy_record_killed_at_random_moments_keeps_finished_episodes(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    rec = tmp_path / "rec.zarr"
    argv = robotft_argv("deploy", ckpt, "--rig", "real_robot/sim_franka.yaml", "--no-operator", "--episodes", "4",
                        "--episode-time", "0.6", "--record", rec, "--append", "--out", tmp_path / "report")
    seen = [0]

    def check(i: int, outcome: str) -> None:
        if not rec.exists():
            assert seen[-1] == 0, "a recording that held episodes disappeared"
            return
        validate_store(rec)
        n = ReplayBuffer.open(rec).n_episodes
        assert n >= seen[-1], f"{n} episodes after holding {seen[-1]}"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rec.zarr.")] == []
        seen.append(n)

    first = robotft_argv("deploy", ckpt, "--rig", "real_robot/sim_franka.yaml", "--no-operator", "--episodes", "4",
                         "--episode-time", "0.6", "--record", rec, "--out", tmp_path / "report")
    def first_episode_committed() -> bool:
        try:
            return rec.exists() and ReplayBuffer.open(rec).n_episodes > seen[-1]
        except Exception:  # read while the session swapped the store: not a kill's result; look again
            return False

    # The window opens once the session has committed its first episode (start-up takes ~10 s here).
    tally = kill_series("deploy-record", lambda i: first if not rec.exists() else argv, check, (0.0, 3.0),
                        Path(tmp_path), ready=first_episode_committed)
    # (An episode in which a starved camera let no step run is not recorded, so the count is not checked.)
    print("deploy --record", dict(tally), "episodes kept:", seen)
