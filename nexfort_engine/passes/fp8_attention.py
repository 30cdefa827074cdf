"""DiT attention in fp8: fused queries/keys in e4m3 into cuDNN's fp8 attention.

What: :func:`rewrite_attentions` runs after :mod:`.fuse_rope` and walks a Dynamo graph for::

    q = nexfort::rms_norm_rope(...)        # only read by the attention
    k = nexfort::rms_norm_rope(...)        # likewise
    out = F.scaled_dot_product_attention(q, k, v)   # no mask, no dropout, not causal, default scale

and replaces it with::

    sq, dq = fp8_scales(<q's weights>, D)                   # static: sqrt(D) max|w| / 448
    q8 = nexfort::rms_norm_rope_fp8(<q's arguments>, sq)    # e4m3 straight from the kernel
    k8 = ... likewise
    v8, dv = quantize_values(v, parts)      # nexfort::absmax over v (or the parts v concatenates), then one pointwise
    o8 = nexfort::sdpa_fp8(q8, k8, v8, pack_scales(dq, dk, dv))
    out = (o8.float() * dv).to(v.dtype)                     # fused into the consumer by Inductor

(:mod:`nexfort_engine.fp8_attention`, :mod:`nexfort_engine.rope`). Only 16-bit attentions whose
head size is a multiple of 16 up to 128 (what cuDNN's fp8 forward takes) are rewritten. Where the
output only goes, through ``transpose(1, 2)`` and reshapes, into ``nexfort::quant_rows`` as its
copied part ``a`` (Flux's single blocks: ``cat([attention, mlp])`` quantized for ``linear2``, by
:mod:`.fuse_quant`), that op reads the e4m3 output with its descale instead (``a_scale``), so the
16-bit output is never written.

Why: cuDNN's fp8 attention is 1.40x its bf16 attention at Flux's shape on an H200, and Flux's O3
step spends about a third of its time in attention (BENCHMARKS.md, fourteenth session).

Why it is safe: the result has the same shape, dtype and layout-independent meaning; the error is
e4m3's (measured and reported by the benchmark: :mod:`nexfort_engine.fp8_attention`). Only
attentions whose queries and keys are read by nothing else are touched, so the 16-bit rotations
disappear with them.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from .. import fp8_attention, rope, rowwise_quant  # noqa: F401 - registers the ops used here
from ._fx import arg as _arg
from ._fx import cache_marks_for
from ._fx import erase_dead as _erase_dead
from ._fx import fake_meta as _fake_meta
from ._fx import is_call as _is_call
from ._fx import is_method as _is_method
from ._fx import static as _static
from ._fx import val as _val

__all__ = ["cache_marks", "dequantize", "find_matches", "rewrite_attentions"]

log = logging.getLogger(__name__)

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_ROPE = torch.ops.nexfort.rms_norm_rope.default
_ROPE_FP8 = torch.ops.nexfort.rms_norm_rope_fp8.default
_SDPA_FP8 = torch.ops.nexfort.sdpa_fp8.default
_QUANT_ROWS = torch.ops.nexfort.quant_rows.default


def dequantize(o8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention output in the model dtype (``o8 * descale``, float32, rounded once)."""
    return (o8.float() * descale).to(dtype)


