"""Measurements: per-step timing, peak memory, compile counters, and errors between latents.

Step timing records a CUDA event in the sampler's per-step callback (no synchronisation inside
the loop, so CPU/GPU overlap between steps is kept) and reads the intervals after one sync at the
end; on the CPU it reads the host clock. ``it/s`` is steps over the time from the first step's
end to the last step's end, divided by (steps - 1): the steady sampling loop, without sampler
set-up, the first step's launch latency or the copy of the result.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepTimer:
    """Callback for ``comfy.sample.sample``: marks the end of each step."""

    device: torch.device
    marks: list[Any] = field(default_factory=list)

    def __call__(self, step: int, x0: Any, x: Any, total_steps: int) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

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
        "compile_seconds": float(s.get("compile_seconds", 0.0)),
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
