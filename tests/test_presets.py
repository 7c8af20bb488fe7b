"""Presets: minimal (each key differs from its base or the code default), loadable, and shipped in the wheel."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from robotft.config import REPO_ROOT, EnvConfig, load_preset, load_yaml, to_dict

IDENTITY_KEYS = {"type", "task", "env", "base", "simulated"}
"""Keys a preset may state at their default: what it is (the discriminator, the task, a real or simulated rig)."""


def _defaults(folder: str, data: dict[str, Any]) -> dict[str, Any]:
    """The code defaults a preset of `folder` fills."""
    if folder == "envs":
        return to_dict(EnvConfig())
    if folder == "policies":
        from robotft.policies.base import policy_config_class

        return to_dict(policy_config_class(data["type"])())
    if folder == "datasets":
        from robotft.datasets.recipe import DatasetRecipe

        return to_dict(DatasetRecipe())
    from robotft.real_robot.rig import RigConfig

    return to_dict(RigConfig())


def _redundant(raw: dict[str, Any], reference: dict[str, Any], where: str = "") -> list[str]:
    """Dotted keys of `raw` whose value equals `reference`'s (mappings compared key by key)."""
    out = []
    for key, value in raw.items():
        if key in IDENTITY_KEYS:
            continue
        if key not in reference:
            continue
        ref = reference[key]
        if isinstance(value, dict) and isinstance(ref, dict):
            out += _redundant(value, ref, f"{where}{key}.")
        elif _same(value, ref):
            out.append(where + key)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _preset_files(folder: str) -> list[Path]:
    return sorted((REPO_ROOT / folder).rglob("*.yaml"))


ALL = [(folder, p) for folder in ("envs", "policies", "datasets", "real_robot") for p in _preset_files(folder)]


@pytest.mark.parametrize(("folder", "path"), ALL, ids=[f"{f}/{p.stem}" for f, p in ALL])
def test_preset_is_minimal(folder, path):
    raw = load_yaml(path)
    if "base" in raw:
        _, reference = load_preset(folder, str(raw["base"]))
        reference = {**_defaults(folder, {**reference, **raw}), **reference}
    else:
        reference = _defaults(folder, raw)
    redundant = _redundant(raw, reference)
    assert not redundant, (f"{path}: {redundant} repeat the value of "
                           f"{'its base ' + repr(raw['base']) if 'base' in raw else 'the code default'}; "
                           "delete them")


def test_every_preset_has_a_description():
    from robotft.config import preset_description

    missing = [str(p) for _, p in ALL if not preset_description(p)]
    assert not missing, f"presets without a leading comment line: {missing}"


