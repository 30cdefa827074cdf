"""Fuse sibling projections (attention Q/K/V) that read the same input into one matmul.

After AOTAutograd, ``to_q(x), to_k(x), to_v(x)`` are three ``mm``/``addmm`` nodes sharing the
same activation operand, each with ``permute(W_i, [1, 0])`` as the weight operand. We rewrite
them as one ``mm(x, permute(cat([W_q, W_k, W_v]), [1, 0]))`` (bias concatenated likewise for
``addmm``) followed by ``split_with_sizes`` along the output features — one large GEMM instead of
three small ones. Weights stay graph inputs, so in-place weight patches (LoRA) are still read at
run time (the concatenation is recomputed each call; with ``freezing`` it is constant-folded).

Safe by construction: only nodes with exactly the same activation node, 2-D weights with the same
input-feature size, the same dtype, and no other users of the permuted weights are grouped; the
result is the same arithmetic per output column. Counter: ``counters["nexfort"]["fused_qkv"]``
(one per group rewritten), ``["fused_qkv_linears"]`` (projections absorbed).
"""

from __future__ import annotations

import hashlib
import operator
from collections import defaultdict
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


def _weight_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """``permute(W, [1, 0])`` -> W, when the permuted weight has no other users."""
    if node.op != "call_function" or node.target not in (aten.permute.default, aten.t.default):
        return None
    if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if len(node.users) != 1:
        return None
    w = node.args[0]
    return w if isinstance(w, torch.fx.Node) else None


def _act_key(node: Any) -> Any:
    """The activation's identity: views of the same tensor to the same shape count as one."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
    ):
        return (node.args[0], tuple(str(s) for s in node.args[1]))
    return node


def _meta(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def _call(graph: torch.fx.Graph, fake_mode: Any, target: Any, args: tuple[Any, ...]) -> torch.fx.Node:
    """Insert ``target(*args)`` and give it the fake value Inductor's lowering expects."""
    node = graph.call_function(target, args)

    def val(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.meta["val"]
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    with fake_mode:
        node.meta["val"] = target(*val(args))
    return node


def fuse_sibling_projections(graph: torch.fx.Graph) -> int:
    """Rewrite groups of >= 2 sibling projections in ``graph``. Returns the number of groups."""
    groups: dict[tuple[Any, ...], list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target is aten.mm.default:
            bias, act, wt = None, node.args[0], node.args[1]
        elif node.target is aten.addmm.default and len(node.args) == 3:
            bias, act, wt = node.args
        else:
            continue
        w = _weight_of(wt) if isinstance(wt, torch.fx.Node) else None
        wv = _meta(w) if w is not None else None
        if w is None or wv is None or wv.dim() != 2:
            continue
        if bias is not None and (not isinstance(bias, torch.fx.Node) or _meta(bias) is None or _meta(bias).dim() != 1):
            continue
        groups[(_act_key(act), node.target, wv.dtype, wv.shape[1])].append(node)

    fused = 0
    for (_act, target, _dtype, _k), nodes in groups.items():
        if len(nodes) < 2:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(nodes, key=order.__getitem__)
        act = first.args[1] if target is aten.addmm.default else first.args[0]
        w_idx = 2 if target is aten.addmm.default else 1
        weights = [n.args[w_idx].args[0] for n in nodes]
        sizes = [int(_meta(w).shape[0]) for w in weights]
        fake_mode = _meta(first).fake_mode
        with graph.inserting_before(first):
            w_cat = _call(graph, fake_mode, aten.cat.default, ([*weights], 0))
            w_t = _call(graph, fake_mode, aten.permute.default, (w_cat, [1, 0]))
            if target is aten.addmm.default:
                b_cat = _call(graph, fake_mode, aten.cat.default, ([n.args[0] for n in nodes], 0))
                out = _call(graph, fake_mode, aten.addmm.default, (b_cat, act, w_t))
            else:
                out = _call(graph, fake_mode, aten.mm.default, (act, w_t))
            parts = _call(graph, fake_mode, aten.split_with_sizes.default, (out, sizes, 1))
            pieces = [_call(graph, fake_mode, operator.getitem, (parts, i)) for i in range(len(nodes))]
        for n, piece in zip(nodes, pieces, strict=True):
            old_t = n.args[w_idx]
            n.replace_all_uses_with(piece)
            graph.erase_node(n)
            if not old_t.users:
                graph.erase_node(old_t)
        fused += 1
        counters_bump(len(nodes))
    if fused:
        graph.lint()
    return fused


def counters_bump(n_linears: int) -> None:
    from torch._dynamo.utils import counters

    counters["nexfort"]["fused_qkv"] += 1
    counters["nexfort"]["fused_qkv_linears"] += n_linears


class FuseQKVPass(CustomGraphPass):
    """Inductor ``post_grad_custom_pre_pass`` wrapper (its uuid keys the FX graph cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_sibling_projections(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(open(__file__, "rb").read()).digest()
