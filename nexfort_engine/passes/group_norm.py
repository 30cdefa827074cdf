"""GroupNorm written in the order channels-last memory is laid out (reference: F.group_norm).

What: :func:`group_norm_channels_last` computes ``torch.nn.functional.group_norm`` with the
channel axis moved last: the input is viewed as ``(N, spatial, G, C/G)`` and the statistics are
reduced over dims 1 and 3 in float32, then the normalised values are scaled, shifted, cast back
and the channel axis moved back to dim 1. :func:`rewrite_group_norms` swaps it in for
every ``F.group_norm`` call of a Dynamo graph before Inductor compiles it (the FX-graph cache key
follows: it hashes the graph after this rewrite).

Why: on a GPU, Inductor keeps conv nets channels-last (``force_layout_optimization``, see
:func:`nexfort_engine.shapes.layout_patches`). ATen's group-norm decomposition reduces each
group in (channel, position) order, which on channels-last memory is a strided walk; Inductor
then indexes every element as ``r // HW`` and ``r % HW``. With static shapes those are divisions
by constants; with symbolic shapes they are 64-bit divisions by a runtime value inside the
innermost loop. On an H200, SD2.1 768² with symbolic shapes spent 2.9 ms per step in group-norm
kernels against 1.7 ms with static shapes (BENCHMARKS.md, seventh session). Reduced in memory
order, the normalisation kernels lose their divisions by H·W; Inductor's own split of the
statistics reduction still keeps one symbolic modulo per element. Measured: 2.87 -> 2.61 ms of
GroupNorm kernels, SD2.1 768² +1.4 %, SDXL +2.1 % (same call), lossless against float32.

Numerics: the same float32 mean/variance (Welford in Inductor, as for ATen's decomposition), the
same ``(x - mean) * rsqrt(var + eps) * weight + bias`` in float32, cast once to the input dtype.
"""

from __future__ import annotations

import hashlib
import inspect

import torch
import torch.nn.functional as F

__all__ = ["cache_marks", "group_norm_channels_last", "rewrite_group_norms", "wanted"]


def wanted(
    option: bool | None, *, channels_last_forced: bool, inductor: bool, dynamic: bool, forward: bool = True
) -> bool:
    """Whether to rewrite: the option when set; auto (``None``) where it was measured to pay, i.e.
    Inductor compiles a conv net's ``forward`` (a UNet) forced channels-last (GPU) under dynamic
    shape. Under static shape the divisions are by constants and ATen's decomposition was as fast
    (SD2.1 768² static: 75.2 it/s with the rewrite, 75.6-75.8 without; BENCHMARKS.md, seventh
    session). A VAE's ``decode``/``encode`` (``forward=False``) was not measured: auto leaves it."""
    if option is not None:
        return option
    return channels_last_forced and inductor and dynamic and forward


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
    n, c = x.shape[0], x.shape[1]
    xs = x.movedim(1, -1)  # (N, *spatial, C)
    xg = xs.reshape(n, -1, num_groups, c // num_groups).float()
    var, mean = torch.var_mean(xg, dim=(1, 3), keepdim=True, correction=0)
    y = ((xg - mean) * torch.rsqrt(var + eps)).reshape(xs.shape)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).movedim(-1, 1)


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
    The function is pure and fully determined by its source, whose hash is the value (it joins
    the cache keys, so an edited function never reuses an old artifact)."""
    fn = group_norm_channels_last
    try:
        source = inspect.getsource(fn).encode()
    except (OSError, TypeError):  # no source shipped: the bytecode and constants identify it too
        source = fn.__code__.co_code + repr(fn.__code__.co_consts).encode()
    return {f"{fn.__module__}.{fn.__name__}": hashlib.sha256(source).hexdigest()[:16]}
