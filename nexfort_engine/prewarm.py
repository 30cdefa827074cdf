"""Prewarm: import the compile stack's modules in a background thread before the first compiled call.

What: a process's first compiled call imports hundreds of modules that a ComfyUI startup did not
(on the 2-core CPU box, tiny Flux: 745, mostly Inductor, AOTAutograd, networkx and sympy's
solvers; on the H200 the profile of a Flux warm start showed ``torch._inductor.inductor_prims``
alone at 3.3 s under cProfile). :func:`record` keeps the names a first call imported, in import
order, in ``<cache root>/prewarm.json``; :func:`start` imports them in a daemon thread, so a
restarted ComfyUI pays them while it loads the checkpoint instead of inside the first sampling.
The nodes start it when a prompt is queued (every custom node has loaded by then).

Safety:

* Only modules of the libraries in :data:`PACKAGES` (no host code, no custom nodes, no kernel
  modules Inductor generated: those have hash names and are never listed), and none that set up
  per-thread state when imported (:data:`THREAD_BOUND`: CUDA-graph trees; with torch 2.11 every
  compiled call fell back to eager on the H200 when the prewarm thread had imported them. The
  compiled module also gives its thread that state if another thread imported them anyway:
  ``threads.py``).
* A compiled call waits for a running prewarm before it compiles (:func:`wait`, at most
  :data:`WAIT_S`), so the thread and Dynamo never import the same modules at once.
* Each import is tried on its own; one that fails is counted and skipped. A ``prewarm.json``
  that does not parse is removed (rebuilt by the next first call).
* ``NEXFORT_PREWARM=0`` turns it off.

Twin: the same imports without the thread (``start(..., background=False)``) - what a first call
does itself when there is no prewarm.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import threads
from .cache.store import atomic_write_json
from .options import env_switch

log = logging.getLogger(__name__)

ENV_PREWARM = "NEXFORT_PREWARM"
FILE = "prewarm.json"
VERSION = 1
#: top-level packages whose modules may be prewarmed: the compile stack and its dependencies
PACKAGES = frozenset({"torch", "functorch", "sympy", "mpmath", "networkx", "triton", "jinja2", "markupsafe",
                      "filelock", "cudnn"})
#: modules that set up per-thread state when imported (threads.py): left to the compiling thread
THREAD_BOUND = frozenset({"torch._inductor.cudagraph_trees"})
#: the longest a compile waits for a running prewarm (seconds; a whole prewarm took 1.7 s on an H200 host)
WAIT_S = 120.0
#: more names than a first call imports (about 750 on the CPU box); keeps a damaged list small
MAX_MODULES = 5000

_lock = threading.Lock()
_thread: threading.Thread | None = None
_status: dict[str, Any] = {"state": "idle", "listed": 0, "imported": 0, "present": 0, "failed": 0, "seconds": 0.0}


def enabled() -> bool:
    return env_switch(ENV_PREWARM)


def allowed(name: str) -> bool:
    """A module name prewarm may import: in :data:`PACKAGES`, every part an identifier, no hash
    names (Inductor's generated modules, e.g. ``torch._inductor.runtime.compile_tasks.<hash>``)."""
    parts = name.split(".")
    return (parts[0] in PACKAGES and all(p.isidentifier() and len(p) < 40 for p in parts)
            and "__main__" not in parts and name not in THREAD_BOUND)


def _path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / FILE


def load(root: str | os.PathLike[str]) -> list[str]:
    """The recorded names (allowed ones only); [] when there is no list. A list that does not
    parse is removed, so the next first call writes a good one."""
    path = _path(root)
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != VERSION or not isinstance(doc.get("modules"), list):
            raise ValueError(f"expected version {VERSION} with a list of modules")
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as e:
        log.warning("nexfort: prewarm list %s is unreadable (%s); removed, the next compile rebuilds it", path, e)
        try:
            path.unlink()
        except OSError:
            pass
        return []
    return [m for m in doc["modules"] if isinstance(m, str) and allowed(m)][:MAX_MODULES]


def record(root: str | os.PathLike[str] | None, before: set[str] | frozenset[str]) -> list[str]:
    """Add the allowed modules imported since ``before`` (a ``set(sys.modules)`` taken before a
    first call) to the list under ``root``. Returns the names added."""
    if root is None:
        return []
    new = [m for m in list(sys.modules) if m not in before and allowed(m)]
    if not new:
        return []
    with _lock:
        names = load(root)
        known = set(names)
        added = [m for m in new if m not in known]
        if added:
            try:
                Path(root).mkdir(parents=True, exist_ok=True)
                atomic_write_json(_path(root), {"version": VERSION, "torch": _torch_version(),
                                                "modules": (names + added)[:MAX_MODULES]})
            except OSError as e:  # read-only cache dir: prewarm is an optimisation
                log.info("nexfort: could not write the prewarm list (%s)", e)
                return []
    return added


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", ""))


def _import_all(names: list[str]) -> None:
    t0 = time.perf_counter()
    for name in names:
        if name in sys.modules:  # imported meanwhile, by an earlier name of the list
            _status["present"] += 1
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optimisation: a module that does not import is skipped
            _status["failed"] += 1
            log.debug("nexfort: prewarm could not import %s: %s", name, e)
        else:
            _status["imported"] += 1
    _status["seconds"] = round(time.perf_counter() - t0, 3)
    _status["state"] = "done"
    log.info("nexfort: prewarm imported %d module(s) in %.1fs (%d failed)", _status["imported"],
             _status["seconds"], _status["failed"])


def start(root: str | os.PathLike[str] | None, background: bool = True) -> bool:
    """Import the modules recorded under ``root`` (once per process; in a daemon thread unless
    ``background`` is False). Returns whether a prewarm started."""
    global _thread
    if root is None or not enabled():
        return False
    with _lock:
        if _status["state"] != "idle":
            return False
        names = [m for m in load(root) if m not in sys.modules]
        _status.update(state="running", listed=len(names))
        if not background:
            _import_all(names)
            return True
        _thread = threading.Thread(target=_import_all, args=(names,), name="nexfort-prewarm", daemon=True)
        _thread.start()
    return True


def wait(timeout: float | None = WAIT_S) -> bool:
    """Block until a running prewarm has finished (called before a compile), at most ``timeout``
    seconds: a compile is never held up longer by an import that does not return. Returns
    whether no prewarm is running any more."""
    t = _thread
    if t is None or t is threading.current_thread():
        return True
    if not t.is_alive():
        return threads.join(t, 1.0)  # its OS thread may still be tearing down (threads.join)
    t0 = time.perf_counter()
    if not threads.join(t, timeout):
        log.warning("nexfort: the prewarm is still importing after %.0fs; compiling without waiting for it",
                    time.perf_counter() - t0)
        return False
    log.debug("nexfort: waited %.2fs for the prewarm", time.perf_counter() - t0)
    return True


def status() -> dict[str, Any]:
    """``state`` (idle, running, done), ``listed`` (names not imported when it started),
    ``imported``, ``present`` (imported meanwhile by an earlier name), ``failed``, ``seconds``."""
    return dict(_status)


def reset() -> None:
    """Forget this process's prewarm (tests)."""
    global _thread
    wait(None)
    with _lock:
        _thread = None
        _status.update(state="idle", listed=0, imported=0, present=0, failed=0, seconds=0.0)
