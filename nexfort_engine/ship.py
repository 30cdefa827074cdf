"""A part of a traced graph, pickled for the compile worker that compiles it (split.py).

What: :func:`dumps` turns a :class:`~nexfort_engine.split.Part` (a Dynamo-level ``GraphModule``
and the fake values of its inputs, symbolic sizes included) into bytes; :func:`loads` rebuilds it
in another process, in a fresh ``FakeTensorMode`` whose shape environment is a copy of the
sender's (the same symbols, hints, ranges, replacements and guards). A compile worker compiles the
rebuilt part exactly as the sender would compile the original: AOTAutograd and Inductor read the
graph, the fake inputs, and the few things Dynamo leaves for them (each placeholder's
``_dynamo_source``, the graph's ``_param_name_to_source`` and ``dynamo_compile_id``, the
``tensor_dict`` that marks parameters as static inputs for CUDA graphs).

Why: before this, every compile worker started from the model itself: it received the model with
zero-filled weights (a second copy of the weights on the GPU per worker), traced it as the caller
did (six traces at once: SDXL 27 s instead of about 20 s alone, run183) and cut the graph the same
way. Shipping the caller's part instead, a worker needs neither the model nor the device memory
for its weights, and starts compiling as soon as the caller has cut the graph.

How: torch's ``GraphPickler`` handles fake tensors, symbolic sizes and the shape environment. The
graph itself is sent as its nodes (op, name, target, type, arguments, and the node metadata listed
in :data:`NODE_META`): ``GraphPickler`` pickles only targets under ``torch``/``operator``/...,
and the engine's graph passes put functions of their own into the graph (pickled here by
reference: module and qualified name, imported by the worker). A fake tensor that is a view keeps
its base; the base's fake mode is dropped before pickling (torch 2.11-2.14 keep it there, and a
fake mode does not pickle) and set again on loading, which ``GraphPickler`` already does. The
fake values in the metadata of the graph's computing nodes travel as plain tensors of the same
layout, not as views (:func:`_flat_values`).

Safety: what cannot be pickled raises :class:`ShipError`, and the caller compiles that part
itself. The worker's compiled part comes back with the index and fingerprint it was sent, and its
new size guards are checked in the caller (split.apply_guards).

Imported only where a graph is cut (it imports torch's graph pickler, which imports Inductor).

Twin: the part compiled in the caller's own process (``"compile_workers": 1``, or a part whose
worker did not deliver).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options, _TensorPickleData
from torch.fx.experimental.symbolic_shapes import ShapeEnv

try:  # torch >= 2.12: slices in a graph's arguments are pytree nodes while pickling
    from torch.fx._graph_pickler import patch_pytree_map_over_slice
except ImportError:  # torch 2.11: the engine's own argument walk (_swap) handles slices
    patch_pytree_map_over_slice = contextlib.nullcontext

#: node metadata that travels (the rest is for debugging and stack traces of errors, and holds
#: objects that do not pickle: module stacks, source functions)
NODE_META = ("example_value", "val", "tensor_dict", "stack_trace")
#: graph-module metadata that travels (AOTAutograd reads it to know the graph came from Dynamo)
MODULE_META = ("dynamo_compile_id", "dynamo_flat_name_to_original_fqn")


class ShipError(RuntimeError):
    """A part that cannot be pickled (the message says what); the caller compiles it itself."""


@dataclasses.dataclass(frozen=True)
class _Arg:
    """A node argument, by the node's name (not a tuple: ``map_aggregate`` keeps it whole)."""

    name: str


def _module_state(gm: fx.GraphModule) -> dict[str, Any]:
    nodes = []
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        args = fx.node.map_arg(n.args, lambda a: _Arg(a.name))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: _Arg(a.name))
        meta = {k: n.meta[k] for k in NODE_META if k in n.meta}
        source = getattr(n, "_dynamo_source", None) if n.op == "placeholder" else None
        nodes.append((n.op, n.name, n.target, n.type, args, kwargs, meta, source))
        if n.op == "get_attr":
            attrs[str(n.target)] = _get_attr(gm, str(n.target))
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        # AOTAutograd reads the sources of the module's own parameters and buffers only
        # (``frontend_utils``); every part of a cut carries the whole model's (SDXL-topology:
        # 27,000 nested sources per part; shipping 7 parts took 2.1-3.0 s of CPU time with them
        # and 0.8-1.4 s without, on the CPU box)
        own = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        own.update(name for name, _ in gm.named_buffers(remove_duplicate=False))
        sources = {k: v for k, v in sources.items() if k in own}
    return {
        "nodes": nodes,
        "attrs": attrs,
        "param_sources": sources,
        "meta": {k: gm.meta[k] for k in MODULE_META if k in gm.meta},
    }


