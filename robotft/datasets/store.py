"""The robotft dataset: a zarr (v2) store with diffusion_policy's replay-buffer layout.

Layout of a store directory::

    data/<key>                 one array per feature, episodes concatenated over time: [N, *shape]
                               (`rgb/base` becomes the nested group `data/rgb` holding `base`)
    meta/episode_ends          int64 [n_episodes], cumulative end index of each episode
    meta/episode_task_index    int64 [n_episodes], index into the `tasks` attribute
    meta (JSON attrs)          format, version, features, fps, tasks, action_spec, env, source

Stores are written only through `DatasetWriter`, which builds the new store in a temporary directory
next to the target and swaps it into place on `finalize()` (or `commit()`), so bad input or a crash never
touches an existing dataset. `ReplayBuffer` reads a store; `validate_store` lists everything wrong with one,
including chunk files that are missing (zarr would read them as zeros) or cannot be decoded.

Names beside a store `<path>` (see `recover_store`): `<path>.tmp-<pid>-<hex>` a store being written,
`<path>.new-<pid>-<hex>` a complete new store about to be swapped in, `<path>.old-<pid>-<hex>` the previous
store while it is swapped out. Every write and every open first finishes or removes what a killed writer
left: an interrupted swap is completed (or undone), so there is always a store at `<path>`.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import zarr

from robotft.config import migrate_type_key
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

FORMAT = "robotft-replay-buffer"
VERSION = 1
NON_OBSERVATION_KEYS = ("action", "reward", "success", "terminated", "truncated")
"""Keys stored per step that are not observations (everything else is, see `ReplayBuffer.spec`)."""
LOW_DIM_CHUNK_STEPS = 1024
"""Time steps per chunk of a low-dimensional array: few files, cheap appends, one read per window."""
_SCAN_BYTES = 1 << 24
"""Bytes read at a time when scanning float arrays for NaN/inf (bounded memory for big arrays)."""
_COMPRESSOR = numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE)


class DatasetError(ValueError):
    """A dataset (store, file or episode) is wrong; the message names the path, the key and what was
    expected."""


def is_image(spec: FeatureSpec) -> bool:
    """Image features (uint8 `[H, W, C]`) are chunked per frame and read lazily."""
    return spec.dtype == "uint8" and len(spec.shape) == 3


def _chunks(spec: FeatureSpec) -> tuple[int, ...]:
    if is_image(spec):
        return (1, *spec.shape)
    return (LOW_DIM_CHUNK_STEPS, *spec.shape)


def _check_features(path: Path, features: Mapping[str, FeatureSpec]) -> None:
    problems = []
    if "action" not in features:
        problems.append("features must include 'action'")
    for key, spec in features.items():
        if spec.key != key:
            problems.append(f"feature {key!r}: FeatureSpec.key is {spec.key!r}, expected {key!r}")
        try:
            np.dtype(spec.dtype)
        except TypeError:
            problems.append(f"feature {key!r}: dtype {spec.dtype!r} is not a numpy dtype")
    if "action" in features and len(features["action"].shape) != 1:
        problems.append(f"feature 'action': shape must be (act_dim,), got {features['action'].shape}")
    if problems:
        raise DatasetError(f"{path}: bad features: " + "; ".join(problems))


def _accepts(src: np.dtype, dst: np.dtype) -> bool:
    """Data of dtype `src` may be stored as `dst`: same dtype, a lossless (numpy "safe") cast, or
    float64 → float32 (numpy's default float; values are checked finite after the cast, which also
    catches overflow)."""
    if src == dst or np.can_cast(src, dst, casting="safe"):
        return True
    return src.kind == "f" and dst.kind == "f"


# --------------------------------------------------------------------------------------------------
# Temporary siblings, interrupted swaps, and what may be replaced

_SIBLING = re.compile(r"\.(tmp|new|old)-(?:(\d+)-)?[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _siblings(path: Path) -> dict[str, list[Path]]:
    """`{"tmp": [...], "new": [...], "old": [...]}`: what writers of `path` that are no longer running left."""
    found: dict[str, list[Path]] = {"tmp": [], "new": [], "old": []}
    if not path.parent.is_dir():
        return found
    for p in path.parent.iterdir():
        if not p.name.startswith(path.name + "."):
            continue
        m = _SIBLING.fullmatch(p.name[len(path.name):])
        if m is None or (m.group(2) is not None and _pid_alive(int(m.group(2)))):
            continue
        found[m.group(1)].append(p)
    return found


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def recover_store(path: str | Path) -> None:
    """Finish or undo what a killed writer of the store at `path` left behind (see the module docstring).

    No store at `path` but a complete `.new-` one: the swap had moved the old store aside, so it is completed
    (the new store is renamed into place). No store and only an `.old-` one: it is renamed back. Then every
    leftover `.tmp-`, `.new-` and `.old-` sibling is deleted. Writers still running are left alone."""
    path = Path(path)
    left = _siblings(path)
    if not path.exists():
        if left["new"]:
            os.rename(max(left["new"], key=lambda p: p.stat().st_mtime), path)
        elif left["old"]:
            os.rename(max(left["old"], key=lambda p: p.stat().st_mtime), path)
    for group in left.values():
        for p in group:
            if p.exists() or p.is_symlink():
                _remove(p)


def sibling_name(path: Path, kind: str) -> Path:
    return path.parent / f"{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def swap_into_place(tmp: Path, path: Path) -> None:
    """Move the complete directory `tmp` to `path`, replacing what is there, such that a kill at any point
    leaves a complete store at `path` once `recover_store` has run: `tmp` is first renamed `.new-` (complete),
    then the old store `.old-`, then `.new-` to `path`; the old store is deleted last."""
    new = sibling_name(path, "new")
    os.rename(tmp, new)
    if not path.exists():
        os.rename(new, path)
        return
    old = sibling_name(path, "old")
    os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old)


def is_robotft_store(path: Path) -> bool:
    """A directory holding a robotft store (by its metadata; its data may be damaged)."""
    attrs = path / "meta" / ".zattrs"
    if not (path / ".zgroup").is_file() or not attrs.is_file():
        return False
    try:
        import json

        return json.loads(attrs.read_text()).get("format") == FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def check_replaceable(path: Path, what: str = "a robotft dataset store") -> None:
    """Refuse to write a store where a file, or a directory that is not `what`, is."""
    if path.exists() and not path.is_dir():
        raise DatasetError(f"{path}: is a file, expected {what} directory (or a new path)")
    if path.is_dir() and any(path.iterdir()) and not is_robotft_store(path):
        raise DatasetError(f"{path}: exists and is not {what}; not replacing it (choose a new path)")


# --------------------------------------------------------------------------------------------------
# Validation


def _data_arrays(data: zarr.Group) -> dict[str, zarr.Array]:
    """All arrays under `data`, by their slash-separated key."""
    found: dict[str, zarr.Array] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, zarr.Array):
            found[name] = obj

    data.visititems(visit)
    return found


def _missing_chunks(arr: zarr.Array) -> list[str]:
    """Names of the chunk files of `arr` that are absent (zarr 2 would read them as `fill_value`: zeros)."""
    grid = [range(math.ceil(n / c)) for n, c in zip(arr.shape, arr.chunks, strict=True)]
    if any(len(r) == 0 for r in grid):
        return []
    sep = getattr(arr, "_dimension_separator", None) or "."
    present = set(arr.store.listdir(arr.path))
    return [name for idx in np.ndindex(*map(len, grid))
            if (name := sep.join(map(str, idx)) if idx else "0") not in present]


def _undecodable_chunk(arr: zarr.Array, lo: int, hi: int) -> tuple[int, Exception] | None:
    """The first chunk along time in steps [lo, hi) that zarr cannot decode, with the error."""
    c = arr.chunks[0]
    for start in range(lo - lo % c, hi, c):
        try:
            arr[start : start + c]
        except Exception as e:  # blosc/zstd RuntimeError, ValueError on a wrong size, ...
            return start // c, e
    return None


def _scan(key: str, arr: zarr.Array, check_values: bool) -> str | None:
    """Read `arr` in bounded-size blocks: the first chunk that cannot be decoded, or (float arrays, with
    `check_values`) the first step holding NaN/inf; None when the array reads clean."""
    row_bytes = max(1, arr.dtype.itemsize * math.prod(arr.shape[1:]))
    step = max(1, _SCAN_BYTES // row_bytes)
    step = max(arr.chunks[0], step - step % arr.chunks[0])
    for lo in range(0, arr.shape[0], step):
        try:
            block = arr[lo : lo + step]
        except Exception:
            chunk, err = _undecodable_chunk(arr, lo, lo + step) or (lo // arr.chunks[0], None)
            return (f"data/{key}: chunk {chunk} (steps {chunk * arr.chunks[0]}-"
                    f"{min(arr.shape[0], (chunk + 1) * arr.chunks[0]) - 1}) cannot be decoded "
                    f"({type(err).__name__}: {err}); expected a {arr.compressor.codec_id if arr.compressor else 'raw'}"
                    f" chunk of {arr.chunks} {arr.dtype}")
        if check_values and arr.dtype.kind == "f":
            bad = ~np.isfinite(block.reshape(block.shape[0], -1)).all(axis=1)
            if bad.any():
                return f"data/{key}: NaN or inf at step {lo + int(np.argmax(bad))}, expected finite values"
    return None


def _problems(path: Path, check_values: bool) -> list[str]:
    """Everything wrong with the store at `path` (empty list when it is valid)."""
    if not path.is_dir():
        return ["does not exist or is not a directory"]
    try:
        root = zarr.open_group(str(path), mode="r")
    except Exception as e:  # zarr raises GroupNotFoundError, ValueError, KeyError, JSON errors...
        return [f"not a zarr group ({type(e).__name__}: {e})"]
    try:
        return _structure_problems(root, check_values)
    except Exception as e:  # unreadable zarr metadata (.zarray/.zattrs) deeper in the store
        return [f"zarr metadata cannot be read ({type(e).__name__}: {e})"]


def _structure_problems(root: zarr.Group, check_values: bool) -> list[str]:
    problems: list[str] = []
    if "data" not in root or not isinstance(root["data"], zarr.Group):
        problems.append("missing group 'data'")
    if "meta" not in root or not isinstance(root["meta"], zarr.Group):
        problems.append("missing group 'meta'")
    if problems:
        return problems
    meta, data = root["meta"], root["data"]
    attrs = dict(meta.attrs)
    if attrs.get("format") != FORMAT:
        problems.append(f"meta attr 'format' is {attrs.get('format')!r}, expected {FORMAT!r}")
    if attrs.get("version") != VERSION:
        problems.append(f"meta attr 'version' is {attrs.get('version')!r}, expected {VERSION}")
    for name in ("features", "fps", "tasks"):
        if name not in attrs:
            problems.append(f"missing meta attr {name!r}")
    features: dict[str, FeatureSpec] = {}
    try:
        features = {k: FeatureSpec.from_dict(v) for k, v in attrs.get("features", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        problems.append(f"meta attr 'features' is malformed ({e!r})")
    if "features" in attrs and "action" not in features:
        problems.append("meta attr 'features' has no 'action' feature")
    if attrs.get("action_spec") is not None:
        try:
            ActionSpec.from_dict(attrs["action_spec"])
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"meta attr 'action_spec' is malformed ({e!r})")

    ends = _check_episode_ends(meta, problems)
    n_steps = int(ends[-1]) if ends is not None and len(ends) else 0
    _check_task_index(meta, attrs.get("tasks", []), ends, problems)

    arrays = _data_arrays(data)
    for key in sorted(set(arrays) - set(features)):
        problems.append(f"data/{key}: array has no declared feature in meta attr 'features'")
    for key, spec in features.items():
        if key not in arrays:
            problems.append(f"data/{key}: feature declared but array missing")
            continue
        arr = arrays[key]
        before = len(problems)
        if tuple(arr.shape[1:]) != spec.shape:
            problems.append(f"data/{key}: per-step shape {tuple(arr.shape[1:])}, expected {spec.shape}")
        if arr.dtype != np.dtype(spec.dtype):
            problems.append(f"data/{key}: dtype {arr.dtype}, expected {spec.dtype}")
        if ends is not None and arr.shape[0] != n_steps:
            problems.append(f"data/{key}: length {arr.shape[0]}, expected episode_ends[-1] = {n_steps}")
        missing = _missing_chunks(arr)
        if missing:
            problems.append(f"data/{key}: chunk files {missing[:5]} missing (of {arr.nchunks}); zarr would "
                            f"read them as {arr.fill_value}, expected every chunk of {arr.shape} to be written")
        elif check_values and len(problems) == before:
            found = _scan(key, arr, check_values)
            if found is not None:
                problems.append(found)
    return problems


def _check_episode_ends(meta: zarr.Group, problems: list[str]) -> np.ndarray | None:
    if "episode_ends" not in meta:
        problems.append("missing array 'meta/episode_ends'")
        return None
    ends = _read_meta_array(meta, "episode_ends", problems)
    if ends is None:
        return None
    if ends.dtype.kind not in "iu" or ends.ndim != 1:
        problems.append(f"meta/episode_ends: dtype {ends.dtype} shape {ends.shape}, expected 1-D int64")
        return None
    if len(ends) and ends[0] <= 0:
        problems.append(f"meta/episode_ends: first end is {ends[0]}, expected > 0")
        return None
    if np.any(np.diff(ends) <= 0):
        i = int(np.argmax(np.diff(ends) <= 0))
        problems.append(
            f"meta/episode_ends: not strictly increasing (ends[{i}]={ends[i]}, ends[{i + 1}]={ends[i + 1]})"
        )
        return None
    return ends


def _read_meta_array(meta: zarr.Group, name: str, problems: list[str]) -> np.ndarray | None:
    """`meta/<name>` read whole; None (and a problem) when a chunk is missing or cannot be decoded."""
    arr = meta[name]
    if not isinstance(arr, zarr.Array):
        problems.append(f"meta/{name}: is a group, expected an array")
        return None
    missing = _missing_chunks(arr)
    if missing:
        problems.append(f"meta/{name}: chunk files {missing[:5]} missing, expected every chunk to be written")
        return None
    try:
        return arr[:]
    except Exception as e:
        problems.append(f"meta/{name}: cannot be decoded ({type(e).__name__}: {e})")
        return None


def _check_task_index(meta: zarr.Group, tasks: Any, ends: np.ndarray | None, problems: list[str]) -> None:
    if "episode_task_index" not in meta:
        problems.append("missing array 'meta/episode_task_index'")
        return
    idx = _read_meta_array(meta, "episode_task_index", problems)
    if idx is None:
        return
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        problems.append(f"meta/episode_task_index: dtype {idx.dtype} shape {idx.shape}, expected 1-D int64")
        return
    if ends is not None and len(idx) != len(ends):
        problems.append(
            f"meta/episode_task_index: {len(idx)} entries, expected one per episode ({len(ends)})"
        )
    n_tasks = len(tasks) if isinstance(tasks, list) else 0
    if len(idx) and (idx.min() < 0 or idx.max() >= n_tasks):
        problems.append(
            f"meta/episode_task_index: values in [{idx.min()}, {idx.max()}], expected in [0, {n_tasks}) "
            f"(the length of meta attr 'tasks')"
        )


def validate_store(path: str | Path, check_values: bool = True) -> None:
    """Raise DatasetError listing every problem of the store at `path`; return None when valid.

    `check_values` also scans float arrays for NaN/inf (reads the whole store, in bounded blocks).
    """
    path = Path(path)
    recover_store(path)
    problems = _problems(path, check_values)
    if problems:
        raise DatasetError(f"{path}: invalid robotft dataset:\n  - " + "\n  - ".join(problems))


# --------------------------------------------------------------------------------------------------
# Reading


class ReplayBuffer:
    """Read-only view of a store. Open with `ReplayBuffer.open(path)`.

    Low-dimensional arrays are loaded into memory on first use (`array(key)`): zarr random reads are
    ~100x slower than numpy indexing. Images stay on disk (`array(key, in_memory=False)`).
    """

    def __init__(self, path: Path, root: zarr.Group) -> None:
        self.path = path
        self._root = root
        attrs = dict(root["meta"].attrs)
        self._attrs = attrs
        self.features: dict[str, FeatureSpec] = {
            k: FeatureSpec.from_dict(v) for k, v in attrs["features"].items()
        }
        self.episode_ends: np.ndarray = root["meta/episode_ends"][:].astype(np.int64)
        self._task_index: np.ndarray = root["meta/episode_task_index"][:].astype(np.int64)
        self._cache: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, path: str | Path) -> ReplayBuffer:
        """Open read-only after validating the structure (values are not scanned; see validate_store)."""
        path = Path(path)
        validate_store(path, check_values=False)
        return cls(path, zarr.open_group(str(path), mode="r"))

    @property
    def keys(self) -> list[str]:
        """Feature keys, sorted (zarr writes JSON attributes with sorted keys)."""
        return list(self.features)

    @property
    def n_episodes(self) -> int:
        return len(self.episode_ends)

    @property
    def n_steps(self) -> int:
        return int(self.episode_ends[-1]) if self.n_episodes else 0

    @property
    def episode_lengths(self) -> np.ndarray:
        """int64 [n_episodes]: steps per episode."""
        return np.diff(self.episode_ends, prepend=0)

    @property
    def fps(self) -> float:
        """Control rate the data was recorded at (steps per second)."""
        return float(self._attrs["fps"])

    @property
    def tasks(self) -> list[str]:
        return list(self._attrs["tasks"])

    @property
    def episode_tasks(self) -> list[str]:
        """Task string of each episode."""
        tasks = self.tasks
        return [tasks[i] for i in self._task_index]

    @property
    def action_spec(self) -> ActionSpec | None:
        d = self._attrs.get("action_spec")
        return None if d is None else ActionSpec.from_dict(d)

    @property
    def env(self) -> dict[str, Any]:
        """Free-form description of the source environment (may be empty); a simulated env's registered name
        is its `type` (stores written before the rename said `backend`, renamed here)."""
        return migrate_type_key(dict(self._attrs.get("env") or {}), "backend", f"{self.path}: meta env")

    @property
    def source(self) -> str:
        return str(self._attrs.get("source", ""))

    @property
    def spec(self) -> EnvSpec:
        """Observation features (all but action/reward/success/terminated/truncated) and action spec."""
        obs = {k: v for k, v in self.features.items() if k not in NON_OBSERVATION_KEYS}
        return EnvSpec(observations=obs, action=self.action_spec)

    def _require(self, key: str) -> None:
        if key not in self.features:
            raise DatasetError(f"{self.path}: no key {key!r}; available keys: {self.keys}")

    def array(self, key: str, in_memory: bool = True) -> np.ndarray | zarr.Array:
        """The whole `[n_steps, *shape]` array of `key`: cached numpy, or the lazy zarr array."""
        self._require(key)
        if not in_memory:
            return self._root["data"][key]
        if key not in self._cache:
            self._cache[key] = self._read(key, slice(None))
        return self._cache[key]

    def _read(self, key: str, rows: slice) -> np.ndarray:
        """`data/<key>[rows]`; a chunk that cannot be decoded is a DatasetError naming it."""
        arr = self._root["data"][key]
        try:
            return arr[rows]
        except Exception as e:  # blosc RuntimeError, ValueError from a wrong .zarray, ...
            lo, hi, _ = rows.indices(arr.shape[0])
            chunk, err = _undecodable_chunk(arr, lo, hi) or (lo // arr.chunks[0], e)
            raise DatasetError(
                f"{self.path / 'data' / key}: chunk {chunk} cannot be decoded ({type(err).__name__}: {err}); "
                f"run `robotft data validate {self.path}`"
            ) from e

    def episode_slice(self, i: int) -> slice:
        """Time-step slice of episode `i` in the concatenated arrays."""
        if not -self.n_episodes <= i < self.n_episodes:
            raise IndexError(f"{self.path}: episode {i} out of range (n_episodes={self.n_episodes})")
        i %= self.n_episodes
        start = int(self.episode_ends[i - 1]) if i > 0 else 0
        return slice(start, int(self.episode_ends[i]))

    def episode(self, i: int) -> dict[str, np.ndarray]:
        """All keys of episode `i`, each `[T, *shape]` (read from cache where loaded)."""
        sl = self.episode_slice(i)
        return {k: (self._cache[k][sl] if k in self._cache else self._read(k, sl)) for k in self.keys}

    def __repr__(self) -> str:
        return f"ReplayBuffer({str(self.path)!r}, episodes={self.n_episodes}, steps={self.n_steps})"


def summarize(path: str | Path) -> str:
    """Human-readable summary: sizes, episode lengths, per-key shape/dtype/unit/range, tasks, source."""
    buf = ReplayBuffer.open(path)
    lengths = buf.episode_lengths
    lines = [
        f"dataset   {buf.path}",
        f"episodes  {buf.n_episodes}    steps {buf.n_steps}    fps {buf.fps:g}",
    ]
    if buf.n_episodes:
        lines.append(f"length    min {lengths.min()}  mean {lengths.mean():.1f}  max {lengths.max()} steps")
    if buf.action_spec is not None:
        a = buf.action_spec
        lines.append(f"control   {a.control_mode} (dim {a.dim}, {a.control_hz:g} Hz, frame {a.frame or '-'})")
    lines.append("keys")
    width = max(len(k) for k in buf.keys)
    for key, spec in buf.features.items():
        desc = f"  {key:<{width}}  {str(spec.shape):<14} {spec.dtype:<8} unit={spec.unit or '-'}"
        if spec.frame:
            desc += f" frame={spec.frame}"
        if not is_image(spec) and buf.n_steps:
            x = buf.array(key)
            desc += f"  min {np.min(x):.4g}  max {np.max(x):.4g}"
        lines.append(desc)
    counts = {t: buf.episode_tasks.count(t) for t in buf.tasks}
    lines.append("tasks     " + (", ".join(f"{t!r} ({n} ep)" for t, n in counts.items()) or "-"))
    lines.append(f"source    {buf.source or '-'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Writing


class DatasetWriter:
    """Write episodes into a store atomically.

    Modes: `create` (the path must not exist), `append` (keep the existing episodes; features and fps
    must match exactly), `overwrite` (replace whatever is at the path). Episodes go into a temporary
    directory `<path>.tmp-<random>` next to the target; `finalize()` swaps it into place by renames,
    so the existing store is untouched until then, and untouched for good if anything fails. Used as
    a context manager it finalizes on a clean exit and deletes the temporary directory on an exception.
    Appending copies the existing store into the temporary directory first (time and disk ∝ its size):
    the price of never writing into the original.

    dtypes: data is cast to the declared dtype when numpy calls the cast "safe" (e.g. int32 → int64),
    and float64 is accepted for float32 features (numpy's default float; values must still be finite
    after the cast). Anything else (e.g. float → uint8) is an error.

    Example::

        with DatasetWriter("demos.zarr", features, fps=20.0) as w:
            w.add_episode({"state": s, "action": a}, task="push the cube")
    """

    def __init__(
        self,
        path: str | Path,
        features: Mapping[str, FeatureSpec],
        *,
        fps: float,
        action_spec: ActionSpec | None = None,
        env: dict[str, Any] | None = None,
        source: str = "",
        mode: str = "create",
    ) -> None:
        self.path = Path(path)
        if mode not in ("create", "append", "overwrite"):
            raise ValueError(f"DatasetWriter mode must be create, append or overwrite, got {mode!r}")
        if not fps > 0:
            raise DatasetError(f"{self.path}: fps must be > 0, got {fps}")
        _check_features(self.path, features)
        if action_spec is not None and (action_spec.dim,) != features["action"].shape:
            raise DatasetError(
                f"{self.path}: action_spec.dim={action_spec.dim} but feature 'action' has shape "
                f"{features['action'].shape}"
            )
        self.features = dict(features)
        self.mode = mode
        self._attrs: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "features": {k: v.to_dict() for k, v in self.features.items()},
            "fps": float(fps),
            "tasks": [],
            "action_spec": None if action_spec is None else action_spec.to_dict(),
            "env": dict(env or {}),
            "source": source,
        }
        self._episode_ends: list[int] = []
        self._task_index: list[int] = []
        self._committed = False
        recover_store(self.path)
        check_replaceable(self.path)
        if mode == "create" and self.path.exists():
            raise DatasetError(f"{self.path}: already exists (append to it with mode='append' / --append, or replace it with mode='overwrite' / --overwrite)")
        existing = self._open_existing() if mode == "append" else None

        self._tmp = sibling_name(self.path, "tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if existing is not None:
                self._copy_of_store()
            else:
                self._root = zarr.open_group(str(self._tmp), mode="w-")
                self._root.create_group("meta")
                data = self._root.create_group("data")
                for key, spec in self.features.items():
                    data.create_dataset(
                        key,
                        shape=(0, *spec.shape),
                        chunks=_chunks(spec),
                        dtype=spec.dtype,
                        compressor=_COMPRESSOR,
                    )
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._done = False

    def _copy_of_store(self) -> None:
        """Start the temporary store as a copy of the one at the path, by hard links: zarr replaces a chunk
        file it rewrites (write to a new file, then rename), so the original's files are never modified."""
        try:
            shutil.copytree(self.path, self._tmp, copy_function=os.link)
        except OSError:  # a file system without hard links
            shutil.rmtree(self._tmp, ignore_errors=True)
            shutil.copytree(self.path, self._tmp)
        self._root = zarr.open_group(str(self._tmp), mode="r+")

    def _open_existing(self) -> ReplayBuffer:
        """Check that the store to append to matches this writer; adopt its episodes and metadata."""
        if not self.path.exists():
            raise DatasetError(f"{self.path}: cannot append, no dataset there (use mode='create')")
        old = ReplayBuffer.open(self.path)
        if old.features != self.features:
            diff = sorted(
                k
                for k in set(old.features) | set(self.features)
                if old.features.get(k) != self.features.get(k)
            )
            raise DatasetError(
                f"{self.path}: cannot append, features differ for keys {diff}: existing "
                f"{ {k: old.features[k].to_dict() for k in diff if k in old.features} }, new "
                f"{ {k: self.features[k].to_dict() for k in diff if k in self.features} }"
            )
        if old.fps != self._attrs["fps"]:
            raise DatasetError(f"{self.path}: cannot append, fps {self._attrs['fps']} != existing {old.fps}")
        new_action = self._attrs["action_spec"]
        if new_action is not None and old.action_spec != ActionSpec.from_dict(new_action):
            raise DatasetError(
                f"{self.path}: cannot append, action_spec {new_action} != existing "
                f"{old._attrs['action_spec']}"
            )
        # The existing store's description wins where this writer was not told otherwise.
        self._attrs["action_spec"] = old._attrs.get("action_spec")
        self._attrs["env"] = self._attrs["env"] or old.env
        self._attrs["source"] = self._attrs["source"] or old.source
        self._attrs["tasks"] = old.tasks
        self._episode_ends = [int(e) for e in old.episode_ends]
        self._task_index = [int(i) for i in old._task_index]
        return old

    @property
    def n_episodes(self) -> int:
        return len(self._episode_ends)

    def _check_episode(self, episode: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate one episode against the features; return it cast to the declared dtypes."""
        where = f"{self.path}: episode {self.n_episodes}"
        problems = []
        missing = sorted(set(self.features) - set(episode))
        extra = sorted(set(episode) - set(self.features))
        if missing:
            problems.append(f"missing keys {missing}")
        if extra:
            problems.append(f"unexpected keys {extra} (declared: {sorted(self.features)})")
        out: dict[str, np.ndarray] = {}
        lengths: dict[str, int] = {}
        for key, spec in self.features.items():
            if key not in episode:
                continue
            x = np.asarray(episode[key])
            want = np.dtype(spec.dtype)
            if x.ndim != len(spec.shape) + 1 or tuple(x.shape[1:]) != spec.shape:
                problems.append(f"key {key!r}: shape {x.shape}, expected [T, *{spec.shape}]")
                continue
            if not _accepts(x.dtype, want):
                problems.append(f"key {key!r}: dtype {x.dtype}, expected {spec.dtype}")
                continue
            x = x.astype(want, copy=False)
            if want.kind == "f" and not np.isfinite(x).all():
                t = int(np.argmax(~np.isfinite(x.reshape(len(x), -1)).all(axis=1)))
                problems.append(f"key {key!r}: NaN or inf at step {t}, expected finite values")
                continue
            lengths[key] = len(x)
            out[key] = x
        if len(set(lengths.values())) > 1:
            problems.append(f"keys have different lengths {lengths}, expected one length T")
        elif lengths and next(iter(lengths.values())) < 1:
            problems.append("episode is empty, expected T >= 1 steps")
        if problems:
            raise DatasetError(f"{where}: " + "; ".join(problems))
        return out

    def add_episode(self, episode: Mapping[str, np.ndarray], task: str = "") -> None:
        """Append one episode: every declared key, each `[T, *shape]` with the same T >= 1."""
        if self._done:
            raise DatasetError(f"{self.path}: writer already finalized or aborted")
        arrays = self._check_episode(episode)
        for key, x in arrays.items():
            self._root["data"][key].append(x, axis=0)
        tasks = self._attrs["tasks"]
        if task not in tasks:
            tasks.append(task)
        start = self._episode_ends[-1] if self._episode_ends else 0
        self._episode_ends.append(start + len(arrays["action"]))
        self._task_index.append(tasks.index(task))

    def finalize(self) -> Path:
        """Write the metadata and swap the new store into place; returns the store path."""
        if self._done:
            raise DatasetError(f"{self.path}: writer already finalized or aborted")
        try:
            self._write_and_swap()
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.path

    def commit(self) -> Path:
        """Put the episodes added so far into place at the path (as `finalize` does) and keep writing, so
        that a session killed later keeps them (a deployment commits after every episode). Costs a hard-link
        copy of the store's files, not of their bytes."""
        if self._done:
            raise DatasetError(f"{self.path}: writer already finalized or aborted")
        try:
            self._write_and_swap()
            self._committed = True
            self._tmp = sibling_name(self.path, "tmp")
            self._copy_of_store()
        except BaseException:
            self.abort()
            raise
        return self.path

    def _write_and_swap(self) -> None:
        meta = self._root["meta"]
        meta.array("episode_ends", np.asarray(self._episode_ends, dtype=np.int64), overwrite=True)
        meta.array("episode_task_index", np.asarray(self._task_index, dtype=np.int64), overwrite=True)
        meta.attrs.put(self._attrs)
        validate_store(self._tmp, check_values=False)
        if self.path.exists() and self.mode == "create" and not self._committed:
            raise DatasetError(f"{self.path}: appeared while writing; not replacing it (mode='create')")
        check_replaceable(self.path)
        swap_into_place(self._tmp, self.path)

    def abort(self) -> None:
        """Delete the temporary directory; the target path is left as it was."""
        self._done = True
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._done:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
