"""GroupNorm written in the order channels-last memory is laid out (reference: F.group_norm).

What: :func:`group_norm_channels_last` computes ``torch.nn.functional.group_norm`` with the
channel axis moved last: the input is pinned channels-last (:func:`channels_last_input`), viewed
as ``(N, *spatial, G, C/G)``, and the statistics are reduced over the spatial dims and the
channels of each group in float32; the normalised values are scaled, shifted, cast back and the
channel axis moved back to dim 1. :func:`rewrite_group_norms` swaps it in for every
``F.group_norm`` call of a Dynamo graph before Inductor compiles it (the FX-graph cache key
follows: it hashes the graph after this rewrite).

Why: on a GPU, Inductor keeps conv nets channels-last (``force_layout_optimization``, see
:func:`nexfort_engine.shapes.layout_patches`). ATen's group-norm decomposition reduces each
group in (channel, position) order, which on channels-last memory is a strided walk; Inductor
then indexes every element as ``r // HW`` and ``r % HW`` (64-bit divisions by a runtime value
under dynamic shape). Reduced in memory order, the normalisation kernels lose those divisions.
Seventh session: SD2.1 768² +1.4 %, SDXL +2.1 % (dynamic shape). Eighth session, with the input
pinned channels-last (a decoder's ``torch.cat`` had been laid out (N, C, H, W) and read across
channels) and the conv weights channels-last (``weight_layout.py``): it pays under static shape
too (SD2.1 768² static 79.9 -> 83.5 it/s, same call), lossless against float32.

Numerics: the same float32 mean/variance (Welford in Inductor, as for ATen's decomposition), the
same ``(x - mean) * rsqrt(var + eps) * weight + bias`` in float32, cast once to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._fx import cache_marks_for

__all__ = ["cache_marks", "channels_last_input", "group_norm_channels_last", "rewrite_group_norms", "wanted"]


@torch.library.custom_op("nexfort::channels_last_input", mutates_args=())
def channels_last_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in channels-last memory (4-D). Eager (the reference): a channels-last copy.

    Compiled, Inductor lowers it to a layout requirement, not a copy (:func:`register_lowering`):
    a producer whose layout is still open (a decoder's ``torch.cat``) is laid out channels-last.
    Without it, a producer read only through :func:`group_norm_channels_last`'s view was laid out
    (N, C, H, W) and the statistics walked it across channels: on an H200 those SD2.1 decoder
    kernels ran 4-30x slower than their memory traffic (BENCHMARKS.md, eighth session). Torch's
    own ``prims.inductor_force_stride_order`` does this too, but torch 2.11 cannot order symbolic
    strides in its lowering (``cannot determine truth value of Relational``)."""
    return x.clone(memory_format=torch.channels_last)


@channels_last_input.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.channels_last)


#: channels-last as Inductor's stride order of a 4-D tensor: (N, C, H, W) ranked by stride
_CHANNELS_LAST_ORDER = [3, 0, 2, 1]


def register_lowering() -> None:
    """Register :func:`channels_last_input`'s Inductor lowering (once; before a compile that may
    contain it): ``require_stride_order`` fixes an open layout in place, copies otherwise."""
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings
    from torch._inductor.lowering import register_lowering as inductor_register_lowering

    op = torch.ops.nexfort.channels_last_input.default
    if op in lowerings:  # registered by an earlier compile
        return

    @inductor_register_lowering(op, type_promotion_kind=None)
    def _lower(x: object) -> object:
        return ir.ExternKernel.require_stride_order(x, _CHANNELS_LAST_ORDER)


def wanted(option: bool | None, *, channels_last_forced: bool, inductor: bool, forward: bool = True) -> bool:
    """Whether to rewrite: the option when set; auto (``None``) where it was measured to pay, i.e.
    Inductor compiles a conv net's ``forward`` (a UNet) forced channels-last (GPU), under dynamic
    and static shape alike (SD2.1 768² on an H200, same call: static 83.5 it/s with the rewrite,
    79.9 without; dynamic 69.4 -> 79.7 with the layout fixes of the eighth session). A VAE's
    ``decode``/``encode`` (``forward=False``) was not measured: auto leaves it."""
    if option is not None:
        return option
    return channels_last_forced and inductor and forward


def group_norm_channels_last(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)``, reduced in channels-last order.

    One float32 ``var_mean`` per (sample, group) over (positions, channels of the group); Inductor
    splits that reduction across blocks itself. Splitting it here into equal chunks of positions
    (combined exactly: mean of the chunk means, mean of the chunk variances + variance of the
    chunk means) was measured too: SD2.1 768² fell from 68.3 to 53.1 it/s and compiled in 273 s
    instead of 113 s (BENCHMARKS.md, seventh session)."""
    if x.dim() < 3 or x.shape[1] % num_groups:
        return F.group_norm(x, num_groups, weight, bias, eps)
    c = x.shape[1]
    if x.dim() == 4:
        # pinned channels-last before it is viewed (see channels_last_input)
        x = torch.ops.nexfort.channels_last_input(x)
    xs = x.movedim(1, -1)  # (N, *spatial, C)
    # (N, *spatial, G, C/G): every view here changes the rank. A same-rank view whose target has a
    # constant (G) where the source has a symbolic size made torch 2.11's pointless-view pass guard
    # on their inequality (``4*W != 32``), and 512² recompiled SD2.1 (eighth session).
    xg = xs.unflatten(-1, (num_groups, c // num_groups)).float()
    dims = (*range(1, x.dim() - 1), x.dim())  # the spatial dims and the channels of a group
    var, mean = torch.var_mean(xg, dim=dims, keepdim=True, correction=0)
    y = ((xg - mean) * torch.rsqrt(var + eps)).flatten(-2)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).movedim(-1, 1)


def _example_output(x: torch.Tensor, num_groups: int, *args: object, **kwargs: object) -> torch.Tensor:
    """The layout :func:`group_norm_channels_last` returns, made in two ops instead of its
    fifteen (``split.refresh_examples`` runs it on the fake values of every rewritten node)."""
    if x.dim() != 4 or x.shape[1] % num_groups:  # other ranks: the op itself (no UNet has them)
        return group_norm_channels_last(x, num_groups, *args, **kwargs)  # type: ignore[arg-type]
    return torch.empty_like(x, memory_format=torch.channels_last)


#: split.refresh_examples: a cheap function with the same output metadata
group_norm_channels_last._nexfort_example = _example_output  # type: ignore[attr-defined]


def rewrite_group_norms(gm: torch.fx.GraphModule) -> int:
    """Point every ``F.group_norm`` node of a Dynamo graph at :func:`group_norm_channels_last`
    (same arguments); returns how many were rewritten."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.group_norm:
            node.target = group_norm_channels_last
            n += 1
    if n:
        gm.recompile()
    return n


def cache_marks() -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` entry for :func:`group_norm_channels_last`:
    AOTAutograd's cache only stores graphs whose functions it knows, and bypassed, every warm start
    re-traces the whole model through AOTAutograd (SD2.1 768² on an H200: 51 s instead of 24 s).
    The function is pure and fully determined by this module's source (it, the op it calls and
    that op's lowering): ``_fx.cache_marks_for``."""
    return cache_marks_for((group_norm_channels_last,))
