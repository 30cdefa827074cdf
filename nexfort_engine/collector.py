"""The garbage collector's pace while the engine compiles.

A compile allocates millions of short-lived, partly cyclic Python objects (FX nodes, sympy
expressions, fake tensors, Dynamo's variable trackers). CPython's collector runs a young
collection every 700 net allocations and a full one whenever the survivors grew by a quarter, and a
full collection walks every tracked object in the process: the compile's and the host's (ComfyUI,
torch, the model's modules). On the 2-core CPU a tiny UNet's compile spent 5.5–6.4 s of about
60 s in 15 full collections of up to 1.4 s each (BENCHMARKS.md, eighteenth session).

:func:`compiling` raises the thresholds while a compiled call runs (:data:`COMPILE_THRESHOLDS`:
young collections every 50 000 allocations, full ones a hundred times rarer), and restores them
after. Garbage is still collected, in fewer, larger passes: the same tiny UNet's compile spent
2.5 s in the collector with the same peak memory (1281 against 1282 MiB), where switching the
collector off (``gc.disable``) left 220 MiB more garbage at the peak. A steady-state call makes few
Python objects, so the raised thresholds change nothing there.

:func:`settle` pays the collector's debt where it is expected: right after a call that compiled
or loaded graphs, one full collection. Under the raised thresholds no full collection runs, so
everything the compile left alive (1.7 M objects after a cold SD2.1 compile, 650 k after a warm
start) is waiting for one; with the thresholds restored it comes at the first full pass CPython
decides on, in the middle of some later sampling step. On an H100 (run156) that was one 1.53 s pause in
the eleventh timed SD2.1 sampling after a cold compile (77.6 it/s became 11.2 for that sampling) and a
0.39 s pause in PixArt's fourth (30.3 became 20.2): a stall of the user's run at a random step.
After one full collection at the end of the compiling call, CPython's next full pass waits until the
survivors grow by a quarter of that heap, which steady sampling does not do. The pass costs what
the stall did (1.5 s at SD2.1's 1.7 M objects on that host), once, inside the compile or warm start
it belongs to.

Process-wide and nestable: the first of concurrent compiled calls (threads, or a model calling
another) raises the thresholds, the last restores what was there before, unless someone else set
other thresholds meanwhile (theirs are kept). ``NEXFORT_COMPILE_GC=0`` leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Iterator

from .options import env_switch

__all__ = ["COMPILE_THRESHOLDS", "compiling", "enabled", "settle"]

#: ``gc.set_threshold`` while compiling: (young, middle, old) as CPython counts them
COMPILE_THRESHOLDS: tuple[int, int, int] = (50_000, 20, 100)

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None


def enabled() -> bool:
    """Whether :func:`compiling` changes the thresholds (``NEXFORT_COMPILE_GC``, default on)."""
    return env_switch("NEXFORT_COMPILE_GC")


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Run the body with the collector paced for a compile (see the module's docstring)."""
    global _depth, _saved
    if not enabled():
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(*COMPILE_THRESHOLDS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if gc.get_threshold() == COMPILE_THRESHOLDS and _saved is not None:
                    gc.set_threshold(*_saved)
                _saved = None


def settle() -> float:
    """One full collection after a call that compiled or loaded graphs (see the module's
    docstring); the seconds it took. Nothing with ``NEXFORT_COMPILE_GC=0``, or while another
    compiled call is still inside :func:`compiling` (a thread compiling, or an outer model calling
    this one): a full pass then would walk that compile's live objects mid-compile; if the outer call
    compiled too, its own end settles."""
    if not enabled():
        return 0.0
    with _lock:
        if _depth:
            return 0.0
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0
