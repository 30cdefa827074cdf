"""Host code a model calls, kept inside one compiled graph as an opaque op.

Some code a model runs cannot be traced: it reads a tensor's value on the host and branches on it
(``sigma = sigmas[0].item(); if sigma > start: ...``). Dynamo then breaks the graph there, and a
model that calls such code in every layer compiles into hundreds of pieces, each entered through
its guards and run apart: slower than eager (an SDXL UNet with an attention patch like that in all
70 cross-attention layers: 0.58x eager, BENCHMARKS.md, run274).

``nexfort::host_call`` keeps that code out of the trace instead: the graph holds one call of the op
whose result has a declared form (the first tensor's size, dtype and device; contiguous), and at
run time the op runs a *resolver*, a Python function registered here by name, eagerly on the real
tensors. The graph stays whole; Dynamo never sees the host read, so no guard follows its value.

- A resolver gets ``(tensors, ints, spec)``: the tensors the graph passes, integers (sizes may be
  symbolic while tracing, and are concrete here) and a string the caller composed at trace time.
  What it needs beyond them (the call's options, the current sampling step's objects) the host
  hands it through :func:`live`, around the compiled call: the graph never carries Python objects.
- Resolvers are named, not numbered: a saved graph holds the name, and the next process finds the
  resolver its host registered again at import.
- A CUDA-graph replay would skip the host code, so the op carries ``cudagraph_unsafe``: where torch
  has the tag and Inductor's graph partition (:func:`partitions_cudagraphs`), Inductor cuts the
  graph around each call and replays the pieces between them as CUDA graphs, the host code running
  eagerly in between; elsewhere the engine turns CUDA graphs off for a graph that holds the op
  (:func:`in_graph`). Either way a host call that reads a tensor's value (``.item()``) waits for the
  GPU; with CUDA graphs the next piece is launched at once, without them every kernel launch of the
  next piece waits for the host.

The torch reference twin is the resolver itself, called eagerly (:func:`run`), as the op does.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: a resolver: ``(tensors, ints, spec) -> tensor shaped like tensors[0]``
Resolver = Callable[[list[torch.Tensor], list[int], str], torch.Tensor]

RESOLVERS: dict[str, Resolver] = {}
_local = threading.local()


class HostCallError(RuntimeError):
    """A host call without a resolver, or one whose result has not the declared form."""


def register(name: str, resolver: Resolver) -> None:
    """Register ``resolver`` under ``name`` (a later registration replaces it: a reloaded host)."""
    RESOLVERS[name] = resolver


@contextlib.contextmanager
def live(state: Any) -> Iterator[None]:
    """``state`` is what :func:`current` returns to resolvers run inside this block (the host's
    objects for the call about to run). Blocks nest; the innermost wins."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(state)
    try:
        yield
    finally:
        stack.pop()


def current() -> Any:
    """The state of the innermost :func:`live` block, or ``None``."""
    stack = _local.__dict__.get("stack")
    return stack[-1] if stack else None


def run(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    """The op's body (and its eager twin): ``resolver`` on the real tensors, its result checked
    against the declared form and returned contiguous, never sharing an input's memory."""
    fn = RESOLVERS.get(resolver)
    if fn is None:
        raise HostCallError(f"nexfort host call: no resolver {resolver!r} is registered "
                            f"(registered: {sorted(RESOLVERS) or 'none'})")
    like = tensors[0]
    out = fn(list(tensors), [int(i) for i in ints], spec)
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype \
            or out.device != like.device:
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise HostCallError(f"nexfort host call {resolver!r} returned {got}; the graph expects "
                            f"{tuple(like.shape)} {like.dtype} on {like.device}")
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if out.untyped_storage().data_ptr() in storages:
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

#: ``NEXFORT_HOST_CALL_CUDAGRAPHS=0``: a graph holding a host call runs without CUDA graphs even
#: where Inductor could partition it (for A/B measurements)
ENV_CUDAGRAPHS = "NEXFORT_HOST_CALL_CUDAGRAPHS"


def partitions_cudagraphs() -> bool:
    """Whether Inductor can replay a graph that holds host calls as CUDA graphs between them: torch
    tags the op ``cudagraph_unsafe`` and has graph partition (torch 2.9+), and the A/B switch is on."""
    from torch._inductor import config as inductor_config

    return bool(_TAGS) and hasattr(inductor_config, "graph_partition") \
        and os.environ.get(ENV_CUDAGRAPHS, "1") != "0"


@torch.library.custom_op("nexfort::host_call", mutates_args=(), tags=_TAGS)
def _host_call(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    return run(tensors, resolver, ints, spec)


@_host_call.register_fake
def _host_call_fake(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    like = tensors[0]
    return like.new_empty(like.shape)


def call(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    """``resolver`` run on the host at this point of the graph (eagerly when not compiling)."""
    return torch.ops.nexfort.host_call.default(tensors, resolver, ints, spec)


OP = torch.ops.nexfort.host_call


def count(gm: torch.fx.GraphModule) -> int:
    """How many host calls ``gm`` (a Dynamo or an aten graph) makes."""
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target in (OP, OP.default))


def in_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` makes a host call."""
    return count(gm) > 0
