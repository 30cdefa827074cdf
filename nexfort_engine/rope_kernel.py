"""The Triton kernel behind :func:`nexfort_engine.rope.triton_rms_norm_rope` (imported only when it
first runs; see that module for what it computes and why).

The 16-bit input and output are read and written as 32-bit words, each one (even, odd) pair of a
row: a row of ``D`` values is ``D/2`` words, loaded and stored contiguously, and the pair a
rotation mixes is the two halves of one word (unpacked with shifts and bit casts). So there is no
reshaping or splitting of register tiles, which made Triton move tiles through shared memory
(earlier versions of this kernel ran at 0.8-1.4 TB/s on an H200, run76/run77).

One program owns ``BLOCK_R`` rows of one batch entry, in (position, head) order: consecutive rows
are the heads of one position, adjacent in memory for a fused QKV output, and they share that
position's rotation matrices (``[D/2, 2, 2]`` float32, loaded per row from L1). Each row is
normalised in float32, rounded to the model dtype as ``rms_norm`` returns it, rotated in float32
and stored in ``[B, L, H, D]`` memory order, so a program reads and writes contiguous runs (the
heads of consecutive positions); the caller hands the result on as a ``[B, H, L, D]`` view, which
cuDNN's attention reads at the same speed as a contiguous one. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors: the tests
compare it with the torch twin that way.

With ``FP8`` the rotated values are multiplied by the float32 scale at ``s_ptr``, clamped to
e4m3's range and stored as e4m3: one 16-bit word per pair (the output pointer is an int16 view),
the operands of cuDNN's fp8 attention (:mod:`nexfort_engine.fp8_attention`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rms_norm_rope_kernel"]


@triton.jit
def _unpack(v, HALF_BITS: tl.constexpr, DTYPE: tl.constexpr):
    """float32 value of one 16-bit half of each 32-bit word (DTYPE 0: bfloat16, 1: float16)."""
    bits = ((v >> HALF_BITS) & 0xFFFF).to(tl.uint16)
    if DTYPE == 0:
        return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """``x`` rounded to the model dtype (as float32)."""
    if DTYPE == 0:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _bits(x, DTYPE: tl.constexpr):
    """The 16 bits of ``x`` in the model dtype, widened to uint32."""
    if DTYPE == 0:
        return x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        return x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _e4m3_bits(x, scale):
    """The 8 bits of ``x * scale`` as e4m3 (clamped to +-448), widened to uint32."""
    y = tl.minimum(tl.maximum(x * scale, -448.0), 448.0)
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)


@triton.jit
def _e4m3x2(lo, hi, scale, HW_CVT: tl.constexpr):
    """One 16-bit word of two e4m3 values (``lo * scale`` in the low byte, ``hi * scale`` in the
    high byte, each clamped to +-448), as int16. ``HW_CVT``: the GPU's ``cvt.rn.satfinite.e4m3x2.f32``
    (CUDA only; Triton 3.6 on an H200 packed the bytes of the form below wrongly for all but the
    first eight words of a row, run109); else the portable form (Triton's interpreter)."""
    a = tl.minimum(tl.maximum(lo * scale, -448.0), 448.0)
    b = tl.minimum(tl.maximum(hi * scale, -448.0), 448.0)
    if HW_CVT:
        # the first source goes to the upper byte
        return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [a, b],
                                         dtype=tl.int16, is_pure=True, pack=1)
    else:
        word = _e4m3_bits(a, 1.0) | (_e4m3_bits(b, 1.0) << 8)
        return word.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def rms_norm_rope_kernel(
    x_ptr, w_ptr, f_ptr, o_ptr, s_ptr,
    L, H, L_OUT, ROW0,
    sxb, sxh, sxl, sfb, sfl,
    eps,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, DTYPE: tl.constexpr, FP8: tl.constexpr,
    HW_CVT: tl.constexpr = False,
):
    """``x_ptr``: int32 view (one word per pair); ``o_ptr``: int32 view, or int16 with ``FP8``
    (``s_ptr``: the float32 scale; unused otherwise); strides in words; ``L`` rows of this part at
    ``ROW0`` in the output's (and the rotation table's) ``L_OUT`` positions."""
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < L * H
    pos = rows // H
    head = rows % H
    pairs = tl.arange(0, HALF)
    mask = rmask[:, None]
    v = tl.load(x_ptr + (b * sxb + pos * sxl + head * sxh)[:, None] + pairs[None, :], mask=mask, other=0)
    x0 = _unpack(v, 0, DTYPE)  # little endian: the even element is the low half
    x1 = _unpack(v, 16, DTYPE)
    rstd = tl.rsqrt(tl.sum(x0 * x0 + x1 * x1, axis=1) / (2 * HALF) + eps)[:, None]
    w0 = tl.load(w_ptr + 2 * pairs).to(tl.float32)[None, :]
    w1 = tl.load(w_ptr + 2 * pairs + 1).to(tl.float32)[None, :]
    # rms_norm's output in the model dtype, then the rotation in float32 (as eager runs it)
    y0 = _round(x0 * rstd * w0, DTYPE)
    y1 = _round(x1 * rstd * w1, DTYPE)
    f = f_ptr + (b * sfb + (ROW0 + pos) * sfl)[:, None] + 4 * pairs[None, :]
    o0 = tl.load(f, mask=mask, other=0.0) * y0 + tl.load(f + 1, mask=mask, other=0.0) * y1
    o1 = tl.load(f + 2, mask=mask, other=0.0) * y0 + tl.load(f + 3, mask=mask, other=0.0) * y1
    out = ((b * L_OUT + ROW0 + pos) * H + head) * HALF  # [B, L, H, D] storage: rows stream out
    if FP8:
        tl.store(o_ptr + out[:, None] + pairs[None, :], _e4m3x2(o0, o1, tl.load(s_ptr), HW_CVT), mask=mask)
    else:
        word = _bits(o0, DTYPE) | (_bits(o1, DTYPE) << 16)
        tl.store(o_ptr + out[:, None] + pairs[None, :], word.to(tl.int32, bitcast=True), mask=mask)
