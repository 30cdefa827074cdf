"""The Triton kernel behind :func:`benchmarks.fp8_attention.triton_fp8_attention` (imported
only when it first runs; see that module for what it computes and why).

One program per ``BLOCK_M`` query rows of one (batch, head): the flash-attention forward loop
(online softmax in base 2) over ``BLOCK_N`` key/value rows at a time, with e4m3 ``Q``/``K``
(one float32 scale per token and head) and, with ``PV_FP8``, e4m3 probabilities against an e4m3
``V`` stored transposed (``[B, H, D, N]``: fp8 tensor-core operands must be K-major; one scale per
channel). Without ``PV_FP8`` the second product runs in ``V``'s own dtype. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors: the tests
compare it with the torch twin that way."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["exp2", "fp8_attention_kernel"]


@triton.jit
def exp2(x, EXP_F16X2: tl.constexpr):
    """``2 ** x`` in float32; with ``EXP_F16X2`` computed in float16, two per MUFU instruction
    (``ex2.approx.f16x2``)."""
    if EXP_F16X2:
        return tl.inline_asm_elementwise(
            "ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16, is_pure=True, pack=2,
        ).to(tl.float32)
    else:
        return tl.math.exp2(x)


@triton.jit
def fp8_attention_kernel(
    Q, K, V, QS, KS, VS, Out,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vr,  # V: rows are channels (PV_FP8) or tokens
    stride_ob, stride_oh, stride_on,
    H, N_Q, N_KV,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PV_FP8: tl.constexpr,
    QK_INT8: tl.constexpr,
    EVEN_KV: tl.constexpr,
    FMAX: tl.constexpr,
    EXP_F16X2: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < N_Q

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None], other=0.0)
    # the per-row scale and the softmax scale folded into one factor per row
    qs = tl.load(QS + pid_bh * N_Q + offs_m, mask=m_ok, other=0.0) * qk_scale

    k_base = K + b * stride_kb + h * stride_kh
    ks_base = KS + pid_bh * N_KV
    v_base = V + b * stride_vb + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    for start_n in range(0, N_KV, BLOCK_N):
        n_idx = start_n + offs_n
        k_ptrs = k_base + n_idx[:, None] * stride_kn + offs_d[None, :]
        if EVEN_KV:
            k = tl.load(k_ptrs)
            ks = tl.load(ks_base + n_idx)
        else:
            n_ok = n_idx < N_KV
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
            ks = tl.load(ks_base + n_idx, mask=n_ok, other=0.0)
        if QK_INT8:
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qs[:, None] * ks[None, :]
        if not EVEN_KV:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # two exponentials per MUFU instruction: the softmax's exp throughput bounds fp8 attention
        p = exp2(s - m_new[:, None], EXP_F16X2)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PV_FP8:
            # V^T block [HEAD_DIM, BLOCK_N]: channels are rows, tokens contiguous
            vt_ptrs = v_base + offs_d[:, None] * stride_vr + n_idx[None, :]
            if EVEN_KV:
                vt = tl.load(vt_ptrs)
            else:
                vt = tl.load(vt_ptrs, mask=n_ok[None, :], other=0.0)
            # p <= 1: scaled to e4m3's range so small probabilities keep their precision
            p8 = (p * FMAX).to(vt.dtype)
            acc += tl.dot(p8, tl.trans(vt))
        else:
            v_ptrs = v_base + n_idx[:, None] * stride_vr + offs_d[None, :]
            if EVEN_KV:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if PV_FP8:
        vs = tl.load(VS + pid_bh * HEAD_DIM + offs_d) / FMAX
        acc = acc * vs[None, :]
    out = acc / l_i[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None])
