"""The Triton kernel behind :func:`nexfort_engine.rope.triton_rms_norm_rope` (imported only when it
first runs; see that module for what it computes and why).

One program owns a ``[BLOCK_L, HEADS, D]`` tile: ``BLOCK_L`` sequence positions of one batch entry
times ``HEADS`` heads. It loads the tile (any row strides) and the same tile at the pair partner
of each column (``col ^ 1``, from the same cache lines), normalises each row in float32, rounds to
the model dtype as ``rms_norm`` returns it, and rotates each pair as
``out[i] = c_self[i] * y[i] + c_other[i] * y[i ^ 1]``, reading the two coefficients straight from
the ``[D/2, 2, 2]`` matrices of each position (loaded once per position, broadcast over the heads).
No reshapes or splits of register tiles: those made Triton move the tiles through shared memory
(a first version ran at about 1 TB/s on an H200). The rows are stored contiguously in
``[B, H, L, D]`` order, the layout attention kernels read. Under ``TRITON_INTERPRET=1`` (set before
this module is imported) it runs on CPU tensors: the tests compare it with the torch twin that way.
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
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    ls = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    hs = pid_h * HEADS + tl.arange(0, HEADS)
    ls64 = ls.to(tl.int64)
    hs64 = hs.to(tl.int64)
    cols = tl.arange(0, D)
    partner = cols ^ 1
    mask = (ls < L)[:, None, None] & (hs < H)[None, :, None]
    rows = b * sxb + ls64[:, None, None] * sxl + hs64[None, :, None] * sxh
    x = tl.load(x_ptr + rows + cols[None, None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + rows + partner[None, None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=2) / D + eps)[:, :, None]
    w = tl.load(w_ptr + cols).to(tl.float32)[None, None, :]
    wp = tl.load(w_ptr + partner).to(tl.float32)[None, None, :]
    dtype = o_ptr.dtype.element_ty
    # rms_norm's output in the model dtype, then the rotation in float32 (as eager runs it)
    y = (x * rstd * w).to(dtype).to(tl.float32)
    yp = (xp * rstd * wp).to(dtype).to(tl.float32)
    # out[2d + j] = f[d, j, 0] y[2d] + f[d, j, 1] y[2d + 1]: c_self = f[d, j, j], c_other = f[d, j, 1 - j]
    f_rows = f_ptr + b * sfb + (ROW0 + ls64)[:, None] * sfl
    lmask = (ls < L)[:, None]
    half, j = cols // 2, cols % 2
    c_self = tl.load(f_rows + (half * 4 + 3 * j)[None, :], mask=lmask, other=0.0)[:, None, :]
    c_other = tl.load(f_rows + (half * 4 + 1 + j)[None, :], mask=lmask, other=0.0)[:, None, :]
    o = c_self * y + c_other * yp
    out_rows = ((b * H + hs64)[None, :, None] * L_OUT + ROW0 + ls64[:, None, None]) * D
    tl.store(o_ptr + out_rows + cols[None, None, :], o.to(dtype), mask=mask)
