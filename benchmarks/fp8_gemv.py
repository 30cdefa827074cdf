"""Experiment (measured, not shipped): single-token fp8 linears as a weight-only product, one Triton kernel, one torch twin.

What: :func:`triton_gemv` computes ``(x @ dequant(wq).T) * w_scale + bias`` for a few rows ``x``
[M, K] (16-bit, not quantized) against a rowwise e4m3 weight ``wq`` [N, K] with float32 scales
[N, 1] (:func:`nexfort_engine.fp8.quantize_rowwise`'s output, what the engine's weight cache
holds); :func:`torch_gemv` is the float32 twin.

Why it was tried: the adaLN modulation of DiT blocks runs its linear on one token per sample
(ComfyUI's Flux ``Modulation``: ``vec[:, None, :]``), so the fp8 path quantized a single row and
ran ``torch._scaled_mm`` on it, which cuBLAS tiles in 128 rows: Flux O3's 76 modulation products
took 1.69 ms per step (22 us each, 1.9 TB/s for 28-56 MB of e4m3 weights), plus 57 quantizations
of the row.

Why it is not in the engine (BENCHMARKS.md, thirteenth session, run90): the kernel beat
``_scaled_mm`` in isolation (``benchmarks/fp8_gemv_kernels.py``: 15.9 vs 24.2 us for 3072 -> 9216,
25.9 vs 40.4 us for 3072 -> 18432, with the weight resident in L2 between replays) but not in the
model, where the weights come from memory: 76 calls took 2.01 ms per step (26 us each), and Flux
O3 ran 11.44 vs 11.43 it/s without it in the same call (error against eager rel-L2 0.0422 vs 0.0432:
the unquantized row is a little more accurate). A kernel that splits K across programs, so each
product streams its weight from every SM at memory speed (about 12 us for 42 MB), is what would
pay: not done.
"""

from __future__ import annotations

import torch

__all__ = ["GEMV_CONFIG", "torch_gemv", "triton_gemv"]

#: (BLOCK_N, BLOCK_K, num_warps, num_stages): the best or within 2 % of it in run90
GEMV_CONFIG = (32, 256, 4, 4)


def torch_gemv(x2: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: ``(x @ wq.T) * scale + bias`` in float32, in ``x``'s dtype (x [M, K], wq
    [N, K] e4m3, w_scale [N, 1])."""
    out = (x2.float() @ wq.float().t()) * w_scale.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x2.dtype)


def triton_gemv(
    x2: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """:func:`torch_gemv` in one Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``); one
    program per ``BLOCK_N`` features and 16 rows."""
    from benchmarks.fp8_gemv_kernel import fp8_gemv_kernel

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = wq.shape[0]
    out = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    if m == 0:
        return out
    block_n, block_k, warps, stages = config or GEMV_CONFIG
    grid = (-(-n // block_n), -(-m // 16))
    fp8_gemv_kernel[grid](
        x2, wq.contiguous(), w_scale.reshape(-1), bias if bias is not None else w_scale, out,
        m, n, k, x2.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=not x2.is_cuda,
        num_warps=warps, num_stages=stages,
    )
    return out
