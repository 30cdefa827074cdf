"""Background compile: a cold compile runs in a child process while the caller keeps running eager.

What: with the ``"background": true`` option, the first call of a :class:`~nexfort_engine.compiler.CompiledModule`
whose cache entry is cold does not compile. It hands a *job* to a child Python process and runs
the call eager; so does every call until the child is done. The child (:func:`child_main`) rebuilds the module and the first call's inputs, compiles them
with the same engine code, options and cache root, and commits the cache entry as a foreground
compile would. The next call of the parent then finds a warm entry and loads it: the precompiled
graphs, or Inductor's caches under ``torch.compile`` (regional compilation).

Why: a whole UNet's cold compile takes minutes (SDXL 170 s on an H200). In the foreground the
first image waits for all of it. Here it arrives at eager speed, and the compiled speed starts
with the first step after the child finishes, for the price of a warm start (seconds) at that step.

What travels to the child (:func:`dumps`): the module and the call's arguments, pickled. Classes
and functions go by reference (the child imports them from the parent's ``sys.path``). Tensors
of at most :data:`COPY_BYTES` go with their values; larger ones (the weights) go as their
metadata (class, size, stride, dtype, device, ``requires_grad``, inference-ness) and the child
allocates them zero-filled: a trace depends on that metadata, not on the values. That costs the
child a second copy of the weights in device memory while it compiles. Graphs that bake the
weights in (the ``freezing`` flag) would bake zeros, so that flag is never compiled here. Engine
wrappers found inside the module (the node layer keeps its compiled modules in the module's
``__dict__``) travel as ``None``. A function defined inside another function travels as its code
only, where the host marked it :data:`CARRIED` (not called by the model). Whatever cannot be
pickled (a patch closure or lambda inside the inputs, a tensor subclass), or is marked
:data:`FOREGROUND` (it serves host code only the host's process has), raises
:class:`Unavailable`, and the caller compiles in the foreground instead.

The child watches its parent and exits when the parent does. It exits at once after writing its
report (:func:`exit_now`): the parent waits for its exit (its device memory) before it loads the
compile, and a normal interpreter exit tears torch down first (1.3-1.9 s on this project's 2-core
machine, in native code; 10 s once; Inductor's compile pool, where there is one, is shut down
gracefully too). The parent terminates a child it no
longer needs (its module collected, its own exit). A child that fails to start or dies leaves no
entry behind (an entry is only trusted once committed) and the parent compiles in the
foreground. A compile that fails in the child is reported back, and the parent runs eager, as
after a failed foreground compile.

The same process plumbing (job directory, log, report, parent watch, cancellation) starts the
compile workers of :mod:`nexfort_engine.split` (:func:`start_worker`). A worker's job holds no
model: the engine's options, resolved settings and cache key. It waits for the part of the graph
the parent ships it (:mod:`nexfort_engine.ship`), compiles that part and writes it back.

Twin: the foreground compile (``"background": false``, the default), which runs the same engine
code in the caller's process.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import io
import json
import logging
import marshal
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch

log = logging.getLogger(__name__)

#: tensors up to this size travel with their values (inputs, tables); larger ones as metadata
COPY_BYTES = 1 << 20
#: under the cache root: ``<JOBS>/<entry key>/`` holds a job's input, log and result
JOBS = "jobs"
JOB_FILE = "job.pkl"
RESULT_FILE = "result.json"
LOG_FILE = "child.log"
#: a compile worker's compiled part of the graph (split.py), and the part it compiles, shipped by
#: the parent (ship.py)
PART_FILE = "part.bin"
PART_IN_FILE = "part_in.bin"
#: the child's program (``-c``: ``-m`` would run a second copy of this module as ``__main__``)
_CHILD = "import sys; from nexfort_engine.background import child_main, exit_now; exit_now(child_main(sys.argv[1]))"
#: the child's scheduling priority offset (Linux/macOS ``nice``)
NICE = 10
#: how often the child checks that its parent is still alive
PARENT_POLL_S = 1.0
#: how a child's OpenMP threads wait for work (``$NEXFORT_CHILD_OMP_WAIT_POLICY`` overrides it;
#: ``inherit``: the caller's environment as is). libgomp's default spins each thread for about
#: 300 000 pauses after every parallel region; a compile process's small CPU ops wake the whole
#: pool again and again, and the spinning threads take cores from the caller's sampling loop
#: (BENCHMARKS.md, thirty-third session). Passive threads sleep at once.
CHILD_OMP_WAIT_POLICY = "PASSIVE"
ENV_CHILD_OMP_WAIT_POLICY = "NEXFORT_CHILD_OMP_WAIT_POLICY"


#: the attribute a host sets on a function it puts among a call's inputs to be carried, not called
#: by the model (ComfyUI's wrapper of the node layer): such a function travels as a stand-in (its
#: code, no closure values; :func:`_stand_in`). Any other function defined inside another function
#: or lambda among the inputs keeps the compile in the foreground: a child would trace it without
#: its closure values and globals and save a graph that ignores them (Kohya Deep Shrink's patch reads
#: its block number and sigma range from its closure; the child's graph of it skipped the downscale
#: and the parent, whose guards match the function by name and code, ran it: BENCHMARKS.md, run272)
CARRIED = "__nexfort_carried__"
#: a class attribute of objects a call's inputs may hold that only the host's process can serve
#: (a host call's stand-in: host_call.py): the compile stays in the host's process
FOREGROUND = "__nexfort_foreground__"


class Unavailable(RuntimeError):
    """This call cannot be compiled in a child process (the message says why)."""


# -- what travels: tensors as values or as metadata -------------------------------------------


def _rebuild_tensor(cls: type, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: str,
                    requires_grad: bool, inference: bool, data: bytes | None) -> torch.Tensor:
    """The child's side of :func:`_reduce_tensor`: a tensor with the same metadata, holding the
    sent values or zeros."""
    with torch.inference_mode(inference):
        t = torch.empty_strided(size, stride, dtype=dtype, device=device)
        if data is not None:
            t.copy_(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
        else:
            t.zero_()
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _reduce_tensor(t: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    cls = type(t)
    if cls not in (torch.Tensor, torch.nn.Parameter):
        raise Unavailable(f"a tensor of class {cls.__module__}.{cls.__qualname__} (only plain tensors travel)")
    if t.device.type == "meta":
        raise Unavailable("a tensor on the meta device")
    data = None
    if t.numel() * t.element_size() <= COPY_BYTES:
        buf = io.BytesIO()
        with torch.inference_mode(False):
            torch.save(t.detach().to("cpu").clone(), buf)
        data = buf.getvalue()
    return _rebuild_tensor, (cls, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), bool(t.requires_grad),
                             t.is_inference(), data)


def _none() -> None:
    return None


def _stand_in(module: str, qualname: str, code: bytes) -> Callable[..., Any]:
    """The child's side of a function defined inside another function (a host's wrapper closure
    among the call's options) or a lambda, which pickle cannot send: a function with the same module,
    qualified name and code object - what a saved graph's guards compare - but empty globals and
    closure cells. Only functions the host marks :data:`CARRIED` (carried along, not called by the
    model) travel so; any other makes :func:`dumps` raise :class:`Unavailable`."""
    code_obj = marshal.loads(code)
    closure = tuple(types.CellType() for _ in code_obj.co_freevars) or None
    fn = types.FunctionType(code_obj, {"__builtins__": builtins, "__name__": module}, code_obj.co_name, None, closure)
    fn.__module__, fn.__qualname__ = module, qualname
    return fn


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, skip: tuple[type, ...]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._skip = skip

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        if isinstance(obj, types.FunctionType) and ("<locals>" in obj.__qualname__ or "<lambda>" in obj.__qualname__):
            if not getattr(obj, CARRIED, False):
                raise Unavailable(f"a function defined inside another function among the call's inputs "
                                  f"({obj.__module__}.{obj.__qualname__}, a model patch?): a child would trace it "
                                  "without its closure values")
            return _stand_in, (obj.__module__, obj.__qualname__, marshal.dumps(obj.__code__))
        if getattr(type(obj), FOREGROUND, False):
            raise Unavailable(f"{type(obj).__module__}.{type(obj).__qualname__} among the call's inputs serves host "
                              "code only this process has")
        if self._skip and isinstance(obj, self._skip):
            return _none, ()
        return NotImplemented


def snapshot(value: Any, depth: int = 0) -> Any:
    """``value`` with its dicts, lists and tuples copied (4 levels deep), the rest shared: a call's
    inputs as the call received them, for a job pickled after the call ran. ComfyUI's UNet adds keys
    to its ``transformer_options`` while it runs (``original_shape``, ``transformer_index``, ...): a
    child tracing the dict as the call left it would save a graph whose guards expect those keys,
    and the next call, with a fresh dict, would fail them."""
    if depth > 4:
        return value
    if type(value) is dict:
        return {k: snapshot(v, depth + 1) for k, v in value.items()}
    if type(value) is list:
        return [snapshot(v, depth + 1) for v in value]
    if type(value) is tuple:
        return tuple(snapshot(v, depth + 1) for v in value)
    return value


def dumps(obj: Any, skip: tuple[type, ...] = ()) -> bytes:
    """Pickle ``obj`` for the child (see the module docstring); instances of ``skip`` become None.
    Raises :class:`Unavailable` naming what could not be pickled."""
    buf = io.BytesIO()
    try:
        _Pickler(buf, skip).dump(obj)
    except Unavailable:
        raise
    except Exception as e:  # noqa: BLE001 - pickle raises many types (PicklingError, TypeError, AttributeError)
        raise Unavailable(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from e
    return buf.getvalue()


# -- device memory for the child's copy of the weights ------------------------------------------

#: what the child needs on the device besides the weights: its CUDA context, the compile's
#: workspace and one warm-up call's activations
CHILD_OVERHEAD_BYTES = 3 << 30


def weight_bytes(module: torch.nn.Module, device: torch.device) -> int:
    """Bytes the child allocates on ``device`` for ``module``'s parameters and buffers there."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or t.device != device:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def memory_shortfall(module: torch.nn.Module, device: torch.device,
                     free_fn: Callable[[torch.device], tuple[int, int]] | None = None) -> str | None:
    """Why the device cannot hold the child's copy of the weights now (its free memory, as the
    driver reports it, below the weights plus :data:`CHILD_OVERHEAD_BYTES`), or ``None``. A child
    that ran out of memory would only fail; one that took the memory the sampling needs would fail
    the user's run."""
    if device.type != "cuda":
        return None
    free, _total = (free_fn or torch.cuda.mem_get_info)(device)
    need = weight_bytes(module, device) + CHILD_OVERHEAD_BYTES
    if free >= need:
        return None
    gib = 1 << 30
    return f"{free / gib:.1f} GiB free on {device}, the child needs about {need / gib:.1f} GiB (a copy of the weights)"


