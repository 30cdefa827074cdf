"""The Triton kernel behind :func:`nexfort_engine.rowwise_quant.triton_quant_rows` (imported only
when it first runs; see that module for what it computes and why). One program per row: either
the whole row held in registers (``ONE_PASS``: ``NCH`` chunks of ``BLOCK`` elements, so a row of
3 x 4096 elements computes no padding lanes) or two passes over it in ``BLOCK`` steps, the row's
absolute maximum first, then the scaled e4m3 values. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors: the tests
compare it with the torch twin that way."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ln_mod_quant_kernel", "quant_rows_kernel"]


@triton.jit
def _hw_tanh(x):
    """The GPU's ``tanh.approx.f32`` (one MUFU instruction, relative error about 2^-11; not in
    Triton's interpreter)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gelu(x, TANH: tl.constexpr, FAST: tl.constexpr, HW_TANH: tl.constexpr = False):
    if TANH:
        # 0.5 x (1 + tanh(u)) == x * sigmoid(2u): one exp, no cancellation near 0
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        if HW_TANH:  # one MUFU instruction instead of an exponential and a division
            return 0.5 * x * (1.0 + _hw_tanh(u))
        elif FAST:  # the hardware's approximate division (2 ulp) instead of IEEE division's sequence
            return tl.fdiv(x, 1.0 + tl.exp(-2.0 * u), ieee_rounding=False)
        else:
            return x / (1.0 + tl.exp(-2.0 * u))
    else:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _load(h_row, offs, mask, K, PROLOGUE: tl.constexpr, FAST: tl.constexpr, HW_TANH: tl.constexpr = False):
    """f(h) at ``offs`` of one row in float32 (PROLOGUE: 0 none, 1 gelu_tanh, 2 gelu, 3 geglu)."""
    v = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        v = _gelu(v, True, FAST, HW_TANH)
    elif PROLOGUE == 2:
        v = _gelu(v, False, FAST)
    elif PROLOGUE == 3:
        g = tl.load(h_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        v = v * _gelu(g, False, FAST)
    return v


@triton.jit
def _scaled(v, scale, FMAX: tl.constexpr, FAST: tl.constexpr):
    """``v / scale`` clamped to e4m3's range; FAST multiplies by the row's reciprocal instead."""
    if FAST:
        v = v * (1.0 / scale)
    else:
        v = v / scale
    return tl.clamp(v, -FMAX, FMAX)


@triton.jit
def _chunk(h_row, c: tl.constexpr, K, PROLOGUE: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
           HW_TANH: tl.constexpr):
    offs = c * BLOCK + tl.arange(0, BLOCK)
    return _load(h_row, offs, offs < K, K, PROLOGUE, FAST, HW_TANH)


@triton.jit
def _put(q_row, v, c: tl.constexpr, K, scale, BLOCK: tl.constexpr, FMAX: tl.constexpr, FAST: tl.constexpr):
    offs = c * BLOCK + tl.arange(0, BLOCK)
    tl.store(q_row + offs, _scaled(v, scale, FMAX, FAST).to(q_row.dtype.element_ty), mask=offs < K)


@triton.jit
def _load_a(a_row, offs, mask, as_ptr, A_SCALED: tl.constexpr):
    """The copied part at ``offs`` in float32: fp8 values times their per-tensor descale when
    ``A_SCALED`` (fp8 attention's output, :mod:`nexfort_engine.passes.fp8_attention`)."""
    v = tl.load(a_row + offs, mask=mask, other=0.0).to(tl.float32)
    if A_SCALED:
        v = v * tl.load(as_ptr)
    return v


@triton.jit
def quant_rows_kernel(
    h_ptr, a_ptr, q_ptr, s_ptr, as_ptr,
    K, KA, stride_h, stride_a, stride_q,
    PROLOGUE: tl.constexpr, HAS_A: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr,
    ONE_PASS: tl.constexpr, BLOCK_A: tl.constexpr, FAST: tl.constexpr = False, NCH: tl.constexpr = 1,  # 1..8: rowwise_quant.MAX_CHUNKS
    HW_TANH: tl.constexpr = False, A_SCALED: tl.constexpr = False,
):
    """One row of ``quantize_rowwise(cat([a, f(h)], -1))`` per program (``as_ptr``: ``a``'s
    descale when ``A_SCALED``, else unused)."""
    row = tl.program_id(0).to(tl.int64)
    h_row = h_ptr + row * stride_h
    a_row = a_ptr + row * stride_a
    q_row = q_ptr + row * stride_q
    if ONE_PASS:
        # the whole row in registers, NCH chunks of BLOCK (NCH * BLOCK >= K, BLOCK_A >= KA): the
        # producer runs once per value and no more than one chunk's worth of padding lanes
        v0 = _chunk(h_row, 0, K, PROLOGUE, BLOCK, FAST, HW_TANH)
        acc = tl.abs(v0)
        if NCH > 1:
            v1 = _chunk(h_row, 1, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v1))
        if NCH > 2:
            v2 = _chunk(h_row, 2, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v2))
        if NCH > 3:
            v3 = _chunk(h_row, 3, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v3))
        if NCH > 4:
            v4 = _chunk(h_row, 4, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v4))
        if NCH > 5:
            v5 = _chunk(h_row, 5, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v5))
        if NCH > 6:
            v6 = _chunk(h_row, 6, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v6))
        if NCH > 7:
            v7 = _chunk(h_row, 7, K, PROLOGUE, BLOCK, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v7))
        amax = tl.max(acc, axis=0)
        if HAS_A:
            offs_a = tl.arange(0, BLOCK_A)
            mask_a = offs_a < KA
            va = _load_a(a_row, offs_a, mask_a, as_ptr, A_SCALED)
            amax = tl.maximum(amax, tl.max(tl.abs(va), axis=0))
            scale = tl.maximum(amax, 1e-12) / FMAX
            qa = _scaled(va, scale, FMAX, FAST)
            tl.store(q_row + offs_a, qa.to(q_ptr.dtype.element_ty), mask=mask_a)
        else:
            scale = tl.maximum(amax, 1e-12) / FMAX
        tl.store(s_ptr + row, scale)
        qh = q_row + KA
        _put(qh, v0, 0, K, scale, BLOCK, FMAX, FAST)
        if NCH > 1:
            _put(qh, v1, 1, K, scale, BLOCK, FMAX, FAST)
        if NCH > 2:
            _put(qh, v2, 2, K, scale, BLOCK, FMAX, FAST)
        if NCH > 3:
            _put(qh, v3, 3, K, scale, BLOCK, FMAX, FAST)
        if NCH > 4:
            _put(qh, v4, 4, K, scale, BLOCK, FMAX, FAST)
        if NCH > 5:
            _put(qh, v5, 5, K, scale, BLOCK, FMAX, FAST)
        if NCH > 6:
            _put(qh, v6, 6, K, scale, BLOCK, FMAX, FAST)
        if NCH > 7:
            _put(qh, v7, 7, K, scale, BLOCK, FMAX, FAST)
    else:
        offs0 = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        # pass 1: the row's absolute maximum
        if HAS_A:
            for k0 in range(0, KA, BLOCK):
                offs = k0 + offs0
                v = _load_a(a_row, offs, offs < KA, as_ptr, A_SCALED)
                acc = tl.maximum(acc, tl.abs(v))
        for k0 in range(0, K, BLOCK):
            offs = k0 + offs0
            v = _load(h_row, offs, offs < K, K, PROLOGUE, FAST, HW_TANH)
            acc = tl.maximum(acc, tl.abs(v))
        scale = tl.maximum(tl.max(acc, axis=0), 1e-12) / FMAX
        tl.store(s_ptr + row, scale)
        # pass 2: the same values again (from L2), scaled and written as e4m3
        if HAS_A:
            for k0 in range(0, KA, BLOCK):
                offs = k0 + offs0
                mask = offs < KA
                v = _load_a(a_row, offs, mask, as_ptr, A_SCALED)
                q = _scaled(v, scale, FMAX, FAST)
                tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        for k0 in range(0, K, BLOCK):
            offs = k0 + offs0
            mask = offs < K
            v = _load(h_row, offs, mask, K, PROLOGUE, FAST, HW_TANH)
            q = _scaled(v, scale, FMAX, FAST)
            tl.store(q_row + KA + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_mod(v, mean, rstd, m_row, a_row, c: tl.constexpr, D, BLOCK: tl.constexpr, offset):
    """``add + layer_norm(x) * (offset + mult)`` at chunk ``c``, the norm, ``offset + mult`` and the
    result each rounded to the model dtype (``mult``'s, which is ``x``'s) as eager's ops round."""
    ROUND: tl.constexpr = m_row.dtype.element_ty
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    y = ((v - mean) * rstd).to(ROUND).to(tl.float32)
    mult = (tl.load(m_row + offs, mask=mask, other=0.0).to(tl.float32) + offset).to(ROUND).to(tl.float32)
    add = tl.load(a_row + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, (add + y * mult).to(ROUND).to(tl.float32), 0.0)


@triton.jit
def ln_mod_quant_kernel(
    x_ptr, m_ptr, a_ptr, q_ptr, s_ptr,
    D, L, stride_x, stride_m, stride_a, stride_q, eps, offset,
    BLOCK: tl.constexpr, NCH: tl.constexpr, FMAX: tl.constexpr, FAST: tl.constexpr,
):
    """One row of ``quantize_rowwise(addcmul(add, layer_norm(x), offset + mult))`` per program: the row in
    NCH (1..4) chunks of BLOCK in registers; ``mult``/``add`` rows by batch (row // L; stride 0
    broadcasts one row to every batch)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // L
    x_row = x_ptr + row * stride_x
    m_row = m_ptr + b * stride_m
    a_row = a_ptr + b * stride_a
    q_row = q_ptr + row * stride_q
    v0 = _chunk(x_row, 0, D, 0, BLOCK, False, False)
    total = v0
    if NCH > 1:
        v1 = _chunk(x_row, 1, D, 0, BLOCK, False, False)
        total += v1
    if NCH > 2:
        v2 = _chunk(x_row, 2, D, 0, BLOCK, False, False)
        total += v2
    if NCH > 3:
        v3 = _chunk(x_row, 3, D, 0, BLOCK, False, False)
        total += v3
    mean = tl.sum(total, axis=0) / D
    offs = tl.arange(0, BLOCK)
    d0 = tl.where(offs < D, v0 - mean, 0.0)
    sq = d0 * d0
    if NCH > 1:
        d1 = tl.where(offs + BLOCK < D, v1 - mean, 0.0)
        sq += d1 * d1
    if NCH > 2:
        d2 = tl.where(offs + 2 * BLOCK < D, v2 - mean, 0.0)
        sq += d2 * d2
    if NCH > 3:
        d3 = tl.where(offs + 3 * BLOCK < D, v3 - mean, 0.0)
        sq += d3 * d3
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / D + eps)
    y0 = _ln_mod(v0, mean, rstd, m_row, a_row, 0, D, BLOCK, offset)
    acc = tl.abs(y0)
    if NCH > 1:
        y1 = _ln_mod(v1, mean, rstd, m_row, a_row, 1, D, BLOCK, offset)
        acc = tl.maximum(acc, tl.abs(y1))
    if NCH > 2:
        y2 = _ln_mod(v2, mean, rstd, m_row, a_row, 2, D, BLOCK, offset)
        acc = tl.maximum(acc, tl.abs(y2))
    if NCH > 3:
        y3 = _ln_mod(v3, mean, rstd, m_row, a_row, 3, D, BLOCK, offset)
        acc = tl.maximum(acc, tl.abs(y3))
    scale = tl.maximum(tl.max(acc, axis=0), 1e-12) / FMAX
    tl.store(s_ptr + row, scale)
    _put(q_row, y0, 0, D, scale, BLOCK, FMAX, FAST)
    if NCH > 1:
        _put(q_row, y1, 1, D, scale, BLOCK, FMAX, FAST)
    if NCH > 2:
        _put(q_row, y2, 2, D, scale, BLOCK, FMAX, FAST)
    if NCH > 3:
        _put(q_row, y3, 3, D, scale, BLOCK, FMAX, FAST)
