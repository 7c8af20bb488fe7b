"""Optional dependencies: one place that imports them and says which extra to install when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message names the `pip install` that adds it."""


def require(module: str, extra: str, why: str = "") -> ModuleType:
    """Import `module` (e.g. `mani_skill.envs`), or raise MissingDependency naming the extra to install.

    `why` says what needs it, e.g. `the ManiSkill env adapter`."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        need = f"{why} needs " if why else ""
        raise MissingDependency(
            f"{need}{module.split('.')[0]}, which is not installed ({e}); install it with "
            f"`pip install 'robotft[{extra}]'`"
        ) from e
