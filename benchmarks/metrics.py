"""Measurements: per-step timing, peak memory, compile counters, and errors between latents.

Step timing records a CUDA event in the sampler's per-step callback (no synchronisation inside
the loop, so CPU/GPU overlap between steps is kept) and reads the intervals after one sync at the
end; on the CPU it reads the host clock. ``it/s`` is steps over the time from the first step's
end to the last step's end, divided by (steps - 1): the steady sampling loop, without sampler
set-up, the first step's launch latency or the copy of the result.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepTimer:
    """Callback for ``comfy.sample.sample``: marks the end of each step."""

    device: torch.device
    marks: list[Any] = field(default_factory=list)
    #: host clock at each callback: the host's own time per step. On a GPU the host runs ahead of
    #: the device unless something synchronises, so a host step as long as the device step means
    #: the step is host-bound (or synchronises), a shorter one that the GPU is the limit.
    host_marks: list[float] = field(default_factory=list)

    def __call__(self, step: int, x0: Any, x: Any, total_steps: int) -> None:
        now = time.perf_counter()
        self.host_marks.append(now)
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(now)

    def seconds_between(self) -> list[float]:
        """Durations of steps 2..N (seconds); call after a sync."""
        if len(self.marks) < 2:
            return []
        if self.device.type == "cuda":
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def it_per_s(self) -> float | None:
        d = self.seconds_between()
        return len(d) / sum(d) if d and sum(d) > 0 else None

    def host_seconds_between(self) -> list[float]:
        """Host time between the callbacks of steps 2..N (seconds)."""
        return [b - a for a, b in zip(self.host_marks, self.host_marks[1:], strict=False)]

    def host_ms_per_step(self) -> float | None:
        """Median host time between callbacks of steps 2..N (ms)."""
        d = self.host_seconds_between()
        return statistics.median(d) * 1000.0 if d else None


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def reserved_gib(device: torch.device) -> float | None:
    """What this process's caching allocator holds (CUDA-graph pools included)."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 2**30
    return None


def device_used_gib(device: torch.device) -> float | None:
    """The device's used memory, every process on it included (a background child's too)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / 2**30
    return None


def latent_error(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max/mean absolute difference and relative L2 (``||out-ref|| / ||ref||``) in float64."""
    a = out.detach().to("cpu", torch.float64)
    b = ref.detach().to("cpu", torch.float64)
    d = (a - b).abs()
    denom = float(torch.linalg.vector_norm(b)) or 1.0
    return {
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "rel_l2": float(torch.linalg.vector_norm(a - b)) / denom,
        "finite": bool(torch.isfinite(a).all()),
    }


# -- compile counters ------------------------------------------------------------------------------


def dynamo_unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def dynamo_recompile_reasons(limit: int = 10) -> list[str]:
    try:
        from torch._dynamo.utils import get_compilation_metrics

        out = [str(m.recompile_reason) for m in get_compilation_metrics() if getattr(m, "recompile_reason", None)]
    except Exception:  # noqa: BLE001 - diagnostics only
        return []
    return out[-limit:]