# -- the parent's side ------------------------------------------------------------------------


def job_data(*, module: torch.nn.Module, args: tuple, kwargs: dict, config: Any, label: str, method: str,
             block_hook: Callable[..., Any] | None, skip: tuple[type, ...] = ()) -> bytes:
    """The job a child loads, pickled (see :func:`dumps`); raises :class:`Unavailable`."""
    payload = {
        "module": module,
        "args": args,
        "kwargs": kwargs,
        "config": config,
        "label": label,
        "method": method,
        "block_hook": block_hook,
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
    }
    return dumps(payload, skip)


@dataclass
class Job:
    """A compile running in a child process."""

    key: str
    path: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    #: when :meth:`done` first saw the child gone
    finished: float | None = None
    #: a compile worker (split.py: the caller waits for it), not a background compile
    worker: bool = False

    def done(self) -> bool:
        if self.finished is not None:
            return True
        if self.proc.poll() is None:
            return False
        self.finished = time.monotonic()
        with _running_lock:
            _running.pop(self.proc.pid, None)
        return True

    def result(self) -> dict[str, Any]:
        """After :meth:`done`: the child's report, or ``{"crashed": why}`` if it wrote none."""
        code = self.proc.wait()
        try:
            report = json.loads((self.path / RESULT_FILE).read_text())
        except (OSError, ValueError):
            report = None
        if not isinstance(report, dict) or code != 0:
            tail = _tail(self.path / LOG_FILE)
            return {"crashed": f"exit code {code}; {tail or 'no output'} (log: {self.path / LOG_FILE})"}
        self.done()
        report["wall_seconds"] = round((self.finished or time.monotonic()) - self.started, 3)
        return report

    def report(self) -> dict[str, Any]:
        """The child's report once written (it may still be exiting), else as :meth:`result`."""
        try:
            report = json.loads((self.path / RESULT_FILE).read_text())
        except (OSError, ValueError):
            report = None
        if isinstance(report, dict):
            return report
        return self.result()

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.done()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:300] for line in text[-lines:])


