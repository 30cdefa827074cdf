"""fp8 per-row activation quantization fused with its producer: one Triton kernel, one torch twin.

What: :func:`quant_rows` computes ``quantize_rowwise(x)`` (:mod:`nexfort_engine.fp8`: e4m3 values
and one float32 scale per row) where ``x`` is not materialised but made from its producer's
inputs on the fly::

    x = cat([a, f(h)], dim=-1)     # ``a`` optional (Flux single blocks); f is the prologue:
    "none":      f(h) = h
    "gelu_tanh": f(h) = gelu(h, approximate="tanh")              # Flux MLPs
    "gelu":      f(h) = gelu(h)                                  # erf form
    "geglu":     f(h) = h[:, :K] * gelu(h[:, K:])                # SDXL / SD2.1 feed-forwards

The custom op ``nexfort::quant_rows`` runs :func:`triton_quant_rows` on CUDA tensors and the twin
:func:`torch_quant_rows` elsewhere; :mod:`nexfort_engine.passes.fuse_quant` puts the op into fp8
graphs in place of Inductor's own quantization of such producers. A second op,
``nexfort::quant_rows_ln_mod`` (:func:`quant_rows_ln_mod`, twin :func:`torch_quant_rows_ln_mod`),
quantizes ``addcmul(add, layer_norm(x), mult)``: the affine-free LayerNorm + per-sample modulation
that makes a DiT block's attention and MLP inputs (ComfyUI's Flux ``apply_mod``).

Why: Inductor quantizes a row wider than its single-pass limit (Flux's 12288/15360-wide rows) in
two kernels, one for the row's ``amax`` and one that recomputes the producer and writes fp8, each
reading the bf16 producer input from memory. On an H200 that took 173 us for Flux's GELU rows and
244 us for its single-block concatenation (BENCHMARKS.md, tenth session), against 69 / 91 us for
the bf16 producer alone. Here each row is one program that holds the whole row in registers, in
up to :data:`MAX_CHUNKS` power-of-two chunks (a 12288-wide row is 3 x 4096: no lanes compute
padding; up to :data:`ONE_PASS_MAX` elements; wider rows make two passes, the second finding the
row in L2), and the tanh GELU is one ``tanh.approx.f32`` per value: 44.5 / 64.9 us (run84; the
whole row as one padded block with an exponential and a division per value took 71 / 89 us).

Numerics: ``amax`` is exact in any order and ``scale = max(amax, 1e-12) / 448`` and ``x / scale``
are the twin's float32 operations. What differs from eager: the producer's value stays in float32
here, while eager rounds it to the model dtype first (Inductor does not round either); on the GPU
the op runs the ``hw-tanh`` form (:data:`gpu_form`): the tanh GELU through the hardware's
approximate tanh (relative error about 2^-11 in the tanh, far below e4m3's 2^-4 steps: 0.11-0.19 %
of the bytes differ from the exact producer's, each within one e4m3 step plus the tanh's error) and
the scaling a multiplication by the row's reciprocal. The LayerNorm op rounds the norm and the
modulated value to the model dtype as eager's two ops do; its mean and variance sum in another
order, so a norm on a rounding boundary can move one step. The tests bound all of these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .fp8 import FP8_DTYPE, scale_rowwise

__all__ = [
    "GPU_FORMS",
    "LN_MAX_CHUNKS",
    "MAX_CHUNKS",
    "PROLOGUES",
    "chunk_width",
    "launch_config",
    "ln_mod_config",
    "quant_rows",
    "quant_rows_ln_mod",
    "torch_quant_rows",
    "torch_quant_rows_ln_mod",
    "torch_scaled_ln_mod",
    "torch_scaled_rows",
    "triton_available",
    "triton_quant_rows",
    "triton_quant_rows_ln_mod",
]

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: prologue name -> the kernel's constexpr code
PROLOGUES: dict[str, int] = {"none": 0, "gelu_tanh": 1, "gelu": 2, "geglu": 3}


def _check(h: torch.Tensor, a: torch.Tensor | None, prologue: str, a_scale: torch.Tensor | None = None) -> int:
    """Validate the arguments; returns the width of ``f(h)``."""
    if a_scale is not None and (a is None or a.dtype != FP8_DTYPE or a_scale.numel() != 1
                                or a_scale.dtype != torch.float32):
        raise ValueError("quant_rows: a_scale (one float32 value) goes with an e4m3 a, got "
                         f"a={None if a is None else a.dtype}, a_scale={a_scale.dtype} {tuple(a_scale.shape)}")
    if prologue not in PROLOGUES:
        raise ValueError(f"quant_rows: unknown prologue {prologue!r}; valid: {', '.join(PROLOGUES)}")
    if h.dim() != 2 or (a is not None and (a.dim() != 2 or a.shape[0] != h.shape[0])):
        raise ValueError("quant_rows: h and a must be 2-D [rows, features] with the same number of rows")
    if prologue == "geglu":
        if h.shape[1] % 2:
            raise ValueError(f"quant_rows: geglu needs an even number of input features, got {h.shape[1]}")
        return h.shape[1] // 2
    return h.shape[1]


def _prologue(h: torch.Tensor, prologue: str) -> torch.Tensor:
    if prologue == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if prologue == "gelu":
        return F.gelu(h)
    if prologue == "geglu":
        value, gate = h.chunk(2, dim=-1)
        return value * F.gelu(gate)
    return h


def torch_scaled_rows(h: torch.Tensor, a: torch.Tensor | None, prologue: str,
                      a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference up to the final cast: the producer in the inputs' dtype, as eager runs it,
    then ``x / scale`` clamped to e4m3's range, in float32. Returns (float32 [M, KA + K], [M, 1]).
    With ``a_scale``, ``a`` is e4m3 and its values are ``a * a_scale`` in float32 (not rounded to
    the model dtype: the kernel does not either)."""
    _check(h, a, prologue, a_scale)
    x = _prologue(h, prologue)
    if a is not None and a_scale is not None:
        x = torch.cat([a.float() * a_scale.reshape(1).float(), x.float()], dim=-1)
    elif a is not None:
        x = torch.cat([a.to(x.dtype), x], dim=-1)
    return scale_rowwise(x)


