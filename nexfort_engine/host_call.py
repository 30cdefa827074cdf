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
- A background compile's child runs the graph it compiled once, with no host state: there the
  calls return zeros (:func:`placeholders`); nobody reads that output.
- A CUDA-graph replay would skip the host code, so the op carries ``cudagraph_unsafe``: Inductor's
  graph partition (torch 2.11, :func:`partitions_cudagraphs`; the engine's CUDA-graph settings turn
  it on at compile and at load) cuts the graph around each call and replays the pieces between
  them as CUDA graphs, the host code running eagerly in between (SDXL with 70 calls: 77 pieces).
  Where torch cannot partition, the engine turns CUDA graphs off for a graph that holds the op.

The torch reference twin is the resolver itself, called eagerly (:func:`run`), as the op does.

A host read of a GPU tensor (``sigmas.cpu()[0].item()``) waits until the GPU has finished all the
work queued before it: with one in every layer, the GPU idles while the host launches each next
piece (SDXL with 70 such reads: 13.7 it/s where the same graph without them runs at about 30).
:func:`host_copied` hands resolvers such a tensor wrapped so that its host reads are answered from
a copy taken once, without blocking, when the wrapper is made; any other use is the device
tensor's, unchanged. :class:`HostCopied`'s twin is the tensor it wraps (the same reads, blocking).
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def placeholders() -> Iterator[None]:
    """Host calls inside this block (this thread) return zeros of their declared form without
    calling their resolvers: for a process that compiles a graph for another one and reads none of
    its outputs (a background compile's child, which has not the host's live state)."""
    before = getattr(_local, "placeholders", False)
    _local.placeholders = True
    try:
        yield
    finally:
        _local.placeholders = before


