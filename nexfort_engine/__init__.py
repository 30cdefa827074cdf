"""nexfort_engine: compile diffusion backbones and VAEs with torch.compile + Inductor.

Knows torch, never ComfyUI. Public API::

    compiled = nexfort_engine.compile(module, options={"mode": "O2"}, cache_dir="/path")
    nexfort_engine.stats()   # compiles, recompiles (+reasons), cache hits/misses, fallbacks

Importing this package starts no CUDA and imports no Triton.
"""

from __future__ import annotations

from .compiler import CompiledModule, compile
from .counters import reset as reset_stats
from .counters import snapshot as stats
from .options import FLAGS, PRESETS, CompileConfig, OptionsError, parse_options

__version__ = "0.1.0"

__all__ = [
    "FLAGS",
    "PRESETS",
    "CompileConfig",
    "CompiledModule",
    "OptionsError",
    "compile",
    "parse_options",
    "reset_stats",
    "stats",
]
