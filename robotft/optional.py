"""Optional dependencies: one place that imports them and says what to install when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message says what needs it and how to install it."""


def require(module: str, extra: str | None, why: str, *, what: str | None = None,
            install: str | None = None) -> ModuleType:
    """Import `module` (e.g. `mani_skill.envs`), or raise MissingDependency: "`why` needs `what` (the import
    error); pip install robotft[`extra`]" (or the `install` instruction, for packages outside the extras).

    `why` names what needs it, e.g. `the maniskill env backend`; `what` defaults to the top-level package."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        how = install or f"pip install robotft[{extra}]"
        raise MissingDependency(f"{why} needs {what or module.split('.')[0]} ({e}); {how}") from e
