"""Experiment (measured, not shipped): attention with 8-bit products, one Triton kernel, one torch twin.

What: :func:`triton_fp8_attention` computes ``scaled_dot_product_attention(q, k, v)`` (no mask,
not causal) from quantized operands with both products on 8-bit tensor cores::

    q8, qs = quantize_tokens(q)       # e4m3 or int8, one float32 scale per (batch, head, token)
    k8, ks = quantize_tokens(k)
    v8, vs = quantize_channels(v)     # e4m3 stored [B, H, D, N], one scale per channel
    S = (q8 @ k8^T) * qs * ks^T * scale
    P = exp(S - rowmax)               # in [0, 1], times 448 and rounded to e4m3
    O = (P8 @ v8) * vs / (448 * rowsum(P))

(``pv_fp8=False`` keeps the second product in ``v``'s dtype.) :func:`torch_fp8_attention` is the
float32 twin from the same quantized operands.

Why it is not in the engine: on an H200 (Triton 3.6, torch 2.11; BENCHMARKS.md, eleventh session,
``benchmarks/attention_kernels.py``) the best configuration ran Flux's attention (24 heads x 4608
tokens x 128) at 618-643 TFLOP/s against cuDNN's bf16 flash kernel at 650, before the 97-135 us
of quantizing q, k and v (cuDNN: 401 us per call), at a relative error of 3.7 % (int8 q/k) or
10 % (e4m3 q/k) against float32 where bf16 SDPA has 0.17 %. Two exponentials per instruction
(``exp_f16x2``) did not help: the kernel is not bound by the softmax's exponentials alone.
"""

from __future__ import annotations

import math

import torch

from nexfort_engine.fp8 import FP8_DTYPE, quantize_rowwise

__all__ = ["FP8_DTYPE", "quantize_channels", "quantize_tokens", "torch_fp8_attention", "triton_fp8_attention"]

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
INT8_MAX = 127.0
#: head dimensions the kernel takes (a power of two: Triton's block shapes)
HEAD_DIMS = (32, 64, 128, 256)


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, D]`` -> (``dtype`` ``[B, H, N, D]`` contiguous, float32 scales ``[B, H, N]``): one
    scale per token and head, ``max(amax, 1e-12) / 448`` for e4m3
    (:func:`nexfort_engine.fp8.quantize_rowwise`), ``/ 127`` (rounded to nearest) for int8."""
    if dtype not in (FP8_DTYPE, torch.int8):
        raise ValueError(f"quantize_tokens: dtype {dtype} not supported; valid: torch.float8_e4m3fn, torch.int8")
    if dtype == FP8_DTYPE:
        q, scale = quantize_rowwise(x)
    else:
        x32 = x.float()
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX
        q = (x32 / scale).clamp(-INT8_MAX, INT8_MAX).round().to(dtype)
    return q.contiguous(), scale.squeeze(-1).contiguous()


def quantize_channels(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, N, D]`` -> (e4m3 ``[B, H, D, N]`` contiguous: ``v`` transposed, float32 scales
    ``[B, H, D]``): one scale per channel and head, over all tokens."""
    q, scale = quantize_rowwise(v.transpose(-1, -2))
    return q.contiguous(), scale.squeeze(-1).contiguous()


def _check(q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor, pv_fp8: bool) -> None:
    if q8.dim() != 4 or k8.dim() != 4 or v.dim() != 4:
        raise ValueError("fp8_attention: q, k and v must be 4-D [batch, heads, tokens, head_dim]")
    b, h, _, d = q8.shape
    n_kv = k8.shape[2]
    v_shape = (b, h, d, n_kv) if pv_fp8 else (b, h, n_kv, d)
    if tuple(k8.shape) != (b, h, n_kv, d) or tuple(v.shape) != v_shape:
        raise ValueError(f"fp8_attention: shapes do not match: q {tuple(q8.shape)}, k {tuple(k8.shape)}, "
                         f"v {tuple(v.shape)} (expected {v_shape}{' = transposed' if pv_fp8 else ''})")
    if q8.dtype != k8.dtype or q8.dtype not in (FP8_DTYPE, torch.int8):
        raise ValueError(f"fp8_attention: q and k must both be float8_e4m3fn or both int8, got {q8.dtype} / {k8.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"fp8_attention: head dim {d} not supported; valid: {', '.join(map(str, HEAD_DIMS))}")


def _out(q8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output ``[B, H, N, D]`` laid out as ``[B, N, H, D]``: the models reshape it to
    ``[B, N, H * D]`` next, which is then a view."""
    b, h, n, d = q8.shape
    return q8.new_empty((b, n, h, d), dtype=dtype).permute(0, 2, 1, 3)


def torch_fp8_attention(
    q8: torch.Tensor, qs: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, v: torch.Tensor,
    vs: torch.Tensor, scale: float, pv_fp8: bool, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The reference, in float32 from the quantized operands (module docstring)."""
    _check(q8, k8, v, pv_fp8)
    q = q8.float() * qs.unsqueeze(-1)
    k = k8.float() * ks.unsqueeze(-1)
    s = (q @ k.transpose(-1, -2)) * scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if pv_fp8:
        p8 = (p * FP8_MAX).to(FP8_DTYPE).float()
        o = (p8 @ v.float().transpose(-1, -2)) * (vs.unsqueeze(-2) / FP8_MAX)
    else:
        o = p.to(v.dtype).float() @ v.float()
    out = _out(q8, out_dtype)
    out.copy_(o / denom)
    return out


def launch_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the fastest of the configurations measured on an
    H200 for 128- and 64-wide heads (run71/72: 64 x 128, 4 warps, 3 stages)."""
    if head_dim > 128:
        return 64, 64, 4, 2
    return 64, 128, 4, 3


def triton_fp8_attention(
    q8: torch.Tensor, qs: torch.Tensor, k8: torch.Tensor, ks: torch.Tensor, v: torch.Tensor,
    vs: torch.Tensor, scale: float, pv_fp8: bool, out_dtype: torch.dtype,
    config: tuple[int, int, int, int] | None = None,
    exp_f16x2: bool = False,
) -> torch.Tensor:
    """:func:`torch_fp8_attention` in one Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    ``config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides :func:`launch_config`."""
    _check(q8, k8, v, pv_fp8)
    import triton

    from benchmarks.fp8_attention_kernel import fp8_attention_kernel

    q8, k8, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q8, k8, v))
    qs, ks, vs = (t.contiguous() for t in (qs, ks, vs))
    b, h, n_q, d = q8.shape
    n_kv = k8.shape[2]
    out = _out(q8, out_dtype)
    if out.numel() == 0:
        return out
    block_m, block_n, warps, stages = config or launch_config(d)
    grid = (triton.cdiv(n_q, block_m), b * h)
    fp8_attention_kernel[grid](
        q8, k8, v, qs, ks, vs, out,
        scale * math.log2(math.e),
        q8.stride(0), q8.stride(1), q8.stride(2),
        k8.stride(0), k8.stride(1), k8.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, n_q, n_kv,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, PV_FP8=pv_fp8, QK_INT8=q8.dtype == torch.int8, EVEN_KV=n_kv % block_n == 0,
        FMAX=FP8_MAX, EXP_F16X2=exp_f16x2, num_warps=warps, num_stages=stages,
    )
    return out