#: children still running, by pid: stopped when this process exits
_running: dict[int, Job] = {}
_running_lock = threading.Lock()


def _cancel_all() -> None:
    with _running_lock:
        jobs = list(_running.values())
    for job in jobs:
        job.cancel()


atexit.register(_cancel_all)


def start(
    *,
    root: str | os.PathLike[str],
    key: str,
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    config: Any,
    label: str,
    method: str,
    block_hook: Callable[..., Any] | None,
    skip: tuple[type, ...] = (),
    child_globals: Sequence[tuple[str, str, Any]] = (),
) -> Job:
    """Pickle the job and start the child; raises :class:`Unavailable` (nothing started) if the
    module or the inputs cannot travel. ``config`` is the engine's CompileConfig (with
    ``background`` off: the child compiles in its foreground). ``child_globals``: ``(module,
    attribute, value)`` set in the child before the job loads (a host's parsed command line, which
    its modules read when imported)."""
    data = job_data(module=module, args=args, kwargs=kwargs, config=config, label=label, method=method,
                    block_hook=block_hook, skip=skip)
    job = _spawn(root, key, data, child_globals, part=None, threads=None)
    log.info("nexfort: %s: compiling in a background process (pid %d; log %s)", label, job.proc.pid,
             job.path / LOG_FILE)
    return job


