"""Measurement probe, loaded by putting this folder on PYTHONPATH (not part of the engine).

At exit it appends one JSON line to ``$NX_PROBE_OUT`` (stderr if unset) with:
- ``gc``: collections and seconds per generation (``gc.callbacks``), the longest pause, every
  pause of 5 ms or more with its ``time.perf_counter()`` start (``gc_events``; the bench's runs
  carry ``t0_perf_s`` on the same clock), and the live object count at exit: does the garbage
  collector explain a slow compile or a slow sampling?
- ``samples`` (``NX_PROBE_SAMPLE=<ms>``): where the main thread is, every few milliseconds; with
  ``NX_PROBE_TIMELINE=1`` also each sample's ``time.perf_counter()``, the main thread's innermost
  frames and every other thread's innermost frame unless that frame is a known wait
  (``samples.timeline``; a thread sleeping in C under another frame still shows, e.g. Inductor's
  subprocess-pool timer at ``timer.py:check``), to line up with the bench's per-step times.
- ``NX_PROBE_CUT=<dir>``: every graph cut (nexfort_engine.split.assign) as a JSON file of its nodes.
- ``cudnn_benchmark_forced_off``: ``NX_PROBE_NO_CUDNN_BENCHMARK=1`` was set (see below).
- ``cudagraph_copies`` (``NX_PROBE_CG_COPIES=1``): what CUDA-graph trees copy into their static
  input buffers before each replay (``CUDAGraphNode._copy_inputs_and_remove_from_src``): calls,
  tensors and bytes per call, and the largest copied inputs (shape, dtype, whether a
  ``Parameter``) of the node that copies most: is a profile's ``multi_tensor_apply`` copy time
  the graph's real inputs or weights passed as plain tensors?
- ``autotune``: every Inductor Triton kernel that benchmarked its configs in this process
  (``CachingAutotuner.benchmark_all_configs``): kernel name, number of configs, seconds, and the
  autotune-cache state Inductor recorded for it, with whether its ``.best_config`` file exists: why
  does a warm start benchmark kernels?
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from types import FrameType

_gc = {"n": [0, 0, 0], "s": [0.0, 0.0, 0.0], "max": 0.0, "t0": 0.0}
_tuned: list[dict] = []
#: every collection of 5 ms or more: [time.perf_counter() at its start, seconds, generation]
_gc_events: list[list] = []
_T0 = time.perf_counter()


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["t0"] = time.perf_counter()
        return
    dt = time.perf_counter() - _gc["t0"]
    g = info["generation"]
    _gc["n"][g] += 1
    _gc["s"][g] += dt
    _gc["max"] = max(_gc["max"], dt)
    if dt >= 0.005 and len(_gc_events) < 500:
        _gc_events.append([round(_gc["t0"], 4), round(dt, 4), g])


gc.callbacks.append(_on_gc)


def _patch_heuristics(mod) -> None:
    cls = mod.CachingAutotuner
    original = cls.benchmark_all_configs

    def benchmark_all_configs(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            info = dict(getattr(self, "autotune_cache_info", None) or {})
            rec = {"kernel": getattr(getattr(self, "fn", None), "__name__", "?"),
                   "configs": len(getattr(self, "launchers", []) or getattr(self, "configs", []) or []),
                   "s": round(time.perf_counter() - t0, 3), "at_s": round(t0 - _T0, 2),
                   "cache": {k: str(v)[:120] for k, v in info.items()},
                   "filename": getattr(self, "filename", None),
                   "coordesc": bool((getattr(self, "inductor_meta", None) or {}).get("coordinate_descent_tuning")),
                   "local_cache": (getattr(self, "inductor_meta", None) or {}).get("autotune_local_cache")}
            ac = getattr(self, "autotune_cache", None)
            lc = getattr(ac, "local_cache", None) if ac is not None else None
            if lc:
                rec["best_config_file"] = lc[1]
                rec["best_config_exists"] = os.path.exists(lc[1])
            _tuned.append(rec)

    cls.benchmark_all_configs = benchmark_all_configs


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once the module ``target`` has been imported (then leaves sys.meta_path)."""

    def __init__(self, target: str, patch) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):
            exec_module(module)
            self.patch(module)

        loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Finder("torch._inductor.runtime.triton_heuristics", _patch_heuristics))


