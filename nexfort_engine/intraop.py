"""The caller's intra-op thread count while a background compile's child runs.

What: while a child of this process compiles in the background (:mod:`nexfort_engine.background`,
the dynamic graph behind a static first graph or a ``"background": true`` compile), the
calling thread runs with one intra-op thread *between* compiled calls. Each compiled call runs
with the count the thread had before (:func:`compiled_call`), and once no child compiles any
more, the count is the thread's own again for good.

Why: torch's CPU kernels run on libgomp's thread pool, and libgomp's default wait policy has each
pool thread spin for about 300 000 pauses after every parallel region before it sleeps. ComfyUI's
sampler runs CPU ops on the prompt's conditioning in every step (py-spy found the sampling thread
in ``CONDCrossAttn.concat`` and ``to_device_async``; our reading: tensors above ATen's grain size,
so parallel regions), which kept 15
threads of a 16-core host spinning at nice 0: 1,200 % CPU for the sampling process (run207). Alone
that costs nothing visible. Beside a child compiling at nice 10 it held SD2.1's sampling, bound by
the host, at 34 it/s instead of 80 and made the child take 78 s instead of 42 s (run214, with and
without this module). With one thread no parallel region starts, and the pool sleeps.

Why not once for the whole compile: the count is part of Dynamo's global-state guard
(``GLOBAL_STATE changed: num_threads``). A graph compiled under one count does not run under
another: Dynamo recompiles, and a static-first graph's guards fail and the call runs eager
(runs 210 and 212). So each compiled call gets the thread's count back for its duration, and a background
child compiles with the caller's count (``background._spawn``).

Where this does not reach: CPU work of other threads, and the calling thread's CPU work after its
last compiled call until its next one (the count is given back at that call once the child is
done). ``OMP_WAIT_POLICY=PASSIVE`` in ComfyUI's environment stops the spinning for the whole process;
libgomp reads it when it loads, before any custom node runs, so the engine cannot set it.

Twin: ``NEXFORT_QUIET_OMP=0`` leaves the count alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch

from . import background
from .options import env_switch

__all__ = ["compiled_call", "enabled", "saved_count"]

log = logging.getLogger(__name__)

_local = threading.local()


def enabled() -> bool:
    """Whether the count drops between calls while a child compiles (``NEXFORT_QUIET_OMP``, default on)."""
    return env_switch("NEXFORT_QUIET_OMP")


def saved_count() -> int | None:
    """The calling thread's own count while it runs with one thread between calls, else ``None``."""
    return getattr(_local, "saved", None)


@contextlib.contextmanager
def compiled_call() -> Iterator[None]:
    """Around a compiled module's call: the thread's own count inside, one thread after it while a
    background child compiles (nested calls: the outermost decides)."""
    depth = getattr(_local, "depth", 0)
    saved = saved_count()
    if depth == 0 and saved is not None:
        torch.set_num_threads(saved)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _after_call()


def _after_call() -> None:
    saved = saved_count()
    if enabled() and background.compiling():
        if saved is None:
            saved = torch.get_num_threads()
            if saved <= 1:
                return
            _local.saved = saved
            log.info("nexfort: one intra-op thread between compiled calls while a background compile runs "
                     "(%d in each call and afterwards)", saved)
        torch.set_num_threads(1)
    elif saved is not None:  # the call ran with it already
        _local.saved = None
