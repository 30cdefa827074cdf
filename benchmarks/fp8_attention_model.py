"""Experiment (benchmark only, not in the engine): cuDNN's fp8 attention inside ComfyUI's Flux, to
measure its quality cost on the whole model.

``benchmarks/cudnn_fp8_attention.py`` measured the kernel alone: 1.40× bf16 cuDNN at Flux's shape,
with a relative error of 0.114 per call (66× bf16's). What that error does to a whole sampling run
is the open question; this answers it. :func:`patch` replaces ComfyUI's ``optimized_attention``
in ``comfy.ldm.flux.math`` (what Flux's blocks call) with :func:`attention`, which runs the custom
op ``nexfort_bench::sdpa_fp8``:

* on CUDA: q, k and v quantized per tensor to e4m3 (``448 / amax``, plain torch ops: not fused, so
  the timing here is not the speed an engine path would have), cuDNN's ``sdpa_fp8`` through
  ``nvidia-cudnn-frontend`` (one graph per shape, built on first use), the e4m3 output (scale
  ``448 / amax(v)``: ``|o| <= max |v|``) dequantized to the model dtype;
* elsewhere: the torch twin :func:`torch_sdpa_fp8` (q, k, v rounded through e4m3 the same way, the
  product in float32; cuDNN also rounds the probabilities, which the twin does not).

``benchmarks/text_to_image.py --attention-experiment cudnn-fp8`` patches after the eager reference,
so ``err_vs_eager`` is the quality cost (with O2, attention's alone; with O3, on top of the fp8
GEMMs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nexfort_engine.fp8 import FP8_DTYPE
from nexfort_engine.rowwise_quant import FP8_MAX

__all__ = ["attention", "patch", "quantize_tensor", "sdpa_fp8", "torch_sdpa_fp8"]

_GRAPHS: dict[tuple, Any] = {}
_HANDLE: list[Any] = []


def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous e4m3 values of ``t`` scaled by ``448 / amax``, and the descale ``amax / 448``
    ([1, 1, 1, 1] float32, on ``t``'s device: no host synchronisation)."""
    amax = t.abs().amax().float().clamp(min=1e-12).reshape(1, 1, 1, 1)
    return (t.float() * (FP8_MAX / amax)).to(FP8_DTYPE).contiguous(), amax / FP8_MAX


def torch_sdpa_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The twin: q, k, v rounded through per-tensor e4m3, attention in float32, in q's dtype."""
    (q8, dq), (k8, dk), (v8, dv) = (quantize_tensor(t) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q8.float() * dq, k8.float() * dk, v8.float() * dv)
    return out.to(q.dtype)


def _graph(shape: tuple[int, ...], stride: tuple[int, ...]) -> Any:
    import cudnn

    from benchmarks.cudnn_fp8_attention import Fp8Sdpa

    if not _HANDLE:
        _HANDLE.append(cudnn.create_handle())
    key = (shape, stride)
    if key not in _GRAPHS:
        _GRAPHS[key] = Fp8Sdpa(_HANDLE[0], shape, stride)  # type: ignore[arg-type]
    return _GRAPHS[key]


@torch.library.custom_op("nexfort_bench::sdpa_fp8", mutates_args=())
def sdpa_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of [B, H, L, D] q, k, v through cuDNN's fp8 forward (CUDA) or the twin."""
    if not q.is_cuda:
        return torch_sdpa_fp8(q, k, v)
    import cudnn

    from benchmarks.cudnn_fp8_attention import fp8_scalars

    (q8, dq), (k8, dk), (v8, dv) = (quantize_tensor(t) for t in (q, k, v))
    graph = _graph(tuple(q8.shape), tuple(q8.stride()))
    cudnn.set_stream(handle=_HANDLE[0], stream=torch.cuda.current_stream().cuda_stream)
    out = torch.empty_like(q8)
    graph(q8, k8, v8, fp8_scalars(dq, dk, dv), out)
    return (out.float() * dv).to(q.dtype)


@sdpa_fp8.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: Any = None,
              attn_precision: Any = None, skip_reshape: bool = False, skip_output_reshape: bool = False,
              **kwargs: Any) -> torch.Tensor:
    """ComfyUI's ``optimized_attention`` signature, for Flux's call (``skip_reshape=True``: q, k, v
    are [B, H, L, D]; no mask). Anything else goes to ComfyUI's own function."""
    if (not skip_reshape or mask is not None or q.shape[-1] % 16 or q.shape[-1] > 128
            or q.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        from comfy.ldm.modules import attention as comfy_attention

        return comfy_attention.optimized_attention(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                                                   skip_reshape=skip_reshape,
                                                   skip_output_reshape=skip_output_reshape, **kwargs)
    b, _, length, d = q.shape
    out = torch.ops.nexfort_bench.sdpa_fp8(q, k, v)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, length, heads * d)


def patch() -> None:
    """Route Flux's attention (``comfy.ldm.flux.math.optimized_attention``) to :func:`attention`."""
    import comfy.ldm.flux.math as flux_math

    flux_math.optimized_attention = attention

