"""The Triton kernel behind :func:`benchmarks.split_d_attention.split_d_attention` (imported only
when it first runs; see that module for what it computes and why).

One program per ``BLOCK_M`` query rows of one (batch, head): the flash-attention forward loop
(online softmax in base 2) over ``BLOCK_N`` key/value rows at a time, in the inputs' 16-bit dtype
with float32 accumulators. The head dimension is held as two power-of-two blocks, ``D0`` columns
and, with ``HAS_TAIL``, a ``D1``-column tail masked to the real width (PixArt-α's 72 = 64 + 16 with
8 of the tail's columns real), so both products do 80 columns of work where one power-of-two
block does 128. ``q·kᵀ`` is the sum of the two blocks' products (the second accumulates into the
first); ``P·V`` goes to two accumulators. ``WARP_SPECIALIZE`` asks Triton for warp-specialised
code on the key/value loop (``tl.range(..., warp_specialize=True)``: Hopper and later, in the
Triton versions that have it), ``EXP_F16X2`` computes the exponentials two per MUFU instruction
in float16, ``LAZY_RESCALE`` rescales the accumulators only when a row's running max grew by more
than 8 (in log2 units), not at every block. Under ``TRITON_INTERPRET=1`` (set before this module
is imported) it runs on CPU tensors: the tests compare it with the torch twin that way."""

from __future__ import annotations

import triton
import triton.language as tl

from benchmarks.fp8_attention_kernel import exp2

__all__ = ["split_d_attention_kernel", "split_d_attention_tma_kernel"]


@triton.jit
def _store_out(Out, b, h, stride_ob, stride_oh, stride_on, offs_m, m_ok, offs_d0, d0_ok, offs_d1, d1_ok, acc0, acc1,
               l_i, HAS_TAIL: tl.constexpr):
    """Both column blocks of the normalised output, masked to the real rows and columns."""
    o_base = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on
    inv_l = 1.0 / l_i
    tl.store(o_base + offs_d0[None, :], (acc0 * inv_l[:, None]).to(Out.dtype.element_ty),
             mask=m_ok[:, None] & d0_ok[None, :])
    if HAS_TAIL:
        tl.store(o_base + offs_d1[None, :], (acc1 * inv_l[:, None]).to(Out.dtype.element_ty),
                 mask=m_ok[:, None] & d1_ok[None, :])


@triton.jit
def _softmax_step(s, m_i, l_i, acc0, acc1, qk_scale, EXP_F16X2: tl.constexpr, LAZY_RESCALE: tl.constexpr):
    """One key block's online-softmax update: ``(p, m_i, l_i, acc0, acc1)`` with the accumulators
    rescaled to the new running max (``s``: raw scores, -inf where masked). The scale is applied
    with the running max subtracted, in one FMA per score."""
    m_blk = tl.max(s, 1) * qk_scale
    if LAZY_RESCALE:
        # rescale only when some row's max grew by more than 2^8 (FlashAttention-4's trick): otherwise
        # the old max stays, p <= 256, and the final division is unchanged
        if tl.max(m_blk - m_i, 0) > 8.0:
            m_new = tl.maximum(m_i, m_blk)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            m_i = m_new
        p = exp2(s * qk_scale - m_i[:, None], EXP_F16X2)
        l_i = l_i + tl.sum(p, 1)
    else:
        m_new = tl.maximum(m_i, m_blk)
        p = exp2(s * qk_scale - m_new[:, None], EXP_F16X2)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        m_i = m_new
    return p, m_i, l_i, acc0, acc1


