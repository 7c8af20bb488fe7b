"""Import robomimic HDF5 datasets (robosuite demonstrations) into a robotft store.

robomimic's layout (Mandlekar et al. 2021; robomimic.readthedocs.io, "Dataset Structure")::

    data                      attrs: env_args (JSON: env_name, type, env_kwargs), total
    data/demo_<n>/obs/<key>   [T, ...] per-step observations (low-dim keys, `<camera>_image` uint8)
    data/demo_<n>/actions     [T, A]
    data/demo_<n>/rewards     [T]
    data/demo_<n>/dones       [T]
    mask/<filter_key>         optional: names of the demos in a split (e.g. `train`, `valid`)

The store gets the keys of the robosuite adapter (robotft.envs.robosuite): `state` (robomimic's low-dim
keys concatenated in the adapter's order), `rgb/<camera>` for each `<camera>_image`, plus `action`,
`reward` and `terminated` (robomimic's `dones`). The file's structure is checked completely before
anything is written; episodes are then streamed through an atomic DatasetWriter, so a malformed file
leaves the target untouched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from robotft.datasets.store import DatasetError, DatasetWriter
from robotft.envs.robosuite import CONTROL_MODE, ROBOT_STATE_KEYS, state_keys, state_names
from robotft.specs import ActionSpec, FeatureSpec

DEFAULT_FPS = 20.0
"""robomimic's control rate, used when env_kwargs records no `control_freq`."""
ROBOSUITE_ENV_TYPE = 1
"""robomimic's EnvType.ROBOSUITE_TYPE, the `type` in env_args of robosuite datasets."""
_DEMO = re.compile(r"demo_(\d+)")
_IMAGE_SUFFIX = "_image"


