"""Host inputs moved to the GPU without stopping the host: pinned staging, asynchronous copy.

What: :func:`to_device_async` returns ``value`` with every CPU tensor in it (also inside lists and
tuples) copied to ``device`` as ``t.pin_memory().to(device, non_blocking=True)``. Other values,
and everything when ``device`` is not a CUDA device, come back unchanged.

Why: a copy from pageable host memory to the GPU makes the host wait until the stream has run
everything queued before it. A host that runs a sampler re-sends the same small CPU tensors every
step (ComfyUI's conditioning: text embeddings, pooled vectors, Flux's guidance), so the GPU's queue
ran dry once per step and then idled while the host launched the next step's first kernels:
on an H200, Flux O3 spent 93.6 ms per step of which the GPU was busy 86.7 (BENCHMARKS.md, tenth
session; the host's profile shows those three copies waiting 43.5 ms per step).

Why it is safe: ``pin_memory()`` copies the values into page-locked memory on the host, before
the call returns, so later changes to the source cannot reach the GPU copy; the pinned block comes
from torch's caching host allocator, which reuses it only after the stream's copy has completed.
The values, dtypes and shapes are the same; only where the tensor lives changes, which is where the
model would have moved it anyway.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["map_cpu_tensors", "to_device_async"]


def to_device_async(value: Any, device: torch.device) -> Any:
    """``value`` with its CPU tensors (top level, lists, tuples, named tuples) on CUDA ``device``,
    copied asynchronously from pinned memory; anything else unchanged."""
    if device.type != "cuda":
        return value
    return map_cpu_tensors(value, lambda t: t.pin_memory().to(device, non_blocking=True))


def map_cpu_tensors(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``move`` applied to each CPU tensor that needs no grad (top level, lists,
    tuples, named tuples; not dicts); containers without such a tensor come back as they are."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.requires_grad:
            return value
        return move(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        moved = [map_cpu_tensors(v, move) for v in value]
        if isinstance(value, list):
            return moved
        if hasattr(value, "_fields"):  # a named tuple takes its fields as arguments
            return type(value)(*moved)
        return type(value)(moved)
    return value