def nexfort_counts() -> dict[str, Any]:
    import nexfort_engine

    s = nexfort_engine.stats()
    return {
        "compiles": int(s.get("compiles", 0)),
        "recompiles": int(s.get("recompiles", 0)),
        "fallbacks": int(s.get("fallbacks", 0)),
        "cache_hits": int(s.get("cache_hits", 0)),
        "cache_misses": int(s.get("cache_misses", 0)),
        "recompile_reasons": list(s.get("recompile_reasons", []))[-10:],
        "fallback_reasons": list(s.get("fallback_reasons", []))[-10:],
        # the traced graph broke (a model patch Dynamo cannot trace, usually): compiled in pieces
        "graph_breaks": int(s.get("graph_breaks", 0)),
        "graph_break_reasons": list(s.get("graph_break_reasons", []))[-10:],
        "compile_seconds": float(s.get("compile_seconds", 0.0)),
        # "background": true - each model's child process (state, its wall time until done)
        "background": {k: m["background"] for k, m in s.get("models", {}).items() if m.get("background")},
        "background_seconds": float(s.get("background_seconds", 0.0)),
        # "static_first": the static graph each model's first call compiled (or why not), and calls
        # of other shapes that ran eager while the dynamic graph compiled in the background
        "static_first": {k: m["static_first"] for k, m in s.get("models", {}).items() if m.get("static_first")},
        "static_first_eager_calls": int(s.get("static_first_eager_calls", 0)),
        # "compile_workers": the cut and where the parts were compiled, per model
        "compile_parts": {k: {"parts": m.get("compile_parts", ""),
                              "own_s": m.get("compile_parts_own_seconds", 0.0),
                              "wait_s": m.get("compile_parts_wait_seconds", 0.0),
                              "slowest_child": m.get("compile_parts_slowest_child", {}),
                              # the parts cut while Dynamo traced: when each was shipped, their costs
                              "streamed": m.get("compile_parts_streamed", {}),
                              # every part: its size, node kinds, where and how long it compiled
                              "each": m.get("compile_parts_each", []),
                              # size guards the parts took after Dynamo built its own (the engine checks them)
                              "late_size_guards": m.get("precompiled_late_size_guards", [])}
                          for k, m in s.get("models", {}).items() if m.get("compile_parts")},
        # seconds per step of each model's last cold compile of a precompiled graph
        "compile_phases": {k: m["compile_phases"] for k, m in s.get("models", {}).items() if m.get("compile_phases")},
        # what ran a cold compile's first call: "as compiled" or "loaded back" (the saved file)
        "precompiled_first_call": {k: m["precompiled_first_call"] for k, m in s.get("models", {}).items()
                                   if m.get("precompiled_first_call")},
        # what the graph passes rewrote, over all compiled models (fp8 attention: run106 on)
        "rewrites": {k: sum(int(m.get(k, 0)) for m in s.get("models", {}).values())
                     for k in ("fp8_quant_fused", "rope_fused", "attention_fp8", "fp8_stored_weights",
                               "group_norms_rewritten", "sdpa_cudnn_first", "gelu_epilogues")},
    }


def compile_counts(compiler: str, graphs_before: int = 0) -> dict[str, Any]:
    """Compiles/recompiles so far: nexfort's own counters, or Dynamo's for ComfyUI's compile."""
    if compiler == "nexfort":
        return nexfort_counts()
    if compiler == "comfy":
        graphs = dynamo_unique_graphs() - graphs_before
        return {
            "compiles": graphs,
            "recompiles": max(graphs - 1, 0),
            "fallbacks": 0,
            "recompile_reasons": dynamo_recompile_reasons(),
        }
    return {"compiles": 0, "recompiles": 0, "fallbacks": 0}


# -- FLOPs and the device's matmul peak ------------------------------------------------------------

#: torch dtype -> the key of :func:`device_peak_tflops`
DTYPE_KEY = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _sdpa_flops_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter() -> Any:
    """``FlopCounterMode`` that also counts the CPU SDPA kernel.

    torch registers FLOP formulas for the CUDA SDPA kernels (flash, efficient, cudnn) but not for
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which SDPA dispatches to on the CPU: without
    this mapping a CPU count would miss every attention.
    """
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    extra = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None and op not in flop_registry:
        extra[op] = _sdpa_flops_cpu
    return FlopCounterMode(display=False, custom_mapping=extra)


def flops_by_op(counter: Any) -> dict[str, int]:
    """``{"mm": n, "_scaled_dot_product_flash_attention": n, ...}`` over the whole counted region."""
    counts = counter.get_flop_counts().get("Global", {})
    return {str(op).removeprefix("aten."): int(n) for op, n in counts.items()}


def time_op(fn: Any, device: torch.device, iters: int, blocks: int = 1, warmup: int = 3) -> float:
    """Best seconds per call of ``fn`` over ``blocks`` timed blocks of ``iters`` calls, after
    ``warmup`` calls (one on CPU). On CUDA each block is timed with events around its calls."""
    for _ in range(warmup if device.type == "cuda" else 1):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(blocks):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1000.0
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            dt = time.perf_counter() - t0
        best = min(best, dt / iters)
    return best


