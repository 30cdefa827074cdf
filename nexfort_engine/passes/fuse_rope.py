"""DiT attention: per-head RMSNorm of queries/keys and their rotary embedding as one fused op.

What: :func:`rewrite_ropes` walks a Dynamo graph for the rotation ComfyUI's Flux-family code
applies to queries and keys (``flux.math.apply_rope1`` in ComfyUI 0.3.75 and later, and the
earlier ``pe[..., 0] * x[..., 0] + pe[..., 1] * x[..., 1]`` form)::

    x_ = y.to(float32).reshape(B, H, L, -1, 1, 2)
    out = pe[..., 0] * x_[..., 0];  out.addcmul_(pe[..., 1], x_[..., 1])   # or mul + mul + add
    result = out.reshape(B, H, L, D).type_as(y)

and, in newer ComfyUI (0.33.0 checked), the same rotation as comfy-kitchen's op
(``torch.ops.comfy_kitchen.apply_rope(q, k, pe)``, ``apply_rope1(x, pe)``: its eager backend is
the formula above, its GPU kernels the same function), where ``y`` is ``rms_norm(x, (D,), w, eps)``
(``QKNorm``; a no-op ``.to(v)`` after it is allowed; ``eps=None``, what newer ComfyUI's
``torch.nn.RMSNorm`` passes, is torch's default: float32's epsilon for 16-bit inputs) or the
``cat(..., dim=2)`` of such norms (Flux's double blocks: text and image streams). Each match is
replaced by one call of ``nexfort::rms_norm_rope`` (:mod:`nexfort_engine.rope`) on the norms'
inputs, weights, ``pe`` and ``eps``.

Only matches whose ``pe`` is float32 ``[B or 1, 1, L, D/2, 2, 2]``, whose norms keep the model
dtype (bfloat16 or float16) and whose head size is a power of two are rewritten; anything else
keeps its ops.

Why: see :mod:`nexfort_engine.rope` (Inductor's kernels for this path re-read the float32 rotation
matrices per head and row; Flux spent about 6 ms of each O3 step on an H200 there).

Why it is safe: the op computes the same function of the same inputs (its docstring states the
rounding); every other user of an intermediate keeps the original nodes, which are erased only
once nothing reads them; the in-place ``addcmul_`` is matched only when nothing else reads the
tensor it updates. The FX-graph cache key follows (it hashes the rewritten graph), and the op is a
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

from .. import rope  # registers nexfort::rms_norm_rope
from ._fx import arg as _arg
from ._fx import erase_dead as _erase_dead
from ._fx import fake_meta as _fake_meta
from ._fx import is_call as _is_call
from ._fx import is_method as _is_method
from ._fx import static as _static
from ._fx import val as _val

__all__ = ["Match", "find_matches", "rewrite_ropes"]

log = logging.getLogger(__name__)

_RMS_NORM = tuple(f for f in (getattr(torch, "rms_norm", None), getattr(F, "rms_norm", None)) if f is not None)


@dataclass
class Match:
    """One rotation to replace: ``result`` becomes ``rms_norm_rope(xs, weights, pe, eps)``."""

    result: fx.Node
    xs: list[fx.Node]
    weights: list[fx.Node]
    pe: fx.Node
    eps: float
    #: nodes the rewrite may make dead (erased only without users)
    chain: list[fx.Node]


def _getitem_last(node: Any, index: int) -> fx.Node | None:
    """``t`` when ``node`` is ``t[..., index]``."""
    if not _is_call(node, (operator.getitem,)) or len(node.args) != 2:
        return None
    key = node.args[1]
    if isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and key[1] == index:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    return None


def _product(node: Any, index: int) -> tuple[fx.Node, fx.Node] | None:
    """(pe, x_) when ``node`` is ``pe[..., index] * x_[..., index]``."""
    # (under a TorchFunctionMode such as fp8's, Dynamo records ``a * b`` as the method ``mul``)
    if not ((_is_call(node, (operator.mul, torch.mul)) or _is_method(node, "mul")) and len(node.args) == 2):
        return None
    pe, x_ = _getitem_last(node.args[0], index), _getitem_last(node.args[1], index)
    return (pe, x_) if pe is not None and x_ is not None else None


def _rotation(out: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(pe, x_, nodes) when ``out`` is the rotated pairs (addcmul_ form or mul + mul + add)."""
    first = _product(out, 0)
    if first is not None:  # out = pe0 * x0; out.addcmul_(pe1, x1)
        updates = [u for u in out.users if _is_method(u, "addcmul_")]
        if len(updates) != 1 or len(out.users) != 2:
            return None
        update = updates[0]
        if len(update.args) != 3 or update.kwargs.get("value", 1) != 1:
            return None
        pe1, x1 = _getitem_last(update.args[1], 1), _getitem_last(update.args[2], 1)
        if pe1 is not first[0] or x1 is not first[1]:
            return None
        return first[0], first[1], [out, update, out.args[0], out.args[1], update.args[1], update.args[2]]
    if (_is_call(out, (operator.add, torch.add)) or _is_method(out, "add")) and len(out.args) == 2 and not out.kwargs:
        a, b = _product(out.args[0], 0), _product(out.args[1], 1)
        if a is None or b is None or a != b:
            return None
        nodes = [out, out.args[0], out.args[1]]
        nodes += [n for m in nodes[1:] for n in m.args]
        return a[0], a[1], nodes
    return None


