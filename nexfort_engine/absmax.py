"""The largest absolute value of attention's values, for their per-tensor fp8 scale: one Triton
kernel, one torch twin.

What: :func:`absmax` returns ``max_i max |x_i|`` over a list of ``[B, H, L_i, D]`` tensors (one,
or the parts Flux's double blocks concatenate on the sequence dim) as a one-element float32
tensor on their device. The custom op ``nexfort::absmax`` runs :func:`triton_absmax` on CUDA
tensors with a contiguous last dim (any other strides: the views of a QKV projection's output
that attention's values are), and the twin :func:`torch_absmax` elsewhere.

Why: fp8 attention (:mod:`nexfort_engine.fp8_attention`) quantizes the values per tensor, so their
maximum must be known before the quantizing pass. Inductor's reduction of the strided value view
ran at 0.6-0.7 TB/s on an H200 (42 us per Flux single block, 48 us per double block with the
concatenation: 2.5 ms of a 78 ms step, run106). This kernel streams each head's rows (``D``
contiguous values, 256 bytes for Flux) from thousands of programs and folds their maxima with one
atomic each.
"""

from __future__ import annotations

from typing import Any

import torch

from .rowwise_quant import _cdiv, triton_available

__all__ = ["absmax", "kernel_takes", "torch_absmax", "triton_absmax"]

#: (BLOCK_R rows, BLOCK_C columns per chunk, num_warps)
DEFAULT_CONFIG = (32, 128, 4)


def _check(xs: list[torch.Tensor]) -> None:
    if not xs or any(x.dim() != 4 for x in xs):
        raise ValueError(f"absmax: one or more [B, H, L, D] tensors, got {[tuple(x.shape) for x in xs]}")


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether the kernel reads ``x`` ([B, H, L, D]): its last dim is contiguous."""
    return x.dim() == 4 and (x.shape[3] <= 1 or x.stride(3) == 1)


def torch_absmax(xs: list[torch.Tensor]) -> torch.Tensor:
    """The reference: the largest ``|x|`` over all parts, float32 ``[1]`` (0 for empty parts)."""
    _check(xs)
    vals = [x.detach().abs().amax().float() for x in xs if x.numel()]
    if not vals:
        return torch.zeros(1, device=xs[0].device)
    return torch.stack(vals).amax().reshape(1)


def _kernel() -> Any:
    from .absmax_kernel import absmax_kernel

    return absmax_kernel


def triton_absmax(xs: list[torch.Tensor], config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """:func:`torch_absmax` with one Triton launch per part (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); every part must satisfy :func:`kernel_takes`."""
    _check(xs)
    block_r, block_c, warps = config or DEFAULT_CONFIG
    out = torch.zeros(1, device=xs[0].device, dtype=torch.float32)
    for x in xs:
        if not kernel_takes(x):
            raise ValueError(f"absmax: the kernel reads rows with a contiguous last dim, got strides "
                             f"{x.stride()} for {tuple(x.shape)}")
        b, h, n, d = x.shape
        if x.numel():
            _kernel()[(_cdiv(n, block_r), b * h)](x, out, n, d, h, x.stride(0), x.stride(1), x.stride(2),
                                                  BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


@torch.library.custom_op("nexfort::absmax", mutates_args=())
def absmax(xs: list[torch.Tensor]) -> torch.Tensor:
    """The largest absolute value over ``xs`` (module docstring), float32 ``[1]``."""
    if xs and all(x.is_cuda and kernel_takes(x) for x in xs) and triton_available():
        return triton_absmax(xs)
    return torch_absmax(xs)


@absmax.register_fake
def _(xs: list[torch.Tensor]) -> torch.Tensor:
    _check(xs)
    return xs[0].new_empty((1,), dtype=torch.float32)