def torch_quant_rows(h: torch.Tensor, a: torch.Tensor | None, prologue: str,
                     a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: :func:`nexfort_engine.fp8.quantize_rowwise` of the producer's output.
    Returns (e4m3 [M, KA + K], float32 [M, 1])."""
    scaled, scale = torch_scaled_rows(h, a, prologue, a_scale)
    return scaled.to(FP8_DTYPE), scale


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    """The Triton kernel (:mod:`nexfort_engine.rowwise_quant_kernel`, imported on first use:
    importing this module needs no Triton)."""
    from .rowwise_quant_kernel import quant_rows_kernel

    return quant_rows_kernel


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


#: rows padded to at most this many elements (a row and, with ``a``, its copied part) are held in
#: registers; wider rows take two passes in 4096-element steps
ONE_PASS_MAX = 32768
#: a one-pass row is held in at most this many chunks of a power-of-two width (the kernel unrolls
#: them), so a 12288-wide row is 6 x 2048 elements instead of 16384 with a quarter of the lanes
#: computing padding
MAX_CHUNKS = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_width(width: int, block: int = 0, max_chunks: int = MAX_CHUNKS) -> int:
    """The power-of-two chunk a one-pass row of ``width`` elements is held in: ``block`` (a
    requested chunk; default 4096 for rows of 8192 or more, 1024 below), raised until at most
    ``max_chunks`` chunks cover the row, and never wider than the row's padded width."""
    block = block or (4096 if width >= 8192 else 1024)
    return min(max(block, _pow2_at_least(_cdiv(max(width, 1), max_chunks))), _pow2_at_least(max(width, 1)))


def launch_config(width: int, a_width: int = 0) -> tuple[bool, int, int]:
    """(one_pass, BLOCK, num_warps) for rows of ``width`` producer elements after ``a_width``
    copied ones; a one-pass BLOCK is the chunk width (:func:`chunk_width`), with 8 warps for
    4096-wide chunks (16 values per thread per chunk) and 4 below. Measured on an H200
    (benchmarks/quant_rows_kernels.py, run84, ``hw-tanh`` form): Flux's 12288-wide GELU rows
    3 x 4096 with 8 warps 44.5 us (6 x 2048: 48.5-53.1; the whole row as one 16384-wide block, the
    kernel before chunks: 53.9-62.9; Inductor 174.1); its 3072 + 12288 single-block rows 64.9 us
    (whole row 78.2-92.3; Inductor 247.6); SDXL's 2560-wide GEGLU rows 3 x 1024 with 4 warps
    45.2 us (one 4096 chunk 56.4; Inductor 73.5). Two passes (rows over :data:`ONE_PASS_MAX`):
    61.0 / 73.6 us on those Flux rows."""
    chunk = chunk_width(width)
    held = chunk * _cdiv(max(width, 1), chunk) + (_pow2_at_least(a_width) if a_width else 0)
    if held <= ONE_PASS_MAX:
        return True, chunk, 8 if chunk >= 4096 else 4
    return False, 4096, 8


def triton_quant_rows(
    h: torch.Tensor,
    a: torch.Tensor | None,
    prologue: str,
    config: tuple[bool, int, int] | None = None,
    out_dtype: torch.dtype = FP8_DTYPE,
    fast: bool = False,
    hw_tanh: bool = False,
    a_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`torch_quant_rows` in one Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    ``config`` (one_pass, BLOCK, num_warps) overrides :func:`launch_config` (benchmarks, tests; a
    one-pass BLOCK is a chunk width, 0 = automatic); ``out_dtype=float32`` stores the scaled
    values before the cast (tests: Triton's interpreter rounds to fp8 in its own way, unlike the
    GPU's round-to-nearest-even conversion). ``fast``: approximate division in the tanh-form GELU
    and one reciprocal per row instead of a division per value (float32 results within a few ulp).
    ``hw_tanh``: the tanh-form GELU through the GPU's ``tanh.approx.f32`` (relative error about
    2^-11 in the tanh; CUDA only: Triton's interpreter has no inline assembly). ``a_scale``: see
    :func:`torch_scaled_rows`."""
    k = _check(h, a, prologue, a_scale)
    if hw_tanh and not h.is_cuda:
        raise ValueError("quant_rows: hw_tanh needs a CUDA tensor (inline PTX)")
    if h.stride(-1) != 1:
        h = h.contiguous()
    if a is not None and a.stride(-1) != 1:
        a = a.contiguous()
    m = h.shape[0]
    ka = a.shape[1] if a is not None else 0
    q = torch.empty((m, ka + k), device=h.device, dtype=out_dtype)
    scale = torch.empty((m, 1), device=h.device, dtype=torch.float32)
    if m == 0:
        return q, scale
    one_pass, block, warps = config or launch_config(k, ka)
    chunks = 1
    if one_pass:  # the whole row in at most MAX_CHUNKS chunks of BLOCK
        block = chunk_width(k, block)
        chunks = _cdiv(max(k, 1), block)
    _kernel()[(m,)](
        h, a if a is not None else h, q, scale, a_scale.reshape(1) if a_scale is not None else scale,
        k, ka, h.stride(0), a.stride(0) if a is not None else 0, q.stride(0),
        PROLOGUE=PROLOGUES[prologue], HAS_A=a is not None, BLOCK=block, FMAX=FP8_MAX,
        ONE_PASS=one_pass, BLOCK_A=_pow2_at_least(max(ka, 1)), FAST=fast, NCH=chunks,
        HW_TANH=hw_tanh and prologue == "gelu_tanh", A_SCALED=a_scale is not None,
        num_warps=warps,
    )
    return q, scale


#: the kernel's forms, by name: (``fast``, ``hw_tanh``) of :func:`triton_quant_rows`
GPU_FORMS: dict[str, tuple[bool, bool]] = {"exact": (False, False), "fast": (True, False), "hw-tanh": (True, True)}
#: the form the op runs on CUDA tensors (read on each call; the benchmark's ``--quant-rows-form``
#: sets it to compare forms in one process). ``hw-tanh``: see :func:`triton_quant_rows`
gpu_form = "hw-tanh"


@torch.library.custom_op("nexfort::quant_rows", mutates_args=())
def quant_rows(h: torch.Tensor, a: torch.Tensor | None, prologue: str,
               a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(cat([a, f(h)], -1))`` with ``f`` named by ``prologue`` (module docstring):
    (e4m3 [M, KA + K], float32 scales [M, 1]). With ``a_scale``, ``a`` is e4m3 holding
    ``a / a_scale`` (fp8 attention's output). The Triton kernel on CUDA (in the form
    :data:`gpu_form` names), the torch twin elsewhere."""
    if h.is_cuda and triton_available():
        fast, hw_tanh = GPU_FORMS[gpu_form]
        return triton_quant_rows(h, a, prologue, fast=fast, hw_tanh=hw_tanh, a_scale=a_scale)
    return torch_quant_rows(h, a, prologue, a_scale)


@quant_rows.register_fake
def _(h: torch.Tensor, a: torch.Tensor | None, prologue: str,
      a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    k = _check(h, a, prologue, a_scale)
    ka = a.shape[1] if a is not None else 0
    return h.new_empty((h.shape[0], ka + k), dtype=FP8_DTYPE), h.new_empty((h.shape[0], 1), dtype=torch.float32)


# -- LayerNorm + modulation (DiT blocks' adaLN inputs): quantize_rowwise(addcmul(add, LN(x), mult))


def _check_ln_mod(x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"quant_rows_ln_mod: x must be [batch, tokens, features], got shape {tuple(x.shape)}")
    for name, t in (("mult", mult), ("add", add)):
        if t.dim() != 3 or t.shape[1] != 1 or t.shape[2] != x.shape[2] or t.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"quant_rows_ln_mod: {name} must be [batch or 1, 1, {x.shape[2]}], got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise ValueError(f"quant_rows_ln_mod: {name} is {t.dtype}, x is {x.dtype}: they must match")


def torch_scaled_ln_mod(
    x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, eps: float, mult_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference up to the final cast: ``addcmul(add, layer_norm(x), mult_offset + mult)`` in
    the inputs' dtype, as eager (ComfyUI's ``apply_mod(norm(x), 1 + scale, shift)`` after an
    affine-free LayerNorm) runs it, then ``x / scale`` clamped to e4m3's range, in float32
    [B * L, D]."""
    _check_ln_mod(x, mult, add)
    if mult_offset:
        mult = mult_offset + mult
    y = torch.addcmul(add, F.layer_norm(x, x.shape[-1:], eps=eps), mult)
    return scale_rowwise(y.reshape(-1, x.shape[-1]))


def torch_quant_rows_ln_mod(
    x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, eps: float, mult_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of :func:`quant_rows_ln_mod`: (e4m3 [B * L, D], float32 [B * L, 1])."""
    scaled, scale = torch_scaled_ln_mod(x, mult, add, eps, mult_offset)
    return scaled.to(FP8_DTYPE), scale


#: the most chunks the LayerNorm kernel holds a row in
LN_MAX_CHUNKS = 4


def ln_mod_config(width: int) -> tuple[int, int, int]:
    """(BLOCK, chunks, num_warps) of the LayerNorm kernel: 1024-wide chunks (Flux's 3072: three, no
    padding) with 4 warps, raised to at most :data:`LN_MAX_CHUNKS` chunks."""
    block = chunk_width(width, 1024, LN_MAX_CHUNKS)
    return block, _cdiv(max(width, 1), block), 4 if block <= 2048 else 8


def triton_quant_rows_ln_mod(
    x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, eps: float, mult_offset: float = 0.0,
    out_dtype: torch.dtype = FP8_DTYPE, config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`torch_quant_rows_ln_mod` in one Triton kernel (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); ``out_dtype=float32`` stores the scaled values before the cast;
    ``config`` (BLOCK, num_warps) overrides :func:`ln_mod_config` (benchmarks; BLOCK as
    :func:`chunk_width` takes it, with at most :data:`LN_MAX_CHUNKS` chunks)."""
    _check_ln_mod(x, mult, add)
    b, n, d = x.shape
    x2 = x.reshape(b * n, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m2, a2 = mult.reshape(mult.shape[0], d), add.reshape(add.shape[0], d)
    if m2.stride(-1) != 1:
        m2 = m2.contiguous()
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    q = torch.empty((b * n, d), device=x.device, dtype=out_dtype)
    scale = torch.empty((b * n, 1), device=x.device, dtype=torch.float32)
    if b * n == 0:
        return q, scale
    block, chunks, warps = ln_mod_config(d)
    if config is not None:
        block = chunk_width(d, config[0], LN_MAX_CHUNKS)
        chunks, warps = _cdiv(max(d, 1), block), config[1]
    from .rowwise_quant_kernel import ln_mod_quant_kernel

    ln_mod_quant_kernel[(b * n,)](
        x2, m2, a2, q, scale, d, n, x2.stride(0),
        m2.stride(0) if m2.shape[0] > 1 else 0, a2.stride(0) if a2.shape[0] > 1 else 0, q.stride(0), float(eps), float(mult_offset),
        BLOCK=block, NCH=chunks, FMAX=FP8_MAX, FAST=out_dtype == FP8_DTYPE and x.is_cuda, num_warps=warps,
    )
    return q, scale


@torch.library.custom_op("nexfort::quant_rows_ln_mod", mutates_args=())
def quant_rows_ln_mod(
    x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, eps: float, mult_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(addcmul(add, layer_norm(x, eps=eps), mult_offset + mult))`` for ``x``
    [B, L, D] and ``mult``/``add`` [B or 1, 1, D] (an affine-free LayerNorm and a per-sample
    modulation, as DiT blocks make their attention and MLP inputs; ``mult_offset=1`` takes
    ComfyUI's ``1 + scale`` into the kernel instead of a kernel of its own): (e4m3 [B * L, D],
    float32 scales [B * L, 1]). The Triton kernel on CUDA, the torch twin elsewhere."""
    if x.is_cuda and triton_available():
        return triton_quant_rows_ln_mod(x, mult, add, eps, mult_offset)
    return torch_quant_rows_ln_mod(x, mult, add, eps, mult_offset)


@quant_rows_ln_mod.register_fake
def _(
    x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, eps: float, mult_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_ln_mod(x, mult, add)
    rows = x.shape[0] * x.shape[1]
    return x.new_empty((rows, x.shape[2]), dtype=FP8_DTYPE), x.new_empty((rows, 1), dtype=torch.float32)
