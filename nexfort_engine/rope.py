"""Query/key RMSNorm and rotary embedding of DiT attention, fused: one Triton kernel, one torch twin.

What: :func:`rms_norm_rope` computes what Flux-style blocks (ComfyUI's ``flux.layers``
``QKNorm`` followed by ``flux.math.apply_rope1``) compute for the queries or the keys::

    y = cat([rms_norm(x_i, (D,), w_i, eps) for each part i], dim=2)   # [B, H, L, D], model dtype
    out[..., 2j + r] = freqs[..., j, r, 0] * y[..., 2j] + freqs[..., j, r, 1] * y[..., 2j + 1]

in float32, returned in the model dtype. ``freqs`` is ComfyUI's ``pe``: ``[B or 1, 1, L, D/2, 2,
2]`` float32. The parts are Flux's double-block text and image streams (one part in single
blocks); each ``x_i`` may be any strided ``[B, H, L_i, D]`` view with a contiguous last dim (the
heads of a fused QKV projection's output). The result is a new ``[B, H, L, D]`` tensor stored in
``[B, L, H, D]`` memory order (a permuted view): rows are read and written in the order they lie
in memory, and cuDNN's attention reads that layout as fast as a contiguous one (BENCHMARKS.md,
eleventh session).

The custom op ``nexfort::rms_norm_rope`` runs :func:`triton_rms_norm_rope` on CUDA tensors and the
twin :func:`torch_rms_norm_rope` elsewhere; :mod:`nexfort_engine.passes.fuse_rope` puts it into
compiled graphs in place of the ops ComfyUI's code traces to.

Why: attention wants queries and keys as ``[B, H, L, D]``, while the QKV projection writes them
as ``[B, L, 3, H, D]``. The transposition is the cost: on an H200 a plain ``.contiguous()`` of
Flux's q and k took 69-76 us (1.6 TB/s, run78), and Inductor's fused kernel for the whole path
took as long (81 us per single block in the model, run68; the double blocks' path about 147 us
over eight kernels). Rows written in the order they are read stream at memory speed, and the
double blocks' concatenation is the output's layout, not a copy.

Numerics: the row's mean square, ``rsqrt`` and the weight product are float32, rounded once to
the model dtype (as torch's fused CUDA ``rms_norm`` and Inductor do; the CPU composite rounds
after the normalisation and again after the weight), and the rotation is float32 on those rounded
values as in eager, one rounding at the end. The result can differ from eager by one rounding
step of the model dtype; the tests bound it.

fp8 (``nexfort::rms_norm_rope_fp8``, for :mod:`nexfort_engine.fp8_attention`): the same rows,
times ``scale`` and stored as e4m3 (clamped to +-448) in the same layout, with
``scale = 1 / descale`` and ``descale = sqrt(D) * max_i |w_i| / 448`` (:func:`fp8_scales`;
[1, 1, 1, 1] float32 on the device, no host synchronisation; made in the compiled graph, where
Inductor computes both in one small kernel). That scale needs no pass over the result: ``sum_i (x_i / rms(x))^2 <= D``, so
``|y_i| <= sqrt(D) * max |w|`` for every element of the normalised row, and a rotation keeps each
pair's norm, so the rotated values stay within the same bound (ComfyUI's ``pe`` are rotations;
anything larger is clamped). e4m3's relative precision does not depend on where in its range a
value falls (down to 2^-6 of the scale's unit), so a bound looser than the actual maximum costs
nothing measurable.
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8 import FP8_DTYPE
from .rowwise_quant import FP8_MAX, _cdiv, triton_available

__all__ = ["fp8_scales", "kernel_takes", "rms_norm_rope", "rms_norm_rope_fp8", "torch_apply_rope",
           "torch_rms_norm_rope", "torch_rms_norm_rope_fp8", "triton_available", "triton_rms_norm_rope"]

#: (BLOCK_R rows per program, num_warps) when none is given (read at each call: the benchmark's
#: ``--rope-config`` sets it to compare configurations in one process). Timed from CUDA graphs on
#: an H200 (benchmarks/rope_kernels.py, run93), Flux's single-block q + k: 48.7 us with (16, 4),
#: 48.5 with (8, 2), 55.1 with (32, 4) (the twelfth session's choice), Inductor 73.6; the double
#: block's path 136.9 / 133.5 / 141.1 us. The twelfth session's eager timings measured Python's
#: launches, not the kernel (BENCHMARKS.md, thirteenth session)
DEFAULT_CONFIG = (16, 4)
#: dtypes the kernel handles (it moves values as 16-bit halves of 32-bit words)
KERNEL_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


def kernel_takes(dtype: torch.dtype, head_size: int) -> bool:
    """Whether the Triton kernel handles this dtype and head size (16-bit, a power of two >= 2)."""
    return dtype in KERNEL_DTYPES and head_size >= 2 and not head_size & (head_size - 1)


def _check(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the arguments; returns (B, H, L, D) of the result."""
    if not xs or len(xs) != len(weights):
        raise ValueError(f"rms_norm_rope: one weight per part, got {len(xs)} parts and {len(weights)} weights")
    b, h, _, d = (xs[0].shape if xs[0].dim() == 4 else (None,) * 4)
    for x, w in zip(xs, weights, strict=True):
        if x.dim() != 4 or x.shape[0] != b or x.shape[1] != h or x.shape[3] != d or x.dtype != xs[0].dtype:
            raise ValueError("rms_norm_rope: parts must be [B, H, L_i, D] with the same B, H, D and dtype, got "
                             f"{[tuple(p.shape) for p in xs]}")
        if w.dim() != 1 or w.shape[0] != d:
            raise ValueError(f"rms_norm_rope: each weight must be [D] = [{d}], got {tuple(w.shape)}")
    if d % 2:
        raise ValueError(f"rms_norm_rope: the head size must be even (pairs are rotated), got {d}")
    length = sum(x.shape[2] for x in xs)
    if (freqs.dim() != 6 or freqs.dtype != torch.float32 or freqs.shape[0] not in (1, b) or freqs.shape[1] != 1
            or freqs.shape[2] != length or freqs.shape[3] != d // 2 or tuple(freqs.shape[4:]) != (2, 2)):
        raise ValueError(f"rms_norm_rope: freqs must be float32 [1 or B, 1, L, D/2, 2, 2] = [.., 1, {length}, {d // 2}, 2, 2], "
                         f"got {freqs.dtype} {tuple(freqs.shape)}")
    return b, h, length, d


def _rotate32(y: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rotation in float32 (``flux.math.apply_rope1`` before its final rounding)."""
    y_ = y.to(dtype=freqs.dtype).reshape(*y.shape[:-1], -1, 1, 2)
    out = freqs[..., 0] * y_[..., 0]
    out.addcmul_(freqs[..., 1], y_[..., 1])
    return out.reshape(*y.shape)


def torch_apply_rope(y: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The rotation as ComfyUI's ``flux.math.apply_rope1`` computes it (float32, then ``y``'s dtype)."""
    return _rotate32(y, freqs).type_as(y)


def _norms(xs: list[torch.Tensor], weights: list[torch.Tensor], eps: float) -> torch.Tensor:
    """Eager's per-part ``rms_norm``, concatenated on the sequence dim."""
    ys = [torch.rms_norm(x, (x.shape[-1],), w, eps) for x, w in zip(xs, weights, strict=True)]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)


def fp8_scales(weights: list[torch.Tensor], head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, descale) of the fp8 result (module docstring): ``descale = sqrt(D) * max |w| / 448``
    and its reciprocal, [1, 1, 1, 1] float32 on the weights' device."""
    wmax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    descale = (wmax * (head_size ** 0.5 / FP8_MAX)).clamp(min=1e-12).reshape(1, 1, 1, 1)
    return 1.0 / descale, descale


def torch_rms_norm_rope_fp8(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor,
                            eps: float, scale: torch.Tensor) -> torch.Tensor:
    """The fp8 reference: the rotated rows (float32, before rounding to the model dtype) times
    ``scale`` (one float32 value), clamped to e4m3's range and rounded to e4m3, in the op's
    layout."""
    _check(xs, weights, freqs)
    out = (_rotate32(_norms(xs, weights, eps), freqs) * scale.reshape(1).float()).clamp(-FP8_MAX, FP8_MAX)
    return _heads_view(out.to(FP8_DTYPE))


def torch_rms_norm_rope(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: eager's ops (``torch.rms_norm`` per part, ``cat`` on the sequence dim, the
    rotation), contiguous."""
    _check(xs, weights, freqs)
    return _heads_view(torch_apply_rope(_norms(xs, weights, eps), freqs))


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, H, L, D]) copied into ``[B, L, H, D]`` memory, viewed as ``[B, H, L, D]``: the
    op's output layout, on every device."""
    out = t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).permute(0, 2, 1, 3)
    return out.copy_(t)


