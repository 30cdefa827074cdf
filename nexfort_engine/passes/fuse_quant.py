"""fp8 graphs: the activation quantization of GELU / GEGLU / concat producers as one fused kernel.

What: :func:`rewrite_quantizations` walks a Dynamo graph traced under
:class:`nexfort_engine.fp8.Fp8LinearMode`. Each ``nexfort::fp8_mm_cached`` call there reads an
activation that :func:`nexfort_engine.fp8.fp8_linear_cached` quantized in the graph
(``x.reshape(-1, K)`` -> float -> row amax -> scale -> divide -> clamp -> e4m3). Where ``x`` comes
from one of these producers, its quantization is replaced by one call of ``nexfort::quant_rows``
(:mod:`nexfort_engine.rowwise_quant`) on the producer's inputs:

* ``gelu(h)`` and ``gelu(h, approximate="tanh")``: Flux's double-block MLPs, DiT MLPs;
* ``cat([a, gelu(h, ...)], dim=-1)``: Flux's single blocks (attention output, MLP activation);
* ``value * gelu(gate)`` with ``value, gate = h.chunk(2, -1)`` (and a no-op dropout after it):
  the GEGLU feed-forward of SD1.x/SD2.x/SDXL transformer blocks;
* ``addcmul(shift, layer_norm(x), 1 + scale)`` with an affine-free LayerNorm of a graph input ``x``
  [B, L, D] and per-sample ``[B, 1, D]`` modulation: the adaLN inputs of Flux-family blocks
  (ComfyUI's ``apply_mod``; the single blocks' ``linear1``, the double blocks' ``qkv``), replaced by
  ``nexfort::quant_rows_ln_mod``. Only a LayerNorm of a graph input (or of its copy, as regional
  blocks make one) is taken: where ``x`` is made in the graph (a residual sum), Inductor fuses that
  sum with the norm and the quantization.

Only rows of at least ``min_width`` elements are rewritten (the row width is a static feature
size, so the decision holds for every resolution under dynamic shape); narrower rows keep
Inductor's single-pass kernel (not measured against this one there; BENCHMARKS.md, tenth session).

Why: see :mod:`nexfort_engine.rowwise_quant` (Inductor's looped two-kernel quantization of wide
rows ran at a third of memory speed).

Why it is safe: the replacement computes the same function of the same inputs (the module
docstring of :mod:`nexfort_engine.rowwise_quant` states the rounding differences); every other
user of the producer keeps the original nodes; nodes of the old chain are erased only once nothing
reads them. The FX-graph cache key follows (it hashes the rewritten graph), and the op is a
registered custom op, which AOTAutograd's cache accepts.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from .. import rowwise_quant  # noqa: F401 - registers nexfort::quant_rows
from ._fx import arg as _arg
from ._fx import erase_dead as _erase_dead
from ._fx import fake_meta as _fake_meta
from ._fx import is_call as _is_call
from ._fx import is_method as _is_method
from ._fx import static as _static
from ._fx import static_width as _static_width
from ._fx import val as _val

__all__ = ["DEFAULT_MIN_WIDTH", "Match", "find_matches", "rewrite_quantizations"]

log = logging.getLogger(__name__)

#: rows narrower than this keep Inductor's kernel: the narrowest rows measured faster in the fused
#: kernel are SDXL's 2560-wide GEGLU rows (H200: 58.9 us against Inductor's single pass, 72.5 us);
#: narrower rows were not measured
DEFAULT_MIN_WIDTH = 2560

_GELU = (torch._C._nn.gelu, F.gelu)
_MUL = (operator.mul, torch.mul)


@dataclass
class Match:
    """One quantization to replace: ``fp8_mm``'s activation operands come from ``chain``; the
    fused op reads ``h`` (and ``a``) through ``prologue``."""

    fp8_mm: fx.Node
    q_node: fx.Node
    scale_node: fx.Node
    h: fx.Node
    a: fx.Node | None
    prologue: str
    width: int
    #: nodes the rewrite may make dead (erased only without users)
    chain: list[fx.Node]
    #: ``ln_mod``: (mult, add, eps, offset) of ``addcmul(add, layer_norm(h, eps=eps), offset + mult)``
    modulation: tuple[Any, ...] = ()


def _quant_chain(mm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """(quantized-values node, scale node, producer node, chain) of fp8_linear_cached's in-graph
    quantization feeding ``mm``, or None when its operands were made some other way."""
    if len(mm.args) < 2:
        return None
    contiguous, scale = mm.args[0], mm.args[1]
    if not _is_method(contiguous, "contiguous"):
        return None
    cast = contiguous.args[0]
    if not _is_method(cast, "to"):
        return None
    clamp = cast.args[0]
    if not _is_method(clamp, "clamp"):
        return None
    div = clamp.args[0]
    if not _is_call(div, (operator.truediv, torch.div)) or div.args[1] is not scale:
        return None
    t32 = div.args[0]
    if not _is_method(t32, "float"):
        return None
    flat = t32.args[0]
    if not (_is_method(flat, "reshape") or _is_method(flat, "view")):
        return None
    producer = flat.args[0]
    if not isinstance(producer, fx.Node):
        return None
    chain = [contiguous, cast, clamp, div, t32, flat]
    # scale = amax(|t32|).clamp(min) / fmax: its nodes die with the chain
    node = scale
    while isinstance(node, fx.Node) and node is not t32 and len(chain) < 12:
        chain.append(node)
        node = node.args[0] if node.args else None
    return contiguous, scale, producer, chain


def _gelu_form(node: Any) -> tuple[fx.Node, str] | None:
    """(input, prologue) of a GELU node."""
    if not _is_call(node, _GELU):
        return None
    h = _arg(node, 0, "input")
    approximate = _arg(node, 1, "approximate", "none")
    if not isinstance(h, fx.Node) or approximate not in ("none", "tanh"):
        return None
    return h, "gelu_tanh" if approximate == "tanh" else "gelu"


def _last_dim(node: fx.Node, dim: Any) -> bool:
    v = _val(node)
    return isinstance(dim, int) and v is not None and dim in (-1, v.dim() - 1)


def _producer(node: fx.Node) -> tuple[fx.Node, fx.Node | None, str, list[fx.Node]] | None:
    """(h, a, prologue, producer nodes) when ``node`` is a producer the fused op can recompute."""
    extra: list[fx.Node] = []
    # a no-op dropout (ComfyUI's FeedForward: Dropout(0.0) after GEGLU, eval mode)
    if _is_call(node, (F.dropout,)) and (_arg(node, 1, "p", 0.5) == 0.0 or _arg(node, 2, "training", True) is False):
        extra.append(node)
        node = _arg(node, 0, "input")
        if not isinstance(node, fx.Node):
            return None
    if (g := _gelu_form(node)) is not None:
        return g[0], None, g[1], [*extra, node]
    if _is_call(node, (torch.cat,)):
        tensors = _arg(node, 0, "tensors")
        if (
            isinstance(tensors, (list, tuple)) and len(tensors) == 2 and _last_dim(node, _arg(node, 1, "dim", 0))
            and isinstance(tensors[0], fx.Node) and (g := _gelu_form(tensors[1])) is not None
        ):
            return g[0], tensors[0], g[1], [*extra, node, tensors[1]]
        return None
    if _is_call(node, _MUL) or _is_method(node, "mul"):
        value, gated = node.args[0], node.args[1] if len(node.args) > 1 else None
        g = _gelu_form(gated)
        if g is None or g[1] != "gelu" or not (_is_call(value, (operator.getitem,)) and _is_call(g[0], (operator.getitem,))):
            return None
        chunk, gate_chunk = value.args[0], g[0].args[0]
        if chunk is not gate_chunk or value.args[1] != 0 or g[0].args[1] != 1 or not _is_method(chunk, "chunk"):
            return None
        h = chunk.args[0]
        if _arg(chunk, 1, "chunks") != 2 or not _last_dim(h, _arg(chunk, 2, "dim", 0)) or not isinstance(h, fx.Node):
            return None
        return h, None, "geglu", [*extra, node, gated, value, g[0], chunk]
    return None


_LAYER_NORM = (F.layer_norm, torch.layer_norm)
#: whether :func:`find_matches` takes the LayerNorm + modulation form (the benchmark's
#: ``--no-ln-mod-quant`` turns it off to compare both in one process)
take_ln_mod = True


def _mutated_before(sources: list[fx.Node], end: fx.Node) -> bool:
    """Whether an in-place method (``add_``, ``mul_``, ...) on one of ``sources`` runs before
    ``end`` in graph order (the op placed before ``end`` would then read other values than the
    LayerNorm did)."""
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    return any(
        u.op == "call_method" and isinstance(u.target, str) and u.target.endswith("_") and order[u] < order[end]
        for s in sources for u in s.users
    )


def _ln_mod_form(node: Any) -> tuple[fx.Node, fx.Node, fx.Node, float, float, list[fx.Node], list[fx.Node]] | None:
    """(x, mult, add, eps, mult offset, producer nodes, the nodes ``x`` is read through) when ``node`` is
    ``addcmul(add, layer_norm(x), offset + mult)`` (offset 0 when ``mult`` is not such a sum)
    with an affine-free LayerNorm over the last dimension of a graph input ``x`` [B, L, D] and
    ``mult``/``add`` of shape [B or 1, 1, D] in ``x``'s dtype (``x`` may be a copy of the input)."""
    if not _is_call(node, (torch.addcmul,)) or node.kwargs.get("value", 1) != 1 or len(node.args) != 3:
        return None
    add, ln, mult = node.args
    if not _is_call(ln, _LAYER_NORM) or len(ln.users) != 1:
        return None
    x = _arg(ln, 0, "input")
    shape = _arg(ln, 1, "normalized_shape")
    weight, bias = _arg(ln, 2, "weight"), _arg(ln, 3, "bias")
    eps = _arg(ln, 4, "eps", 1e-5)
    sources = [x]
    if (_is_method(x, "clone") or _is_call(x, (torch.clone,))) and len(x.args) == 1 and not x.kwargs:
        # regional blocks run on copies of their inputs (regions._forward_on_copies): the copy
        # holds the input's values until the block's residual updates it, after this linear, so
        # the op reads the input itself and the copy stays a part of Inductor's residual kernel
        # (find_matches checks that nothing writes either in place before the linear)
        x = x.args[0]
        sources.append(x)
    xv, mv, av = _val(x), _val(mult), _val(add)
    if not (isinstance(x, fx.Node) and x.op == "placeholder") or weight is not None or bias is not None:
        return None
    if xv is None or mv is None or av is None or xv.dim() != 3 or not isinstance(eps, float):
        return None
    d = _static(xv.shape[-1])
    if d is None or not isinstance(shape, (list, tuple)) or len(shape) != 1 or _static(shape[0]) != d:
        return None
    for t in (mv, av):
        if t.dim() != 3 or _static(t.shape[1]) != 1 or _static(t.shape[2]) != d or t.dtype != xv.dtype:
            return None
    nodes = [node, ln]
    offset = 0.0
    # ComfyUI's ``1 + scale`` (a method ``add`` or ``+`` with the number on either side): computed
    # in the kernel, not by a kernel of its own
    if (_is_method(mult, "add") or _is_call(mult, (operator.add, torch.add))) and len(mult.args) == 2 and not mult.kwargs:
        a0, a1 = mult.args
        num, t = (a1, a0) if isinstance(a1, (int, float)) else (a0, a1)
        tv = _val(t)
        if (isinstance(num, (int, float)) and not isinstance(num, bool) and isinstance(t, fx.Node) and tv is not None
                and tuple(tv.shape) == tuple(mv.shape) and tv.dtype == mv.dtype):
            nodes.append(mult)  # dies with the chain unless something else reads it
            offset, mult = float(num), t
    return x, mult, add, eps, offset, nodes, sources


