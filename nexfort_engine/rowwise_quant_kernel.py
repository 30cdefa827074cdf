"""The Triton kernel behind :func:`nexfort_engine.rowwise_quant.triton_quant_rows` (imported only
when it first runs; see that module for what it computes and why). One program per row: either
the whole row held in registers (``ONE_PASS``) or two passes over it in ``BLOCK`` steps, the row's
absolute maximum first, then the scaled e4m3 values. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors: the tests
compare it with the torch twin that way."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["quant_rows_kernel"]


@triton.jit
def _gelu(x, TANH: tl.constexpr, FAST: tl.constexpr):
    if TANH:
        # 0.5 x (1 + tanh(u)) == x * sigmoid(2u): one exp, no cancellation near 0
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        if FAST:  # the hardware's approximate division (2 ulp) instead of IEEE division's sequence
            return tl.fdiv(x, 1.0 + tl.exp(-2.0 * u), ieee_rounding=False)
        else:
            return x / (1.0 + tl.exp(-2.0 * u))
    else:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _load(h_row, offs, mask, K, PROLOGUE: tl.constexpr, FAST: tl.constexpr):
    """f(h) at ``offs`` of one row in float32 (PROLOGUE: 0 none, 1 gelu_tanh, 2 gelu, 3 geglu)."""
    v = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        v = _gelu(v, True, FAST)
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
def quant_rows_kernel(
    h_ptr, a_ptr, q_ptr, s_ptr,
    K, KA, stride_h, stride_a, stride_q,
    PROLOGUE: tl.constexpr, HAS_A: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr,
    ONE_PASS: tl.constexpr, BLOCK_A: tl.constexpr, FAST: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    h_row = h_ptr + row * stride_h
    a_row = a_ptr + row * stride_a
    q_row = q_ptr + row * stride_q
    if ONE_PASS:
        # the whole row in registers (BLOCK >= K, BLOCK_A >= KA): the producer runs once
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        v = _load(h_row, offs, mask, K, PROLOGUE, FAST)
        amax = tl.max(tl.abs(v), axis=0)
        if HAS_A:
            offs_a = tl.arange(0, BLOCK_A)
            mask_a = offs_a < KA
            va = tl.load(a_row + offs_a, mask=mask_a, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(va), axis=0))
            scale = tl.maximum(amax, 1e-12) / FMAX
            qa = _scaled(va, scale, FMAX, FAST)
            tl.store(q_row + offs_a, qa.to(q_ptr.dtype.element_ty), mask=mask_a)
        else:
            scale = tl.maximum(amax, 1e-12) / FMAX
        tl.store(s_ptr + row, scale)
        q = _scaled(v, scale, FMAX, FAST)
        tl.store(q_row + KA + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        offs0 = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        # pass 1: the row's absolute maximum
        if HAS_A:
            for k0 in range(0, KA, BLOCK):
                offs = k0 + offs0
                v = tl.load(a_row + offs, mask=offs < KA, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(v))
        for k0 in range(0, K, BLOCK):
            offs = k0 + offs0
            v = _load(h_row, offs, offs < K, K, PROLOGUE, FAST)
            acc = tl.maximum(acc, tl.abs(v))
        scale = tl.maximum(tl.max(acc, axis=0), 1e-12) / FMAX
        tl.store(s_ptr + row, scale)
        # pass 2: the same values again (from L2), scaled and written as e4m3
        if HAS_A:
            for k0 in range(0, KA, BLOCK):
                offs = k0 + offs0
                mask = offs < KA
                v = tl.load(a_row + offs, mask=mask, other=0.0).to(tl.float32)
                q = _scaled(v, scale, FMAX, FAST)
                tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        for k0 in range(0, K, BLOCK):
            offs = k0 + offs0
            mask = offs < K
            v = _load(h_row, offs, mask, K, PROLOGUE, FAST)
            q = _scaled(v, scale, FMAX, FAST)
            tl.store(q_row + KA + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
