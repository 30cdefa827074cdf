"""In-process ComfyUI for the glue tests, and the pack's ``nodes/patcher.py`` loaded under its own name.

ComfyUI has a top-level ``nodes`` module of its own, so the pack's ``nodes`` package is never
imported as ``nodes`` here: ``patcher.py`` (which needs only torch, the engine and, lazily,
``comfy``) is loaded through ``pack_modules.nodes_module`` under a throw-away package name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


import nexfort_engine  # noqa: E402


@pytest.fixture(scope="session")
def patcher(comfy_inproc):
    from pack_modules import nodes_module

    with nodes_module("patcher", pkg="_nexfort_pack_nodes_tests") as mod:
        yield mod


@pytest.fixture(autouse=True)
def nx_cache_env(pack_cache_env):
    """Every node test: the pack's cache root in a session temp dir (``pack_cache_env``)."""
    return pack_cache_env


@pytest.fixture
def fresh_stats():
    nexfort_engine.reset_stats()
    yield nexfort_engine.stats
    nexfort_engine.reset_stats()