def _patch_split(mod) -> None:
    """``NX_PROBE_CUT=<dir>``: every cut's nodes in graph order, one JSON file per cut: each node's
    target, output layout, weight in the cut and part (to fit the cut's cost model offline)."""
    original = mod.assign

    def assign(gm, n):
        mapping = original(gm, n)
        if mapping is not None:
            rows = [[mod._kind(node), str(mod._signature(node)), mod._weight(node), mapping[node]]
                    for node in gm.graph.nodes if node in mapping]
            path = os.path.join(os.environ["NX_PROBE_CUT"], f"cut-{os.getpid()}-{len(os.listdir(os.environ['NX_PROBE_CUT']))}.json")
            with open(path, "w") as f:
                json.dump({"n": n, "share": os.environ.get("NEXFORT_OWN_PART_SHARE"), "nodes": rows}, f)
        return mapping

    mod.assign = assign


_cg_copies: dict[str, dict] = {}


def _patch_cudagraph_trees(mod) -> None:
    original = mod.CUDAGraphNode._copy_inputs_and_remove_from_src

    def _copy_inputs_and_remove_from_src(self, dsts, srcs):
        import torch

        rec = _cg_copies.setdefault(str(id(self)), {"calls": 0, "tensors": 0, "bytes": 0, "largest": []})
        rec["calls"] += 1
        if rec["calls"] == 1:
            rows = []
            for idx in self.non_static_input_idx:
                t = srcs[idx]
                if isinstance(t, torch.Tensor):
                    rows.append((t.numel() * t.element_size(), idx, list(t.shape), str(t.dtype),
                                 isinstance(t, torch.nn.Parameter)))
            rec["tensors"] = len(rows)
            rec["bytes"] = sum(r[0] for r in rows)
            rec["largest"] = sorted(rows, reverse=True)[:12]
            rec["parameters"] = sum(1 for r in rows if r[4])
            rec["inputs"] = len(srcs)
        return original(self, dsts, srcs)

    mod.CUDAGraphNode._copy_inputs_and_remove_from_src = _copy_inputs_and_remove_from_src


if os.environ.get("NX_PROBE_CG_COPIES") == "1":
    sys.meta_path.insert(0, _Finder("torch._inductor.cudagraph_trees", _patch_cudagraph_trees))

if os.environ.get("NX_PROBE_CUT"):
    os.makedirs(os.environ["NX_PROBE_CUT"], exist_ok=True)
    sys.meta_path.insert(0, _Finder("nexfort_engine.split", _patch_split))

_samples = {"n": 0, "incl": {}, "leaf": {}, "timeline": []}
#: ``NX_PROBE_TIMELINE=1`` with ``NX_PROBE_SAMPLE``: also keep every sample's perf_counter time and
#: innermost frames, to line samples up with the bench's per-step times (``t0_perf_s``)
_TIMELINE = os.environ.get("NX_PROBE_TIMELINE") == "1"
#: innermost frames of a thread that is waiting, not running Python (left out of the timeline)
_IDLE = frozenset({"wait", "_wait_for_tstate_lock", "select", "poll", "_recv_msg", "recv_bytes", "_recv", "get",
                   "_worker", "accept", "sleep", "read", "readinto", "_read_thread"})