def _get_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for name in target.split("."):
        obj = getattr(obj, name)
    return obj


def _set_attr(root: torch.nn.Module, target: str, value: Any) -> None:
    *path, last = target.split(".")
    obj: Any = root
    for name in path:
        if not hasattr(obj, name):
            setattr(obj, name, torch.nn.Module())
        obj = getattr(obj, name)
    if isinstance(value, torch.nn.Module):
        obj.add_module(last, value)
    elif isinstance(value, torch.nn.Parameter):
        obj.register_parameter(last, value)
    elif isinstance(value, torch.Tensor):
        obj.register_buffer(last, value)
    else:
        setattr(obj, last, value)


def _swap(obj: Any, env: dict[str, fx.Node]) -> Any:
    """Arguments with :class:`_Arg` replaced by the rebuilt nodes."""
    return fx.node.map_aggregate(obj, lambda a: env[a.name] if isinstance(a, _Arg) else a)


def _rebuild_module(state: dict[str, Any]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, typ, args, kwargs, meta, source in state["nodes"]:
        node = graph.create_node(op, target, _swap(args, env), _swap(kwargs, env), name, typ)
        node.meta.update(meta)
        if op == "placeholder":
            node._dynamo_source = source  # type: ignore[attr-defined]
        env[name] = node
    root = torch.nn.Module()
    for target, value in state["attrs"].items():
        _set_attr(root, target, value)
    gm = fx.GraphModule(root, graph)
    if state["param_sources"] is not None:
        gm._param_name_to_source = state["param_sources"]
    gm.meta.update(state["meta"])
    return gm


class _Tensor(_TensorPickleData):
    """GraphPickler's fake tensor, with a view's base pickled without its fake mode; with ``flat``,
    a view is pickled as a tensor of its own (the same sizes, strides, storage offset and dtype)."""

    def __init__(self, describer: Any, t: torch.Tensor, flat: bool = False) -> None:
        super().__init__(describer, t)
        m = self.metadata
        if flat and m.is_view:
            self.metadata = dataclasses.replace(m, is_view=False, base=None, view_func=None)
        elif m.base is not None and getattr(m.base, "fake_mode", None) is not None:
            self.metadata = dataclasses.replace(m, base=dataclasses.replace(m.base, fake_mode=None))


def _flat_values(gm: fx.GraphModule) -> set[int]:
    """The fake values in the metadata of ``gm``'s computing nodes that need not stay views: the
    worker's compile reads their sizes (Inductor's pre-grad passes), AOTAutograd traces the graph
    again from its inputs, whose aliasing is what counts (they keep their bases). Rebuilding a view
    re-runs ``as_strided`` under the fake mode, with symbolic sizes: a third of a part's loading
    on the CPU box, and of its pickling."""
    inputs = {id(v) for n in gm.graph.nodes if n.op == "placeholder" for k in NODE_META
              if isinstance(v := n.meta.get(k), FakeTensor)}
    return {id(v) for n in gm.graph.nodes if n.op != "placeholder" for k in NODE_META
            if isinstance(v := n.meta.get(k), FakeTensor) and id(v) not in inputs}


class _PartPickler(GraphPickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, Options(ops_filter=None))
        self._flat: set[int] = set()

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, fx.GraphModule):
            self._flat |= _flat_values(obj)  # pickled with the state, after this
            return _rebuild_module, (_module_state(obj),)
        if isinstance(obj, FakeTensor):
            data = _Tensor(self._meta_tensor_describer, obj, flat=id(obj) in self._flat)
            return _Tensor.unpickle, (data, self._unpickle_state)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` (a part's graph module and fake inputs, in any container); raises :class:`ShipError`."""
    try:
        with patch_pytree_map_over_slice(), io.BytesIO() as stream:
            _PartPickler(stream).dump(obj)
            return stream.getvalue()
    except Exception as e:  # noqa: BLE001 - pickling raises many types; the part is compiled here instead
        text = str(e).splitlines()[0][:300] if str(e) else ""
        raise ShipError(f"{type(e).__name__}: {text}") from e


def loads(data: bytes) -> Any:
    """Rebuild what :func:`dumps` pickled, in a fresh fake mode with its own shape environment."""
    with patch_pytree_map_over_slice():
        return GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
