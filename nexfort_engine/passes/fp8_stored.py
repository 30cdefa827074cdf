"""fp8 graphs of models that *store* their linear weights in e4m3: the stored weights feed the fp8
GEMMs directly.

What: ComfyUI keeps a diffusion model's weights in ``float8_e4m3fn`` when it is loaded with
``weight_dtype: fp8_e4m3fn`` (the UNETLoader's option; Flux's usual setting on 24 GB cards) or from
an fp8 checkpoint (``scaled_fp8``: one scale per weight). Its ``manual_cast`` linears cast the weight
up to the compute dtype at every call (``w.to(bf16)``, times the scale for scaled checkpoints) and
call ``F.linear``. Under :class:`nexfort_engine.fp8.Fp8LinearMode` that ``F.linear`` becomes
``nexfort::fp8_mm_cached(xq, x_scale, w_cast, bias)`` on the *cast* weight, a new tensor at every
call: the weight cache misses every time and quantizes it again inline (a pass over the weight in
bf16, another in e4m3, every step), and the stored e4m3 values are rounded a second time with new
row scales.

:func:`rewrite_stored_weights` finds each ``fp8_mm_cached`` whose weight is such a cast of an e4m3
tensor (``to``/``type``/``bfloat16``/``half`` to the compute dtype, optionally times a one-element scale) and replaces it
by ``nexfort::fp8_mm_stored(xq, x_scale, w_e4m3, scale, bias)``: ``torch._scaled_mm`` on the stored
weight itself, with the scale (or 1) as every output channel's scale. The cast leaves the graph
when nothing else reads it.

Why it is safe: eager computes ``x @ (w_e4m3 * s).T`` in bf16; the rewritten op multiplies the same
e4m3 values and the same scale (in fp32, before the one rounding of the output). The only
quantization left is the activation's, which the cached path has too; the weight's second rounding
goes. Weights changed in place (ComfyUI's LoRA patching writes the e4m3 parameter) are read live, as
any graph input; a weight that goes through other functions first (ComfyUI's ``weight_function``
patches) does not match and keeps the cached path. Only ``float8_e4m3fn`` is taken (``_scaled_mm``'s
rowwise form wants e4m3 on both sides).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .. import fp8  # noqa: F401 - registers nexfort::fp8_mm_cached and nexfort::fp8_mm_stored
from ._fx import arg as _arg
from ._fx import erase_dead as _erase_dead
from ._fx import fake_meta as _fake_meta
from ._fx import val as _val

__all__ = ["enabled", "rewrite_stored_weights", "stored_source"]

#: A/B switch for the benchmark (``--no-fp8-stored``); the engine always runs the pass in fp8 graphs
enabled = True

_CAST_METHODS = ("to", "type", "bfloat16", "half")
_CAST_FUNCTIONS = (torch.Tensor.to, torch.Tensor.type)
_MUL_FUNCTIONS = (operator.mul, torch.mul, torch.Tensor.mul)
_COMPUTE = (torch.bfloat16, torch.float16, torch.float32)


def _cast_source(node: object) -> fx.Node | None:
    """The e4m3 tensor ``node`` casts to a compute dtype (bf16, fp16, fp32; same shape and device),
    else None."""
    if not isinstance(node, fx.Node):
        return None
    is_cast = (node.op == "call_method" and node.target in _CAST_METHODS) or (
        node.op == "call_function" and node.target in _CAST_FUNCTIONS)
    if not is_cast or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    out, src = _val(node), _val(node.args[0])
    if out is None or src is None or out.dtype not in _COMPUTE or src.dtype != torch.float8_e4m3fn:
        return None
    if src.dim() != 2 or tuple(src.shape) != tuple(out.shape) or src.device != out.device:
        return None
    return node.args[0]


def _one_element(node: object) -> bool:
    v = _val(node)
    return v is not None and v.numel() == 1 and v.is_floating_point()


def stored_source(weight: object) -> tuple[fx.Node, fx.Node | None, list[fx.Node]] | None:
    """For an ``fp8_mm_cached`` weight operand: (stored e4m3 tensor, scale node or None, the cast
    chain's nodes) when the operand is a cast of a stored e4m3 weight, optionally times a
    one-element scale; else None."""
    chain: list[fx.Node] = []
    scale: fx.Node | None = None
    node = weight
    if isinstance(node, fx.Node) and (
            (node.op == "call_method" and node.target == "mul")
            or (node.op == "call_function" and node.target in _MUL_FUNCTIONS)) and len(node.args) == 2:
        a, b = node.args
        if _one_element(b) and _cast_source(a) is not None:
            scale, node = b, a
        elif _one_element(a) and _cast_source(b) is not None:
            scale, node = a, b
        else:
            return None
        chain.append(weight)
    src = _cast_source(node)
    if src is None:
        return None
    chain.append(node)
    return src, scale, chain


def rewrite_stored_weights(gm: fx.GraphModule) -> int:
    """Replace each ``fp8_mm_cached`` on a cast stored-e4m3 weight by ``fp8_mm_stored`` on the
    stored weight; returns how many were replaced."""
    if not enabled:
        return 0
    cached = torch.ops.nexfort.fp8_mm_cached.default
    stored = torch.ops.nexfort.fp8_mm_stored.default
    graph = gm.graph
    dead: list[fx.Node] = []
    n = 0
    for mm in list(graph.nodes):
        if mm.op != "call_function" or mm.target is not cached:
            continue
        found = stored_source(_arg(mm, 2, "weight"))
        if found is None:
            continue
        src, scale, chain = found
        xq, x_scale, bias = _arg(mm, 0, "xq"), _arg(mm, 1, "x_scale"), _arg(mm, 3, "bias")
        with graph.inserting_before(mm):
            new = graph.call_function(stored, (xq, x_scale, src, scale, bias))
        _fake_meta(new, stored, xq, x_scale, src, scale, bias)
        new.meta.update({k: v for k, v in mm.meta.items() if k not in ("example_value", "val")})
        mm.replace_all_uses_with(new)
        graph.erase_node(mm)
        dead.extend(chain)
        n += 1
    if n:
        _erase_dead(dead)
        graph.lint()
        gm.recompile()
    return n
