"""Load one module of the pack's ``nodes/`` package without running ``nodes/__init__.py`` (which
registers the nodes with ComfyUI): the package is mounted under a throw-away name, so its
relative imports (``from .patcher import ...``) work, and removed again afterwards."""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def nodes_module(name: str, pkg: str = "_nexfort_pack") -> Iterator[ModuleType]:
    """``nodes/<name>.py`` imported as ``<pkg>.nodes.<name>`` for the duration of the block."""
    pack = types.ModuleType(pkg)
    pack.__path__ = [str(REPO)]
    sub = types.ModuleType(f"{pkg}.nodes")
    sub.__path__ = [str(REPO / "nodes")]
    sys.modules[pkg], sys.modules[f"{pkg}.nodes"] = pack, sub
    try:
        yield importlib.import_module(f"{pkg}.nodes.{name}")
    finally:
        for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[mod]