def _kernel() -> Any:
    """The Triton kernel (:mod:`nexfort_engine.rope_kernel`, imported on first use: importing this
    module needs no Triton)."""
    from .rope_kernel import rms_norm_rope_kernel

    return rms_norm_rope_kernel


def triton_rms_norm_rope(
    xs: list[torch.Tensor],
    weights: list[torch.Tensor],
    freqs: torch.Tensor,
    eps: float,
    config: tuple[int, int] | None = None,
    fp8_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`torch_rms_norm_rope` in one Triton launch per part (CUDA, or CPU under
    ``TRITON_INTERPRET=1``), for bfloat16/float16 inputs. ``config`` (BLOCK_R, num_warps)
    overrides :data:`DEFAULT_CONFIG` (benchmarks, tests). With ``fp8_scale`` (a one-element
    float32 tensor on the inputs' device) the result is e4m3: the values times that scale, clamped
    to +-448 (:func:`torch_rms_norm_rope_fp8` without its descale)."""
    b, h, length, d = _check(xs, weights, freqs)
    dtype = xs[0].dtype
    if not kernel_takes(dtype, d):
        raise ValueError(f"rms_norm_rope: the Triton kernel takes {', '.join(map(str, KERNEL_DTYPES))} "
                         f"with a power-of-two head size, got {dtype} and {d}")
    block_r, warps = config or DEFAULT_CONFIG
    if block_r < 1 or block_r & (block_r - 1):
        raise ValueError(f"rms_norm_rope: BLOCK_R must be a power of two, got {block_r}")
    fp8 = fp8_scale is not None
    if fp8:
        storage = torch.empty((b, length, h, d), device=xs[0].device, dtype=FP8_DTYPE)
        words_out = storage.view(torch.int16)
        scale = fp8_scale.reshape(1)
        if scale.dtype != torch.float32:
            raise ValueError(f"rms_norm_rope: fp8_scale must be float32, got {scale.dtype}")
    else:
        storage = torch.empty((b, length, h, d), device=xs[0].device, dtype=dtype)
        words_out = storage.view(torch.int32)
        scale = words_out  # unused by the kernel
    if freqs.stride(5) != 1 or freqs.stride(4) != 2 or freqs.stride(3) != 4:
        freqs = freqs.contiguous()
    row0 = 0
    for x, w in zip(xs, weights, strict=True):
        n = x.shape[2]
        if n and b and h:
            words = _words(x)
            _kernel()[(_cdiv(n * h, block_r), b)](
                words, w.contiguous(), freqs, words_out, scale,
                n, h, length, row0,
                words.stride(0), words.stride(1), words.stride(2),
                freqs.stride(0) if freqs.shape[0] > 1 else 0, freqs.stride(2),
                float(eps),
                HALF=d // 2, BLOCK_R=block_r, DTYPE=KERNEL_DTYPES[dtype], FP8=fp8, HW_CVT=fp8 and x.is_cuda,
                num_warps=warps,
            )
        row0 += n
    return storage.permute(0, 2, 1, 3)


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([B, H, L, D], 16-bit) as int32 words of (even, odd) pairs, without a copy where its
    strides and offset allow it."""
    if x.stride(3) != 1 or any(s % 2 for s in x.stride()[:3]) or x.storage_offset() % 2:
        x = x.contiguous()
    return x.view(torch.int32)


@torch.library.custom_op("nexfort::rms_norm_rope", mutates_args=())
def rms_norm_rope(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """Queries or keys normalised per head and rotated (module docstring): a contiguous
    ``[B, H, L, D]`` tensor. The Triton kernel on CUDA (bfloat16/float16, power-of-two head
    sizes), the torch twin elsewhere."""
    d = xs[0].shape[-1] if xs else 0
    if xs and xs[0].is_cuda and kernel_takes(xs[0].dtype, d) and triton_available():
        return triton_rms_norm_rope(xs, weights, freqs, eps)
    return torch_rms_norm_rope(xs, weights, freqs, eps)


@rms_norm_rope.register_fake
def _(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor, eps: float) -> torch.Tensor:
    b, h, length, d = _check(xs, weights, freqs)
    return xs[0].new_empty((b, length, h, d)).permute(0, 2, 1, 3)


@torch.library.custom_op("nexfort::rms_norm_rope_fp8", mutates_args=())
def rms_norm_rope_fp8(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor,
                      eps: float, scale: torch.Tensor) -> torch.Tensor:
    """:func:`rms_norm_rope` times ``scale`` as e4m3 (module docstring): the Triton kernel on
    CUDA, :func:`torch_rms_norm_rope_fp8` elsewhere."""
    d = xs[0].shape[-1] if xs else 0
    if xs and xs[0].is_cuda and kernel_takes(xs[0].dtype, d) and triton_available():
        return triton_rms_norm_rope(xs, weights, freqs, eps, fp8_scale=scale)
    return torch_rms_norm_rope_fp8(xs, weights, freqs, eps, scale)


@rms_norm_rope_fp8.register_fake
def _(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: torch.Tensor,
      eps: float, scale: torch.Tensor) -> torch.Tensor:
    b, h, length, d = _check(xs, weights, freqs)
    return xs[0].new_empty((b, length, h, d), dtype=FP8_DTYPE).permute(0, 2, 1, 3)