def _norm(node: Any, dtype: torch.dtype) -> tuple[fx.Node, fx.Node, float, list[fx.Node]] | None:
    """(x, weight, eps, nodes) when ``node`` is ``rms_norm(x, (D,), weight, eps)`` in ``dtype``,
    optionally followed by a ``.to(...)`` that keeps it."""
    nodes: list[fx.Node] = []
    if _is_method(node, "to"):
        v = _val(node)
        if v is None or v.dtype != dtype:
            return None
        nodes.append(node)
        node = node.args[0]
    if not _is_call(node, _RMS_NORM):
        return None
    x, shape = _arg(node, 0, "input"), _arg(node, 1, "normalized_shape")
    weight, eps = _arg(node, 2, "weight"), _arg(node, 3, "eps")
    xv = _val(x)
    if xv is None or xv.dim() != 4 or xv.dtype != dtype or not isinstance(weight, fx.Node):
        return None
    if eps is None:  # torch's default: the epsilon of the float32 arithmetic 16-bit inputs use
        eps = torch.finfo(torch.float32).eps
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or _int(shape[0]) != _static(xv.shape[-1]):
        return None
    wv, nv = _val(weight), _val(node)
    if wv is None or wv.dim() != 1 or nv is None or nv.dtype != dtype:
        return None
    return x, weight, float(eps), [*nodes, node]


def _parts(y: fx.Node, dtype: torch.dtype) -> tuple[list[fx.Node], list[fx.Node], float, list[fx.Node]] | None:
    """(xs, weights, eps, nodes) of the norms ``y`` is made of (one, or a ``cat`` on dim 2)."""
    if _is_call(y, (torch.cat,)):
        tensors, dim = _arg(y, 0, "tensors"), _arg(y, 1, "dim", 0)
        if not isinstance(tensors, (list, tuple)) or not tensors or dim not in (2, -2):
            return None
        norms = [f for t in tensors if (f := _norm(t, dtype)) is not None]
        eps = {f[2] for f in norms}
        if len(norms) != len(tensors) or len(eps) != 1:
            return None
        return [f[0] for f in norms], [f[1] for f in norms], eps.pop(), [y, *(n for f in norms for n in f[3])]
    found1 = _norm(y, dtype)
    if found1 is None:
        return None
    return [found1[0]], [found1[1]], found1[2], found1[3]


def _int(a: Any) -> int | None:
    """A static int argument, also when traced as a size node (``x.shape[-1]``)."""
    if isinstance(a, fx.Node):
        a = a.meta.get("example_value", a.meta.get("val"))
    return None if isinstance(a, bool) else _static(a)


def _match(result: fx.Node) -> Match | None:
    # result = out.reshape(B, H, L, D).type_as(y)
    if not (_is_method(result, "type_as") and len(result.args) == 2):
        return None
    reshaped, y = result.args
    if not (_is_method(reshaped, "reshape") or _is_method(reshaped, "view")) or not isinstance(y, fx.Node):
        return None
    out = reshaped.args[0]
    rotation = _rotation(out) if isinstance(out, fx.Node) else None
    if rotation is None:
        return None
    pe, x_, rot_nodes = rotation
    # x_ = y.to(float32).reshape(B, H, L, -1, 1, 2)
    if not (_is_method(x_, "reshape") or _is_method(x_, "view")):
        return None
    t32 = x_.args[0]
    if not (_is_method(t32, "to") or _is_method(t32, "float")) or t32.args[0] is not y:
        return None
    yv, rv, pv, xv, tv = _val(y), _val(result), _val(pe), _val(x_), _val(t32)
    if any(v is None for v in (yv, rv, pv, xv, tv)):
        return None
    assert yv is not None and rv is not None and pv is not None and xv is not None and tv is not None
    dtype = yv.dtype
    if rv.dtype != dtype or tv.dtype != torch.float32 or yv.dim() != 4:
        return None
    # what the kernel takes only (16-bit, power-of-two heads): elsewhere the op would run its eager
    # twin where Inductor compiles the same ops
    d = _static(yv.shape[-1])
    if d is None or not rope.kernel_takes(dtype, d):
        return None
    if xv.dim() != 6 or _static(xv.shape[-3]) != d // 2 or tuple(_static(s) for s in xv.shape[-2:]) != (1, 2):
        return None
    if not _rotation_shapes_fit(yv, rv, pv, d):
        return None
    # the intermediates feed only the rotation (the in-place update must not be seen elsewhere)
    if len(x_.users) != 2 or len(t32.users) != 1 or len(reshaped.users) != 1:
        return None
    parts = _parts(y, dtype)
    if parts is None:
        return None
    xs, weights, eps, norm_nodes = parts
    return Match(result, xs, weights, pe, eps, [result, reshaped, *rot_nodes, x_, t32, *norm_nodes])


