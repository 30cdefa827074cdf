"""Per-thread state that torch creates only in the thread that imported a module.

What: ``torch._inductor.cudagraph_trees`` keeps its tree managers in a ``threading.local`` that it
fills when the module is imported, for the importing thread only. torch 2.11 (the device's)
then asserts in any other thread that replays a CUDA graph (``get_obj``:
``assert torch._C._is_key_in_tls(attr_name)``); torch 2.14 creates the state on first use. In
ComfyUI that other thread is real: the prompt worker runs the model, while the module may have
been imported by the prewarm thread (``prewarm.py``: seen on the H200, every compiled call fell
back to eager) or by another custom node at startup.

:func:`adopt_cudagraph_trees` gives the calling thread that state, as the module does for its
importer (its ``_initialize_tls`` where torch has it, else the same two attributes and TLS
entries). The compiled module calls it before a compiled call.

:func:`join` joins a thread and then waits until its OS thread has finished too. ``Thread.join``
returns while the OS thread is still tearing down its C++ thread-local state; a process that exits
then can abort in torch's native teardown (``terminate called without an active exception``,
SIGABRT). Seen on CPU with torch 2.14 after a thread imported ``torch._inductor``: 5 of 120 exits
under load, 0 of 120 with :func:`join`.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

__all__ = ["adopt_cudagraph_trees", "join"]

_KEYS = ("tree_manager_containers", "tree_manager_locks")


def adopt_cudagraph_trees() -> bool:
    """Create CUDA-graph trees' per-thread state in this thread when it lacks it. Returns whether
    it had to (False: the module is not imported, or this thread has the state)."""
    ct = sys.modules.get("torch._inductor.cudagraph_trees")
    local = getattr(ct, "local", None)
    if local is None or hasattr(local, _KEYS[0]):
        return False
    import torch

    if torch._C._is_key_in_tls(_KEYS[0]):  # copied from a parent thread by autograd
        return False
    init = getattr(ct, "_initialize_tls", None)
    if init is not None:
        init(local)
        return True
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    for key in _KEYS:
        torch._C._stash_obj_in_tls(key, getattr(local, key))
    return True


def join(thread: threading.Thread, timeout: float | None = None) -> bool:
    """``thread.join(timeout)``, then wait (within what is left of ``timeout``, at most 5 s) until
    its OS thread has left ``/proc/self/task`` (Linux; elsewhere only the join). Returns whether
    the thread has finished."""
    t0 = time.monotonic()
    thread.join(timeout)
    if thread.is_alive():
        return False
    tid = thread.native_id
    if tid is None or not os.path.isdir("/proc/self/task"):
        return True
    left = 5.0 if timeout is None else min(5.0, max(0.0, timeout - (time.monotonic() - t0)))
    deadline = time.monotonic() + left
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.002)
    return True
