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

Second form (fourteenth session, run98): :func:`triton_gemv_rows`, a register-only kernel
(``benchmarks/fp8_gemv_rows_kernel.py``: the weight tile loaded straight into registers, float32
multiply-adds, one reduction at the end, the modulation's silu computed in the kernel), so
thousands of small programs stream the weight without staging it through shared memory. Timed
over one Flux step's 76 products with distinct weights (3.2 GB, from memory): 1.65 ms in its best
launch (8 x 1024, 4 warps) against ``_scaled_mm``'s 1.66 ms with the silu and quantization kernel;
its default launch 1.90 ms; in the model 2.32 ms per step, and Flux O3 11.64 vs 11.68 it/s without
it in the same call. Neither form reaches the 3.4 TB/s cuBLAS's bf16 product reads its (twice
larger) weight at; both stop near 2 TB/s. Not integrated.
"""

from __future__ import annotations

import torch

__all__ = ["GEMV_CONFIG", "ROWS_CONFIG", "torch_gemv", "triton_gemv", "triton_gemv_rows"]

#: (BLOCK_N, BLOCK_K, num_warps, num_stages): the best or within 2 % of it in run90
GEMV_CONFIG = (32, 256, 4, 4)
#: (BLOCK_N, BLOCK_K, num_warps) of the register-only form: the best in run98's step case
ROWS_CONFIG = (8, 1024, 4)
#: rows one program of the register-only form holds
ROWS_MAX = 4


def _check_prologue(prologue: str) -> None:
    if prologue not in ("none", "silu"):
        raise ValueError(f"prologue must be 'none' or 'silu', got {prologue!r}")


def torch_gemv(x2: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               prologue: str = "none") -> torch.Tensor:
    """The reference: ``(p(x) @ wq.T) * scale + bias`` in float32, in ``x``'s dtype (x [M, K], wq
    [N, K] e4m3, w_scale [N, 1]; ``p`` is ``"none"`` or ``"silu"``, computed in ``x``'s dtype like
    the eager graph)."""
    _check_prologue(prologue)
    if prologue == "silu":
        x2 = torch.nn.functional.silu(x2)
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


def triton_gemv_rows(
    x2: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    prologue: str = "none", config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """:func:`torch_gemv` by the register-only kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``)
    for up to :data:`ROWS_MAX` rows."""
    from benchmarks.fp8_gemv_rows_kernel import fp8_gemv_kernel

    _check_prologue(prologue)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = wq.shape[0]
    if m > ROWS_MAX:
        raise ValueError(f"triton_gemv_rows: at most {ROWS_MAX} rows, got {m}")
    out = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    if m == 0:
        return out
    block_n, block_k, warps = config or ROWS_CONFIG
    fp8_gemv_kernel[(-(-n // block_n), 1)](
        x2, wq.contiguous(), w_scale.reshape(-1), bias if bias is not None else w_scale, out,
        m, n, k, x2.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SILU=prologue == "silu",
        BLOCK_M=1 << (m - 1).bit_length(), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return out
