"""ManiSkill3 demonstrations without downloads: motion planning → replay into a control mode → import.

ManiSkill's motion planner records `pd_joint_pos` trajectories without observations; its replay tool
re-simulates them in the target control mode (e.g. `pd_ee_delta_pose`) and observation mode (`state`, or
`rgb` for camera images) and writes a new .h5/.json pair, which `import_maniskill_h5` turns into a robotft
store. The env config's `kwargs` (e.g. `sensor_configs: {width: 64, height: 64}` for small camera images)
are written into the planned trajectory's metadata, which the replay tool builds its env from. Both ManiSkill
tools run as subprocesses on the CPU backend (mplib segfaults under some numpy builds; a crash there
must not take the caller down).

The replay tool tracks the planned path closed-loop (each delta action points from where the arm is to the
plan's next target), so it can record demonstrations with recovery in them: with `replay_noise_std > 0`
Gaussian noise is added to every executed arm action of a delta controller while the tool records the
noise-free tracking action, DART's noise injection (Laskey et al. 2017, arXiv 1703.09327). A BC policy
trained on such demos has seen states off the plan and the actions that return to it, so it tolerates the
exploration noise of RL fine-tuning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from robotft.config import EnvConfig
from robotft.datasets.store import DatasetError, DatasetWriter
from robotft.specs import ActionSpec, FeatureSpec

OBS_MODES = ("state", "rgb")
"""Observation modes the importer reads (what the replay tool's `-o` wrote)."""
DEFAULT_FPS = 20.0
"""ManiSkill's default control frequency, used when the trajectory metadata does not record one."""

# The planner's CLI always starts at seed 0; its `_main` takes the start seed, so call it directly.
_PLANNER_DRIVER = """
import sys
from mani_skill.examples.motionplanning.panda import run
seed = int(sys.argv[1])
sys.argv = ["run", *sys.argv[2:]]
run._main(run.parse_args(), start_seed=seed)
"""


# DART: noise on the executed actions of delta controllers (the target env's arm; the planner's own
# `pd_joint_pos` env and the grippers are absolute), added before the controller clips and scales them. The
# replay tool records the action passed to env.step, so the demos keep the noise-free tracking action.
_NOISY_REPLAY_DRIVER = """
import sys
import torch
from mani_skill.agents.controllers.base_controller import BaseController
from mani_skill.trajectory import replay_trajectory
noise_std, seed = float(sys.argv[1]), int(sys.argv[2])
generator = torch.Generator().manual_seed(seed)
preprocess = BaseController._preprocess_action
def noisy_preprocess(self, action):
    if getattr(self.config, "use_delta", False):
        action = torch.as_tensor(action)
        noise = noise_std * torch.randn(action.shape, generator=generator, dtype=torch.float32)
        action = action + noise.to(action.device, action.dtype)
    return preprocess(self, action)
BaseController._preprocess_action = noisy_preprocess
replay_trajectory.main(replay_trajectory.parse_args(sys.argv[3:]))
"""


def _run_streaming(cmd: list[str], what: str, progress: bool) -> None:
    """Run `cmd`, forwarding its output to stderr when `progress` and stderr is a terminal (the tools redraw
    tqdm bars, which in a log file become one endless line); otherwise one line when it starts and one when
    it ends. Raise with the output's tail on failure."""
    live = progress and sys.stderr.isatty()
    t0 = time.perf_counter()
    if progress and not live:
        print(f"{what}: running", file=sys.stderr, flush=True)
    tail = b""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        # Read raw chunks, not lines: tqdm redraws with "\r" and would otherwise appear only at the end.
        while chunk := os.read(proc.stdout.fileno(), 4096):
            tail = (tail + chunk)[-4000:]
            if live:
                sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()
        rc = proc.wait()
    if progress and not live and rc == 0:
        print(f"{what}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if rc != 0:
        raise RuntimeError(
            f"{what} failed (exit code {rc}): {' '.join(cmd)}\n--- last output ---\n"
            f"{tail.decode(errors='replace')}"
        )


def generate_maniskill_demos(
    env_cfg: EnvConfig,
    n_episodes: int,
    out: str | Path,
    seed: int = 0,
    mode: str = "create",
    progress: bool = True,
    replay_noise_std: float = 0.0,
) -> dict[str, Any]:
    """Motion-plan `n_episodes` successful demos of `env_cfg.task`, replay them into
    `env_cfg.control_mode` / `env_cfg.obs_mode` and write the store `out`.

    `replay_noise_std`: std of the Gaussian noise on the executed arm actions during the replay, in the
    controller's normalized units ([-1, 1]; 0.05 is 5 mm per step for ManiSkill's `pd_ee_delta_pos`), with
    the noise-free actions recorded (DART, see the module docstring). It needs a delta controller (the
    replay tracks the plan only in those). Replays that the noise makes fail are not kept.

    Planning seeds start at `seed` and skip seeds the planner fails on. Returns stats:
    `planned` (successful plans), `planner_attempts` (seeds tried), `planner_failure_rate` (the share of
    tried seeds the planner failed on), `replayed` (successful replays), `kept` (episodes written),
    `plan_seconds`, `replay_seconds`, `import_seconds`, `seconds` and `out`.
    """
    if env_cfg.type != "maniskill":
        raise ValueError(f"generate_maniskill_demos needs env.type='maniskill', got {env_cfg.type!r}")
    if n_episodes < 1:
        raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
    if replay_noise_std < 0:
        raise ValueError(f"replay_noise_std must be >= 0, got {replay_noise_std}")
    if replay_noise_std > 0 and "delta" not in env_cfg.control_mode:
        raise ValueError(
            f"replay_noise_std > 0 needs a delta controller (the replay tracks the plan only in those), got "
            f"control_mode {env_cfg.control_mode!r}"
        )
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="robotft-msdemos-"))
    try:
        _run_streaming(
            [
                sys.executable,
                "-c",
                _PLANNER_DRIVER,
                str(seed),
                "-e",
                env_cfg.task,
                "-n",
                str(n_episodes),
                "--only-count-success",
                "-b",
                "cpu",
                "--record-dir",
                str(tmp),
                "--traj-name",
                "plan",
            ],
            "ManiSkill motion planning",
            progress,
        )
        planned_h5 = tmp / env_cfg.task / "motionplanning" / "plan.h5"
        plan_meta = _read_json(planned_h5.with_suffix(".json"))
        planned = len(plan_meta["episodes"])
        # The planner tries seeds seed, seed + 1, ... and keeps the successful ones: the last kept seed says
        # how many it tried.
        last_seed = max((int(ep.get("episode_seed", seed)) for ep in plan_meta["episodes"]), default=seed - 1)
        attempts = max(last_seed - seed + 1, planned)
        if env_cfg.kwargs:
            plan_meta["env_info"]["env_kwargs"].update(env_cfg.kwargs)
            planned_h5.with_suffix(".json").write_text(json.dumps(plan_meta))
        t1 = time.perf_counter()
        if progress:  # the replay tool draws one bar per trajectory: thousands of lines, so it runs quietly
            print(f"ManiSkill trajectory replay of {planned} demos into {env_cfg.control_mode}", file=sys.stderr,
                  flush=True)
        replay = (["-c", _NOISY_REPLAY_DRIVER, str(replay_noise_std), str(seed)] if replay_noise_std > 0
                  else ["-m", "mani_skill.trajectory.replay_trajectory"])
        _run_streaming(
            [
                sys.executable,
                *replay,
                "--traj-path",
                str(planned_h5),
                "-b",
                "physx_cpu",
                "-o",
                env_cfg.obs_mode,
                "-c",
                env_cfg.control_mode,
                "--reward-mode",
                env_cfg.reward_mode,
                "--record-rewards",
                "--save-traj",
            ],
            f"ManiSkill trajectory replay of {planned} demos into {env_cfg.control_mode}",
            False,
        )
        t2 = time.perf_counter()
        # The replay tool names its output plan.<obs_mode>.<control_mode>.<backend>.h5.
        converted = sorted(planned_h5.parent.glob(f"plan.{env_cfg.obs_mode}.{env_cfg.control_mode}.*.h5"))
        if not converted:
            raise RuntimeError(f"ManiSkill trajectory replay wrote no file next to {planned_h5}")
        stats = import_maniskill_h5(
            converted[0], out, control_mode=env_cfg.control_mode, mode=mode, task=env_cfg.task
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t3 = time.perf_counter()
    return {
        "planned": planned,
        "planner_attempts": attempts,
        "planner_failure_rate": (attempts - planned) / attempts if attempts else 0.0,
        "replayed": stats["successes"],
        "kept": stats["kept"],
        "plan_seconds": t1 - t0,
        "replay_seconds": t2 - t1,
        "import_seconds": t3 - t2,
        "seconds": t3 - t0,
        "out": str(out),
    }


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DatasetError(f"{path}: metadata file missing (ManiSkill writes a .json beside each .h5)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON: {e}") from e


def import_maniskill_h5(
    h5_path: str | Path,
    out: str | Path,
    *,
    control_mode: str | None = None,
    mode: str = "create",
    only_success: bool = True,
    task: str = "",
) -> dict[str, Any]:
    """Convert a ManiSkill trajectory file (+ its sibling .json) recorded with obs_mode `state` or `rgb`.

    Per episode `traj_<id>`: `obs` `[T+1, D]` (obs_mode `state`) or, for `rgb`, the group `obs` whose
    `agent` and `extra` leaves are flattened into `state` (in recorded order, as the ManiSkill env adapter
    flattens them) and whose `sensor_data/<camera>/rgb` `[T+1, H, W, 3]` uint8 become `rgb/<camera>`; the
    last observation is dropped so `obs[t]` pairs with `action[t]`. Also `actions` `[T, A]`, and
    `rewards` / `success` `[T]` where present. Everything is read and checked before anything is written,
    so a bad file leaves `out` untouched (images too are held in memory until then).
    `control_mode`, when given, must equal the file's. `task` defaults to the ManiSkill env id.

    Returns `{"episodes", "successes", "kept", "steps", "state_dim", "act_dim"}`.
    """
    import h5py

    h5_path = Path(h5_path)
    if not h5_path.is_file():
        raise DatasetError(f"{h5_path}: file not found")
    meta = _read_json(h5_path.with_suffix(".json"))
    env_info = meta.get("env_info")
    if not isinstance(env_info, dict) or "env_id" not in env_info:
        raise DatasetError(f"{h5_path.with_suffix('.json')}: missing key 'env_info.env_id'")
    env_kwargs = env_info.get("env_kwargs", {})
    file_mode = env_kwargs.get("control_mode")
    if control_mode is not None and file_mode != control_mode:
        raise DatasetError(
            f"{h5_path}: control mode is {file_mode!r} (env_info.env_kwargs.control_mode), expected "
            f"{control_mode!r}; convert it with mani_skill.trajectory.replay_trajectory -c {control_mode}"
        )
    obs_mode = env_kwargs.get("obs_mode")
    if obs_mode not in OBS_MODES:
        raise DatasetError(
            f"{h5_path}: obs_mode is {obs_mode!r} (env_info.env_kwargs.obs_mode), expected one of "
            f"{OBS_MODES}; replay it with -o state or -o rgb"
        )

    episodes: list[dict[str, np.ndarray]] = []
    successes = 0
    with h5py.File(h5_path, "r") as f:
        for ep in meta.get("episodes", []):
            if not isinstance(ep, dict) or "episode_id" not in ep:
                raise DatasetError(
                    f"{h5_path.with_suffix('.json')}: an entry of 'episodes' has no 'episode_id'"
                )
            data = _read_episode(f, h5_path, f"traj_{ep['episode_id']}", obs_mode)
            success = bool(ep.get("success", data["success"][-1] if "success" in data else False))
            successes += success
            if success or not only_success:
                episodes.append(data)
    if not episodes:
        raise DatasetError(f"{h5_path}: no episodes to import (only_success={only_success})")
    keys = set(episodes[0])
    for i, ep in enumerate(episodes):
        if set(ep) != keys:
            raise DatasetError(f"{h5_path}: episode {i} has keys {sorted(ep)}, expected {sorted(keys)}")

    state_dim, act_dim = episodes[0]["state"].shape[1], episodes[0]["action"].shape[1]
    fps = float(env_kwargs.get("sim_config", {}).get("control_freq", DEFAULT_FPS))
    features = {
        # ManiSkill's flat state mixes joint angles (rad), velocities and poses (m, quaternions) in the
        # world frame: honest units would need per-task names, which ManiSkill does not record.
        "state": FeatureSpec("state", (state_dim,), "float32", unit="mixed", frame="world"),
        # pd_ee_delta_pose actions are in [-1, 1]; the controller scales them to metres and radians.
        "action": FeatureSpec("action", (act_dim,), "float32", unit="normalized", frame="robot_base"),
    }
    for key in sorted(k for k in keys if k.startswith("rgb/")):
        shape = episodes[0][key].shape[1:]
        features[key] = FeatureSpec(key, shape, "uint8", unit="rgb8", frame="camera")
    if "reward" in keys:
        features["reward"] = FeatureSpec("reward", (), "float32", unit=env_kwargs.get("reward_mode", ""))
    if "success" in keys:
        features["success"] = FeatureSpec("success", (), "bool")
    low, high = _action_bounds(env_info, act_dim)
    action_spec = ActionSpec(
        control_mode=file_mode or "", dim=act_dim, low=low, high=high, control_hz=fps, frame="robot_base"
    )
    env = {
        "type": "maniskill",
        "env_id": env_info["env_id"],
        "env_kwargs": env_kwargs,
        "max_episode_steps": env_info.get("max_episode_steps"),
    }
    with DatasetWriter(
        out,
        features,
        fps=fps,
        action_spec=action_spec,
        env=env,
        source=f"maniskill-h5:{h5_path.name}",
        mode=mode,
    ) as writer:
        for ep in episodes:
            writer.add_episode(ep, task=task or env_info["env_id"])
    return {
        "episodes": len(meta.get("episodes", [])),
        "successes": successes,
        "kept": len(episodes),
        "steps": sum(len(ep["action"]) for ep in episodes),
        "state_dim": state_dim,
        "act_dim": act_dim,
    }


def _read_episode(f: Any, h5_path: Path, name: str, obs_mode: str) -> dict[str, np.ndarray]:
    """One episode group → `{state[, rgb/<camera>...], action[, reward][, success]}` with obs[T] dropped."""
    if name not in f:
        raise DatasetError(f"{h5_path}: missing group {name!r} listed in the .json episodes")
    g = f[name]
    for key in ("obs", "actions"):
        if key not in g:
            raise DatasetError(f"{h5_path}: {name}/{key} missing")
    actions = g["actions"][:]
    obs = _read_state_obs(g, h5_path, name) if obs_mode == "state" else _read_rgb_obs(g, h5_path, name)
    for key, x in obs.items():
        if actions.ndim != 2 or len(x) != len(actions) + 1:
            raise DatasetError(
                f"{h5_path}: {name}: obs {key!r} has {len(x)} steps and actions shape {actions.shape}, "
                f"expected obs [T+1, ...] and actions [T, A]"
            )
    out = {key: x[:-1] for key, x in obs.items()}
    out["action"] = actions.astype(np.float32)
    if "rewards" in g:
        out["reward"] = g["rewards"][:].astype(np.float32)
    if "success" in g:
        out["success"] = g["success"][:].astype(bool)
    for key, x in out.items():
        if len(x) != len(actions):
            raise DatasetError(f"{h5_path}: {name}: {key} has {len(x)} steps, expected {len(actions)}")
    return out


def _read_state_obs(g: Any, h5_path: Path, name: str) -> dict[str, np.ndarray]:
    """obs_mode `state`: the flat `obs` `[T+1, D]`."""
    import h5py

    if not isinstance(g["obs"], h5py.Dataset) or g["obs"].ndim != 2:
        raise DatasetError(
            f"{h5_path}: {name}/obs is not a flat [T+1, D] state array (obs_mode 'state' expected)"
        )
    return {"state": g["obs"][:].astype(np.float32)}


def _read_rgb_obs(g: Any, h5_path: Path, name: str) -> dict[str, np.ndarray]:
    """obs_mode `rgb`: `state` from the `agent` and `extra` leaves, `rgb/<camera>` from `sensor_data`."""
    import h5py

    obs = g["obs"]
    if not isinstance(obs, h5py.Group) or "agent" not in obs or "sensor_data" not in obs:
        raise DatasetError(
            f"{h5_path}: {name}/obs is not a group with 'agent' and 'sensor_data' (obs_mode 'rgb' expected)"
        )
    leaves = [leaf for part in ("agent", "extra") if part in obs for leaf in _leaves(obs[part])]
    out = {"state": np.concatenate(leaves, axis=1).astype(np.float32)}
    for camera, data in obs["sensor_data"].items():
        if "rgb" not in data:
            continue
        rgb = data["rgb"][:]
        if rgb.dtype != np.uint8 or rgb.ndim != 4 or rgb.shape[-1] != 3:
            raise DatasetError(
                f"{h5_path}: {name}/obs/sensor_data/{camera}/rgb is {rgb.dtype} {rgb.shape}, "
                f"expected uint8 [T+1, H, W, 3]"
            )
        out[f"rgb/{camera}"] = rgb
    if len(out) == 1:
        raise DatasetError(f"{h5_path}: {name}/obs/sensor_data has no camera with an 'rgb' image")
    return out


def _leaves(group: Any) -> list[np.ndarray]:
    """Depth-first `[T+1, -1]` leaves of a group. ManiSkill records with track_order=True, so iterating a
    group follows the env's own dict order, the order the env adapter flattens `state` in (h5py's
    `visititems` would go alphabetically instead)."""
    import h5py

    out = []
    for item in group.values():
        out.extend(_leaves(item) if isinstance(item, h5py.Group) else [item[:].reshape(len(item), -1)])
    return out


def _action_bounds(env_info: dict[str, Any], act_dim: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Action bounds from the recorded action space if the metadata has one, else [-1, 1] (the range
    of ManiSkill's normalized controllers)."""
    space = env_info.get("action_space")
    if isinstance(space, dict) and len(space.get("low", ())) == act_dim == len(space.get("high", ())):
        return tuple(map(float, space["low"])), tuple(map(float, space["high"]))
    return (-1.0,) * act_dim, (1.0,) * act_dim
