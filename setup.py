"""Build hook: the top-level preset folders (envs/, policies/, real_robot/, datasets/) are the source of truth;
a wheel ships copies of their YAML files inside the package, as `robotft/_presets/<folder>/...`, which
`robotft.config` reads through importlib.resources. An editable install reads the folders in place."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PRESET_FOLDERS = ("envs", "policies", "real_robot", "datasets")


def _not_yaml(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not (Path(folder, n).is_dir() or n.endswith((".yaml", ".yml")))]


class BuildPyWithPresets(build_py):
    """`build_py` that also copies the preset folders into the built package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        root = Path(__file__).resolve().parent
        target = Path(self.build_lib) / "robotft" / "_presets"
        shutil.rmtree(target, ignore_errors=True)  # a preset deleted since the last build must not ship
        for folder in PRESET_FOLDERS:
            if (root / folder).is_dir():
                shutil.copytree(root / folder, target / folder, dirs_exist_ok=True, ignore=_not_yaml)


setup(cmdclass={"build_py": BuildPyWithPresets})
