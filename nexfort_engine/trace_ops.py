"""Stand-ins while Dynamo traces a saved graph: ``F.linear`` as an op that only allocates (a
cheaper trace), ``torch.linspace`` with a symbolic length (no size specialised).

What: while the engine traces a module into a saved graph (:func:`standing_in`, used around
``precompile.trace``), ``torch.nn.functional.linear`` is a Python function that, under Dynamo,
calls :func:`trace_linear`, a custom op whose fake implementation allocates the output and checks
nothing else. The backend turns every such node back into ``torch._C._nn.linear``
(:func:`restore`) before any pass, cut or compile sees the graph, so what Inductor compiles, what
the cache keys hash and what runs are the graphs the plain trace gives.

Why: Dynamo propagates fake tensors through every op it traces, in the caller's process, one
after the other, before any part of the graph can go to a compile worker. ``F.linear``'s fake
propagation under symbolic sizes goes through ATen's decomposition (reshape, ``mm`` or ``addmm``,
view back) with its size checks. On an H100 host SDXL's trace (the ``dynamo_trace`` phase) took
18.6-20.2 s with the stand-in against 20.5-22.8 s without (three pairs, run194); on the CPU box
the fake propagation of its 743 linears went from 3.4 to 1.4 s, with the whole trace within noise
(BENCHMARKS.md, twenty-eighth section). AOTAutograd still propagates through the real op
afterwards, in each part's compile, which the workers run in parallel.

Why it is safe:
- the stand-in's output has the sizes, strides, dtype and device the real op gives: an input of
  ``(..., in)`` and a weight ``(out, in)`` give a contiguous ``(..., out)`` tensor (ATen's linear
  folds the leading dims or calls ``matmul``; both return contiguous output);
- it stands in only where that holds: plain tensors (:func:`plain`: not subclasses, whose own
  dispatch knows ``aten.linear`` and not this op), a 2-D weight, matching dtypes (else the real op raises as
  eager does), no autocast (which would change the output dtype);
- outside a trace (another thread calling ``F.linear`` while the engine traces) it calls the real
  op: only Dynamo sees the stand-in. A Dynamo trace that another thread runs during the window
  would see it too (its graph computes the same, its guard on ``F.linear`` fails once restored);
  ComfyUI runs one prompt at a time. Two engine traces may overlap (a first compile holds the
  engine's lock, a recompile does not): :func:`standing_in` counts them and restores ``F.linear``
  when the last one ends;
- the saved graph's guard on ``F.linear`` is fingerprinted as the real function
  (:func:`originals`, given to ``precompile.GuardRecorder``), so the restored ``F.linear`` passes it:
  the stand-in never causes a recompile;
- the reference twin is the op itself: eagerly, :func:`trace_linear` is ``torch._C._nn.linear``.

``torch.linspace`` (:func:`linspace`, :func:`linspace_symbolic`): ComfyUI's Flux, Wan and
Qwen-Image build their rotary position ids with ``torch.linspace(0, n - 1, steps=n)`` where ``n``
is the latent's height or width in patches. ``linspace`` takes a plain int ``steps``, so Dynamo
specialises ``n`` (a guard such as ``(1 + W) // 2 == 4``) and a whole-model graph compiled for one
resolution recompiles at the next. While the engine traces, ``torch.linspace`` with a symbolic
``steps`` is computed from ``arange`` with ATen's own formula instead, and the length stays
symbolic. Unlike ``F.linear`` nothing is restored: those ops are the graph's. Only the saved-graph
trace swaps it (its guard on the stand-in is fingerprinted as ``torch.linspace``, as above); a
``torch.compile`` graph (regional compilation, fp8) would keep a live guard on the stand-in. Under
regional compilation the position ids are built outside the compiled blocks anyway. On the tiny
zoo (CPU, ``tests/nodes/test_patcher_families.py``): Flux, Wan 2.1 and Qwen-Image compiled whole
took a graph per resolution before (three over three sizes), one now, equal to eager within 1e-4.
Values: integer ids (the models' case) are the real op's exactly in float32/64; other spans within
an ulp; 16-bit dtypes computed in float32 and rounded once, closer to the exact values than ATen's
own 16-bit arithmetic (``tests/engine/test_trace_ops.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F

__all__ = ["linspace_symbolic", "originals", "plain", "restore", "standing_in", "trace_linear"]

#: the real function (``torch.nn.functional.linear`` is ``torch._C._nn.linear``)
_LINEAR = torch._C._nn.linear
#: the real ``torch.linspace``
_LINSPACE = torch.linspace


@torch.library.custom_op("nexfort::trace_linear", mutates_args=())
def trace_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (eager: exactly it), as one opaque node while Dynamo traces."""
    return _LINEAR(x, weight, bias)