def block_times(fn: Any, device: torch.device, iters: int, blocks: int, warm_s: float = 0.0) -> list[float]:
    """Seconds per call of ``fn`` in each of ``blocks`` timed blocks of ``iters`` calls, after
    calling it for ``warm_s`` seconds (at least once). CUDA: events around each block, all blocks
    queued back to back and read after one synchronisation, so the GPU never idles between them
    (its clocks and power state stay those of sustained work, as in a sampling loop)."""
    t_end = time.perf_counter() + warm_s
    fn()
    n = 1
    while time.perf_counter() < t_end:
        fn()
        n += 1
        if device.type == "cuda" and n % 16 == 0:
            sync(device)  # keep the queue short, so the warm-up is what the clock says
    sync(device)
    if device.type != "cuda":
        out = []
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters)
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(blocks + 1)]
    events[0].record()
    for i in range(blocks):
        for _ in range(iters):
            fn()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1000.0 / iters for i in range(blocks)]


_PEAK_CACHE: dict[str, dict[str, Any]] = {}
#: how :func:`device_peak` times each dtype on a GPU: warm-up seconds, blocks, calls per block
PEAK_TIMING_GPU = {"warm_s": 0.5, "blocks": 20, "iters": 10}


def device_peak(device: torch.device, n: int | None = None) -> dict[str, Any]:
    """Measured dense matmul throughput of ``device``: ``{"tflops": {"fp32", "fp16", "bf16", "fp8"},
    "best_tflops": {...}, "spread": {dtype: (slowest block, fastest block) TFLOP/s}, "n": n,
    "fp8_scaling": "rowwise" | "tensorwise" | None, "timing": PEAK_TIMING_GPU}``.

    An n x n x n ``torch.mm`` (n = 8192 on a GPU, 512 on the CPU) per dtype. On a GPU each dtype
    is first run for half a second, then 20 blocks of 10 calls are timed back to back (CUDA events,
    no idle gaps); ``tflops`` is the median block - the rate the GPU sustains under a
    model's load - and ``best_tflops`` the fastest block. The earlier form (3 warm-up calls, best of 3 blocks
    of 10) moved its bf16 figure between 644 and 797 TFLOP/s in six repeats in one process on an
    H100 (run307; fp16 760-771), and with it every "% of peak" of a row (BENCHMARKS.md,
    fifty-ninth session). fp8: ``torch._scaled_mm`` on float8_e4m3fn with row-wise scales (bf16
    out) where the GPU has fp8 (compute capability >= 8.9), tensor-wise scales if row-wise is
    refused; ``None`` where unsupported (and on the CPU). fp32 runs with the current TF32 setting.
    Measured once per process and device.
    """
    key = str(device)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 512)
    timing = PEAK_TIMING_GPU if cuda else {"warm_s": 0.0, "blocks": 1, "iters": 3}
    out: dict[str, float | None] = {}
    best: dict[str, float | None] = {}
    spread: dict[str, tuple[float, float]] = {}
    scaling_used = None
    gen = torch.Generator(device=device).manual_seed(0)

    def rate(name: str, fn: Any) -> None:
        secs = sorted(block_times(fn, device, timing["iters"], timing["blocks"], timing["warm_s"]))
        flops = 2 * n**3 / 1e12
        out[name] = flops / statistics.median(secs)
        best[name] = flops / secs[0]
        spread[name] = (float(f"{flops / secs[-1]:.4g}"), float(f"{flops / secs[0]:.4g}"))

    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        try:
            a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
            c = torch.empty(n, n, device=device, dtype=dtype)
            rate(name, lambda a=a, b=b, c=c: torch.mm(a, b, out=c))
        except Exception:  # noqa: BLE001 - a dtype without a matmul kernel on this device
            out[name] = best[name] = None
    out["fp8"] = best["fp8"] = None
    if cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9):
        a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=device)
        for scaling, sa, sb in (("rowwise", torch.ones(n, 1, device=device), torch.ones(1, n, device=device)),
                                ("tensorwise", one, one)):
            try:
                rate("fp8", lambda sa=sa, sb=sb: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                                  out_dtype=torch.bfloat16))
            except Exception:  # noqa: BLE001 - this scaling is not supported here
                continue
            scaling_used = scaling
            break
    _PEAK_CACHE[key] = {"tflops": out, "best_tflops": best, "spread": spread, "n": n,
                        "fp8_scaling": scaling_used, "timing": dict(timing)}
    return _PEAK_CACHE[key]


