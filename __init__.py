"""nexfort for ComfyUI: compile diffusion models and VAEs with torch.compile/Inductor/Triton.

Importable anywhere: inside ComfyUI it exposes the V3 ``comfy_entrypoint`` and ``WEB_DIRECTORY``;
outside ComfyUI (plain Python, tests) it imports cleanly and exposes nothing ComfyUI-specific.
Importing starts no CUDA and needs no Triton.
"""

import os
import sys

WEB_DIRECTORY = "./web"

# A user clones this pack into custom_nodes/: make the embedded engine importable as the
# top-level `nexfort_engine` (one copy, one set of counters). Appended, so ComfyUI's own
# modules (its `nodes.py`) always win over our `nodes/` package name.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.append(_here)

try:  # ComfyUI is importable only inside a ComfyUI host.
    import comfy_api.latest  # noqa: F401
except ImportError:  # pragma: no cover - exercised by tests/test_lean_import.py
    _IN_COMFY = False
else:
    _IN_COMFY = True

if _IN_COMFY:
    from .nodes import comfy_entrypoint  # noqa: F401

__all__ = ["WEB_DIRECTORY"]
