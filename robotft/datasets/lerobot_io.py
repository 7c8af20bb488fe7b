"""LeRobot datasets in and out: `robotft data import --from-lerobot` and `robotft data export --to-lerobot`.

Both directions go through LeRobot's own `LeRobotDataset` (lerobot 0.4.4, format v3.0: parquet tables, one
mp4 per camera chunk, `meta/info.json`), so whatever LeRobot reads or writes, robotft does the same way.

Feature names map between the two with one table (`DEFAULT_KEY_MAP`, LeRobot key → robotft key) that the user
can extend or override (`--map LEROBOT=ROBOTFT`, `--map-file map.yaml`); a `*` at the end of both sides maps a
whole prefix, e.g. `observation.images.*` → `rgb/*`. Mapping a key to an empty value drops it. Export uses the
table backwards; robotft keys it does not name become `observation.<key with / as .>`.

Images: LeRobot decodes video frames to float `[C, H, W]` in [0, 1]; robotft stores uint8 `[H, W, 3]` (chunked
per frame in zarr), so import rounds `255 x` back to the encoded 8-bit value. Export writes images as video.

Nothing half-written is ever left behind: import checks the LeRobot dataset's files before reading it and
writes through the store's atomic `DatasetWriter`; export builds the LeRobot dataset in a temporary directory
next to the target and renames it into place only once LeRobot has finalized it.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from robotft.datasets.store import (
    DatasetError,
    DatasetWriter,
    ReplayBuffer,
    is_image,
    recover_store,
    sibling_name,
    swap_into_place,
)
from robotft.specs import ActionSpec, FeatureSpec

DEFAULT_KEY_MAP: dict[str, str] = {
    "observation.state": "state",
    "observation.environment_state": "env_state",
    "observation.images.*": "rgb/*",
    "action": "action",
    "next.reward": "reward",
    "next.success": "success",
}
"""LeRobot feature → robotft key (DESIGN.md fixed keys); LeRobot's recording conventions for the last two."""
LEROBOT_INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
"""Columns every LeRobot dataset has, which become robotft's episode structure rather than features."""
SCALAR_KEYS = ("reward", "success", "terminated", "truncated")
"""robotft keys stored per step as scalars (shape `()`); LeRobot stores them as shape `(1,)`."""
SUPPORTED_VERSION = "v3.0"
ROBOTFT_META = "robotft.json"
"""File that export adds to the LeRobot dataset's `meta/` folder (LeRobot ignores it): each exported feature's
robotft key and spec (units, frames), the action spec, env and source. Import uses it where the key map says
nothing, so robotft → LeRobot → robotft keeps keys like `robot/joint_pos` and the sim-to-real metadata."""
DECODE_BLOCK = 64
"""Video frames decoded at a time (bounded memory: decoded frames are float32, 4x the uint8 size)."""
_LEROBOT_HINT = "install the extra: pip install -e .[lerobot] (then lerobot==0.4.4 with --no-deps)"


def _require_lerobot() -> None:
    try:
        import lerobot  # noqa: F401
    except ImportError as e:
        raise ImportError(f"LeRobot import/export needs lerobot: {_LEROBOT_HINT}") from e


# --------------------------------------------------------------------------------------------------
# The key map


def load_key_map(
    overrides: Mapping[str, str | None] | None = None, map_file: str | Path | None = None
) -> dict[str, str]:
    """DEFAULT_KEY_MAP, updated by a YAML/JSON file of `lerobot_key: robotft_key` entries, then by `overrides`.
    An entry with an empty or null value drops that LeRobot feature."""
    table: dict[str, str] = dict(DEFAULT_KEY_MAP)
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if map_file is not None:
        import yaml

        path = Path(map_file)
        if not path.is_file():
            raise DatasetError(f"{path}: key-map file not found")
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise DatasetError(
                f"{path}: expected a mapping of LeRobot feature: robotft key, got {type(data).__name__}"
            )
        layers.append((str(path), data))
    if overrides:
        layers.append(("--map", overrides))
    for where, layer in layers:
        for src, dst in layer.items():
            if dst is not None and not isinstance(dst, str):
                raise DatasetError(
                    f"{where}: key {src!r} maps to {dst!r}, expected a robotft key string or empty"
                )
            if str(src).endswith("*") != (bool(dst) and str(dst).endswith("*")) and dst:
                raise DatasetError(f"{where}: {src!r} -> {dst!r}: a '*' prefix pattern must end both sides")
            table[str(src)] = dst or ""
    return table


