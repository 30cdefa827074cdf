"""Fixtures for the engine tests: a session-wide nexfort cache, fresh counters, the tiny zoo.

The engine never imports ComfyUI, but the dynamic-shape tests drive it through ComfyUI's own
model classes and sampler, in this process (``tiny_models.boot``). Tests that need the host are
skipped, with the fix, where it is missing. Compiles that check logic use ``backend: eager``;
real Inductor compiles carry ``@pytest.mark.inductor`` and share one cache dir per session so an
identical compile in a later test is a cache hit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import tiny_models  # noqa: E402

import nexfort_engine  # noqa: E402


@pytest.fixture(scope="session")
def nx_cache(tmp_path_factory) -> Path:
    """One nexfort cache root for the whole session (identical compiles hit)."""
    return tmp_path_factory.mktemp("nexfort_engine_cache")


@pytest.fixture(autouse=True)
def intra_op_threads():
    """The intra-op thread count as the test found it: a test that ends while a background child
    still compiles (or fails midway) leaves one thread between calls (intraop.py)."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    from nexfort_engine import intraop

    intraop._local.saved = None
    intraop._local.depth = 0


@pytest.fixture
def fresh_stats():
    """Engine counters zeroed before the test (they are process-wide)."""
    nexfort_engine.reset_stats()
    yield nexfort_engine.stats
    nexfort_engine.reset_stats()


@pytest.fixture(scope="session")
def zoo(comfy_inproc):
    """name -> tiny ModelPatcher, built once per session (tests must not mutate them)."""
    return {name: build() for name, build in tiny_models.FAMILIES.items()}


@pytest.fixture
def patcher(comfy_inproc, pack_cache_env):
    """The node layer's ``nodes/patcher.py`` (it compiles a ComfyUI ModelPatcher's model), its
    cache root in a session temp dir, never the host's user directory."""
    from pack_modules import nodes_module

    with nodes_module("patcher", pkg="_nexfort_pack_engine") as mod:
        yield mod


@pytest.fixture
def clean_dynamo(monkeypatch):
    """No cache dir from the environment, and Dynamo's caches and counters reset around the test
    (graph counts are compared; test_regional.py has its own, with fresh counters too)."""
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cache():
    """The process-wide fp8 weight cache (nexfort_engine.fp8.CACHE), empty before and after the test."""
    from nexfort_engine.fp8 import CACHE, clear_cache

    clear_cache()
    CACHE.stats.update(dict.fromkeys(CACHE.stats, 0))
    yield CACHE
    clear_cache()


@pytest.fixture
def resolve_kwargs(monkeypatch) -> dict:
    """What the compiled module passes to ``settings.resolve`` about its model and device (the
    keyword arguments of its last call), recorded while the real function runs."""
    from nexfort_engine import compiler

    seen: dict = {}
    real = compiler.resolve

    def spy(config, **kw):
        seen.update(kw)
        return real(config, **kw)

    monkeypatch.setattr(compiler, "resolve", spy)
    return seen