def test_base_inheritance_merges_and_detects_loops(tmp_path, monkeypatch):
    from robotft.config import ConfigError, load_env_config

    (tmp_path / "envs" / "t").mkdir(parents=True)
    (tmp_path / "envs" / "t" / "a.yaml").write_text("# A\ntype: toy\nnum_envs: 3\nrandomization: {obs_noise_std: 0.1}\n")
    (tmp_path / "envs" / "t" / "b.yaml").write_text("# B\nbase: t/a\nrandomization: {action_noise_std: 0.2}\n")
    (tmp_path / "envs" / "t" / "c.yaml").write_text("# C\nbase: t/d\n")
    (tmp_path / "envs" / "t" / "d.yaml").write_text("# D\nbase: t/c\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_env_config("t/b")
    assert cfg.num_envs == 3
    assert cfg.randomization.obs_noise_std == 0.1 and cfg.randomization.action_noise_std == 0.2
    with pytest.raises(ConfigError, match="loops"):
        load_env_config("t/c")


def test_presets_of_each_kind_load():
    from robotft.config import from_dict, list_presets, load_env_config
    from robotft.datasets.recipe import load_recipe
    from robotft.policies.base import policy_config_class
    from robotft.real_robot.rig import load_rig

    for name in list_presets("envs"):
        load_env_config(name)
    for name in list_presets("policies"):
        path, data = load_preset("policies", name)
        from_dict(policy_config_class(data["type"]), data, where=str(path))
    for name in list_presets("real_robot"):
        load_rig(name)
    for name in list_presets("datasets"):
        load_recipe(name)


def test_wheel_ships_presets(tmp_path):
    """The wheel, installed into a fresh virtualenv outside the checkout, lists and loads its presets."""
    # Build from a copy of what the sdist holds, so the checkout gets no build/ folder.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    for name in ("robotft", "envs", "policies", "real_robot", "datasets"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            str(src), "-w", str(wheels)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("robotft-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The new venv sees this interpreter's packages (torch, ...) but gets its own robotft from the wheel
    # (--ignore-installed: pip would otherwise count the checkout's editable install as already there).
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "--no-deps", "--ignore-installed", "-q", str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROBOTFT_PRESETS")}
    listed = subprocess.run([str(venv / "bin" / "robotft"), "presets"], cwd=outside, env=env,
                            capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    for folder in ("envs", "policies", "real_robot", "datasets"):
        for path in _preset_files(folder):
            name = path.relative_to(REPO_ROOT / folder).with_suffix("").as_posix()
            assert name in listed.stdout, f"{folder}/{name} missing from the installed wheel's presets"
    probe = ("import robotft.config as c; assert '_presets' in str(c.find_preset('envs', 'mujoco/hopper_dr')), "
             "c.find_preset('envs', 'mujoco/hopper_dr'); "
             "print(c.__file__, c.load_env_config('mujoco/hopper_dr').randomization.friction_scale)")
    loaded = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=outside, env=env,
                            capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert str(venv) in loaded.stdout and "(0.5, 1.5)" in loaded.stdout, loaded.stdout


def test_rig_examples_in_docstrings_follow_the_schema():
    """The YAML examples in the robot, camera and object-pose source config docstrings load as rig presets and
    name their backend with `type:` (not the old `backend:`, which still loads)."""
    import textwrap

    import yaml

    from robotft.config import from_dict
    from robotft.real_robot.fiducial import FiducialConfig
    from robotft.real_robot.franka import FrankaConfig
    from robotft.real_robot.realsense import RealSenseConfig
    from robotft.real_robot.rig import RigConfig

    for cls, key in ((FrankaConfig, "robot"), (RealSenseConfig, "cameras"), (FiducialConfig, "object_poses")):
        example = yaml.safe_load(textwrap.dedent(cls.__doc__.split("):\n", 1)[1]))
        rig = from_dict(RigConfig, example, where=f"{cls.__name__} docstring")
        device = {"robot": rig.robot, "object_poses": rig.object_poses}.get(key) or rig.cameras[0]
        raw = example[key][0] if key == "cameras" else example[key]
        assert "type" in raw and "backend" not in raw, f"{cls.__name__} docstring: {raw}"
        from_dict(cls, device.config, where=f"{cls.__name__} docstring")


def test_algorithms_doc_points_at_real_symbols():
    """Every `robotft/...py:Symbol` in docs/algorithms.md names a module attribute (or a class's)."""
    import importlib
    import re

    text = (REPO_ROOT / "docs" / "algorithms.md").read_text()
    refs = re.findall(r"`(robotft/[\w/]+\.py):([\w.]+)`", text)
    assert len(refs) > 20, refs
    for path, symbol in refs:
        obj = importlib.import_module(path[:-3].replace("/", "."))
        for part in symbol.split("."):
            assert hasattr(obj, part), f"docs/algorithms.md: {path}:{symbol} does not exist"
            obj = getattr(obj, part)


def test_datasets_folder_is_not_a_python_package():
    """`datasets/` holds recipes only: an `__init__.py` would shadow Hugging Face `datasets`, which LeRobot
    imports."""
    assert (REPO_ROOT / "datasets").is_dir()
    assert not list((REPO_ROOT / "datasets").rglob("*.py")), "datasets/ must hold YAML recipes only"
