"""GEMM algorithms chosen by measurement, once per shape, and kept in the cache directory.

What: ``nexfort::tuned_linear(x, w, b, gelu)`` (``passes/tuned_linear.py`` puts it in place of a
compiled graph's 16-bit linears and of ``nexfort::linear_gelu``) runs the cuBLASLt algorithm this
module chose for its (GPU, cuBLASLt version, M, K, N, dtype, epilogue), through
:mod:`nexfort_engine.cublaslt`; a shape without a choice runs torch's own call (``F.linear`` /
``torch._addmm_activation``: cuBLASLt's heuristic), and is queued. After the compiled model's call
returns (never while a CUDA graph is captured), :func:`tune_pending` searches the queued shapes:

1. the heuristic's 8 answers, then every tile of the algorithms it named (at the stages, custom
   options and cluster shapes it named), then
   every CTA swizzle × custom option × cluster shape of the six fastest tiles, each timed for three
   back-to-back calls in one batch of CUDA events (a screen);
2. the six fastest and torch's own call, each captured as a CUDA graph of 20 calls and replayed in
   turn 9 times (median): the sustained load a compiled model's graphs put the GPU under, where the
   heuristic's tiles lose most (BENCHMARKS.md, fifty-fifth session);
3. the fastest is kept only if it beats torch's call by :data:`MARGIN` and its error against a
   float32 computation is no worse than torch's own (it is bit-identical in every case measured);
   else the entry says "torch's call" and the shape is not searched again.

The table (``<cache dir>/gemm_tuning.json``) is read at the first use of a directory and written
atomically after each search (merged with what other processes wrote meanwhile); an entry that does
not parse, or whose algorithm this library no longer accepts (``AlgoCheck``), is dropped and its
shape searched again. Counters under ``stats()["gemm_tuning"]``.

Why: torch takes cuBLASLt's heuristic's first answer. Under sustained load other tiles of the same
algorithm run PixArt-α's fc1 + GELU 1.28× and its qkv 1.11-1.14× faster, bit for bit the same
output (runs 302-303). The search costs 2-13 s per shape on an H100 (run305), paid once per cache directory.

The reference twin of the op is ``F.linear`` (then tanh-GELU): what runs on CPU, for float32,
for operands the tuned path does not take (unaligned or strided), and for every shape not chosen.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import counters

__all__ = [
    "MARGIN",
    "MIN_FLOPS",
    "TABLE_FILE",
    "linear_reference",
    "clear",
    "enqueue",
    "pending",
    "reset",
    "summary",
    "table",
    "tune_pending",
    "tuned_linear",
    "use_dir",
]

log = logging.getLogger(__name__)

SECTION = "gemm_tuning"
TABLE_FILE = "gemm_tuning.json"
FORMAT_VERSION = 1
#: a shape is searched when its GEMM does at least this much work (2·M·K·N): smaller ones are
#: launch-bound, where no tile choice pays back its search
MIN_FLOPS = 4e9
#: a searched algorithm replaces torch's call only when at least this much faster (graph medians)
MARGIN = 1.02
#: workspace a candidate may use (the winners measured used 4 bytes)
WORKSPACE_BYTES = 1 << 20
#: seconds of searching per process (``NEXFORT_GEMM_TUNE_SECONDS``; 0: choose nothing new, use
#: the table only)
ENV_BUDGET = "NEXFORT_GEMM_TUNE_SECONDS"
DEFAULT_BUDGET_S = 120.0
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: operands the tuned path takes must start on this boundary (cuBLASLt's heuristic assumes 256)
_ALIGN = 256
_SCREEN_CALLS = 3
_TOP_TILES = 6
_FINALISTS = 6
_GRAPH_CALLS = 20
_ROUNDS = 9
_CHECK_ROWS = 1024


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """The torch twin: ``F.linear`` (then tanh-GELU)."""
    out = F.linear(x, weight, bias)
    return F.gelu(out, approximate="tanh") if gelu else out


@dataclass
class _Ready:
    """A chosen algorithm, resolved for this process (descriptors built, ``AlgoCheck`` passed)."""

    desc: Any
    algo: Any
    workspace: int


_lock = threading.RLock()
_run_lock = threading.Lock()  # the descriptors' bias pointer is set per call
_path: Path | None = None
_table: dict[str, dict[str, Any]] = {}
_ready: dict[str, _Ready | None] = {}
_pending: dict[str, tuple[int, int, int, str, str, int]] = {}
_spent_s = 0.0
_device_tags: dict[int, str] = {}


def reset() -> None:
    """Forget the table, the resolved choices and the queue (tests)."""
    global _path, _spent_s
    with _lock:
        _path = None
        _table.clear()
        _ready.clear()
        _pending.clear()
        _device_tags.clear()
        _spent_s = 0.0


def table() -> dict[str, dict[str, Any]]:
    """A copy of the table in use."""
    with _lock:
        return {k: dict(v) for k, v in _table.items()}


def pending() -> list[str]:
    """The keys queued for a search."""
    with _lock:
        return list(_pending)


def _epilogue(bias: bool, gelu: bool) -> str:
    return "gelu_bias" if gelu else ("bias" if bias else "none")


def valid_entry(entry: Any) -> bool:
    """Whether a table entry has the fields the op reads (a hand-edited or cut file fails this)."""
    if not isinstance(entry, dict):
        return False
    cfg = entry.get("config")
    if cfg is not None and not (isinstance(cfg, dict) and isinstance(cfg.get("id"), int)
                                and all(isinstance(v, int) for v in cfg.values())):
        return False
    return all(isinstance(entry.get(k), int) and entry[k] > 0 for k in ("m", "k", "n")) and \
        entry.get("dtype") in _DTYPES and entry.get("epilogue") in ("none", "bias", "gelu_bias")


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of ``path``; a file that does not parse is counted, logged and ignored (it is
    rewritten at the next save), as is every entry without the fields the op reads."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("nexfort: GEMM tuning table %s unreadable (%s); searching again", path, e)
        return {}
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_VERSION or not isinstance(obj.get("entries"), dict):
            raise ValueError("not a nexfort GEMM tuning table of format %d" % FORMAT_VERSION)
    except ValueError as e:
        counters.bump_section(SECTION, "corrupt_tables")
        log.warning("nexfort: GEMM tuning table %s is corrupt (%s); it is rebuilt", path, e)
        return {}
    good = {k: v for k, v in obj["entries"].items() if valid_entry(v)}
    if len(good) != len(obj["entries"]):
        counters.bump_section(SECTION, "corrupt_entries", len(obj["entries"]) - len(good))
        log.warning("nexfort: %d entries of %s dropped (fields missing); their shapes are searched again",
                    len(obj["entries"]) - len(good), path)
    return good


def use_dir(root: str | os.PathLike[str] | None) -> None:
    """Keep the table in ``root`` (the compile cache directory); None: in memory only."""
    global _path
    path = Path(root) / TABLE_FILE if root is not None else None
    with _lock:
        if path == _path:
            return
        _path = path
        _table.clear()
        _ready.clear()
        if path is not None:
            _table.update(_read(path))
            counters.set_section(SECTION, table=str(path), entries=len(_table))


def clear(root: str | os.PathLike[str]) -> int:
    """Delete the table kept in ``root`` (the Cache Manager's "clear all"); how many entries it
    held. The shapes are searched again at their next call."""
    path = Path(root) / TABLE_FILE
    held = len(_read(path))
    with _lock:
        if _path == path:
            _table.clear()
            _ready.clear()
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    counters.set_section(SECTION, entries=0)
    return held


def summary(root: str | os.PathLike[str]) -> dict[str, int]:
    """{"entries", "chosen"} of the table kept in ``root`` (for reports)."""
    entries = _read(Path(root) / TABLE_FILE)
    return {"entries": len(entries), "chosen": sum(1 for e in entries.values() if e.get("config"))}


def _save() -> None:
    """Merge our entries into the file (another process may have added its own) and write it
    atomically."""
    from filelock import FileLock

    from .cache.store import atomic_write_json

    path = _path
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=30):
            merged = _read(path)
            with _lock:
                merged.update(_table)
                _table.update(merged)
                snapshot = dict(merged)
            atomic_write_json(path, {"format": FORMAT_VERSION, "entries": snapshot})
        counters.set_section(SECTION, entries=len(snapshot))
    except (OSError, TimeoutError) as e:
        log.warning("nexfort: could not write the GEMM tuning table %s (%s)", path, e)


def _device_tag(index: int) -> str:
    tag = _device_tags.get(index)
    if tag is None:
        from . import cublaslt

        props = torch.cuda.get_device_properties(index)
        tag = f"{props.name}|sm{props.major}{props.minor}|lt{cublaslt.get().version}"
        _device_tags[index] = tag
    return tag


def key(device_tag: str, m: int, k: int, n: int, dtype: str, epilogue: str) -> str:
    return f"{device_tag}|{dtype}|{epilogue}|{m}x{k}x{n}"


def _takes(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Operands the tuned path runs: CUDA, 16-bit, contiguous rows, aligned, big enough."""
    if not (x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x2.dtype
            and weight.dim() == 2 and weight.device == x2.device):
        return False
    if bias is not None and (bias.dtype != x2.dtype or bias.dim() != 1 or not bias.is_contiguous()
                             or bias.data_ptr() % _ALIGN):
        return False
    m, k = x2.shape
    if m == 0 or 2.0 * m * k * weight.shape[0] < MIN_FLOPS:
        return False
    if not (x2.is_contiguous() and weight.is_contiguous()) or x2.data_ptr() % _ALIGN or weight.data_ptr() % _ALIGN:
        return False
    return type(weight) is torch.Tensor or isinstance(weight, torch.nn.Parameter)


def _resolve(k: str) -> _Ready | None | bool:
    """The table's choice for ``k`` made ready for this process: _Ready, None (torch's call), or
    False (no usable entry)."""
    from . import cublaslt

    entry = _table.get(k)
    if entry is None:
        return False
    if entry.get("config") is None:
        return None
    lt = cublaslt.get()
    d = lt.build(entry["m"], entry["k"], entry["n"], _DTYPES[entry["dtype"]], entry["epilogue"])
    h = lt.from_config(d, entry["config"])
    if h is None or h.workspace_size > WORKSPACE_BYTES:
        counters.bump_section(SECTION, "stale_entries")
        log.warning("nexfort: the tuned GEMM algorithm for %s is not accepted here; searching again", k)
        _table.pop(k, None)
        return False
    counters.bump_section(SECTION, "table_hits")
    return _Ready(d, h.algo, int(h.workspace_size))


def _choice(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> _Ready | None:
    from . import cublaslt

    if not cublaslt.loaded() and torch.cuda.is_current_stream_capturing():
        return None  # loading cuBLASLt runs a matmul and a sync: torch's call in this graph
    m, k = x2.shape
    n = weight.shape[0]
    dtype = str(x2.dtype).removeprefix("torch.")
    epi = _epilogue(bias is not None, gelu)
    index = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    kk = key(_device_tag(index), m, k, n, dtype, epi)
    r = _ready.get(kk, False)
    if r is not False:
        return r
    with _lock:
        r = _resolve(kk)
        if r is False:
            enqueue(kk, (m, k, n, dtype, epi, index))
            return None
        _ready[kk] = r
    return r


def enqueue(kk: str, spec: tuple[int, int, int, str, str, int]) -> None:
    """Queue ``kk`` (m, k, n, dtype name, epilogue, device index) for :func:`tune_pending`; until it
    is searched its calls run torch's call."""
    with _lock:
        if kk not in _pending and kk not in _table:
            _pending[kk] = spec
            counters.bump_section(SECTION, "misses")


def _torch_call(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    if gelu and bias is not None and x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16):
        return torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    return linear_reference(x2, weight, bias, gelu)


@torch.library.custom_op("nexfort::tuned_linear", mutates_args=())
def tuned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (then tanh-GELU when ``gelu``, with a bias) with the cuBLASLt
    algorithm chosen for its shape (module docstring); torch's own call for every shape not chosen,
    the twin :func:`linear_reference` off the GPU."""
    if not x.is_cuda or x.dim() < 2 or (gelu and bias is None):
        return linear_reference(x, weight, bias, gelu)
    x2 = x.reshape(-1, x.shape[-1])
    ready = _choice(x2, weight, bias, gelu) if _takes(x2, weight, bias) else None
    if ready is None:
        out = _torch_call(x2.contiguous() if x2.stride(-1) != 1 else x2, weight, bias, gelu)
    else:
        from . import cublaslt

        out = torch.empty(x2.shape[0], weight.shape[0], device=x2.device, dtype=x2.dtype)
        ws = torch.empty(ready.workspace, device=x2.device, dtype=torch.uint8) if ready.workspace else None
        with _run_lock:
            cublaslt.get().matmul(ready.desc, ready.algo, weight, x2, bias, out, ws)
    return out.view(*x.shape[:-1], weight.shape[0])


@tuned_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# -- the search ------------------------------------------------------------------------------------

def _budget_s() -> float:
    try:
        return float(os.environ.get(ENV_BUDGET, DEFAULT_BUDGET_S))
    except ValueError:
        return DEFAULT_BUDGET_S


def _graph(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` in one CUDA graph (thread-local capture: other threads' CUDA work
    is not an error), after warm-up calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    return g


def _interleaved(graphs: list[torch.cuda.CUDAGraph], calls: int, rounds: int) -> list[float]:
    """Median ms per call of each graph, replayed in turn ``rounds`` times (drift falls on all alike)."""
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for i, g in enumerate(graphs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / calls)
    return [sorted(t)[len(t) // 2] for t in times]


def _rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def search(m: int, k: int, n: int, dtype: torch.dtype, epilogue: str, device: int = 0) -> dict[str, Any]:
    """Find the fastest cuBLASLt configuration for one shape (module docstring); the table entry."""
    from . import cublaslt

    t0 = time.perf_counter()
    lt = cublaslt.get()
    dev = torch.device("cuda", device)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) / math.sqrt(k)
    bias = torch.randn(n, device=dev, dtype=dtype, generator=g) * 0.1 if epilogue != "none" else None
    gelu = epilogue == "gelu_bias"

    def torch_call() -> torch.Tensor:
        return _torch_call(x, w, bias, gelu)

    rows = min(m, _CHECK_ROWS)  # errors checked on the first rows: a float32 copy of them only
    ref = torch_call()[:rows].clone()
    ref32 = linear_reference(x[:rows].float(), w.float(), bias.float() if bias is not None else None, gelu)
    torch_err = _rel_l2(ref, ref32)
    d = lt.build(m, k, n, dtype, epilogue)
    out = torch.empty(m, n, device=dev, dtype=dtype)
    ws = torch.empty(WORKSPACE_BYTES, device=dev, dtype=torch.uint8)
    heur = lt.heuristics(d, 8, WORKSPACE_BYTES)

    def screen(cands: list[Any]) -> list[tuple[float, Any]]:
        """(ms per call, candidate) of each that runs, from one batch of events (one sync)."""
        events = []
        for h in cands:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                lt.matmul(d, h.algo, w, x, bias, out, ws)  # a warm-up call, also the failure check
                start.record()
                for _ in range(_SCREEN_CALLS):
                    lt.matmul(d, h.algo, w, x, bias, out, ws)
                end.record()
            except RuntimeError:
                continue
            events.append((start, end, h))
        torch.cuda.synchronize()
        return [(s.elapsed_time(e) / _SCREEN_CALLS, h) for s, e, h in events]

    timed = screen(heur)
    named = [lt.config(h.algo) for h in heur]

    def used(field: str) -> tuple[int, ...]:
        return tuple(sorted({c.get(field, 0) for c in named}))

    ids, stages = used("id"), used("stages_id")

    # every tile of those algorithms at the heuristic's stages, custom options and cluster shapes (on
    # sm90 cuBLASLt accepts none of its tiles at the default custom option and cluster shape: with
    # those, this pass found nothing and the search saw only the heuristic's answers, run304)
    tiles_pass = lt.enumerate(d, WORKSPACE_BYTES, 4000, algo_ids=ids, stages=stages, swizzles=(0,),
                              customs=used("custom_option"), clusters=used("cluster_shape_id"))
    by_tile = sorted(screen(tiles_pass), key=lambda t: t[0])
    top = tuple(dict.fromkeys(lt.config(h.algo)["tile_id"] for _, h in by_tile))[:_TOP_TILES]
    # the fastest tiles with every swizzle, custom option and cluster shape
    wide = lt.enumerate(d, WORKSPACE_BYTES, 4000, algo_ids=ids, stages=stages, tiles=top) if top else []
    timed += by_tile + screen(wide)
    screened = len(timed)
    timed.sort(key=lambda t: t[0])
    finalists, seen = [], set()
    for _, h in timed:
        cfg = tuple(sorted(lt.config(h.algo).items()))
        if cfg in seen:
            continue
        seen.add(cfg)
        out.zero_()
        lt.matmul(d, h.algo, w, x, bias, out, ws)
        if _rel_l2(out[:rows], ref32) <= torch_err * 1.01 + 1e-7 and torch.isfinite(out).all():
            finalists.append((h, bool(torch.equal(out[:rows], ref))))
        if len(finalists) >= _FINALISTS:
            break
    graphs = [_graph(torch_call, _GRAPH_CALLS)]
    for h, _ in finalists:
        graphs.append(_graph(lambda h=h: lt.matmul(d, h.algo, w, x, bias, out, ws), _GRAPH_CALLS))
    med = _interleaved(graphs, _GRAPH_CALLS, _ROUNDS)
    torch_ms, cand = med[0], med[1:]
    best = min(range(len(cand)), key=cand.__getitem__) if cand else None
    entry: dict[str, Any] = {
        "m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), "epilogue": epilogue,
        "torch_ms": round(torch_ms, 5), "screened": screened, "tiles_screened": len(by_tile), "config": None,
        "heuristic_first": lt.config(heur[0].algo) if heur else None,
    }
    if best is not None:
        h, identical = finalists[best]
        entry.update(best_ms=round(cand[best], 5), speedup=round(torch_ms / cand[best], 4), bit_identical=identical)
        if torch_ms / cand[best] >= MARGIN:
            entry["config"] = lt.config(h.algo)
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    del graphs
    return entry


def _can_search() -> bool:
    return torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()


def _run_search(m: int, k: int, n: int, dtype: str, epilogue: str, index: int) -> dict[str, Any]:
    with torch.cuda.device(index), torch.inference_mode():
        return search(m, k, n, _DTYPES[dtype], epilogue, index)


def tune_pending() -> int:
    """Search the queued shapes (module docstring) within the process's budget; how many were
    searched. A no-op while a CUDA graph is captured or nothing is queued."""
    global _spent_s
    if not _pending or not _can_search():
        return 0
    done = 0
    while True:
        with _lock:
            if not _pending:
                break
            kk, (m, k, n, dtype, epi, index) = next(iter(_pending.items()))
            if _spent_s >= _budget_s():
                # over budget: torch's call for the rest of this process (not written: searched later)
                for rest in _pending:
                    _ready[rest] = None
                counters.bump_section(SECTION, "over_budget", len(_pending))
                _pending.clear()
                break
            del _pending[kk]
        t0 = time.perf_counter()
        try:
            entry = _run_search(m, k, n, dtype, epi, index)
        except Exception as e:  # a search must never cost the user's run: torch's call it is
            log.warning("nexfort: GEMM search for %s failed (%s: %s); torch's call is used", kk, type(e).__name__, e)
            counters.bump_section(SECTION, "failed_searches")
            entry = {"m": m, "k": k, "n": n, "dtype": dtype, "epilogue": epi, "config": None,
                     "error": f"{type(e).__name__}: {e}"[:300]}
        _spent_s += time.perf_counter() - t0
        with _lock:
            _table[kk] = entry
            _ready.pop(kk, None)
        counters.bump_section(SECTION, "searched")
        counters.bump_section(SECTION, "chosen" if entry.get("config") else "kept_torch")
        counters.set_section(SECTION, search_seconds=round(_spent_s, 3))
        log.info("nexfort: GEMM %s: %s (%.2fx torch's call under load, %.1f s)", kk,
                 "tuned algorithm" if entry.get("config") else "torch's call kept", entry.get("speedup", 1.0),
                 entry.get("seconds", 0.0))
        _save()
        done += 1
    return done
