"""The packages some source types need beyond the core: imported when a source asks for them, refused in
one line naming the package and phalanx's extra that brings it (pyproject.toml, phalanx/extras.py)."""

from __future__ import annotations

import importlib
from importlib.util import find_spec
from types import ModuleType

from phalanx.errors import PhalanxError

EXTRA = "data"


def available(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_module(module: str, what: str) -> ModuleType:
    """Import `module`, or raise one line saying that `what` needs it. Only the one package is checked,
    not the whole extra: a `.zst` file needs zstandard, never `datasets`."""
    if not available(module):
        raise PhalanxError(
            f"{what} needs the {module!r} package, which is not installed: "
            f"pip install {module} (or pip install 'phalanx[{EXTRA}]')"
        )
    return importlib.import_module(module)