def start_worker(
    *,
    root: str | os.PathLike[str],
    key: str,
    data: bytes,
    label: str,
    part: tuple[int, int],
    threads: int | None = None,
    child_globals: Sequence[tuple[str, str, Any]] = (),
) -> Job:
    """Start a compile worker (split.py) for part ``part = (index, count)`` of the graph the caller
    is about to trace. ``data``: what it compiles with, pickled by :func:`dumps` (options, resolved
    settings, cache key: no model). The worker readies itself, then waits for its part in
    :data:`PART_IN_FILE` in its job directory (``Job.path``; :mod:`nexfort_engine.ship`), compiles
    it, writes it to :data:`PART_FILE` and its report, and commits nothing. ``threads``: its
    Inductor compile threads."""
    job = _spawn(root, key, data, child_globals, part=part, threads=threads)
    log.info("nexfort: %s: compile worker for part %d of %d (pid %d; log %s)", label, part[0], part[1],
             job.proc.pid, job.path / LOG_FILE)
    return job


def _spawn(root: str | os.PathLike[str], key: str, data: bytes, child_globals: Sequence[tuple[str, str, Any]],
           part: tuple[int, int] | None, threads: int | None) -> Job:
    path = Path(root) / JOBS / key
    path.mkdir(parents=True, exist_ok=True)
    for name in (RESULT_FILE, JOB_FILE, PART_FILE, PART_IN_FILE):
        with contextlib.suppress(OSError):
            (path / name).unlink()
    header = {"sys_path": [p for p in sys.path if isinstance(p, str)], "root": str(root), "parent": os.getpid(),
              "globals": dumps(list(child_globals)), "part": part}
    with open(path / JOB_FILE, "wb") as f:
        pickle.dump(header, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.write(data)
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)  # the directory holding nexfort_engine
    env["PYTHONPATH"] = os.pathsep.join([here, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    if threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    # the caller's intra-op thread count, whatever set it: it is part of Dynamo's global-state
    # guard, and a graph compiled under another count recompiles when the caller first runs it
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    policy = os.environ.get(ENV_CHILD_OMP_WAIT_POLICY) or CHILD_OMP_WAIT_POLICY
    if policy != "inherit":
        env["OMP_WAIT_POLICY"] = policy
    with open(path / LOG_FILE, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path / JOB_FILE)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
        )
    job = Job(key=key, path=path, proc=proc, worker=part is not None)
    with _running_lock:
        _running[proc.pid] = job
    return job


def compiling() -> bool:
    """Whether a background compile's child of this process is still running (compile workers,
    which their caller waits for, do not count)."""
    with _running_lock:
        jobs = [j for j in _running.values() if not j.worker]
    return any(not j.done() for j in jobs)


# -- the child's side -------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    def run() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                exit_now(3)

    threading.Thread(target=run, name="nexfort-parent-watch", daemon=True).start()


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), from Linux's ``/proc``; none elsewhere."""
    parents: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def exit_now(code: int) -> NoReturn:
    """The child's exit once its report is written: its own children (Inductor's compile pool and
    its workers, compile workers) killed, its log flushed, no interpreter teardown. The parent runs
    eager until this exit. A normal exit took 1.3-1.9 s after the report on the 2-core machine
    (torch's teardown, no Python frame on the stack) and once 10 s; it also shuts Inductor's
    compile pool down gracefully, giving each worker up to 10 s."""
    below = descendants(os.getpid())
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    log.info("nexfort: exiting with code %d (%d process(es) below this one stopped)", code, len(below))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _write_result(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, default=str))
    os.replace(tmp, path)