@triton.jit
def split_d_attention_kernel(
    Q, K, V, Out,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, N_Q, N_KV,
    HEAD_DIM: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_KV: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
    EXP_F16X2: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d0 = tl.arange(0, D0)
    offs_d1 = D0 + tl.arange(0, D1)
    # D0 > HEAD_DIM: one padded block (120 -> 128), its columns masked like the tail's
    d0_ok = offs_d0 < HEAD_DIM
    d1_ok = offs_d1 < HEAD_DIM
    m_ok = offs_m < N_Q
    # a partly real block reads through offsets clamped to the last real column: Triton 3.6
    # miscompiles the masked loads of such a block on the GPU (the tail's columns wrong, then an
    # illegal access; BENCHMARKS.md, fifty-fourth session). Correct, but scalar loads: slow.
    # (the store keeps the plain offsets, its masks are compiled right)
    offs_d0l = tl.minimum(offs_d0, HEAD_DIM - 1) if D0 > HEAD_DIM else offs_d0
    offs_d1l = tl.minimum(offs_d1, HEAD_DIM - 1) if D0 + D1 > HEAD_DIM else offs_d1

    q_base = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn
    q0 = tl.load(q_base + offs_d0l[None, :], mask=m_ok[:, None] & d0_ok[None, :], other=0.0)
    if HAS_TAIL:
        q1 = tl.load(q_base + offs_d1l[None, :], mask=m_ok[:, None] & d1_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)

    for start_n in tl.range(0, N_KV, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        n_idx = start_n + offs_n
        n_ok = n_idx < N_KV
        k_rows = k_base + n_idx[:, None] * stride_kn
        v_rows = v_base + n_idx[:, None] * stride_vn
        if EVEN_KV and D0 <= HEAD_DIM:
            k0 = tl.load(k_rows + offs_d0[None, :])
        else:
            k0 = tl.load(k_rows + offs_d0l[None, :], mask=n_ok[:, None] & d0_ok[None, :], other=0.0)
        s = tl.dot(q0, tl.trans(k0))
        if HAS_TAIL:
            k1 = tl.load(k_rows + offs_d1l[None, :], mask=n_ok[:, None] & d1_ok[None, :], other=0.0)
            s = tl.dot(q1, tl.trans(k1), s)
        if not EVEN_KV:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        p, m_i, l_i, acc0, acc1 = _softmax_step(s, m_i, l_i, acc0, acc1, qk_scale, EXP_F16X2, LAZY_RESCALE)
        if EVEN_KV and D0 <= HEAD_DIM:
            v0 = tl.load(v_rows + offs_d0[None, :])
        else:
            v0 = tl.load(v_rows + offs_d0l[None, :], mask=n_ok[:, None] & d0_ok[None, :], other=0.0)
        p16 = p.to(v0.dtype)
        acc0 = tl.dot(p16, v0, acc0)
        if HAS_TAIL:
            v1 = tl.load(v_rows + offs_d1l[None, :], mask=n_ok[:, None] & d1_ok[None, :], other=0.0)
            acc1 = tl.dot(p16, v1, acc1)

    _store_out(Out, b, h, stride_ob, stride_oh, stride_on, offs_m, m_ok, offs_d0, d0_ok, offs_d1, d1_ok, acc0, acc1,
               l_i, HAS_TAIL)


@triton.jit
def split_d_attention_tma_kernel(
    desc_q0, desc_q1, desc_k0, desc_k1, desc_v0, desc_v1, Out,
    qk_scale,
    stride_ob, stride_oh, stride_on,
    H, N_Q, N_KV,
    HEAD_DIM: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_KV: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
    EXP_F16X2: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
):
    """The same attention with q, k and v read through tensor descriptors (TMA on Hopper): each is
    a ``[batch * tokens, heads * head dim]`` matrix, a head's columns start at ``h * HEAD_DIM``.
    The tail block reads the next head's first columns (or zeros past the last head): q's and k's
    are zeroed after the load, and the accumulator columns v's fill are never stored. Key rows past
    ``N_KV`` (the next batch's) are masked out of the softmax."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d0 = tl.arange(0, D0)
    offs_d1 = D0 + tl.arange(0, D1)
    d0_ok = offs_d0 < HEAD_DIM
    d1_ok = offs_d1 < HEAD_DIM
    m_ok = offs_m < N_Q
    col = h * HEAD_DIM
    q_row = b * N_Q + pid_m * BLOCK_M
    kv_row = b * N_KV

    q0 = desc_q0.load([q_row, col])
    if D0 > HEAD_DIM:
        q0 = tl.where(d0_ok[None, :], q0, 0.0)
    if HAS_TAIL:
        q1 = tl.where(d1_ok[None, :], desc_q1.load([q_row, col + D0]), 0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, D1], dtype=tl.float32)

    for start_n in tl.range(0, N_KV, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k0 = desc_k0.load([kv_row + start_n, col])
        if D0 > HEAD_DIM:
            k0 = tl.where(d0_ok[None, :], k0, 0.0)
        s = tl.dot(q0, tl.trans(k0))
        if HAS_TAIL:
            # zeroed too: a NaN in the next head must not reach this one's scores through 0 * NaN
            k1 = tl.where(d1_ok[None, :], desc_k1.load([kv_row + start_n, col + D0]), 0.0)
            s = tl.dot(q1, tl.trans(k1), s)
        if not EVEN_KV:
            s = tl.where((start_n + offs_n < N_KV)[None, :], s, float("-inf"))
        p, m_i, l_i, acc0, acc1 = _softmax_step(s, m_i, l_i, acc0, acc1, qk_scale, EXP_F16X2, LAZY_RESCALE)
        v0 = desc_v0.load([kv_row + start_n, col])
        p16 = p.to(v0.dtype)
        acc0 = tl.dot(p16, v0, acc0)
        if HAS_TAIL:
            acc1 = tl.dot(p16, desc_v1.load([kv_row + start_n, col + D0]), acc1)

    _store_out(Out, b, h, stride_ob, stride_oh, stride_on, offs_m, m_ok, offs_d0, d0_ok, offs_d1, d1_ok, acc0, acc1,
               l_i, HAS_TAIL)
