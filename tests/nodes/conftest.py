"""In-process ComfyUI for the glue tests, and the pack's ``nodes/patcher.py`` loaded under its own name.

ComfyUI has a top-level ``nodes`` module of its own, so the pack's ``nodes`` package is never
imported as ``nodes`` here: ``patcher.py`` (which needs only torch, the engine and, lazily,
``comfy``) is loaded from its file as ``_nexfort_nodes_patcher``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


import nexfort_engine  # noqa: E402


@pytest.fixture(scope="session")
def patcher(comfy_inproc):
    name = "_nexfort_nodes_patcher"
    spec = importlib.util.spec_from_file_location(name, REPO / "nodes" / "patcher.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def nx_cache_env(tmp_path_factory, monkeypatch):
    """The pack's cache root (``$NEXFORT_CACHE_DIR``) in a session temp dir, never the user's."""
    root = tmp_path_factory.getbasetemp() / "nexfort_nodes_cache"
    root.mkdir(exist_ok=True)
    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(root))
    return root


@pytest.fixture
def fresh_stats():
    nexfort_engine.reset_stats()
    yield nexfort_engine.stats
    nexfort_engine.reset_stats()