def child_main(job_file: str) -> int:
    """Compile the job in ``job_file`` and write its report next to it (exit code 0), or exit non-zero."""
    started = time.time()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = Path(job_file)
    with open(path, "rb") as f:
        header = pickle.load(f)
        _watch_parent(int(header["parent"]))
        if header.get("part") is None and hasattr(os, "nice"):
            # a background compile: the parent's eager steps keep their CPU time, the compile takes
            # the rest (a compile worker's parent waits for it: no nice)
            with contextlib.suppress(OSError):
                os.nice(NICE)
        for p in reversed(header["sys_path"]):
            if p not in sys.path:
                sys.path.insert(0, p)
        for module, attr, value in pickle.loads(header["globals"]):
            setattr(importlib.import_module(module), attr, value)
        t0 = time.perf_counter()
        payload = pickle.load(f)
    load_s = time.perf_counter() - t0
    with contextlib.suppress(OSError):
        path.unlink()  # consumed

    from . import counters
    from .compiler import CompiledModule
    from .compiler import compile as nx_compile

    if header.get("part") is not None:  # a compile worker (split.py)
        index, _count = header["part"]
        times = {"started": started, "loaded": time.time()}
        cm = CompiledModule.part_worker(payload, header["root"])
        _ready(payload["config"])
        times["ready"] = time.time()
        t1 = time.perf_counter()
        data = _wait_for(path.parent / PART_IN_FILE, WORKER_WAIT_S)
        if data is None:
            _write_result(path.parent / RESULT_FILE, {"error": f"no part arrived within {WORKER_WAIT_S:.0f}s",
                                                       "part": index})
            return 0
        times["received"] = time.time()
        wait_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        with torch.set_grad_enabled(bool(payload.get("grad", False))):
            cm.compile_shipped_part(data, path.parent / PART_FILE, times)
        _write_result(path.parent / RESULT_FILE, {"error": None, "part": index, "load_seconds": round(load_s, 3),
                                                   "wait_seconds": round(wait_s, 3),
                                                   "compile_seconds": round(time.perf_counter() - t1, 3)})
        return 0
    cm = nx_compile(payload["module"], payload["config"], cache_dir=header["root"], label=payload["label"],
                    method=payload["method"], block_hook=payload["block_hook"])
    from . import host_call

    t1 = time.perf_counter()
    # the call compiles the graph; its output is not read (host calls need the host's live state)
    with torch.inference_mode(payload["inference"]), torch.set_grad_enabled(payload["grad"]), \
            host_call.placeholders():
        cm(*payload["args"], **payload["kwargs"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rec = counters.snapshot()["models"].get(cm.label, {})
    _write_result(path.parent / RESULT_FILE, {
        "failed": cm.failed,
        "label": cm.label,
        "load_seconds": round(load_s, 3),
        "compile_seconds": round(time.perf_counter() - t1, 3),
        "compiles": rec.get("compiles", 0),
        "cache_key": rec.get("cache_key", ""),
    })
    return 0


#: how long a compile worker waits for its part (the parent's trace comes first; a parent that
#: stops needing it terminates it, one that dies takes it along: _watch_parent)
WORKER_WAIT_S = 1800.0


def _ready(config: Any) -> None:
    """What a compile worker can do before its part arrives, while the parent traces: import
    Inductor, start its compile pool, and create the CUDA context it compiles for."""
    from torch._inductor import compile_fx  # noqa: F401 - the import is the work
    from torch._inductor.async_compile import AsyncCompile

    if getattr(config, "backend", "inductor") == "inductor":
        with contextlib.suppress(Exception):  # a pool that does not start is started by the compile
            AsyncCompile.warm_pool()
    if torch.cuda.is_available():
        torch.cuda.init()


def _wait_for(path: Path, timeout: float) -> bytes | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            data = path.read_bytes()
            with contextlib.suppress(OSError):
                path.unlink()  # consumed
            return data
        time.sleep(0.02)
    return None
