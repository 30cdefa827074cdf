"""ComfyUI side of nexfort: thin V3 nodes over nexfort_engine (imported only inside ComfyUI)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io
from typing_extensions import override

from .cache_manager import NexfortCacheManager
from .compile_controlnet import NexfortCompileControlNet
from .compile_model import NexfortCompileModel
from .compile_vae import NexfortCompileVAE

NODES: list[type[io.ComfyNode]] = [NexfortCompileModel, NexfortCompileVAE, NexfortCompileControlNet,
                                   NexfortCacheManager]


class NexfortExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        try:
            from .routes import register_routes
        except ImportError:  # routes are optional (no server in-process)
            pass
        else:
            register_routes()
        from .prewarm import register_prewarm

        register_prewarm()
        return NODES


async def comfy_entrypoint() -> NexfortExtension:
    return NexfortExtension()
