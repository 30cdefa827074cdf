"""32-bit symbolic sizes in Inductor's Triton kernels where the kernel already indexes in 32 bits.

What: :func:`int32_size_args` is a context manager that, around one Inductor compile, types the
symbolic size arguments of generated Triton kernels (``ks0``, ``ks1``, ...) as ``i32`` whenever
Inductor chose 32-bit indexing for that kernel, instead of always ``i64``.

Why: under dynamic shape every index that splits a flat position by a symbolic extent
(``x // (H*W)``, ``x % C``-like terms with ``H*W`` symbolic) divides by a kernel argument.
Inductor types those arguments ``i64`` unconditionally (``signature_to_meta``: "risky to use
tl.int32 ... we may have ks0*ks1 later"), so each such division is a 64-bit integer division,
which a GPU emulates in dozens of instructions. On an H200, SD2.1 768²'s nearest-upsample kernel
took 167 us per call under dynamic shape (about 8 us of memory traffic), and the dynamic graph
spent 4.8 ms per step in Triton kernels against 3.5 ms for the static one (BENCHMARKS.md, seventh
and eighth sessions). With the arguments in 32 bits those divisions take the 32-bit path.
Measured (same call, with the eighth session's layout fixes): SD2.1 768² O2 76.3 -> 78.9 it/s,
Triton kernels 3.27 -> 2.91 ms per step.

Why it is safe: Inductor picks 32-bit indexing for a kernel only after proving, or guarding, that
its element count and every buffer it touches fit in ``int32`` (``can_use_32bit_indexing``; a
larger shape fails the guard and recompiles with 64-bit indexing). Every product of sizes a
kernel's index expressions form is bounded by those extents. Templates (matmul, attention) keep
Inductor's choice. The reference is the same compile without this: the same integer arithmetic
on the same values, only in 32 bits, so the float results do not change (SD2.1 768² on an H200:
the same max error against eager with and without it, BENCHMARKS.md, eighth session). The
kernels need a GPU; the CPU tests check the typing decision where Inductor makes it.

Scope: only the compile it wraps (module attributes restored on exit; compiles hold the engine's
compile lock). The flag is part of the cache key (:meth:`nexfort_engine.settings.Settings.digest`):
the FX-graph cache does not see this patch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

__all__ = ["int32_size_args", "wanted"]

#: the modules whose pointwise/reduction kernels' signatures are typed, each importing
#: ``signature_to_meta`` by name (imported before patching, so none binds the wrapper for good);
#: templates (select_algorithm) and user Triton kernels (wrapper) keep Inductor's typing
_CODEGEN_MODULES = ("torch._inductor.codegen.triton", "torch._inductor.codegen.triton_combo_kernel")


def wanted(option: bool | None, *, cuda: bool, dynamic: bool) -> bool:
    """The option when set; auto (``None``): on for Inductor's GPU (Triton) kernels under dynamic
    shape, the only case with symbolic size arguments."""
    if option is not None:
        return option
    return cuda and dynamic


def _patched(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def signature_to_meta(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("size_dtype") != "tl.int32" or kwargs.get("is_template", False):
            return original(*args, **kwargs)
        from torch._inductor import config

        # Inductor types ``ks*`` arguments like the kernel's index dtype exactly when block
        # pointers are on (they cannot index in 64 bits); only that decision reads the flag here
        with config.patch({"triton.use_block_ptr": True}):
            return original(*args, **kwargs)

    signature_to_meta.__nexfort_original__ = original  # type: ignore[attr-defined]
    return signature_to_meta


@contextlib.contextmanager
def int32_size_args(enabled: bool = True) -> Iterator[None]:
    """Around one Inductor compile: 32-bit ``ks*`` kernel arguments where the kernel indexes in
    32 bits (see the module docstring). A no-op when ``enabled`` is false or this torch's codegen
    has no ``signature_to_meta`` to wrap."""
    if not enabled:
        yield
        return
    import importlib

    holders = []
    for name in _CODEGEN_MODULES:
        try:
            holders.append(importlib.import_module(name))
        except ImportError:
            continue
    holders = [m for m in holders if callable(getattr(m, "signature_to_meta", None))]
    originals = [m.signature_to_meta for m in holders]  # type: ignore[attr-defined]
    for mod, original in zip(holders, originals, strict=True):
        if not hasattr(original, "__nexfort_original__"):  # not already wrapped (nested use)
            mod.signature_to_meta = _patched(original)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for mod, original in zip(holders, originals, strict=True):
            mod.signature_to_meta = original  # type: ignore[attr-defined]
