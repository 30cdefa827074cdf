"""Single-pass (persistent) row reductions for wide rows: LayerNorms, the fp8 activation quantization.

What: :func:`persistent_rows` is a context manager that, around one Inductor compile, lets
Inductor's Triton codegen keep a whole row in registers ("persistent reduction") for inner
reductions up to ``limit`` elements, instead of its default 1024.

Why: the fp8 path quantizes each linear's input per row in the graph
(``amax(|x|)`` -> scale -> cast, :func:`nexfort_engine.fp8.quantize_rowwise`), fused by Inductor
with the op that produced ``x`` (GELU * gate, LayerNorm + modulation). Rows are the linears'
input features: 640-5120 on SDXL, 3072-15360 on Flux. Above 1024 Inductor emits a *looped*
reduction: one pass over the row for the amax, a second pass that recomputes the producer and
writes the fp8 values (or two kernels). Profiled on an H200 (BENCHMARKS.md, run14) those kernels
ran at 3-5x the single-pass memory-traffic time: 6 ms per SDXL step, ~12 ms per Flux step. A
persistent reduction reads the producer's inputs once. The arithmetic is the same (amax is exact
in any order), so this changes speed, not numbers.

Since the eighth session it is on for every GPU compile: a LayerNorm row wider than 1024 (SDXL's
1280-channel levels; PixArt 1152, Flux 3072) was a looped reduction too. SDXL 1024² O2 on an H200:
LayerNorm kernels 2.30 -> 1.62 ms per step, 30.5-30.6 -> 31.5 it/s, still lossless against float32
(a sum's order changes: float32 rounding, not precision). PixArt and Flux were not re-measured.

Scope: only the compile it wraps (Inductor's choices handler is thread-local and restored on
exit), only inner reductions with a static row length, never cooperative reductions or
deterministic ("strict sum") reductions whose block size Inductor fixes itself. The limit is part
of the cache key (:meth:`nexfort_engine.settings.Settings.digest`): the FX-graph cache does not
see the handler.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["DEFAULT_LIMIT", "persistent_rows", "wants_persistent"]

#: rows up to this many elements are reduced in one pass. Measured on an H200 (BENCHMARKS.md, runs
#: 14 and 20): one pass was faster up to 5120-element rows (SDXL's GEGLU: 62 -> 46 and 155 -> 80
#: us per call; LayerNorm rows of 640-3072: 1.5-1.9x) and slower for Flux's 12288-element GELU
#: rows (168 -> 200 us), so wider rows keep Inductor's looped reduction
DEFAULT_LIMIT = 8192


def _static_int(expr: Any) -> int | None:
    try:
        return int(expr)
    except (TypeError, ValueError):  # symbolic: Inductor's own heuristic decides
        return None


def wants_persistent(features: Any, cooperative: bool, limit: int) -> bool:
    """Whether a reduction with these kernel ``features`` should be persistent under ``limit``:
    an inner reduction with a static row length of at most ``limit`` elements. ``False`` means
    "Inductor's default decides", not "looped"."""
    from torch._inductor import config
    from torch._inductor.runtime.hints import ReductionHint

    if cooperative or limit <= 0 or not config.triton.persistent_reductions:
        return False
    if features.get_reduction_hint() != ReductionHint.INNER:
        return False
    strict = getattr(features, "strict_sum_rblock", None)
    if strict is not None and strict() is not None:
        return False
    n = _static_int(features.reduction_numel)
    return n is not None and n <= limit


def _choices_class() -> type:
    from torch._inductor.choices import InductorChoices

    class PersistentRowChoices(InductorChoices):  # type: ignore[misc]
        def __init__(self, limit: int) -> None:
            super().__init__()
            self.limit = limit

        def should_use_persistent_reduction(self, features: Any, cooperative_reduction: bool, *args: Any,
                                            **kwargs: Any) -> bool:
            if wants_persistent(features, cooperative_reduction, self.limit):
                return True
            return super().should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs)

        def uuid(self) -> Any:  # for hosts that key caches by the choices class
            return ("nexfort.persistent_rows", self.limit)

    return PersistentRowChoices


@contextlib.contextmanager
def persistent_rows(limit: int = DEFAULT_LIMIT) -> Iterator[None]:
    """Within this block, Inductor compiles inner reductions of rows up to ``limit`` elements as
    single-pass kernels (see the module docstring). ``limit <= 0``: no change."""
    if limit <= 0:
        yield
        return
    from torch._inductor.virtualized import V

    with V.set_choices_handler(_choices_class()(limit)):
        yield
