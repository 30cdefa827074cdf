"""A linear layer followed by tanh-GELU as one GEMM whose epilogue applies the GELU.

What: :func:`rewrite_gelu_epilogues` walks a Dynamo graph for ``gelu(linear(x, w, b),
approximate="tanh")`` - the MLP of PixArt-α, SD3/MMDiT, Flux's double blocks, Wan, HunyuanDiT and
LTX (``nn.GELU(approximate="tanh")`` after ComfyUI's ``Linear``) - where the linear has a bias and
no other user and its operands are all float16 or all bfloat16, and replaces the pair with one call
of ``nexfort::linear_gelu``. On CUDA that op is ``torch._addmm_activation(b, x, w.T, use_gelu=True)``:
cuBLASLt's ``GELU_BIAS`` epilogue, the bias and the (tanh) GELU applied to the float32 accumulator
before the one rounding to the model dtype. Elsewhere, and for inputs the epilogue does not take, it is the reference twin
:func:`linear_gelu_reference` (``F.gelu(F.linear(x, w, b), approximate="tanh")``).

Why: Inductor leaves the GEMM to cuBLAS and the GELU to a pointwise kernel that reads and writes
the whole wide activation again: PixArt-α's 8192 × 4608 fp16 MLP activation costs 51 µs per block
(1.44 ms of a 33 ms step on an H200, run257). The epilogue does it for about 9 µs more GEMM time
(PixArt's fc1: 0.131 ms GEMM, 0.174 ms GEMM + GELU, 0.140 ms with the epilogue; Flux's bf16
4096 × 3072 × 12288: 0.460 ms either way; BENCHMARKS.md, fifty-second session).

Numerics: closer to float32 than the two kernels - one rounding instead of two (rel-L2 against a
float32 computation 2.1e-4 against 3.2e-4 for PixArt's shape, 1.7e-3 against 2.6e-3 for Flux's).
cuBLASLt's GELU is the tanh form (against exact-GELU 2.9e-4, the tanh form's own distance), which
is why only ``approximate="tanh"`` is matched.

Why it is safe: the op computes the same function of the same inputs; the linear's output is read
by nothing else (it is erased); the FX-graph cache key follows (it hashes the rewritten graph),
and the op is a registered custom op, which AOTAutograd's cache accepts and CUDA graphs capture
(it does no host work).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import fx

from ._fx import arg as _arg
from ._fx import fake_meta as _fake_meta
from ._fx import is_call as _is_call
from ._fx import val as _val

__all__ = ["linear_gelu", "linear_gelu_reference", "rewrite_gelu_epilogues", "wanted"]

log = logging.getLogger(__name__)

_LINEAR = (torch._C._nn.linear, F.linear)
_GELU = (torch._C._nn.gelu, F.gelu)
#: dtypes cuBLASLt's epilogue is used for (others take the twin)
_EPILOGUE_DTYPES = (torch.float16, torch.bfloat16)


def linear_gelu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The torch twin: ``F.gelu(F.linear(x, weight, bias), approximate="tanh")``."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def _epilogue_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in _EPILOGUE_DTYPES and weight.dtype == x.dtype and bias.dtype == x.dtype
            and weight.dim() == 2 and bias.dim() == 1 and x.dim() >= 2 and x.numel() > 0)


@torch.library.custom_op("nexfort::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate="tanh")``; on CUDA in 16-bit, one cuBLASLt
    GEMM with the bias and GELU in its epilogue (module docstring), else the twin."""
    if not _epilogue_takes(x, weight, bias):
        return linear_gelu_reference(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_gelu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def wanted(option: bool | None, *, cuda: bool, inductor: bool) -> bool:
    """Whether to rewrite: the option when set; auto (``None``) on a GPU when Inductor compiles
    (on CPU the op would be its twin: nothing to gain)."""
    if option is not None:
        return option
    return cuda and inductor


def _match(gelu: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(x, weight, bias) of ``gelu(linear(x, weight, bias), approximate="tanh")``, or None."""
    if not _is_call(gelu, _GELU) or _arg(gelu, 1, "approximate", "none") != "tanh":
        return None
    lin = _arg(gelu, 0, "input")
    if not _is_call(lin, _LINEAR) or len(lin.users) != 1:
        return None
    x, weight, bias = _arg(lin, 0, "input"), _arg(lin, 1, "weight"), _arg(lin, 2, "bias")
    if not all(isinstance(n, fx.Node) for n in (x, weight, bias)):
        return None
    vx, vw, vb = _val(x), _val(weight), _val(bias)
    if vx is None or vw is None or vb is None or vw.dim() != 2 or vb.dim() != 1 or vx.dim() < 2:
        return None
    if not (vx.dtype == vw.dtype == vb.dtype) or vx.dtype not in _EPILOGUE_DTYPES:
        return None  # float32 (or mixed) has no epilogue to gain: Inductor keeps its own kernels
    if type(vw) is not torch.Tensor and not isinstance(vw, torch._subclasses.FakeTensor):
        return None  # a tensor subclass (a quantized weight) has its own linear
    return x, weight, bias


def rewrite_gelu_epilogues(gm: fx.GraphModule) -> int:
    """Replace every matching ``gelu(linear(...), approximate="tanh")`` in ``gm`` with
    ``nexfort::linear_gelu``; return how many."""
    count = 0
    op = torch.ops.nexfort.linear_gelu.default
    for gelu in list(gm.graph.nodes):
        found = _match(gelu)
        if found is None:
            continue
        x, weight, bias = found
        lin = _arg(gelu, 0, "input")
        with gm.graph.inserting_before(gelu):
            fused = gm.graph.call_function(op, (x, weight, bias))
        _fake_meta(fused, linear_gelu_reference, x, weight, bias)
        gelu.replace_all_uses_with(fused)
        gm.graph.erase_node(gelu)
        gm.graph.erase_node(lin)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.debug("nexfort: %d linear + tanh-GELU pairs as one GEMM with a GELU epilogue", count)
    return count
