"""The Triton kernel behind :func:`nexfort_engine.absmax.triton_absmax` (imported only when it
first runs; see that module for what it computes and why).

One program reduces ``BLOCK_R`` positions of one (batch entry, head), each a row of ``cols``
contiguous elements read in ``BLOCK_C`` chunks, to the largest absolute value, and folds it into
the float32 result with an atomic maximum (the values are non-negative). Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors: the tests compare it with the torch twin that way.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["absmax_kernel"]


@triton.jit
def absmax_kernel(x_ptr, out_ptr, rows, cols, heads, s_b, s_h, s_r,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``x_ptr``: element (b, h, r, c) at ``b * s_b + h * s_h + r * s_r + c``; ``out_ptr``: one
    float32. Grid: (row blocks, batch * heads)."""
    bh = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    base = x_ptr + (bh // heads) * s_b + (bh % heads) * s_h + r * s_r
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(base[:, None] + c[None, :], mask=rmask[:, None] & (c < cols)[None, :], other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.atomic_max(out_ptr, tl.max(tl.max(acc, axis=1), axis=0))