def achieved(flops_per_step: int | None, it_s: float | None, peak: dict[str, Any], dtype_key: str) -> dict[str, Any]:
    """``achieved_tflops`` (FLOPs per step x it/s) and ``pct_of_peak`` against ``peak[dtype_key]``
    (``peak``: the ``"tflops"`` dict of :func:`device_peak`)."""
    if not flops_per_step or not it_s:
        return {"achieved_tflops": None, "pct_of_peak": None}
    tflops = flops_per_step * it_s / 1e12
    p = peak.get(dtype_key)
    return {"achieved_tflops": tflops, "pct_of_peak": 100.0 * tflops / p if p else None}


#: kernel name fragment -> category, first match wins (lower-case names; cuBLAS/cuDNN/CUTLASS/
#: Triton/ATen naming on Hopper; "other" collects the rest)
KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("conv", ("conv", "fprop", "dgrad", "wgrad", "winograd", "implicit_convolve")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "ampere_", "hopper", "cublas", "matmul",
              "scaled_mm", "::mm", "_mm", "addmm", "bmm")),
    ("triton", ("triton",)),
    ("norm", ("norm",)),
    ("copy", ("memcpy", "memset", "copy", "cat")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "unrolled", "index")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    # Inductor's generated kernels are named after the ops they fused ("triton_poi_fused_convolution_
    # silu_3" is a pointwise epilogue, not a convolution); only its templates are GEMMs/convs
    if low.startswith("triton_") and not low.startswith("triton_tem"):
        return "triton"
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _device_us(evt: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def _is_device_event(evt: Any) -> bool:
    return str(getattr(evt, "device_type", "")).endswith("CUDA")


def idle_gaps(events: Any, steps: int, top: int = 8, min_us: float = 20.0) -> dict[str, Any]:
    """Where the GPU waited, from a profiler's event list (``prof.events()``): the gaps of at least
    ``min_us`` between one kernel (any stream) ending and the next starting, per step, and the
    ``top`` largest with the kernels on either side and the host's ``aten::`` ops running in the
    gap (the ones with the most time inside it: what the host was doing while the GPU had nothing
    queued). Empty without device events."""
    steps = max(steps, 1)
    kernels = sorted((float(e.time_range.start), float(e.time_range.end), str(e.name))
                     for e in events if _is_device_event(e))
    if len(kernels) < 2:
        return {}
    gaps: list[tuple[float, float, float, str, str]] = []
    busy_end, last = kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start - busy_end >= min_us:
            gaps.append((start - busy_end, busy_end, start, last, name))
        if end >= busy_end:
            busy_end, last = end, name
    host = sorted((float(e.time_range.start), float(e.time_range.end), str(e.name))
                  for e in events if not _is_device_event(e) and str(e.name).startswith("aten::"))
    starts = [h[0] for h in host]
    longest = max((h[1] - h[0] for h in host), default=0.0)
    largest = []
    for us, a, b, before, after in sorted(gaps, reverse=True)[:top]:
        inside: dict[str, float] = {}
        # only ops starting after (a - the longest op) can reach into the gap
        for j in range(bisect.bisect_left(starts, a - longest), len(host)):
            h_start, h_end, name = host[j]
            if h_start >= b:
                break
            overlap = min(h_end, b) - max(h_start, a)
            if overlap > 0:
                inside[name] = inside.get(name, 0.0) + overlap
        largest.append({
            "us": round(us, 1), "after_kernel": before[:90], "before_kernel": after[:90],
            "host_ops": [f"{n} {round(v, 1)}us" for n, v in sorted(inside.items(), key=lambda kv: -kv[1])[:4]],
        })
    return {
        "min_gap_us": min_us,
        "idle_ms_per_step": round(sum(g[0] for g in gaps) / 1000.0 / steps, 3),
        "gaps_per_step": round(len(gaps) / steps, 1),
        "span_ms_per_step": round((busy_end - kernels[0][0]) / 1000.0 / steps, 3),
        "largest": largest,
    }


def calls_by_position(events: Any, names: Iterable[str], steps: int, max_calls: int = 80) -> dict[str, list[float]]:
    """For each kernel in ``names`` that runs a whole number of times per step (at most
    ``max_calls``): its mean duration in microseconds at each position within a step (the i-th call
    of every step), from a profiler's event list. Says whether one kernel runs slower in some
    blocks than in others (e.g. Flux's attention in double vs single blocks)."""
    steps = max(steps, 1)
    wanted = set(names)
    calls: dict[str, list[float]] = {}
    for e in sorted((e for e in events if _is_device_event(e) and str(e.name) in wanted),
                    key=lambda e: float(e.time_range.start)):
        calls.setdefault(str(e.name), []).append(float(e.time_range.end) - float(e.time_range.start))
    out: dict[str, list[float]] = {}
    for name, durations in calls.items():
        per_step, extra = divmod(len(durations), steps)
        if not 0 < per_step <= max_calls or extra > per_step // 2:
            continue
        # a call or two outside the sampling loop (a warm-up, a final decode) come first: the loop's
        # calls are the last ``per_step * steps``
        durations = durations[-per_step * steps:]
        out[name[:160]] = [round(sum(durations[s * per_step + i] for s in range(steps)) / steps, 1)
                           for i in range(per_step)]
    return out


def kernel_breakdown(prof: Any, steps: int, wall_s: float, top: int = 15, cuda: bool = True) -> dict[str, Any]:
    """GPU kernel time of one profiled sampling run, per step: by category and the top kernels
    (``cuda=False``: self CPU time of the ``aten::`` ops instead, for CPU runs).

    ``gpu_busy_ms_per_step`` vs ``wall_ms_per_step`` shows how much of a step the GPU idles
    (launch overhead, host work between kernels); the profiler itself adds host overhead, so the
    wall figure is an upper bound.
    """
    steps = max(steps, 1)
    kernels: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        if cuda:
            us = _device_us(evt) if str(getattr(evt, "device_type", "")).endswith("CUDA") else 0.0
        else:
            us = float(evt.self_cpu_time_total) if evt.key.startswith("aten::") else 0.0
        if us > 0:
            k = kernels.setdefault(evt.key, [0.0, 0])
            k[0] += us
            k[1] += int(evt.count)
    total_us = sum(v[0] for v in kernels.values())
    category = {name: kernel_category(name) for name in kernels}
    cats: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        cats[category[name]] = cats.get(category[name], 0.0) + us
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    events = prof.events() if cuda else None  # the profiler's event list, built once for both analyses
    return {
        "steps": steps,
        "wall_ms_per_step": 1000.0 * wall_s / steps,
        "gpu_busy_ms_per_step": total_us / 1000.0 / steps,
        "kernels_per_step": sum(v[1] for v in kernels.values()) / steps,
        "by_category_ms_per_step": {c: round(us / 1000.0 / steps, 3) for c, us in
                                    sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "category": category[n], "ms_per_step": round(us / 1000.0 / steps, 3),
                         "calls_per_step": round(c / steps, 1)} for n, (us, c) in ranked],
        # every generated (Triton) kernel, to compare two compiles of one model kernel by kernel
        "triton_kernels": {n: [round(us / 1000.0 / steps, 4), round(c / steps, 1)]
                           for n, (us, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])
                           if category[n] == "triton" or n.startswith("triton_")},
        # where the GPU waited between kernels, and what the host ran meanwhile (GPU runs only)
        "idle_gaps": idle_gaps(events, steps) if cuda else {},
        # the largest kernels' durations by position within a step (GPU runs only)
        "calls_by_position": calls_by_position(events, [n for n, _ in ranked[:6]], steps) if cuda else {},
    }