def run(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    """The op's body (and its eager twin): ``resolver`` on the real tensors, its result checked
    against the declared form and returned contiguous, never sharing an input's memory."""
    if getattr(_local, "placeholders", False):
        return torch.zeros_like(tensors[0], memory_format=torch.contiguous_format)
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


def partitions_cudagraphs() -> bool:
    """Whether Inductor replays a graph that holds host calls as CUDA graphs between them: torch
    tags the op ``cudagraph_unsafe`` and has graph partition (both in torch 2.11, the floor). The
    engine's CUDA-graph settings turn partition on at compile and at load alike (settings.py)."""
    from torch._inductor import config as inductor_config

    return bool(_TAGS) and hasattr(inductor_config, "graph_partition")


# A ``torch.library.Library`` op, not a ``torch.library.custom_op``: the latter runs three more Python
# layers per call (its autograd wrapper, a redispatch, an aliasing check), 19-37 us against 7-11 us a
# call on the CPU here, and a UNet with an attention patch in every layer makes 70 host calls a step.
# :func:`run` does the aliasing check itself; nothing here has a gradient (ComfyUI samples without).
_LIB = torch.library.Library("nexfort", "FRAGMENT")
_LIB.define("host_call(Tensor[] tensors, str resolver, SymInt[] ints, str spec) -> Tensor", tags=_TAGS)
_LIB.impl("host_call", run, "CompositeExplicitAutograd")


@torch.library.register_fake("nexfort::host_call", lib=_LIB)
def _host_call_fake(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    like = tensors[0]
    return like.new_empty(like.shape)


def call(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
    """``resolver`` run on the host at this point of the graph (eagerly when not compiling)."""
    return torch.ops.nexfort.host_call.default(tensors, resolver, ints, spec)


OP = torch.ops.nexfort.host_call


# -- values a host call carries: integers (symbolic while tracing) and a spec string ---------------

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
_SEP = "\x1f"


def encode(value: Any, ints: list[Any]) -> str | None:
    """``value`` as a short code for a host call's spec: None, bools, integers (appended to
    ``ints``: they may be symbolic sizes while tracing), strings, float dtypes, and lists and tuples
    of them; ``None`` for anything else (the op cannot carry it)."""
    if value is None:
        return "n"
    if isinstance(value, bool):
        return "b1" if value else "b0"
    if isinstance(value, (int, torch.SymInt)):
        ints.append(value)
        return "i"
    if isinstance(value, str):
        return "s" + str(len(value)) + ":" + value
    if isinstance(value, torch.dtype):
        for name, dtype in _DTYPES.items():
            if value == dtype:
                return "d" + name + ";"
        return None
    if isinstance(value, (list, tuple)):
        inner, own = [], []  # its integers join ``ints`` only if all of it can be carried
        for item in value:
            code = encode(item, own)
            if code is None:
                return None
            inner.append(code)
        ints.extend(own)
        return ("l" if isinstance(value, list) else "t") + str(len(inner)) + ":" + "".join(inner)
    return None


def _decode(code: str, pos: int, ints: list[int], at: list[int]) -> tuple[Any, int]:
    tag = code[pos]
    if tag == "n":
        return None, pos + 1
    if tag == "b":
        return code[pos + 1] == "1", pos + 2
    if tag == "i":
        at[0] += 1
        return ints[at[0] - 1], pos + 1
    if tag == "d":
        end = code.index(";", pos)
        return _DTYPES[code[pos + 1:end]], end + 1
    colon = code.index(":", pos)
    n = int(code[pos + 1:colon])
    pos = colon + 1
    if tag == "s":
        return code[pos:pos + n], pos + n
    items = []
    for _ in range(n):
        item, pos = _decode(code, pos, ints, at)
        items.append(item)
    return (items if tag == "l" else tuple(items)), pos


def spec(tag: str, values: dict[str, Any], ints: list[Any]) -> str:
    """A spec holding ``tag`` and each of ``values`` that :func:`encode` can carry (the others are
    left out), its integers appended to ``ints``."""
    parts = [tag]
    for key, value in values.items():
        if (code := encode(value, ints)) is not None:
            parts.append(key + "=" + code)
    return _SEP.join(parts)


#: decoded specs by ``(spec, ints)``, with the keys of their list values: a graph makes the same few
#: calls every step (SDXL with an attention patch: 70)
_DECODED: dict[tuple[str, tuple[int, ...]], tuple[str, dict[str, Any], tuple[str, ...]]] = {}
_DECODED_MAX = 4096


def _fresh(value: Any) -> Any:
    """``value`` with its lists copied (a caller may change a list it was handed; tuples and the
    rest are immutable)."""
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    return value


def _holds_list(value: Any) -> bool:
    return isinstance(value, list) or (isinstance(value, tuple) and any(_holds_list(v) for v in value))


def decode(text: str, ints: list[int]) -> tuple[str, dict[str, Any]]:
    """``(tag, {key: value})`` from a :func:`spec` and the integers the op passed; a new dict (and
    new lists) each call, parsed once per distinct ``(text, ints)``."""
    key = (text, tuple(ints))
    hit = _DECODED.get(key)
    if hit is None:
        tag, *parts = text.split(_SEP)
        at = [0]
        values = {}
        for part in parts:
            name, _, code = part.partition("=")
            values[name], _ = _decode(code, 0, ints, at)
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        hit = _DECODED[key] = (tag, values, tuple(k for k, v in values.items() if _holds_list(v)))
    tag, values, lists = hit
    out = dict(values)
    for name in lists:
        out[name] = _fresh(out[name])
    return tag, out


class StandIn:
    """Stands in, inside a traced model, for host code the model calls as ``fn(*tensors, options)``
    (ComfyUI's attention replace patches: ``patch(q, k, v, extra_options)``): one host call of
    ``resolver``, shaped like the first tensor, whose spec carries ``tag`` and the values of
    ``keys`` found in ``options`` (:func:`spec`); the resolver finds the rest in the host's live
    state. An engine object: it pickles as itself, so a background compile's child traces the same
    op (and runs :func:`placeholders`); copies are the object itself."""

    def __init__(self, resolver: str, tag: str, keys: tuple[str, ...]) -> None:
        self.resolver, self.tag, self.keys = resolver, tag, tuple(keys)

    def __call__(self, *args: Any) -> torch.Tensor:
        *tensors, options = args
        ints: list[Any] = []
        text = spec(self.tag, {k: options[k] for k in self.keys if k in options}, ints)
        return call(list(tensors), self.resolver, ints, text)

    def __copy__(self) -> StandIn:
        return self

    def __deepcopy__(self, memo: dict) -> StandIn:
        return self

    def __repr__(self) -> str:
        return f"StandIn({self.resolver!r}, {self.tag!r})"


def count(gm: torch.fx.GraphModule) -> int:
    """How many host calls ``gm`` (a Dynamo or an aten graph) makes."""
    return sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target in (OP, OP.default))


def in_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` makes a host call."""
    return count(gm) > 0


#: the reads :class:`HostCopied` answers from its host copy (``Tensor.numpy`` needs a CPU tensor:
#: ``t.cpu().numpy()`` is covered by ``cpu``)
_HOST_READS = (torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__bool__)
#: what keeps a :class:`HostCopied` (the same values, so the same host copy, indexed alike)
_KEEPS = (torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.__getitem__)


def _plain_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


class HostCopied(torch.Tensor):
    """A device tensor whose host reads (``.cpu()``, ``.to("cpu")``, ``.item()``, ``.tolist()``,
    ``float()``, ``int()``, ``bool()``) come from a copy of its values taken when it was made (see
    :func:`host_copied`). ``detach``, ``clone`` and plain indexing keep the wrapper; every other
    operation runs on the device tensor and returns plain tensors."""

    _nx_host: torch.Tensor
    #: ``[event]`` until the copy is known to have landed, then ``[None]``: shared by the wrappers
    #: ``detach``/``clone``/indexing make (a patch reads ``sigmas.detach().cpu()`` in every layer:
    #: one wait per copy, not one per layer)
    _nx_ready: list[Any]

    @classmethod
    def _wrap(cls, device: torch.Tensor, host: torch.Tensor, ready: list[Any]) -> HostCopied:
        out = device.as_subclass(cls)
        out._nx_host, out._nx_ready = host, ready
        return out

    def _host(self) -> torch.Tensor:
        ready = self._nx_ready
        if ready[0] is not None:  # the non-blocking copy has landed once this returns
            ready[0].synchronize()
            ready[0] = None
        return self._nx_host

    def __deepcopy__(self, memo: dict) -> HostCopied:
        with torch._C.DisableTorchFunctionSubclass():
            device = self.clone()
        # the copy once it has landed (a clone of the pinned buffer before that could be stale)
        return HostCopied._wrap(device, self._host().clone(), [None])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        me = args[0] if args else None
        if isinstance(me, HostCopied):
            if func in _HOST_READS and len(args) == 1 and not kwargs:
                host = me._host()
                return host.clone() if func is torch.Tensor.cpu else func(host)
            if func is torch.Tensor.to:
                device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
                if device is not None and device.type == "cpu":
                    host = me._host()
                    return host.to(dtype=dtype or host.dtype, memory_format=memory_format or torch.preserve_format,
                                    copy=True)
            if func in _KEEPS and (func is not torch.Tensor.__getitem__ or _plain_index(args[1])):
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                # the same host copy (never written after the copy: reads hand out clones), indexed
                # alike; no wait here, the new wrapper waits for the same copy at its first read
                host = me._nx_host[args[1]] if func is torch.Tensor.__getitem__ else me._nx_host
                return cls._wrap(out, host, me._nx_ready)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def host_copied(t: torch.Tensor) -> torch.Tensor:
    """``t`` wrapped as :class:`HostCopied`: on a CUDA device its values are copied to pinned host
    memory now without blocking (the first host read waits for that copy only, not for the rest of
    the GPU's queue); elsewhere the copy is plain. A tensor that is already wrapped is returned."""
    if isinstance(t, HostCopied):
        return t
    src = t.detach()
    if src.is_cuda:
        host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        host.copy_(src, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(src.device))
        return HostCopied._wrap(t, host, [ready])
    return HostCopied._wrap(t, src.to("cpu", copy=True), [None])