def cache_marks() -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` entries for the plain functions this pass
    puts into graphs (:func:`dequantize`, ``fp8_attention.quantize_values``/``pack_scales``,
    ``rope.fp8_scales``): AOTAutograd's cache bypasses graphs calling functions it does not know,
    and every warm start then re-traced the blocks (Flux O3: 9.11-11.62 s instead of 8.65, run114).
    The functions are pure and determined by their modules' sources (``_fx.cache_marks_for``)."""
    return cache_marks_for((dequantize, fp8_attention.quantize_values, fp8_attention.pack_scales, rope.fp8_scales))


def _default_args(node: fx.Node) -> bool:
    """No mask, no dropout, not causal, the default scale, no GQA."""
    mask, dropout = _arg(node, 3, "attn_mask"), _arg(node, 4, "dropout_p", 0.0)
    causal, scale = _arg(node, 5, "is_causal", False), _arg(node, 6, "scale")
    return (mask is None and dropout in (0, 0.0) and causal is False and scale is None
            and not node.kwargs.get("enable_gqa", False) and len(node.args) <= 7)


def _rope_source(node: Any, attention: fx.Node) -> fx.Node | None:
    """``node`` when it is a fused rotation that only ``attention`` reads."""
    if not _is_call(node, (_ROPE,)) or set(node.users) != {attention}:
        return None
    return node


def find_matches(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, fx.Node, fx.Node]]:
    """(attention, q, k, v) for each attention :func:`rewrite_attentions` replaces."""
    found = []
    for node in gm.graph.nodes:
        if not _is_call(node, _SDPA) or len(node.args) < 3 or not _default_args(node):
            continue
        q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        if _rope_source(q, node) is None or _rope_source(k, node) is None or not isinstance(v, fx.Node):
            continue
        if q is k:
            continue
        qv, kv, vv, ov = _val(q), _val(k), _val(v), _val(node)
        if qv is None or kv is None or vv is None or ov is None or vv.dim() != 4:
            continue
        # one head count for q, k and v (no grouped-query attention), k and v of one length
        # (symbolic sizes compared as expressions: comparing SymInts would add guards)
        if str(qv.shape[1]) != str(kv.shape[1]) or str(kv.shape[1]) != str(vv.shape[1]) or str(kv.shape[2]) != str(vv.shape[2]):
            continue
        d = _static(qv.shape[-1])
        if (d is None or not fp8_attention.takes_head_size(d) or _static(vv.shape[-1]) != d
                or qv.dtype not in (torch.bfloat16, torch.float16) or vv.dtype != qv.dtype or ov.dtype != qv.dtype):
            continue
        found.append((node, q, k, v))
    return found


def _value_parts(v: fx.Node) -> list[fx.Node]:
    """The tensors ``v`` concatenates on the sequence dim (Flux's double blocks: text and image
    values), or ``[v]``."""
    if _is_call(v, (torch.cat,)):
        tensors, dim = _arg(v, 0, "tensors"), _arg(v, 1, "dim", 0)
        vals = [_val(t) for t in tensors] if isinstance(tensors, (list, tuple)) else []
        if (dim in (2, -2) and vals and all(isinstance(t, fx.Node) for t in tensors)
                and all(x is not None and x.dim() == 4 for x in vals)):
            return list(tensors)
    return [v]


def _call(graph: fx.Graph, fn: Any, args: tuple, meta_fn: Any, *meta_args: Any) -> fx.Node:
    node = graph.call_function(fn, args)
    _fake_meta(node, meta_fn, *meta_args)
    return node


def _item(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    v = node.meta.get("example_value")
    if isinstance(v, tuple):
        item.meta["example_value"] = v[index]
    return item


def _fp8_rope(graph: fx.Graph, rope_node: fx.Node, head_size: int) -> tuple[fx.Node, fx.Node]:
    """(e4m3 result, descale) nodes for a fused rotation; the scales are torch ops in the graph."""
    xs, weights, pe, eps = rope_node.args
    scales = graph.call_function(rope.fp8_scales, (list(weights), head_size))
    _fake_meta(scales, lambda *ws: rope.fp8_scales(list(ws), head_size), *weights)
    scale, descale = _item(graph, scales, 0), _item(graph, scales, 1)
    node = graph.call_function(_ROPE_FP8, (list(xs), list(weights), pe, eps, scale))
    n = len(xs)

    def call(*vals: Any) -> Any:
        return _ROPE_FP8(list(vals[:n]), list(vals[n:2 * n]), vals[2 * n], eps, vals[2 * n + 1])

    _fake_meta(node, call, *xs, *weights, pe, scale)
    return node, descale


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fold_into_quant_rows(graph: fx.Graph, out: fx.Node, o8: fx.Node, dv: fx.Node) -> bool:
    """Hand ``o8`` and its descale to the ``quant_rows`` that ``out`` (its dequantization) only
    feeds as ``a`` through ``transpose(1, 2)`` and reshapes (module docstring)."""
    t = _only_user(out)
    if not (_is_method(t, "transpose") and tuple(t.args[1:]) in ((1, 2), (2, 1), (-3, -2), (-2, -3))):
        return False
    chain, node = [t], _only_user(t)
    while node is not None and (_is_method(node, "reshape") or _is_method(node, "view")):
        chain.append(node)
        node = _only_user(node)
    a2 = chain[-1]
    if (node is None or not _is_call(node, (_QUANT_ROWS,)) or len(chain) < 2 or _arg(node, 1, "a") is not a2
            or _arg(node, 3, "a_scale") is not None or node.kwargs):
        return False
    a2v = _val(a2)
    width = _static(a2v.shape[-1]) if a2v is not None and a2v.dim() == 2 else None
    if width is None:
        return False
    h2, prologue = node.args[0], node.args[2]
    with graph.inserting_before(node):
        t8 = graph.call_method("transpose", (o8, 1, 2))
        _fake_meta(t8, lambda x: x.transpose(1, 2), o8)
        a8 = graph.call_method("reshape", (t8, -1, width))
        _fake_meta(a8, lambda x: x.reshape(-1, width), t8)
        fused = graph.call_function(_QUANT_ROWS, (h2, a8, prologue, dv))
        _fake_meta(fused, _QUANT_ROWS, h2, a8, prologue, dv)
    node.replace_all_uses_with(fused)
    graph.erase_node(node)
    _erase_dead([*reversed(chain), out])
    return True


def rewrite_attentions(gm: fx.GraphModule) -> int:
    """Replace each attention :func:`find_matches` finds by the fp8 path; returns how many."""
    matches = find_matches(gm)
    if not matches:
        return 0
    graph = gm.graph
    for attention, q, k, v in matches:
        dtype = _val(attention).dtype  # type: ignore[union-attr]
        d = _static(_val(q).shape[-1])  # type: ignore[union-attr]
        with graph.inserting_before(attention):
            q8, dq = _fp8_rope(graph, q, d)
            k8, dk = _fp8_rope(graph, k, d)
            parts = _value_parts(v)
            vq = _call(graph, fp8_attention.quantize_values, (v, parts),
                       lambda v_, *ps: fp8_attention.quantize_values(v_, list(ps)), v, *parts)
            v8, dv = _item(graph, vq, 0), _item(graph, vq, 1)
            scales = _call(graph, fp8_attention.pack_scales, (dq, dk, dv), fp8_attention.pack_scales, dq, dk, dv)
            o8 = _call(graph, _SDPA_FP8, (q8, k8, v8, scales), _SDPA_FP8, q8, k8, v8, scales)
            out = graph.call_function(dequantize, (o8, dv, dtype))
            _fake_meta(out, dequantize, o8, dv, dtype)
        attention.replace_all_uses_with(out)
        graph.erase_node(attention)
        graph.erase_node(q)
        graph.erase_node(k)
        _fold_into_quant_rows(graph, out, o8, dv)
    graph.lint()
    gm.recompile()
    log.debug("nexfort: %d attention(s) in fp8", len(matches))
    return len(matches)

