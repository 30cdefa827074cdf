"""The Triton kernel behind :func:`benchmarks.fp8_gemv.triton_gemv` (an experiment, measured and
not shipped: see that module).

``out [M, N] = (x [M, K] @ dequant(wq [N, K]).T) * w_scale [N] + bias [N]`` for a handful of rows:
one program per ``BLOCK_N`` output features (and ``BLOCK_M`` rows), streaming its weight rows once
in ``BLOCK_K`` steps, the fp8 weights widened to the activation's 16-bit type and multiplied on
tensor cores with float32 accumulation (the products of a 16-bit value and an e4m3 value are exact
in float32), the per-feature scale and the bias applied once at the end. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors with float32
products (``F32_DOT``: the interpreter's bfloat16 ``tl.dot`` returns garbage): the tests compare it
with the torch twin that way, and on a GPU with the 16-bit products.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_gemv_kernel"]


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, o_ptr,
    M, N, K, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr = False,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] of the row-major [N, K] weight: each feature's K values contiguous
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if F32_DOT:  # Triton's interpreter (its bfloat16 products are wrong): exact float32 products
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # e4m3 values are exact in either 16-bit type; tensor cores, float32 accumulation
            acc += tl.dot(x, w.to(x.dtype))
    out = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
