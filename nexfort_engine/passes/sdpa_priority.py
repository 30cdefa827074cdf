"""cuDNN attention ahead of flash inside compiled graphs, where the device prefers it.

ComfyUI (0.29 and later, on Linux and Windows with CUDA) runs every large attention inside
``sdpa_kernel([FLASH, CUDNN, EFFICIENT, MATH], set_priority=True)`` (``comfy.ops``). On Hopper
that demotes the backend torch itself puts first there: torch's default order starts with cuDNN on
sm90/sm100 with a recent cuDNN (``check_prefer_cudnn_attention`` in torch's ``sdp_utils.cpp``), and
measured 1.6-1.9x faster than flash at PixArt's, SDXL's and Flux's shapes on an H200 (torch 2.11,
BENCHMARKS.md, first session). With the priority, Flux-dev ran at 6.33 it/s under ComfyUI's own
compile on ComfyUI 0.33 against 7.39 on 0.3.75, which sets no priority on Linux.

Dynamo traces the context manager into the graph as ``torch.nn.attention._sdpa_kernel(backends,
True)`` calls around the attention (entering with the caller's list, leaving with the order before
it); AOTAutograd runs them while it traces, so the order in force there decides which fused
attention op the compiled graph calls. This pass moves cuDNN right ahead of flash in every entering
list that puts flash first and also allows cuDNN: the caller's set of backends is kept (nothing is
turned on that it turned off) and only that pair changes places. A leaving call restores the whole
order that was in force (it names every backend) and is left as it is, so the process's own order
is the same after a compile as before. Outside compiled graphs (eager calls, fallbacks) the
caller's order stays.

Both are exact attention kernels (fp32 softmax statistics, 16-bit probabilities); the error of the
compiled output against float32 is measured per model by the bench.

Those two functions also made AOTAutograd's cache refuse every such graph (``check_node_safe``
knows neither), with or without this pass: no graph of ComfyUI 0.33 could be saved (SDXL's static
first-call graph fell back to a compile in the process, 338 s, run3 of the forty-third session)
and every warm start would re-trace. :func:`cache_marks` names them for Inductor's
``unsafe_marked_cacheable_functions``: what they do is fully determined by their arguments,
constants in the graph and so in its cache key, as torch's own allowlist reasons for the autocast
context's calls.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.fx as fx
from torch.nn.attention import SDPBackend

from ._fx import arg, cache_marks_for, is_call

log = logging.getLogger(__name__)

__all__ = ["cache_marks", "device_prefers_cudnn", "rewrite_sdpa_priorities"]

#: CUDA capabilities where torch's default order puts cuDNN attention first (Hopper and datacenter
#: Blackwell: ``check_prefer_cudnn_attention``); elsewhere flash is torch's own first choice too
CUDNN_FIRST_CAPABILITIES = ((9, 0), (10, 0), (10, 3))
#: cuDNN that torch requires before preferring it (9.15.1 fixed sequence lengths that are not
#: multiples of 128; torch 2.14's rule, the strictest seen): 9.19 on the device's torch 2.11
CUDNN_MIN_VERSION = 91500


def cache_marks() -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` entries for the calls Dynamo records for an
    ``sdpa_kernel`` block (``torch.nn.attention._sdpa_kernel`` and ``_backend_from_string``), valued
    by their module's source (``_fx.cache_marks_for``: a torch that changes them changes the key)."""
    return cache_marks_for((torch.nn.attention._sdpa_kernel, torch.nn.attention._backend_from_string))


def device_prefers_cudnn(capability: tuple[int, int] | None, cudnn_version: int | None) -> bool:
    """Whether torch's own attention order starts with cuDNN on this GPU (the rule of torch's
    ``check_prefer_cudnn_attention``, including its ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` opt-out)."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    return (capability is not None and tuple(capability) in CUDNN_FIRST_CAPABILITIES
            and cudnn_version is not None and cudnn_version > CUDNN_MIN_VERSION)


def _backend(item: Any) -> SDPBackend | None:
    """The backend one list element names: a constant, or Dynamo's ``_backend_from_string`` call."""
    if isinstance(item, SDPBackend):
        return item
    if is_call(item, (torch.nn.attention._backend_from_string,)):
        name = arg(item, 0, "name")
        return getattr(SDPBackend, name, None) if isinstance(name, str) else None
    return None


#: every backend a priority order holds: a list naming all of them is Dynamo's restore of the order
#: in force before a ``sdpa_kernel`` block (``torch._C._get_sdp_priority_order()``), not a caller's
FULL_ORDER = frozenset(b for b in SDPBackend.__members__.values() if b != SDPBackend.ERROR)


def _reordered(items: list[Any]) -> list[Any] | None:
    """``items`` with cuDNN moved right ahead of flash, or None when it already is, when the list
    does not name both, or when it is a restore (names every backend)."""
    kinds = [_backend(a) for a in items]
    if SDPBackend.CUDNN_ATTENTION not in kinds or SDPBackend.FLASH_ATTENTION not in kinds:
        return None
    if FULL_ORDER <= set(kinds):
        return None
    c, f = kinds.index(SDPBackend.CUDNN_ATTENTION), kinds.index(SDPBackend.FLASH_ATTENTION)
    if c < f:
        return None
    out = list(items)
    cudnn = out.pop(c)
    out.insert(f, cudnn)
    return out


def rewrite_sdpa_priorities(gm: fx.GraphModule) -> int:
    """Put cuDNN ahead of flash in the graph's ``_sdpa_kernel(..., set_priority=True)`` calls;
    returns how many lists changed."""
    changed = 0
    for node in gm.graph.nodes:
        if not is_call(node, (torch.nn.attention._sdpa_kernel,)) or not arg(node, 1, "set_priority", False):
            continue
        backends = arg(node, 0, "backends")
        if not isinstance(backends, (list, tuple)):
            continue
        new = _reordered(list(backends))
        if new is None:
            continue
        value = type(backends)(new)
        if node.args:
            node.args = (value, *node.args[1:])
        else:
            node.kwargs = {**node.kwargs, "backends": value}
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
        log.debug("nexfort: cuDNN attention put ahead of flash in %d priority list(s)", changed)
    return changed
