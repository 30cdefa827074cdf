"""Start the engine's prewarm (``nexfort_engine.prewarm``) when ComfyUI receives its first prompt.

By then every custom node has loaded (no import of theirs runs beside the prewarm thread), and
the prompt's checkpoint loading overlaps the prewarm's imports. Registered once, with ComfyUI's
``PromptServer.add_on_prompt_handler``; the handler returns the prompt unchanged and never fails it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def on_prompt(json_data: Any) -> Any:
    """ComfyUI's on-prompt handler: start the prewarm (once per process), pass the prompt on."""
    try:
        from nexfort_engine import prewarm

        from .patcher import cache_root

        if prewarm.status()["state"] == "idle":
            prewarm.start(cache_root())
    except Exception:  # noqa: BLE001 - an optimisation must not fail the user's prompt
        logger.debug("nexfort: prewarm did not start", exc_info=True)
    return json_data


def register_prewarm(server: Any = None) -> bool:
    """Add :func:`on_prompt` to the server's on-prompt handlers (``PromptServer.instance`` by
    default). Idempotent; False without a server (plain Python, tests without a host)."""
    if server is None:
        try:
            from server import PromptServer
        except ImportError:
            return False
        server = getattr(PromptServer, "instance", None)
    if server is None or not hasattr(server, "add_on_prompt_handler"):
        return False
    if on_prompt in getattr(server, "on_prompt_handlers", []):
        return False
    server.add_on_prompt_handler(on_prompt)
    return True
