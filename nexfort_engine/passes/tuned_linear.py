"""A compiled graph's 16-bit linears as ``nexfort::tuned_linear``: the GEMM algorithm measured for
each shape (``nexfort_engine/gemm_tuning.py``) instead of cuBLASLt's heuristic's first answer.

What: :func:`rewrite_tuned_linears` replaces every ``F.linear(x, w, b)`` of a Dynamo graph whose
operands are all float16 or all bfloat16 (a plain 2-D weight, not a quantized subclass) with
``nexfort::tuned_linear(x, w, b, False)``, and every ``nexfort::linear_gelu(x, w, b)`` (the GELU
epilogue pass runs first) with ``nexfort::tuned_linear(x, w, b, True)``.

Why: under the sustained load of a compiled model's CUDA graphs, tiles the heuristic does not
offer run PixArt-α's fc1 + GELU 1.28× and its qkv 1.11-1.14× faster (BENCHMARKS.md, fifty-fifth
session); the op runs the fastest one measured for its shape, and torch's own call for every
other shape.

Why it is safe: the op computes the same function (the chosen algorithm's error against float32
is checked to be no worse than torch's own when it is chosen; bit-identical in every case
measured); shapes are read at run time, so dynamic shape keeps one graph; the op does no host
work CUDA graphs cannot capture (its search runs after the model's call, never while capturing);
it is a registered custom op (AOTAutograd's cache accepts it) and the FX-graph cache key hashes
the rewritten graph.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import fx

from .. import gemm_tuning
from ._fx import arg as _arg
from ._fx import fake_meta as _fake_meta
from ._fx import is_call as _is_call
from ._fx import val as _val
from .gelu_epilogue import linear_gelu  # noqa: F401 - registers nexfort::linear_gelu

__all__ = ["rewrite_tuned_linears", "wanted"]

log = logging.getLogger(__name__)

_LINEAR = (torch._C._nn.linear, F.linear)
_DTYPES = (torch.float16, torch.bfloat16)


def wanted(option: bool | None) -> bool:
    """Whether to rewrite: only when the option asks for it; auto (``None``) is off. Measured in a
    model (PixArt-α O2 on an H100, run305), the searched algorithms ran the step no faster (30.82 and
    30.93 it/s with them, 30.82 without) while the search added 12 s to the first run: their
    per-shape gains (1-6 %) are within the spread of one kernel's timings between runs. A forced
    ``True`` leaves quantized (fp8) weights alone (:func:`_operands`)."""
    return bool(option)


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    x, weight, bias = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or not (bias is None or isinstance(bias, fx.Node)):
        return None
    vx, vw = _val(x), _val(weight)
    vb = _val(bias) if bias is not None else None
    if vx is None or vw is None or (bias is not None and vb is None) or vw.dim() != 2 or vx.dim() < 2:
        return None
    if vx.dtype not in _DTYPES or vw.dtype != vx.dtype or (vb is not None and (vb.dtype != vx.dtype or vb.dim() != 1)):
        return None  # float32 or mixed: Inductor keeps its own GEMM
    if type(vw) is not torch.Tensor and not isinstance(vw, torch._subclasses.FakeTensor):
        return None  # a tensor subclass (a quantized weight) has its own linear
    return x, weight, bias


def rewrite_tuned_linears(gm: fx.GraphModule) -> int:
    """Replace the 16-bit linears and ``nexfort::linear_gelu`` calls of ``gm`` with
    ``nexfort::tuned_linear``; return how many."""
    count = 0
    op = torch.ops.nexfort.tuned_linear.default
    gelu_op = torch.ops.nexfort.linear_gelu.default
    for node in list(gm.graph.nodes):
        gelu = node.op == "call_function" and node.target is gelu_op
        if not gelu and not _is_call(node, _LINEAR):
            continue
        found = _operands(node) if not gelu else tuple(node.args[:3])
        if found is None:
            continue
        x, weight, bias = found
        with gm.graph.inserting_before(node):
            tuned = gm.graph.call_function(op, (x, weight, bias, gelu))
        _fake_meta(tuned, gemm_tuning.linear_reference, x, weight, bias, gelu)
        node.replace_all_uses_with(tuned)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.debug("nexfort: %d linears as nexfort::tuned_linear", count)
    return count
