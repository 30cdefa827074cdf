"""``nodes/routes.py`` without a ComfyUI server: registration is idempotent and ``GET /nexfort/stats``
always answers the same JSON shape, from the engine's real counters or from empty values.

``nodes/`` is loaded inside a throw-away package (``_nexfort_pack``) without running
``nodes/__init__.py`` (that needs ComfyUI); the route reads the same ``nexfort_engine`` counters
the rest of the pack bumps.
"""

from __future__ import annotations

import asyncio
import importlib
import sys

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from pack_modules import nodes_module

ENGINE_KEYS = {"compiles", "recompiles", "recompile_reasons", "cache_hits", "cache_misses", "fallbacks",
               "fallback_reasons", "cudagraph_skips", "static_first_eager_calls", "eager_calls", "graph_breaks",
               "graph_break_reasons", "compile_seconds", "models"}


@pytest.fixture
def routes():
    # nodes/__init__.py is not executed (that needs ComfyUI)
    with nodes_module("routes") as mod:
        yield mod


def _get(route_table: web.RouteTableDef, path: str) -> tuple[int, dict]:
    async def go():
        app = web.Application()
        app.add_routes(route_table)
        async with TestServer(app) as srv, ClientSession() as s, s.get(srv.make_url(path)) as r:
            return r.status, await r.json()

    return asyncio.run(go())


def test_register_routes_is_idempotent(routes):
    table = web.RouteTableDef()
    assert routes.register_routes(table) is True
    assert routes.register_routes(table) is False
    assert [(r.method, r.path) for r in table] == [("GET", "/nexfort/stats")]


def test_register_routes_without_comfyui_is_a_no_op(routes, monkeypatch):
    monkeypatch.setitem(sys.modules, "server", None)  # `from server import PromptServer` -> ImportError
    assert routes.register_routes() is False


def test_stats_route_serves_engine_counters(routes, monkeypatch, tmp_path):
    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    stats = importlib.import_module("nexfort_engine.counters")
    stats.reset()
    stats.set_info("unet", node_id="7", state="compiled")
    stats.bump("unet", "compiles")
    stats.bump("unet", "cache_hits", 2)
    listing = [{"key": "k1", "label": "unet", "size_bytes": 123, "hits": 2, "last_used": 1.0}]
    monkeypatch.setattr(routes, "cache_listing", lambda: listing)
    table = web.RouteTableDef()
    routes.register_routes(table)
    try:
        status, body = _get(table, "/nexfort/stats")
    finally:
        stats.reset()
    assert status == 200
    assert body["errors"] == []
    assert body["cache_dir"] == str(tmp_path)
    assert ENGINE_KEYS <= set(body["engine"])
    assert body["engine"]["compiles"] == 1 and body["engine"]["cache_hits"] == 2
    unet = body["engine"]["models"]["unet"]
    assert unet["state"] == "compiled" and unet["node_ids"] == ["7"] and unet["cache_hits"] == 2
    assert body["cache"] == listing


def test_stats_route_answers_when_engine_and_cache_fail(routes, monkeypatch, tmp_path):
    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    def boom():
        raise ImportError("no engine here")

    monkeypatch.setattr(routes, "engine_stats", boom)
    monkeypatch.setattr(routes, "cache_listing", lambda: (_ for _ in ()).throw(OSError("index unreadable")))
    table = web.RouteTableDef()
    routes.register_routes(table)
    status, body = _get(table, "/nexfort/stats")
    assert status == 200
    assert body["engine"] == routes.empty_engine_stats()
    assert set(body["engine"]) == ENGINE_KEYS
    assert body["cache"] == []
    assert len(body["errors"]) == 2 and "no engine here" in body["errors"][0]
    assert "index unreadable" in body["errors"][1]


def test_empty_engine_stats_carry_every_engine_counter(routes):
    """The route's zero shape names every counter the engine reports, so a new counter (like
    ``cudagraph_skips``) reaches the badge as 0, not as a missing key, when the engine is absent."""
    counters = importlib.import_module("nexfort_engine.counters")
    counters.reset()
    engine = counters.snapshot()
    not_shown = {"calls", "corrupt_entries"}  # internal counters the badge and the summary never read
    missing = set(counters.COUNTERS) - not_shown - set(routes.empty_engine_stats())
    assert not missing, f"route zero shape lacks engine counters {sorted(missing)}"
    assert set(routes.empty_engine_stats()) <= set(engine)


def test_empty_engine_stats_are_fresh_objects(routes):
    a = routes.empty_engine_stats()
    a["models"]["x"] = {}
    a["recompile_reasons"].append("y")
    assert routes.empty_engine_stats()["models"] == {} and routes.empty_engine_stats()["recompile_reasons"] == []