def parse_map_args(items: list[str] | None) -> dict[str, str]:
    """`["observation.images.top=rgb/base", "observation.velocity="]` → `{...}` (empty value drops the key)."""
    out = {}
    for item in items or []:
        src, sep, dst = item.partition("=")
        if not sep or not src:
            raise DatasetError(f"--map expects LEROBOT_KEY=ROBOTFT_KEY, got {item!r}")
        out[src] = dst
    return out


def map_key(key: str, table: Mapping[str, str]) -> str | None:
    """The other side's name of `key` under `table` (exact entries first, then the longest `prefix*` entry):
    `""` when the table drops it, None when the table does not name it."""
    if key in table:
        return table[key]
    best = None
    for src, dst in table.items():
        matches = src.endswith("*") and key.startswith(src[:-1]) and len(key) > len(src) - 1
        if matches and (best is None or len(src) > len(best[0])):
            best = (src, dst)
    if best is None:
        return None
    return best[1] and best[1][:-1] + key[len(best[0]) - 1 :]


def _inverse(table: Mapping[str, str]) -> dict[str, str]:
    return {dst: src for src, dst in table.items() if dst}


# --------------------------------------------------------------------------------------------------
# Import


def resolve_lerobot_root(root_or_repo_id: str | Path) -> tuple[Path, str]:
    """`(root, repo_id)`: a local dataset directory, or a repo id found in LeRobot's hub cache
    (`$HF_LEROBOT_HOME/<repo_id>`). No download is attempted."""
    path = Path(root_or_repo_id).expanduser()
    if path.is_dir():
        return path.resolve(), f"local/{path.name}"
    _require_lerobot()
    from lerobot.utils.constants import HF_LEROBOT_HOME

    cached = Path(HF_LEROBOT_HOME) / str(root_or_repo_id)
    if cached.is_dir():
        return cached, str(root_or_repo_id)
    raise DatasetError(
        f"{root_or_repo_id}: not a local LeRobot dataset directory, and not in LeRobot's hub cache at {cached} "
        f"(robotft does not download; fetch it first, e.g. LeRobotDataset('{root_or_repo_id}') while online)"
    )