def _kitchen_op(name: str) -> tuple[Any, ...]:
    """comfy-kitchen's op ``name`` (its packet and default overload) where it is registered."""
    try:
        packet = getattr(torch.ops.comfy_kitchen, name)
        return (packet, packet.default)
    except (AttributeError, RuntimeError):
        return ()


def _kitchen_matches(node: fx.Node) -> list[Match]:
    """The rotations a call of comfy-kitchen's ``apply_rope`` / ``apply_rope1`` makes (one per
    output whose input is a norm of the form :func:`_parts` takes)."""
    if node.op != "call_function" or node.kwargs:
        return []
    pair = node.target in _kitchen_op("apply_rope")
    if not pair and node.target not in _kitchen_op("apply_rope1"):
        return []
    n_in = 2 if pair else 1
    if len(node.args) != n_in + 1 or not all(isinstance(a, fx.Node) for a in node.args):
        return []
    ys, pe = list(node.args[:n_in]), node.args[n_in]
    pv = _val(pe)
    if pv is None or len(ys) != len(set(ys)):
        return []
    results: dict[int, fx.Node] = {0: node}
    if pair:  # the outputs are read through getitem only
        results = {u.args[1]: u for u in node.users
                   if _is_call(u, (operator.getitem,)) and len(u.args) == 2 and isinstance(u.args[1], int)}
        if len(results) != len(node.users):
            return []
    matches = []
    for i, y in enumerate(ys):
        result = results.get(i)
        if result is None:
            continue
        yv, rv = _val(y), _val(result)
        if yv is None or rv is None or yv.dim() != 4 or rv.dtype != yv.dtype:
            continue
        d = _static(yv.shape[-1])
        if d is None or not rope.kernel_takes(yv.dtype, d) or not _rotation_shapes_fit(yv, rv, pv, d):
            continue
        parts = _parts(y, yv.dtype)
        if parts is None:
            continue
        xs, weights, eps, norm_nodes = parts
        matches.append(Match(result, xs, weights, pe, eps, [result, node, *norm_nodes]))
    return matches


def _rotation_shapes_fit(yv: torch.Tensor, rv: torch.Tensor, pv: torch.Tensor, d: int) -> bool:
    """``pe`` is float32 ``[B or 1, 1, L, D/2, 2, 2]`` and the rotated tensor ``[B, H, L, D]``."""
    if pv.dtype != torch.float32 or pv.dim() != 6 or _static(pv.shape[1]) != 1 or _static(pv.shape[3]) != d // 2:
        return False
    if tuple(_static(s) for s in pv.shape[4:]) != (2, 2):
        return False
    # (symbolic sizes compared as expressions: comparing them as SymInts would add guards)
    if _static(pv.shape[0]) != 1 and str(pv.shape[0]) != str(yv.shape[0]):
        return False
    return rv.dim() == 4 and _static(rv.shape[-1]) == d


def find_matches(gm: fx.GraphModule) -> list[Match]:
    """The rotations of ``gm`` that :func:`rewrite_ropes` replaces."""
    found = []
    for node in gm.graph.nodes:
        if (m := _match(node)) is not None:
            found.append(m)
        else:
            found.extend(_kitchen_matches(node))
    return found


def rewrite_ropes(gm: fx.GraphModule) -> int:
    """Replace each rotation :func:`find_matches` finds by ``nexfort::rms_norm_rope``; returns how
    many were replaced."""
    matches = find_matches(gm)
    if not matches:
        return 0
    graph = gm.graph
    op = torch.ops.nexfort.rms_norm_rope.default
    for m in matches:
        with graph.inserting_before(m.result):
            fused = graph.call_function(op, (list(m.xs), list(m.weights), m.pe, m.eps))
            _fake_meta_list(fused, op, m)
        m.result.replace_all_uses_with(fused)
    _erase_dead(_with_shape_readers([n for m in matches for n in m.chain]))
    graph.lint()
    gm.recompile()
    log.debug("nexfort: %d query/key norm + rotary embedding(s) fused", len(matches))
    return len(matches)


def _with_shape_readers(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` and the nodes that only read their sizes (``y.shape[i]`` is traced as ``size``
    and ``getitem``): dead with the chain, and otherwise keeping its first node alive."""
    out = list(nodes)
    for n in nodes:
        for u in n.users:
            if _is_method(u, "size") or _is_method(u, "dim") or (
                _is_call(u, (getattr,)) and len(u.args) == 2 and u.args[1] == "shape"
            ):
                out.append(u)
                out.extend(g for g in u.users if _is_call(g, (operator.getitem,)))
    return out


def _fake_meta_list(node: fx.Node, op: Any, m: Match) -> None:
    """``example_value`` of the fused node (its list arguments hold nodes)."""
    n_x = len(m.xs)

    def call(*vals: Any) -> Any:
        return op(list(vals[:n_x]), list(vals[n_x:2 * n_x]), vals[2 * n_x], m.eps)

    _fake_meta(node, call, *m.xs, *m.weights, m.pe)