def is_robomimic_hdf5(path: str | Path) -> bool:
    """True when `path` is an HDF5 file with robomimic's `data` group carrying `env_args`."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return isinstance(f.get("data"), h5py.Group) and "env_args" in f["data"].attrs
    except OSError:
        return False


def import_robomimic_hdf5(
    path: str | Path,
    out: str | Path,
    *,
    mode: str = "create",
    filter_key: str | None = None,
    task: str = "",
) -> dict[str, Any]:
    """Write the demos of the robomimic file `path` (those in `mask/<filter_key>` when given) to `out`.

    `task` defaults to the robosuite env name. Returns `{"episodes", "steps", "state_dim", "act_dim",
    "cameras"}`. Raises DatasetError naming the file and key for malformed input.
    """
    import h5py

    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DatasetError(f"{path}: not an HDF5 file ({e})") from e
    with f:
        env_args = _env_args(path, f)
        env_kwargs = env_args.get("env_kwargs", {})
        demos = _demo_names(path, f, filter_key)
        layout = _check_layout(path, f, demos)
        num_arms, cameras, act_dim = layout["num_arms"], layout["cameras"], layout["act_dim"]
        state_dim = layout["state_dim"]
        object_dim = state_dim - num_arms * sum(len(c) for c in ROBOT_STATE_KEYS.values())
        # The file does not say which object observables make up `object` (it depends on the robosuite
        # version that wrote it), so those dims are named by index.
        names = state_names(num_arms, [str(i) for i in range(object_dim)])
        features = {
            "state": FeatureSpec("state", (state_dim,), "float32", unit="mixed", frame="world", names=names),
            **{
                f"rgb/{cam}": FeatureSpec(f"rgb/{cam}", shape, "uint8", unit="rgb8", frame=cam)
                for cam, shape in cameras.items()
            },
            # OSC_POSE inputs in [-1, 1]; the controller scales them to 0.05 m / 0.5 rad per step.
            "action": FeatureSpec("action", (act_dim,), "float32", unit="normalized", frame="robot_base"),
            "reward": FeatureSpec("reward", (), "float32"),
            "terminated": FeatureSpec("terminated", (), "bool"),
        }
        fps = float(env_kwargs.get("control_freq", DEFAULT_FPS))
        action_spec = ActionSpec(
            CONTROL_MODE, act_dim, (-1.0,) * act_dim, (1.0,) * act_dim, control_hz=fps, frame="robot_base"
        )
        env = {
            "type": "robosuite",
            "task": env_args["env_name"],
            "env_kwargs": env_kwargs,
        }
        steps = 0
        with DatasetWriter(
            out, features, fps=fps, action_spec=action_spec, env=env, source=f"robomimic-hdf5:{path.name}", mode=mode
        ) as writer:
            for name in demos:
                episode = _read_demo(path, f[f"data/{name}"], name, num_arms, cameras)
                writer.add_episode(episode, task=task or env_args["env_name"])
                steps += len(episode["action"])
    return {
        "episodes": len(demos),
        "steps": steps,
        "state_dim": state_dim,
        "act_dim": act_dim,
        "cameras": sorted(cameras),
    }


def _env_args(path: Path, f: Any) -> dict[str, Any]:
    """`data.attrs["env_args"]`, parsed and checked to describe a robosuite env under OSC_POSE."""
    import h5py

    if not isinstance(f.get("data"), h5py.Group):
        raise DatasetError(f"{path}: missing group 'data' (not a robomimic dataset)")
    if "env_args" not in f["data"].attrs:
        raise DatasetError(f"{path}: missing attribute 'env_args' on group 'data'")
    raw = f["data"].attrs["env_args"]
    try:
        env_args = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: data.attrs['env_args'] is not valid JSON: {e}") from e
    if not isinstance(env_args, dict) or not isinstance(env_args.get("env_name"), str):
        raise DatasetError(f"{path}: data.attrs['env_args'] has no string 'env_name'")
    if env_args.get("type", ROBOSUITE_ENV_TYPE) != ROBOSUITE_ENV_TYPE:
        raise DatasetError(
            f"{path}: data.attrs['env_args'].type is {env_args['type']!r}, expected {ROBOSUITE_ENV_TYPE} "
            "(a robosuite dataset)"
        )
    kwargs = env_args.get("env_kwargs", {})
    if not isinstance(kwargs, dict):
        raise DatasetError(f"{path}: data.attrs['env_args'].env_kwargs is not a mapping")
    controller = _controller_type(kwargs.get("controller_configs"))
    if controller not in (None, CONTROL_MODE):
        raise DatasetError(
            f"{path}: data.attrs['env_args'].env_kwargs.controller_configs is {controller!r}, expected "
            f"{CONTROL_MODE!r} (the only control mode of the robosuite adapter)"
        )
    return env_args


def _controller_type(configs: Any) -> str | None:
    """The arm controller of robomimic's controller_configs: robosuite <= 1.4 stores `{"type": "OSC_POSE"}`,
    1.5 a composite `{"type": "BASIC", "body_parts": {"right": {"type": "OSC_POSE"}}}`; None if absent."""
    if not isinstance(configs, dict):
        return None
    parts = configs.get("body_parts")
    if isinstance(parts, dict):
        types = {p.get("type") for p in parts.values() if isinstance(p, dict)}
        return types.pop() if len(types) == 1 else str(sorted(map(str, types)))
    return configs.get("type")


def _demo_names(path: Path, f: Any, filter_key: str | None) -> list[str]:
    """Demo groups in numeric order (demo_2 before demo_10), restricted to `mask/<filter_key>`."""
    demos = sorted((k for k in f["data"] if _DEMO.fullmatch(k)), key=lambda k: int(k[5:]))
    if filter_key is not None:
        key = f"mask/{filter_key}"
        if key not in f:
            available = sorted(f["mask"]) if "mask" in f else []
            raise DatasetError(f"{path}: no filter key {key!r}; available: {available}")
        wanted = [n.decode() if isinstance(n, bytes) else str(n) for n in f[key][:]]
        missing = sorted(set(wanted) - set(demos))
        if missing:
            raise DatasetError(f"{path}: {key} lists demos that are not in 'data': {missing[:5]}")
        demos = [d for d in demos if d in set(wanted)]
    if not demos:
        raise DatasetError(f"{path}: no 'data/demo_<n>' groups to import")
    return demos


def _check_layout(path: Path, f: Any, demos: list[str]) -> dict[str, Any]:
    """Check every demo's keys, shapes and dtypes (metadata only, no data read) and return the layout
    shared by all: `num_arms`, `state_dim`, `act_dim`, `cameras` ({camera: (H, W, 3)})."""
    import h5py

    layout: dict[str, Any] | None = None
    for name in demos:
        g = f[f"data/{name}"]
        for key in ("obs", "actions", "rewards", "dones"):
            if key not in g:
                raise DatasetError(f"{path}: data/{name}/{key} missing")
        obs = g["obs"]
        if not isinstance(obs, h5py.Group):
            raise DatasetError(f"{path}: data/{name}/obs is not a group of per-key arrays")
        actions = g["actions"]
        if actions.ndim != 2 or actions.shape[0] < 1:
            raise DatasetError(f"{path}: data/{name}/actions has shape {actions.shape}, expected [T >= 1, A]")
        T = actions.shape[0]
        num_arms = sum(1 for i in range(8) if f"robot{i}_eef_pos" in obs)
        if num_arms == 0:
            raise DatasetError(f"{path}: data/{name}/obs/robot0_eef_pos missing (robomimic low-dim keys expected)")
        state_dim = 0
        for key in state_keys(num_arms):
            if key not in obs:
                raise DatasetError(f"{path}: data/{name}/obs/{key} missing")
            arr = obs[key]
            expected = len(ROBOT_STATE_KEYS[key.split("_", 1)[1]]) if key != "object" else None
            if arr.ndim != 2 or arr.shape[0] != T or (expected is not None and arr.shape[1] != expected):
                raise DatasetError(
                    f"{path}: data/{name}/obs/{key} has shape {arr.shape}, expected "
                    f"[{T}, {expected if expected is not None else 'D'}] (T from data/{name}/actions)"
                )
            if arr.dtype.kind not in "fiu":
                raise DatasetError(f"{path}: data/{name}/obs/{key} has dtype {arr.dtype}, expected numbers")
            state_dim += arr.shape[1]
        cameras = {}
        for key in obs:
            if not key.endswith(_IMAGE_SUFFIX):
                continue
            arr = obs[key]
            if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[0] != T or arr.shape[3] != 3:
                raise DatasetError(
                    f"{path}: data/{name}/obs/{key} is {arr.dtype} {arr.shape}, expected uint8 [{T}, H, W, 3]"
                )
            cameras[key.removesuffix(_IMAGE_SUFFIX)] = tuple(arr.shape[1:])
        for key in ("rewards", "dones"):
            if g[key].shape != (T,):
                raise DatasetError(f"{path}: data/{name}/{key} has shape {g[key].shape}, expected [{T}]")
        if actions.shape[1] != 7 * num_arms:
            raise DatasetError(
                f"{path}: data/{name}/actions has {actions.shape[1]} dims, expected {7 * num_arms} "
                f"({CONTROL_MODE} + gripper for {num_arms} arm(s))"
            )
        found = {"num_arms": num_arms, "state_dim": state_dim, "act_dim": actions.shape[1], "cameras": cameras}
        if layout is None:
            layout = found
        elif found != layout:
            raise DatasetError(f"{path}: data/{name} has layout {found}, but {demos[0]} has {layout}")
    assert layout is not None  # demos is non-empty
    return layout


def _read_demo(path: Path, g: Any, name: str, num_arms: int, cameras: dict[str, tuple]) -> dict[str, np.ndarray]:
    """One demo group as the store's per-step arrays (structure already checked by `_check_layout`)."""
    obs = g["obs"]
    episode = {
        "state": np.concatenate([obs[k][:].astype(np.float32) for k in state_keys(num_arms)], axis=1),
        **{f"rgb/{cam}": obs[f"{cam}{_IMAGE_SUFFIX}"][:] for cam in cameras},
        "action": g["actions"][:].astype(np.float32),
        "reward": g["rewards"][:].astype(np.float32),
        "terminated": g["dones"][:].astype(bool),
    }
    for key in ("state", "action", "reward"):
        if not np.isfinite(episode[key]).all():
            raise DatasetError(f"{path}: data/{name}: {key} holds NaN or inf")
    return episode