def _read_info(root: Path) -> dict[str, Any]:
    """`meta/info.json`, checked for what import needs."""
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise DatasetError(f"{info_path}: missing; {root} is not a LeRobot dataset (expected meta/info.json)")
    try:
        info = json.loads(info_path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{info_path}: not valid JSON: {e}") from e
    missing = [k for k in ("codebase_version", "fps", "features", "data_path") if k not in info]
    if missing:
        raise DatasetError(f"{info_path}: missing keys {missing}")
    version = str(info["codebase_version"])
    if version != SUPPORTED_VERSION:
        hint = ""
        if version.startswith("v2"):
            hint = (
                f"; lerobot 0.4.4 reads only {SUPPORTED_VERSION}: convert it with "
                f"`python -m lerobot.datasets.v30.convert_dataset_v21_to_v30 --repo-id=... --root={root}`"
            )
        raise DatasetError(
            f"{info_path}: codebase_version is {version!r}, expected {SUPPORTED_VERSION!r}{hint}"
        )
    for name in ("tasks.parquet", "episodes"):
        if not (root / "meta" / name).exists():
            raise DatasetError(
                f"{root / 'meta' / name}: missing (every LeRobot {SUPPORTED_VERSION} dataset has it)"
            )
    return info


def _plan_features(
    info: dict[str, Any], table: Mapping[str, str], info_path: Path, recorded: Mapping[str, str]
) -> tuple[dict[str, tuple[str, dict]], list[str]]:
    """`({robotft_key: (lerobot_key, lerobot_feature)}, skipped lerobot keys)`; `recorded` (from ROBOTFT_META)
    names the keys the table does not. Checks that every explicitly named LeRobot feature exists and that an
    action comes out."""
    features: dict[str, dict] = info["features"]
    plan: dict[str, tuple[str, dict]] = {}
    skipped = []
    for key, feat in features.items():
        if key in LEROBOT_INDEX_COLUMNS:
            continue
        dst = map_key(key, table)
        if dst is None:
            dst = recorded.get(key)
        if not dst:
            skipped.append(key)
            continue
        if dst in plan:
            raise DatasetError(
                f"{info_path}: features {plan[dst][0]!r} and {key!r} both map to robotft key {dst!r}"
            )
        plan[dst] = (key, feat)
    named = [
        src for src, dst in table.items() if dst and not src.endswith("*") and src not in DEFAULT_KEY_MAP
    ]
    absent = [src for src in named if src not in features]
    if absent:
        raise DatasetError(
            f"{info_path}: the key map names features {absent} that the dataset does not have; "
            f"its features: {sorted(k for k in features if k not in LEROBOT_INDEX_COLUMNS)}"
        )
    if "action" not in plan:
        raise DatasetError(
            f"{info_path}: no feature maps to robotft key 'action' (features: "
            f"{sorted(k for k in features if k not in LEROBOT_INDEX_COLUMNS)}); map one with --map KEY=action"
        )
    return plan, skipped


def _read_robotft_meta(root: Path) -> dict[str, Any]:
    """The ROBOTFT_META record of a dataset robotft exported; `{}` for any other LeRobot dataset."""
    path = root / "meta" / ROBOTFT_META
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(meta.get("keys"), dict) or not isinstance(meta.get("features"), dict):
        raise DatasetError(f"{path}: expected the objects 'keys' and 'features' (written by robotft data export)")
    return meta


def _feature_spec(robotft_key: str, lerobot_key: str, feat: dict, info_path: Path) -> FeatureSpec:
    shape = tuple(int(s) for s in feat.get("shape", ()))
    dtype = feat.get("dtype")
    names = feat.get("names")
    if dtype in ("video", "image"):
        if len(shape) != 3:
            raise DatasetError(
                f"{info_path}: feature {lerobot_key!r} has shape {shape}, expected [H, W, C] or [C, H, W]"
            )
        channels_first = isinstance(names, list) and names[:1] == ["channels"]
        h, w, c = (shape[1], shape[2], shape[0]) if channels_first else shape
        if c != 3:
            raise DatasetError(f"{info_path}: feature {lerobot_key!r} has {c} channels, expected 3 (RGB)")
        return FeatureSpec(robotft_key, (h, w, 3), "uint8", unit="rgb8")
    try:
        np.dtype(dtype)
    except TypeError as e:
        raise DatasetError(
            f"{info_path}: feature {lerobot_key!r} has dtype {dtype!r}, expected a numeric dtype"
        ) from e
    if robotft_key in SCALAR_KEYS and shape == (1,):
        shape = ()
    vector_names = tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else ()
    if len(shape) != 1 or len(vector_names) != shape[0]:
        vector_names = ()
    return FeatureSpec(robotft_key, shape, str(np.dtype(dtype)), names=vector_names)


def _check_files(meta: Any, root: Path, video_keys: list[str], columns: list[str]) -> None:
    """Every parquet and mp4 file the episode index (a `LeRobotDatasetMetadata`) points to exists (LeRobot
    would try to download a missing one), and every parquet file holds `columns` (Hugging Face `datasets`
    would silently fill a missing one with nulls)."""
    import pyarrow.parquet as pq

    checked: set[Path] = set()
    for ep in range(meta.total_episodes):
        data = root / meta.get_data_file_path(ep)
        if not data.is_file():
            raise DatasetError(
                f"{data}: missing data file of episode {ep} (listed in {root / 'meta' / 'episodes'})"
            )
        if data not in checked:
            try:
                present = set(pq.read_schema(data).names)
            except Exception as e:  # pyarrow's ArrowInvalid/OSError on a truncated or foreign file
                raise DatasetError(f"{data}: not a readable parquet file ({type(e).__name__}: {e}); expected the "
                                   f"data of episode {ep}") from e
            missing = [c for c in columns if c not in present]
            if missing:
                raise DatasetError(
                    f"{data}: lacks columns {missing} that meta/info.json declares; columns present: {sorted(present)}"
                )
            checked.add(data)
        for key in video_keys:
            video = root / meta.get_video_file_path(ep, key)
            if not video.is_file():
                raise DatasetError(f"{video}: missing video of feature {key!r}, episode {ep}")


def _check_meta_files(root: Path) -> None:
    """Every JSON and parquet file under `meta/` parses (LeRobot's own errors do not name the file)."""
    import pyarrow.parquet as pq

    for path in sorted((root / "meta").rglob("*")):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".parquet":
                pq.read_schema(path)
        except Exception as e:  # JSONDecodeError, UnicodeDecodeError, pyarrow's ArrowInvalid
            kind = "JSON" if path.suffix == ".json" else "parquet"
            raise DatasetError(f"{path}: not a readable {kind} file ({type(e).__name__}: {e})") from e


def read_lerobot_episodes(
    root: Path, repo_id: str, plan: Mapping[str, tuple[str, dict]], features: Mapping[str, FeatureSpec]
) -> tuple[Any, Iterator[tuple[dict[str, np.ndarray], str]]]:
    """Open the dataset with `LeRobotDataset` and return `(dataset, iterator of (episode arrays, task))`."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata

    _check_meta_files(root)
    try:
        meta = LeRobotDatasetMetadata(repo_id, root=root)
    except Exception as e:  # LeRobot raises many kinds here; the user needs the file, not the type
        raise DatasetError(
            f"{root}: LeRobot cannot read the metadata under meta/ ({type(e).__name__}: {e})"
        ) from e
    video_keys = [src for src, feat in plan.values() if feat.get("dtype") == "video"]
    image_keys = [src for src, feat in plan.values() if feat.get("dtype") == "image"]
    columns = [src for src, feat in plan.values() if feat.get("dtype") != "video"]
    _check_files(meta, root, video_keys, columns)
    try:
        ds = LeRobotDataset(repo_id, root=root, download_videos=False)
    except Exception as e:
        raise DatasetError(f"{root}: LeRobot cannot load the dataset ({type(e).__name__}: {e})") from e
    return ds, _episodes(ds, root, plan, features, video_keys, image_keys)


def _episodes(
    ds: Any,
    root: Path,
    plan: Mapping[str, tuple[str, dict]],
    features: Mapping[str, FeatureSpec],
    video_keys: list[str],
    image_keys: list[str],
) -> Iterator[tuple[dict[str, np.ndarray], str]]:
    raw = ds.hf_dataset.with_format("numpy")
    index = np.asarray(raw["index"])
    tasks = list(ds.meta.tasks.index)
    task_index = np.asarray(raw["task_index"]).reshape(-1)
    timestamps = np.asarray(raw["timestamp"], dtype=np.float64).reshape(-1)
    low_dim = {dst: src for dst, (src, feat) in plan.items() if feat.get("dtype") not in ("video", "image")}
    columns = {src: np.asarray(raw[src]) for src in low_dim.values()}
    position = {int(i): p for p, i in enumerate(index)}
    for ep in range(ds.meta.total_episodes):
        record = ds.meta.episodes[ep]
        lo, hi = int(record["dataset_from_index"]), int(record["dataset_to_index"])
        if lo not in position or hi - 1 not in position or position[hi - 1] - position[lo] != hi - lo - 1:
            raise DatasetError(
                f"{root / 'data'}: rows of episode {ep} (index {lo}..{hi - 1}) are missing or out of order"
            )
        rows = slice(position[lo], position[hi - 1] + 1)
        episode_tasks = sorted(set(task_index[rows].tolist()))
        if len(episode_tasks) != 1:
            raise DatasetError(
                f"{root}: episode {ep} has {len(episode_tasks)} tasks {[tasks[i] for i in episode_tasks]}; "
                "a robotft episode has one task string"
            )
        arrays: dict[str, np.ndarray] = {}
        for dst, src in low_dim.items():
            x = columns[src][rows]
            # Parquet stores shape-(1,) features as plain scalars; the spec says which shape robotft keeps.
            arrays[dst] = x.reshape(len(x), *features[dst].shape)
        for dst, (src, _) in plan.items():
            if src in video_keys:
                video = root / ds.meta.get_video_file_path(ep, src)
                start = float(record[f"videos/{src}/from_timestamp"])
                ts = (start + timestamps[rows]).tolist()
                arrays[dst] = _decode(video, ts, ds, src, ep)
            elif src in image_keys:
                arrays[dst] = np.stack(
                    [_image_to_uint8(ds.hf_dataset[p][src]) for p in range(rows.start, rows.stop)]
                )
        yield arrays, tasks[episode_tasks[0]]


def _decode(video: Path, ts: list[float], ds: Any, key: str, ep: int) -> np.ndarray:
    """Frames of `video` at timestamps `ts` as uint8 `[T, H, W, 3]`; a damaged or short video is a DatasetError."""
    from lerobot.datasets.video_utils import decode_video_frames

    try:
        blocks = [decode_video_frames(video, ts[i : i + DECODE_BLOCK], ds.tolerance_s, ds.video_backend)
                  for i in range(0, len(ts), DECODE_BLOCK)]
    except Exception as e:  # torchcodec/pyav raise many kinds on a truncated or corrupt file
        detail = " ".join(str(e).split())[:300]
        raise DatasetError(f"{video}: cannot decode the frames of feature {key!r}, episode {ep} "
                           f"({type(e).__name__}: {detail}); expected a complete video") from e
    frames = _to_uint8_hwc(np.concatenate([b.numpy() for b in blocks]))
    if len(frames) != len(ts):
        raise DatasetError(f"{video}: {len(frames)} frames decoded for feature {key!r}, episode {ep}, "
                           f"expected {len(ts)}")
    return frames


def _to_uint8_hwc(frames: np.ndarray) -> np.ndarray:
    """Decoded frames float `[T, C, H, W]` in [0, 1] → uint8 `[T, H, W, C]` (the encoded 8-bit values)."""
    return np.clip(np.rint(frames * 255.0), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def _image_to_uint8(img: Any) -> np.ndarray:
    """One image-dtype frame (LeRobot returns float `[C, H, W]` in [0, 1]) → uint8 `[H, W, C]`."""
    return _to_uint8_hwc(np.asarray(img)[None])[0]


def import_lerobot(
    root_or_repo_id: str | Path,
    out: str | Path,
    *,
    key_map: Mapping[str, str] | None = None,
    mode: str = "create",
) -> dict[str, Any]:
    """Import a LeRobot v3.0 dataset (local root, or a repo id in the hub cache) into the robotft store `out`.

    Features are renamed by `key_map` (default: `load_key_map()`); LeRobot features it does not map are skipped
    and listed in the result. Episode boundaries, per-episode task strings and fps are kept; videos are decoded
    to uint8 `[H, W, 3]`. Returns `{"episodes", "steps", "fps", "keys", "skipped", "tasks", "source"}`.
    """
    _require_lerobot()
    root, repo_id = resolve_lerobot_root(root_or_repo_id)
    table = dict(key_map) if key_map is not None else load_key_map()
    info = _read_info(root)
    info_path = root / "meta" / "info.json"
    recorded = _read_robotft_meta(root)
    plan, skipped = _plan_features(info, table, info_path, recorded.get("keys", {}))
    features = {dst: _feature_spec(dst, src, feat, info_path) for dst, (src, feat) in plan.items()}
    for key, spec in features.items():
        # robotft's own export: restore units, frames and names where the data still has the recorded layout.
        # Scalars went out as shape (1,), LeRobot's scalar layout.
        old = recorded.get("features", {}).get(key)
        if old is None or old["dtype"] != spec.dtype:
            continue
        if tuple(old["shape"]) == spec.shape or (tuple(old["shape"]) == () and spec.shape == (1,)):
            features[key] = FeatureSpec.from_dict(old)
    action_spec = recorded.get("action_spec")
    if action_spec is not None:
        action_spec = ActionSpec.from_dict(action_spec)
        if (action_spec.dim,) != features["action"].shape:
            action_spec = None
    fps = float(info["fps"])
    ds, episodes = read_lerobot_episodes(root, repo_id, plan, features)
    env = {
        **recorded.get("env", {}),
        "lerobot": {
            "repo_id": repo_id,
            "root": str(root),
            "robot_type": info.get("robot_type"),
            "codebase_version": info["codebase_version"],
            "key_map": table,
        },
    }
    source = f"lerobot:{repo_id}" + (f" (exported from {recorded['source']})" if recorded.get("source") else "")
    steps = 0
    with DatasetWriter(
        out, features, fps=fps, action_spec=action_spec, env=env, source=source, mode=mode
    ) as writer:
        for arrays, task in episodes:
            writer.add_episode(arrays, task=task)
            steps += len(arrays["action"])
    return {
        "episodes": ds.meta.total_episodes,
        "steps": steps,
        "fps": fps,
        "keys": sorted(features),
        "skipped": skipped,
        "tasks": list(ds.meta.tasks.index),
        "source": str(root),
    }


# --------------------------------------------------------------------------------------------------
# Export


def _lerobot_key(key: str, inverse: Mapping[str, str]) -> str:
    return map_key(key, inverse) or "observation." + key.replace("/", ".")


def _lerobot_feature(spec: FeatureSpec) -> dict[str, Any]:
    if is_image(spec):
        return {"dtype": "video", "shape": spec.shape, "names": ["height", "width", "channels"]}
    shape = spec.shape if spec.shape else (1,)
    names = list(spec.names) if spec.names else None
    return {"dtype": spec.dtype, "shape": shape, "names": names}


def export_lerobot(
    store: str | Path,
    out: str | Path,
    repo_id: str,
    *,
    key_map: Mapping[str, str] | None = None,
    overwrite: bool = False,
    vcodec: str = "libsvtav1",
    robot_type: str | None = None,
) -> dict[str, Any]:
    """Write the robotft store `store` as a LeRobot v3.0 dataset at `out` (images as video, encoded with
    `vcodec`), with `LeRobotDataset.create` + `add_frame` / `save_episode` / `finalize`.

    Keys are renamed by the inverse of `key_map` (default `load_key_map()`); scalar features become shape `(1,)`.
    The dataset is built in a temporary directory beside `out` and renamed into place when complete; an existing
    `out` is an error unless `overwrite`, and is replaced only after the new dataset is finalized.
    Returns `{"episodes", "steps", "fps", "features", "out"}`.
    """
    _require_lerobot()
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    buf = ReplayBuffer.open(store)
    out = Path(out)
    recover_store(out)
    if out.exists() and not out.is_dir():
        raise DatasetError(f"{out}: is a file, expected a LeRobot dataset directory (or a new path)")
    if out.exists() and not overwrite:
        raise DatasetError(f"{out}: already exists (replace it with overwrite=True / --overwrite)")
    if out.exists() and any(out.iterdir()) and not (out / "meta" / "info.json").is_file():
        raise DatasetError(f"{out}: exists and is not a LeRobot dataset (no meta/info.json); not replacing it")
    fps = buf.fps
    if not math.isclose(fps, round(fps)):
        raise DatasetError(f"{buf.path}: fps is {fps}, but LeRobot datasets need an integer fps")
    # The names the data had when it was imported from LeRobot come back first, then the table's.
    imported = (buf.env.get("lerobot") or {}).get("key_map") or {}
    table = _inverse(dict(key_map) if key_map is not None else load_key_map())
    inverse = {**_inverse(imported), **table} if key_map is not None else {**table, **_inverse(imported)}
    names = {key: _lerobot_key(key, inverse) for key in buf.keys}
    clashes = {v for v in names.values() if list(names.values()).count(v) > 1}
    if clashes:
        raise DatasetError(f"{buf.path}: several keys map to the LeRobot features {sorted(clashes)}: {names}")
    features = {names[k]: _lerobot_feature(spec) for k, spec in buf.features.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling_name(out, "tmp")
    try:
        ds = LeRobotDataset.create(
            repo_id,
            fps=int(round(fps)),
            features=features,
            root=tmp,
            robot_type=robot_type,
            use_videos=True,
            vcodec=vcodec,
        )
        tasks = buf.episode_tasks
        for i in range(buf.n_episodes):
            episode = buf.episode(i)
            for t in range(len(episode["action"])):
                frame = {names[k]: _frame_value(x[t], buf.features[k]) for k, x in episode.items()}
                frame["task"] = tasks[i]
                ds.add_frame(frame)
            ds.save_episode()
        ds.finalize()
        export_meta = {
            "keys": {names[k]: k for k in buf.keys},
            "features": {k: spec.to_dict() for k, spec in buf.features.items()},
            "action_spec": None if buf.action_spec is None else buf.action_spec.to_dict(),
            "env": buf.env,
            "source": buf.source,
        }
        (tmp / "meta" / ROBOTFT_META).write_text(json.dumps(export_meta, indent=2))
        # LeRobot keeps the PNG frames it encoded from in images/; the videos hold them now.
        shutil.rmtree(tmp / "images", ignore_errors=True)
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"episodes": buf.n_episodes, "steps": buf.n_steps, "fps": fps, "features": names, "out": str(out)}


def _frame_value(x: np.ndarray, spec: FeatureSpec) -> np.ndarray:
    """One step of a robotft array as LeRobot's add_frame wants it (scalars as shape `(1,)`)."""
    x = np.asarray(x)
    return x.reshape(1) if spec.shape == () else x
