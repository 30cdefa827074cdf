"""nexfort for ComfyUI: compile diffusion models and VAEs with torch.compile/Inductor/Triton.

Importable anywhere: inside ComfyUI it exposes the V3 ``comfy_entrypoint`` and ``WEB_DIRECTORY``;
outside ComfyUI (plain Python, tests) it imports cleanly and exposes nothing ComfyUI-specific.
Importing starts no CUDA and needs no Triton.
"""

WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

try:  # ComfyUI is importable only inside a ComfyUI host.
    import comfy_api.latest  # noqa: F401
except ImportError:  # pragma: no cover - exercised by tests/test_lean_import.py
    _IN_COMFY = False
else:
    _IN_COMFY = True

if _IN_COMFY:
    from .nodes import comfy_entrypoint  # noqa: F401

__all__ = ["WEB_DIRECTORY", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]