def find_matches(gm: fx.GraphModule, min_width: int | None = None) -> list[Match]:
    """The quantizations of ``gm`` that :func:`rewrite_quantizations` replaces (rows of at least
    ``min_width`` elements; default :data:`DEFAULT_MIN_WIDTH`)."""
    min_width = DEFAULT_MIN_WIDTH if min_width is None else min_width
    mm_op = torch.ops.nexfort.fp8_mm_cached.default
    matches = []
    for node in gm.graph.nodes:
        if not _is_call(node, (mm_op,)):
            continue
        chain = _quant_chain(node)
        if chain is None:
            continue
        q_node, scale_node, producer, nodes = chain
        ln_mod = _ln_mod_form(producer) if take_ln_mod else None
        if ln_mod is not None:
            x, mult, add, eps, offset, producer_nodes, sources = ln_mod
            width = _static_width(producer)
            if width is not None and width >= min_width and not _mutated_before(sources, node):
                matches.append(Match(node, q_node, scale_node, x, None, "ln_mod", width, [*nodes, *producer_nodes],
                                     (mult, add, eps, offset)))
            continue
        found = _producer(producer)
        if found is None:
            continue
        h, a, prologue, producer_nodes = found
        width = _static_width(producer)
        h_width, a_width = _static_width(h), _static_width(a) if a is not None else 0
        if width is None or h_width is None or a_width is None or width < min_width:
            continue
        hv = _val(h)
        if hv is None or hv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            continue
        matches.append(Match(node, q_node, scale_node, h, a, prologue, width, [*nodes, *producer_nodes]))
    return matches


