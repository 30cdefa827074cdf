"""HTTP routes that expose nexfort's counters to the browser: ``GET /nexfort/stats``.

The web extension (``web/nexfort.js``) polls this route to draw status badges on our nodes; tests
read it too, so the UI, the Cache Manager and the tests all see the same counters.

The route always answers 200 with the same JSON shape, even when the engine or the cache cannot be
read (an import failure, a half-written index): missing parts come back as empty values and the
reason goes into ``errors``. That keeps the front end free of special cases.

Registration is explicit and idempotent: ``nodes/__init__.py`` calls :func:`register_routes` once
ComfyUI's ``PromptServer`` exists; calling it again (a reload, a second import path) adds nothing.
ComfyUI mirrors every route under ``/api`` when the server starts, so the front end reaches it as
``api.fetchApi("/nexfort/stats")``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial
from typing import Any

logger = logging.getLogger(__name__)

STATS_PATH = "/nexfort/stats"

_ENGINE_COUNTERS: dict[str, Any] = {
    "compiles": 0,
    "recompiles": 0,
    "recompile_reasons": [],
    "cache_hits": 0,
    "cache_misses": 0,
    "fallbacks": 0,
    "fallback_reasons": [],
    "graph_breaks": 0,
    "graph_break_reasons": [],
    "cudagraph_skips": 0,
    "static_first_eager_calls": 0,
    "eager_calls": 0,
    "compile_seconds": 0.0,
    "models": {},
}

_registered = False


def empty_engine_stats() -> dict[str, Any]:
    """The engine's stats shape with every counter at zero (what the route sends without an engine)."""
    return {k: (type(v)() if isinstance(v, (list, dict)) else v) for k, v in _ENGINE_COUNTERS.items()}


def engine_stats() -> dict[str, Any]:
    """``nexfort_engine.stats()`` merged over the zero shape, so every key is always present."""
    # Absolute import, like the rest of the pack (nodes/patcher.py): one module, one set of counters.
    import nexfort_engine

    stats = empty_engine_stats()
    stats.update(nexfort_engine.stats())
    return stats


def cache_listing() -> list[dict[str, Any]]:
    """Entries of the persistent compile cache (``key``, ``label``, ``size_bytes``, ``hits``, ``last_used``)."""
    from nexfort_engine.cache import CacheStore

    from .patcher import cache_root

    return list(CacheStore(cache_root()).list())


def collect_stats() -> dict[str, Any]:
    """The body of ``GET /nexfort/stats``:
    ``{"engine": {...}, "cache": [...], "cache_dir": str | None, "prewarm": {...}, "errors": [...]}``."""
    errors: list[str] = []
    try:
        from .patcher import cache_root

        cache_dir: str | None = cache_root()
    except Exception as e:  # noqa: BLE001
        errors.append(f"cache_dir: {type(e).__name__}: {e}")
        cache_dir = None
    try:
        engine = engine_stats()
    except Exception as e:  # noqa: BLE001 - the route must answer whatever the engine does
        logger.debug("nexfort stats: engine unavailable", exc_info=True)
        errors.append(f"engine: {type(e).__name__}: {e}")
        engine = empty_engine_stats()
    try:
        cache = cache_listing()
    except Exception as e:  # noqa: BLE001 - same: a missing or broken cache is an empty listing
        logger.debug("nexfort stats: cache listing unavailable", exc_info=True)
        errors.append(f"cache: {type(e).__name__}: {e}")
        cache = []
    try:
        from nexfort_engine import prewarm

        prewarm_status: dict[str, Any] = prewarm.status()
    except Exception as e:  # noqa: BLE001
        errors.append(f"prewarm: {type(e).__name__}: {e}")
        prewarm_status = {}
    return {"engine": engine, "cache": cache, "cache_dir": cache_dir, "prewarm": prewarm_status, "errors": errors}


async def get_stats(request) -> Any:
    """aiohttp handler for ``GET /nexfort/stats`` (disk reads run off the event loop)."""
    from aiohttp import web

    body = await asyncio.to_thread(collect_stats)
    return web.json_response(
        body, dumps=partial(json.dumps, default=str), headers={"Cache-Control": "no-store"}
    )


def register_routes(routes=None) -> bool:
    """Add our routes to ComfyUI's route table (``PromptServer.instance.routes`` by default).

    Idempotent: returns ``True`` when the routes were added by this call, ``False`` when they were
    already there or there is no server (plain Python, tests without a host).
    Must run before the server starts (ComfyUI freezes the table in ``add_routes``); custom-node
    import time is before that.
    """
    global _registered
    if routes is None:
        try:
            from server import PromptServer
        except ImportError:
            logger.debug("nexfort routes: ComfyUI's server module is not importable; no routes added")
            return False
        instance = getattr(PromptServer, "instance", None)
        if instance is None:
            logger.debug("nexfort routes: no PromptServer instance yet; no routes added")
            return False
        routes = instance.routes
        if _registered:
            return False
    if any(getattr(r, "path", None) == STATS_PATH and getattr(r, "method", None) == "GET" for r in routes):
        _registered = True
        return False
    routes.get(STATS_PATH)(get_stats)
    _registered = True
    logger.debug("nexfort routes: registered GET %s", STATS_PATH)
    return True