@trace_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the module's parameters and buffers and the call's tensors are all plain tensors:
    a tensor subclass (ComfyUI's quantized or GGUF weights) dispatches ``aten.linear`` itself and
    would not know the stand-in. Checked once before the trace (inside it, a type test would be
    a guard evaluated on every call)."""
    from torch.utils._pytree import tree_leaves

    tensors = [*module.parameters(), *module.buffers(), *tree_leaves((args, kwargs))]
    return all(type(t) in _PLAIN for t in tensors if isinstance(t, torch.Tensor))


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``F.linear`` is while :func:`standing_in` is entered."""
    if (
        torch.compiler.is_compiling()
        and input.dim() >= 1
        and weight.dim() == 2
        and input.dtype == weight.dtype
        and (bias is None or bias.dtype == input.dtype)
        and not torch.is_autocast_enabled(input.device.type)
    ):
        return torch.ops.nexfort.trace_linear(input, weight, bias)
    return _LINEAR(input, weight, bias)


def linspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """What ``torch.linspace`` is while :func:`standing_in` is entered: under Dynamo, with an int
    (symbolic or not) ``steps`` and number ends, :func:`linspace_symbolic`; anywhere else the real op. No
    default arguments: Dynamo would guard on them (``__kwdefaults__``), and the real op, which a
    saved graph's guards are checked against, has none."""
    names = ("start", "end", "steps")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    steps = given.get("steps")
    dtype = given.get("dtype")
    if (
        torch.compiler.is_compiling()
        and len(args) <= 3
        # a SymInt under Dynamo, whose isinstance says int (not torch.SymInt); a plain int takes
        # the same formula (the same values, a static graph)
        and isinstance(steps, int)
        and not isinstance(steps, bool)
        and not isinstance(given.get("start"), torch.Tensor)
        and not isinstance(given.get("end"), torch.Tensor)
        and set(given) <= {*names, "dtype", "device", "layout", "requires_grad", "pin_memory"}
        and given.get("layout") in (None, torch.strided)
        and not given.get("requires_grad")
        and (dtype is None or dtype.is_floating_point)
    ):
        return linspace_symbolic(given["start"], given["end"], steps, dtype=dtype or torch.get_default_dtype(),
                                 device=given.get("device"))
    return _LINSPACE(*args, **kwargs)


def linspace_symbolic(start: Any, end: Any, steps: Any, *, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """``torch.linspace(start, end, steps)`` from ``arange``, whose length may stay symbolic under
    Dynamo (``linspace`` takes a plain int ``steps``: Dynamo specialises it, and with it the size it
    came from). ATen's kernel's formula: the first half counted up from ``start``, the second down
    from ``end``, in float32 for 16-bit dtypes. Its reference twin is ``torch.linspace``."""
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    idx = torch.arange(steps, device=device, dtype=torch.int64).to(compute)
    # the builtin, not torch.sym_max: Dynamo makes it sym_max for a SymInt and folds it for an
    # int, where torch 2.11 refuses torch.sym_max ('torch.* op returned non-Tensor')
    step = (end - start) / max(steps - 1, 1)
    # a 1-long span is its start, as ATen's (which special-cases it)
    out = torch.where(idx < max(steps // 2, 1), start + step * idx, end - step * (steps - 1 - idx))
    return out.to(dtype)


#: what :func:`standing_in` swaps: name -> (namespace, attribute, stand-in, real function)
_SWAPS: dict[str, tuple[Any, str, Any, Any]] = {
    "linear": (F, "linear", linear, _LINEAR),
    "linspace": (torch, "linspace", linspace, _LINSPACE),
}
_lock = threading.Lock()
#: per swap, how many :func:`standing_in` windows hold it (the real function is back at 0)
_depth = dict.fromkeys(_SWAPS, 0)


@functools.cache
def _cache_originals() -> None:
    """Let torch's caches that list ``torch.nn.functional``'s members see the real ``F.linear``
    before it is swapped: built inside the window (the process's first trace), they would hold
    the stand-in for good. Once per process: torch never clears them, and every compiled call on
    the ``torch.compile`` path enters :func:`standing_in`."""
    torch.overrides.get_overridable_functions()
    from torch._dynamo.variables.torch import get_overridable_functions

    get_overridable_functions()


@contextlib.contextmanager
def standing_in(enabled: bool = True, *, symbolic_linspace: bool = False) -> Iterator[None]:
    """``F.linear`` is :func:`linear` inside where ``enabled``, ``torch.linspace`` is
    :func:`linspace` where ``symbolic_linspace`` (re-entrant; restored on exit, also on an error)."""
    names = [name for name, on in (("linear", enabled), ("linspace", symbolic_linspace)) if on]
    if not names:
        yield
        return
    _cache_originals()
    with _lock:
        for name in names:
            namespace, attr, stand_in, _real = _SWAPS[name]
            _depth[name] += 1
            if _depth[name] == 1:
                setattr(namespace, attr, stand_in)
    try:
        yield
    finally:
        with _lock:
            for name in names:
                namespace, attr, _stand_in, real = _SWAPS[name]
                _depth[name] -= 1
                if _depth[name] == 0:
                    setattr(namespace, attr, real)


def originals() -> dict[int, Any]:
    """A stand-in's id -> the function it stands for: a guard on a stand-in is a guard on that."""
    return {id(stand_in): real for _namespace, _attr, stand_in, real in _SWAPS.values()}


def restore(gm: torch.fx.GraphModule) -> int:
    """Turn the stand-ins' nodes of a Dynamo graph back into the real op; how many."""
    ops = (torch.ops.nexfort.trace_linear, torch.ops.nexfort.trace_linear.default)
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            node.target = _LINEAR
            n += 1
    if n:
        gm.recompile()
    return n