def rewrite_quantizations(gm: fx.GraphModule, min_width: int | None = None) -> int:
    """Replace each quantization :func:`find_matches` finds by ``nexfort::quant_rows``; returns
    how many were replaced."""
    matches = find_matches(gm, min_width)
    if not matches:
        return 0
    graph = gm.graph
    op = torch.ops.nexfort.quant_rows.default
    ln_op = torch.ops.nexfort.quant_rows_ln_mod.default
    for m in matches:
        with graph.inserting_before(m.fp8_mm):
            if m.prologue == "ln_mod":
                fused = graph.call_function(ln_op, (m.h, *m.modulation))
                _fake_meta(fused, ln_op, m.h, *m.modulation)
            else:
                h_width = _static_width(m.h)
                h2 = graph.call_method("reshape", (m.h, -1, h_width))
                _fake_meta(h2, lambda t, *s: t.reshape(*s), m.h, -1, h_width)
                a2 = None
                if m.a is not None:
                    a_width = _static_width(m.a)
                    a2 = graph.call_method("reshape", (m.a, -1, a_width))
                    _fake_meta(a2, lambda t, *s: t.reshape(*s), m.a, -1, a_width)
                fused = graph.call_function(op, (h2, a2, m.prologue))
                _fake_meta(fused, op, h2, a2, m.prologue)
            q = graph.call_function(operator.getitem, (fused, 0))
            scale = graph.call_function(operator.getitem, (fused, 1))
            if "example_value" in fused.meta:
                q.meta["example_value"], scale.meta["example_value"] = fused.meta["example_value"]
        m.fp8_mm.replace_input_with(m.q_node, q)
        m.fp8_mm.replace_input_with(m.scale_node, scale)
    _erase_dead([n for m in matches for n in m.chain])
    graph.lint()
    gm.recompile()
    log.debug("nexfort: %d fp8 quantization(s) fused with their producers", len(matches))
    return len(matches)

