"""The register-only Triton kernel behind :func:`benchmarks.fp8_gemv.triton_gemv_rows` (an
experiment, measured and not shipped: see that module).

``out [M, N] = (p(x) [M, K] @ dequant(wq [N, K]).T) * w_scale [N] + bias [N]`` for one to four
rows ``x``, where ``p`` is the prologue (``SILU``: ``silu(x)`` rounded to ``x``'s dtype, as the
eager graph rounds it; else the identity). No tensor cores and no shared memory: one program per
``BLOCK_N`` output features loads ``[BLOCK_N, BLOCK_K]`` weight tiles straight into registers
(16-byte loads along K), widens them to float32 (a 16-bit value times an e4m3 value is exact in
float32), multiplies by the rows' values and accumulates elementwise; the one reduction over K,
the per-feature scale and the bias come at the end. Runs on CPU tensors under
``TRITON_INTERPRET=1`` (the tests compare it with the twin).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_gemv_kernel"]


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, o_ptr,
    M, N, K, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        xv = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        x = xv.to(tl.float32)
        if SILU:  # the eager graph's silu, rounded to the activation's dtype like its output
            x = (x / (1.0 + tl.exp(-x))).to(xv.dtype).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    out = tl.sum(acc, axis=2) * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
