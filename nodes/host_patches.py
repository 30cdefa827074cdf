"""Attention replacements that read the host, run as host calls inside the compiled UNet.

Custom nodes such as IPAdapter (ComfyUI_IPAdapter_plus), InstantID and PuLID put an ``attn1`` or
``attn2`` *replace* patch on every attention layer of a UNet (``set_model_attn2_replace``). Each
call reads the step's sigma on the host (``extra_options["sigmas"].detach().cpu()[0].item()``) and
applies its extra attention only inside its start/end window. Dynamo cannot trace the read: the
graph breaks in every layer, and the compiled SDXL UNet ran at 0.58x eager, ComfyUI's own compile at
0.62x (run274).

Here such a patch is swapped, for the call, for the stand-in of its kind (:data:`STAND_INS`, a
``host_call.StandIn``): traced, it is one ``nexfort::host_call`` op shaped like the query (the
replace patch's contract: ComfyUI feeds its result to the layer's ``to_out``). At run time the op
finds the call's *own* patch at that layer in the options ComfyUI passed (:func:`prepare` hands them
over through ``host_call.live``) and calls it eagerly with the options it would have got, the step's
sigmas among them as a ``host_call.HostCopied`` (their host reads do not wait for the GPU). The UNet
stays one graph; the patch's sigma test, its weights, its images and its window never reach a
guard, so changing them compiles nothing.

Which patches: those whose code reads a tensor's value on the host (``.item()``, ``.tolist()``
among the names its code, its nested code or its class's methods use). Patches Dynamo can trace
(ComfyUI's own, e.g. Perturbed-Attention Guidance's) stay as they are, compiled into the graph.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from nexfort_engine import host_call

RESOLVER = "comfyui.attention_replace"
KINDS = ("attn1", "attn2")
#: what ComfyUI's UNet sets in its options while it runs (openaimodel.py, attention.py) or adds for
#: the layer (BasicTransformerBlock): the op carries their traced values, the rest come live
TRACED_KEYS = ("block", "block_index", "transformer_index", "original_shape", "activations_shape",
               "n_heads", "dim_head", "attn_precision")
HOST_READS = frozenset({"item", "tolist"})

_verdicts: dict[Any, bool] = {}


def _owner(patch: Any) -> Any:
    """What ``patch``'s code belongs to: a function (a partial's function), or the class of a
    callable object or of a bound method's object."""
    fn = getattr(patch, "func", None) if not isinstance(patch, (types.FunctionType, types.MethodType)) else None
    target = fn if callable(fn) else patch
    if isinstance(target, types.MethodType):
        target = target.__self__
    return target if isinstance(target, types.FunctionType) else type(target)


def _codes(owner: Any) -> list[types.CodeType]:
    """The code objects of :func:`_owner`'s result: a function's, or every method of a class."""
    if isinstance(owner, types.FunctionType):
        return [owner.__code__]
    out = []
    for klass in owner.__mro__:
        if klass is object:
            continue
        for value in vars(klass).values():
            value = getattr(value, "__func__", value)
            if isinstance(value, types.FunctionType):
                out.append(value.__code__)
    return out


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def reads_host(patch: Any) -> bool:
    """Whether ``patch``'s code reads a tensor's value on the host (see the module docstring);
    decided once per function code or class (this runs for every patch of every model call)."""
    owner = _owner(patch)
    key = owner.__code__ if isinstance(owner, types.FunctionType) else owner
    if key not in _verdicts:
        _verdicts[key] = any(_names(c) & HOST_READS for c in _codes(owner))
    return _verdicts[key]


#: one stand-in per kind (a new patch object, e.g. another IPAdapter weight, meets the same guards):
#: traced, a call is one host call of :data:`RESOLVER` shaped like the query, carrying its kind and
#: the values of :data:`TRACED_KEYS`; an engine object, so a background compile's child traces it too
STAND_INS = {kind: host_call.StandIn(RESOLVER, kind, TRACED_KEYS) for kind in KINDS}


def _resolve(tensors: list[torch.Tensor], ints: list[int], spec: str) -> torch.Tensor:
    state = host_call.current()
    if state is None:
        raise host_call.HostCallError("a host-reading attention patch ran outside a nexfort-compiled "
                                      "ComfyUI model call (no live options)")
    base, originals = state
    kind, traced = host_call.decode(spec, ints)
    extra = dict(base)  # each patch gets its own dict, as ComfyUI's layers hand out
    extra.update(traced)
    table = originals.get(kind, {})
    block = traced.get("block")
    patch = None
    if block is not None:
        patch = table.get((block[0], block[1], traced.get("block_index", 0)), table.get(tuple(block)))
    if patch is None:
        raise host_call.HostCallError(f"no {kind} replace patch for {block} in this call's options")
    q, k, v = tensors
    return patch(q, k, v, extra)


host_call.register(RESOLVER, _resolve)


def swapped(options: dict) -> int:
    """How many patches :func:`prepare` swapped in ``options`` (its result) for stand-ins."""
    replace = options.get("patches_replace", {})
    return sum(1 for kind in KINDS for p in replace.get(kind, {}).values() if p is STAND_INS[kind])


def prepare(options: Any) -> tuple[Any, Any]:
    """``(options for the compiled model, state for host_call.live)`` for one model call: a copy of
    ComfyUI's ``transformer_options`` with each host-reading attention replace patch swapped for its
    stand-in, and the originals; ``(options, None)`` where there is none."""
    if not isinstance(options, dict):
        return options, None
    replace = options.get("patches_replace")
    if not isinstance(replace, dict) or not any(k in replace for k in KINDS):
        return options, None
    originals, swapped = {}, dict(replace)
    for kind in KINDS:
        table = replace.get(kind)
        if not isinstance(table, dict):
            continue
        hosted = {key: STAND_INS[kind] for key, p in table.items() if reads_host(p)}
        if hosted:
            originals[kind] = table
            swapped[kind] = {**table, **hosted}
    if not originals:
        return options, None
    new = dict(options)
    new["patches_replace"] = swapped
    # what the patches get: the step's sigmas read on the host from a copy taken now, so that their
    # .item() does not wait for the GPU to finish every layer before (host_call.host_copied)
    base = {k: v for k, v in new.items() if k not in ("patches", "patches_replace")}
    if isinstance(sigmas := base.get("sigmas"), torch.Tensor):
        base["sigmas"] = host_call.host_copied(sigmas)
    return new, (base, originals)
