"""The Triton kernel behind :func:`nexfort_engine.rope.triton_rms_norm_rope` (imported only when it
first runs; see that module for what it computes and why).

One program owns ``BLOCK_L`` sequence positions of one batch entry and ``HEADS`` heads. It loads
the rotation matrices of its positions once (``[BLOCK_L, D/2, 2, 2]`` float32) and then, head by
head, loads ``[BLOCK_L, D]`` of the input (any row strides), normalises each row in float32, rounds
to the model dtype as ``rms_norm`` returns it, rotates the (even, odd) pairs and stores the rows
contiguously in ``[B, H, L, D]`` order, the layout attention kernels read. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors: the tests
compare it with the torch twin that way.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rms_norm_rope_kernel"]


@triton.jit
def rms_norm_rope_kernel(
    x_ptr, w_ptr, f_ptr, o_ptr,
    L, H, L_OUT, ROW0,
    sxb, sxh, sxl, sfb, sfl,
    eps,
    D: tl.constexpr, BLOCK_L: tl.constexpr, HEADS: tl.constexpr,
):
    pid_l = tl.program_id(0)
    h0 = tl.program_id(1) * HEADS
    b = tl.program_id(2).to(tl.int64)
    HALF: tl.constexpr = D // 2
    ls = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = ls < L
    ls64 = ls.to(tl.int64)
    cols = tl.arange(0, D)
    # rotation matrices of these positions (absolute position ROW0 + l), [BLOCK_L, D/2, 2, 2]
    f_rows = f_ptr + b * sfb + (ROW0 + ls64)[:, None] * sfl
    f = tl.load(f_rows + tl.arange(0, 2 * D)[None, :], mask=lmask[:, None], other=0.0)
    f_k0, f_k1 = tl.split(tl.reshape(f, (BLOCK_L, HALF, 2, 2)))  # f[..., j, 0], f[..., j, 1]
    f00, f10 = tl.split(f_k0)
    f01, f11 = tl.split(f_k1)
    w = tl.load(w_ptr + cols).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    for i in range(HEADS):
        h = h0 + i
        if h < H:
            x = tl.load(
                x_ptr + b * sxb + h * sxh + ls64[:, None] * sxl + cols[None, :],
                mask=lmask[:, None], other=0.0,
            ).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            # rms_norm's output in the model dtype, then the rotation in float32 (as eager runs it)
            y = (x * rstd[:, None] * w[None, :]).to(dtype).to(tl.float32)
            y0, y1 = tl.split(tl.reshape(y, (BLOCK_L, HALF, 2)))
            o0 = f00 * y0 + f01 * y1
            o1 = f10 * y0 + f11 * y1
            o = tl.reshape(tl.join(o0, o1), (BLOCK_L, D))
            out_rows = ((b * H + h) * L_OUT + ROW0 + ls64) * D
            tl.store(o_ptr + out_rows[:, None] + cols[None, :], o.to(dtype), mask=lmask[:, None])
