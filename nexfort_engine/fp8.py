"""fp8 linears: dynamic rowwise e4m3 quantization of token-wise ``F.linear`` calls.

What: :class:`Fp8LinearMode` is a ``TorchFunctionMode`` that routes eligible
``torch.nn.functional.linear`` calls (ComfyUI's ops and plain ``nn.Linear`` both call it) to
:func:`fp8_linear`: the activation is quantized per row (token) and the weight per output
channel, both to ``float8_e4m3fn`` with fp32 scales computed from the current values, and the
product runs on fp8 tensor cores through ``torch._scaled_mm``. :func:`fp8_linear_reference` is
its torch twin (same quantization, fp32 matmul).

Why it is safe:

* Nothing is converted ahead of time. The mode is entered around each compiled call and Dynamo
  traces it, so the quantization is *part of the graph* and reads the module's live bf16/fp16
  parameters every call: weight patches (LoRA) are seen without a recompile, and the eager
  fallback, which runs outside the mode, is the untouched model.
* Only token-wise linears are converted (:func:`eligible`): inputs with a sequence dimension and
  shapes fp8 kernels accept. Timestep/adaLN/pooled-embedding MLPs (2-D inputs) are tiny and
  precision-sensitive, so they stay in the model's dtype. The decision uses static properties
  only (rank, feature sizes, dtype), never the token count, so it holds under dynamic shape.
* Dynamic rowwise scales follow each row's range: the error is that of e4m3 rounding (about
  3-4% relative-L2 on random data), with no calibration to go stale.
* Inference only: a call that needs gradients passes through unchanged (``_scaled_mm`` has no
  backward).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = [
    "Fp8LinearMode",
    "eligible",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_supported",
    "quantize_rowwise",
]

FP8_DTYPE = torch.float8_e4m3fn
#: ``_scaled_mm`` needs the contraction (K) and output (N) sizes aligned to 16 bytes of fp8.
ALIGN = 16
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: fp8 tensor cores: Ada (sm89) and Hopper (sm90) and newer.
MIN_CAPABILITY = (8, 9)


def quantize_rowwise(t: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [..., K] -> (fp8 values, fp32 scales [..., 1]) with ``t ~= q * scale`` per row.

    The scale maps each row's absolute maximum onto the fp8 format's largest finite value.
    """
    fmax = torch.finfo(dtype).max
    t32 = t.float()
    amax = t32.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=1e-12) / fmax
    q = (t32 / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` is a token-wise linear the fp8 path takes.

    Static properties only (rank, feature sizes, dtypes, autograd state), so the answer is the
    same for every token count / resolution under dynamic shape.
    """
    if x.dim() < 3 or weight.dim() != 2:
        return False
    out_features, in_features = weight.shape
    if in_features % ALIGN or out_features % ALIGN or x.shape[-1] != in_features:
        return False
    if x.dtype not in INPUT_DTYPES or weight.dtype != x.dtype:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def _flatten(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    out_shape = (*x.shape[:-1], weight.shape[0])
    return x.reshape(-1, x.shape[-1]), out_shape


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on fp8 tensor cores: rowwise-scaled ``torch._scaled_mm``.

    ``_scaled_mm`` wants a row-major first and a column-major second operand (``wq.t()`` of a
    contiguous ``wq``), K and N multiples of 16, and bf16 output with rowwise scales on CUDA.
    """
    x2, out_shape = _flatten(x, weight)
    xq, sx = quantize_rowwise(x2)
    wq, sw = quantize_rowwise(weight)
    # a bf16 model's bias goes into the GEMM's epilogue (no extra pass over the output); fp16
    # models add it in the cast Inductor fuses anyway. Fast accumulation: Hopper's fp8 MMA
    # accumulates partial sums in reduced precision, part of what low precision trades.
    fused_bias = bias is not None and x.dtype == torch.bfloat16 and bias.dtype == torch.bfloat16
    out = torch._scaled_mm(
        xq.contiguous(), wq.contiguous().t(), scale_a=sx, scale_b=sw.t(),
        bias=bias if fused_bias else None, out_dtype=torch.bfloat16, use_fast_accum=True,
    )
    if bias is not None and not fused_bias:
        out = out.float() + bias.float()
    return out.to(x.dtype).reshape(out_shape)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of :func:`fp8_linear`: same quantization, dequantized fp32 matmul."""
    x2, out_shape = _flatten(x, weight)
    xq, sx = quantize_rowwise(x2)
    wq, sw = quantize_rowwise(weight)
    out = (xq.float() * sx) @ (wq.float() * sw).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(out_shape)


def fp8_supported(device: torch.device | str) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA sm89+) and torch has ``_scaled_mm``.

    CPU runs the fp8 path correctly but not faster, so it is only used there when forced.
    """
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def _linear_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``F.linear(input, weight, bias=None)``'s arguments, positional or by keyword."""
    names = ("input", "weight", "bias")
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(vals) < 2:
        return None, None, None
    return vals[0], vals[1], vals[2] if len(vals) > 2 else None


class Fp8LinearMode(torch.overrides.TorchFunctionMode):
    """Routes eligible ``F.linear`` calls to the fp8 path; every other call passes through.

    Enter it around a ``torch.compile``'d call: Dynamo traces the mode, so the quantization and
    ``_scaled_mm`` land in the graph. ``reference=True`` uses :func:`fp8_linear_reference`.
    """

    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        self.reference = reference

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(args, kwargs)
            if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and eligible(x, weight):
                if self.reference:
                    return fp8_linear_reference(x, weight, bias)
                return fp8_linear(x, weight, bias)
        return func(*args, **kwargs)