def _where(frame: FrameType) -> str:
    """A timeline entry for one frame: file, function and line."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"


def _sampler(main_id: int, interval: float) -> None:
    """``NX_PROBE_SAMPLE=<ms>``: where the main thread is, every few milliseconds (a poor man's
    py-spy: counts per function, inclusive of callees and as the innermost frame)."""
    import threading

    incl, leaf = _samples["incl"], _samples["leaf"]
    me = threading.get_ident()
    names: dict[int, str] = {}  # thread names, looked up again when a thread is new to them
    while True:
        time.sleep(interval)
        frames = sys._current_frames()
        frame = frames.get(main_id)
        if frame is None:
            if not threading.main_thread().is_alive():
                return
            continue
        _samples["n"] += 1
        seen = set()
        first = True
        if _TIMELINE and len(_samples["timeline"]) < 40000:
            stack, f = [], frame
            while f is not None and len(stack) < 8:
                stack.append(_where(f))
                f = f.f_back
            entry: list = [round(time.perf_counter(), 4), stack]
            # other threads' innermost frames too, unless they wait (a thread holding the GIL in
            # the background makes the main thread's steps slower without showing in its stack)
            if any(ident not in names for ident in frames):
                names = {ident: str(ident) for ident in frames}  # threads threading does not list
                names.update((t.ident, t.name) for t in threading.enumerate() if t.ident is not None)
            others = {names[ident]: _where(f) for ident, f in frames.items()
                      if ident not in (main_id, me) and f.f_code.co_name not in _IDLE}
            if others:
                entry.append(others)
            _samples["timeline"].append(entry)
        while frame is not None:
            code = frame.f_code
            key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
            if first:
                leaf[key] = leaf.get(key, 0) + 1
                first = False
            if key not in seen:
                seen.add(key)
                incl[key] = incl.get(key, 0) + 1
            frame = frame.f_back


if os.environ.get("NX_PROBE_NO_CUDNN_BENCHMARK") == "1":
    # what a warm start costs without cuDNN's per-shape algorithm search: setting
    # torch.backends.cudnn.benchmark (the engine's "benchmark" flag does, per compiled call) is ignored
    import torch.backends.cudnn as _cudnn
    from torch.backends import ContextProp as _ContextProp

    type(_cudnn).benchmark = _ContextProp(_cudnn.torch._C._get_cudnn_benchmark,
                                          lambda _v: _cudnn.torch._C._set_cudnn_benchmark(False))

if os.environ.get("NX_PROBE_SAMPLE"):
    import threading as _threading

    _threading.Thread(target=_sampler, args=(_threading.get_ident(), float(os.environ["NX_PROBE_SAMPLE"]) / 1000),
                      name="nx-probe-sampler", daemon=True).start()


def _maxrss_mib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _report() -> None:
    rec = {"label": os.environ.get("NX_PROBE_LABEL", ""), "argv": sys.argv[:1], "pid": os.getpid(), "wall_s": round(time.perf_counter() - _T0, 2),
           "gc_collections": _gc["n"], "gc_s": [round(x, 2) for x in _gc["s"]],
           "gc_max_s": round(_gc["max"], 3), "gc_events": _gc_events, "objects_at_exit": len(gc.get_objects()),
           "gc_frozen": gc.get_freeze_count(), "maxrss_mib": _maxrss_mib(), "autotune": _tuned,
           "cudnn_benchmark_forced_off": os.environ.get("NX_PROBE_NO_CUDNN_BENCHMARK") == "1"}
    if _cg_copies:
        rec["cudagraph_copies"] = sorted(_cg_copies.values(), key=lambda r: -r["bytes"] * r["calls"])[:20]
    if _samples["n"]:
        top = sorted(_samples["incl"].items(), key=lambda kv: -kv[1])[:300]
        rec["samples"] = {"n": _samples["n"], "incl": dict(top),
                          "leaf": dict(sorted(_samples["leaf"].items(), key=lambda kv: -kv[1])[:150])}
        if _samples["timeline"]:
            rec["samples"]["timeline"] = _samples["timeline"]
    out = os.environ.get("NX_PROBE_OUT")
    line = json.dumps(rec)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    else:
        print("NX_PROBE " + line, file=sys.stderr)


atexit.register(_report)