def compile_phases(min_s: float = 0.5) -> dict[str, float]:
    """Dynamo/Inductor's own phase timers (``torch._dynamo.utils.compile_times``), seconds summed
    over every compile so far in this process, phases of at least ``min_s``. Phases nest
    (``_compile.compile_inner`` contains ``bytecode_tracing`` and ``OutputGraph.call_user_compiler``),
    so they do not add up; they say where a warm-up went (tracing, cache loads, kernel loads)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
    except Exception:  # noqa: BLE001 - diagnostics only, API differs between torch versions
        return {}
    out = {}
    for name, value in zip(names, values, strict=False):
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if v >= min_s:
            out[name] = round(v, 2)
    return out


def host_breakdown(prof: Any, steps: int, wall_s: float, top: int = 25) -> dict[str, Any]:
    """Host (Python) time of one ``cProfile``d sampling run, per step: the functions with the most
    own time and those with the most cumulative time (cProfile's overhead inflates both; compare
    functions with each other, not with the unprofiled wall time)."""
    import pstats

    steps = max(steps, 1)
    st = pstats.Stats(prof)
    rows = []
    for (path, line, fn), (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{Path(path).name}:{line}({fn})" if line else fn, ncalls, tottime, cumtime))

    def pick(key: int) -> list[dict[str, Any]]:
        ranked = sorted(rows, key=lambda r: -r[key])[:top]
        return [{"fn": r[0][:160], "calls_per_step": round(r[1] / steps, 1),
                 "self_ms_per_step": round(1000.0 * r[2] / steps, 3),
                 "cum_ms_per_step": round(1000.0 * r[3] / steps, 3)} for r in ranked]

    return {
        "steps": steps,
        "wall_ms_per_step": 1000.0 * wall_s / steps,
        "top_self": pick(2),
        "top_cumulative": pick(3),
    }


def cudagraph_state() -> dict[str, Any]:
    """CUDA-graph trees' state after the runs: Inductor's cudagraph counters (``cudagraph_skips``:
    graphs or calls that fell back to running their kernels one by one) and the tree manager's
    re-record counts (a node re-recorded past ``cudagraph_unexpected_rerecord_limit`` runs eager)."""
    out: dict[str, Any] = {}
    try:
        from torch._dynamo.utils import counters

        out["counters"] = {k: int(v) for k, v in counters["inductor"].items() if "cudagraph" in k}
        from torch._inductor import cudagraph_trees

        mgr = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if mgr is not None:
            rerecords = [n for per_node in mgr.num_rerecord.values() for n in per_node.values()]
            out["functions"] = len(mgr.ids_to_funcs)
            out["rerecords_total"] = int(sum(rerecords))
            out["rerecords_max"] = int(max(rerecords, default=0))
            out["rerecord_limit"] = int(torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit)
            out["warmed_up_functions"] = len(mgr.warmed_up_functions)
    except Exception as e:  # noqa: BLE001 - diagnostics only, internals differ between torch versions
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def capture_graph(fn: Callable[[], Any], calls: int = 20) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph, after three warm-up calls
    on a side stream (CUDA only)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graph(fn: Callable[[], Any], calls: int = 20) -> float:
    """Seconds per call of ``fn`` replayed ``calls`` times from one CUDA graph (best of 5): for
    kernels shorter than a Python call, whose eager timing measures the host (CUDA only)."""
    graph = capture_graph(fn, calls)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def run_kernel_cases(cases: Iterable[str], measure: Callable[[str], dict[str, Any]], output_json: Path | None) -> list[dict[str, Any]]:
    """A kernel microbenchmark's cases: each ``measure(case)`` row printed as one JSON line as it
    finishes, then all of them written to ``output_json`` (with the device and torch version)."""
    torch._dynamo.config.cache_size_limit = 64  # one compiled variant per case and configuration
    rows = []
    for case in cases:
        row = measure(case)
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
        rows.append(row)
    if output_json:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": rows}
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(result, indent=1))
    return rows
