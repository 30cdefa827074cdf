"""nexfort for ComfyUI: compile diffusion models and VAEs with torch.compile/Inductor/Triton.

Importable anywhere: inside ComfyUI it exposes the V3 ``comfy_entrypoint`` and ``WEB_DIRECTORY``;
outside ComfyUI (plain Python, tests) it imports cleanly and exposes nothing ComfyUI-specific.
Importing starts no CUDA and needs no Triton.
"""

import logging
import os
import re
import sys
from importlib import metadata

WEB_DIRECTORY = "./web"

#: The oldest torch and Triton the pack supports (pyproject's dependencies say the same; the tests
#: check both agree).
MIN_VERSIONS = {"torch": (2, 11), "triton": (3, 0)}

_logger = logging.getLogger(__name__)


def _release(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``: the leading numbers of a version string."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("-")[0])[:3])


def version_problems(version=metadata.version) -> list[str]:
    """One message per installed torch/Triton older than :data:`MIN_VERSIONS`, with the fix.

    Reads package metadata only (nothing is imported, no CUDA starts). Triton is optional (CPU-only
    installs have none; Windows has ``triton-windows``): it is checked only where installed.
    """
    problems = []
    for package, minimum in MIN_VERSIONS.items():
        names = (package, "triton-windows") if package == "triton" else (package,)
        for name in names:
            try:
                found = version(name)
            except metadata.PackageNotFoundError:
                continue
            if _release(found) < minimum:
                want = ".".join(map(str, minimum))
                problems.append(
                    f"nexfort needs {package} >= {want}, found {name} {found}: compiled nodes may fail and run "
                    f"uncompiled. Update this ComfyUI's torch as ComfyUI's install guide says (with the CUDA "
                    f"index URL; its Triton comes with it).")
            break
    return problems

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
    for _problem in version_problems():
        _logger.warning(_problem)
    from .nodes import comfy_entrypoint  # noqa: F401

__all__ = ["WEB_DIRECTORY"]
