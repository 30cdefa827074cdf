"""Regional compilation: compile a repeated block once and reuse it for every identical twin.

A diffusion transformer is mostly a stack of identical blocks (PixArt-alpha: 28, Flux: 19 double +
38 single, Wan 2.1: 30). Compiling the whole model makes Dynamo trace and Inductor optimise and
code-generate every copy, so cold compile time, warm-start time (load, re-trace) and the cache all
grow with the depth. Here each group of structurally identical blocks gets *one* compiled function:
with ``inline_inbuilt_nn_modules`` (torch >= 2.5 default) a block's weights are graph inputs, so every
twin passes the same guards and reuses the one graph. The glue around the blocks (embeddings, RoPE
tables, the final layer) runs eager; it is a small share of a DiT's step at the sizes it is used at,
and it is also where ComfyUI's size-dependent Python lives (Flux's ``linspace(steps=(w + 1) // 2)``),
so the compiled blocks never specialise on the resolution.

Why it is safe: nothing in the model is replaced or renamed (state-dict keys, LoRA patches and
``ModelPatcher`` bookkeeping are untouched). For the duration of one call of our compiled module each
block's ``_compiled_call_impl`` - the slot ``nn.Module.__call__`` honours, the one
``nn.Module.compile()`` sets - points at the compiled function, and the previous value is restored
afterwards, so an uncompiled clone sharing the model, or our eager fallback, sees plain modules.
Blocks with hooks are left alone (a compiled ``forward`` would skip them). The compiled function
works on in-graph copies of a block's tensor arguments (:func:`block_forward`): ComfyUI's blocks
update their inputs in place, which would keep CUDA-graph trees from replaying them; the caller
uses the returned values, as ComfyUI's models do.

Used by :class:`nexfort_engine.compiler.CompiledModule` when the ``regional`` option is on, or
``None`` (auto) and :func:`find_regions` finds top-level block stacks holding most of the weights
(DiTs). ``True`` also takes nested stacks (a UNet's transformer blocks; its ResBlocks, convolutions
and glue then run eager: on an H200 SDXL compiles in 15-18 s instead of 294 s for the whole
dynamic-shape UNet, at 24.8-25.2 vs 26.7 it/s; BENCHMARKS.md runs 17-18).
"""

from __future__ import annotations

import contextlib
import hashlib
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .cache.store import structure_digest

#: called with a block's (args, kwargs) before its compiled forward; returns the ones to pass
Prepare = Callable[[tuple, dict], tuple[tuple, dict]]

#: a stack needs at least this many identical blocks to be worth compiling once
MIN_REPEATS = 4
#: auto mode: the regions must hold at least this share of the model's parameters
MIN_SHARE = 0.5


@dataclass(frozen=True)
class Region:
    """A group of structurally identical blocks from one top-level ``ModuleList``."""

    path: str
    signature: str
    blocks: tuple[torch.nn.Module, ...]

    @property
    def name(self) -> str:
        return f"{self.path}[{type(self.blocks[0]).__name__}x{len(self.blocks)}]"


def block_signature(block: torch.nn.Module) -> str:
    """Class, printed architecture, and every parameter/buffer's name, shape and dtype (the cache's
    structure digest: blocks with equal signatures trace to the same graph)."""
    return structure_digest(block)


def _has_hooks(block: torch.nn.Module) -> bool:
    return any(
        getattr(m, attr, None)
        for m in block.modules()
        for attr in ("_forward_hooks", "_forward_pre_hooks")
    ) or bool(getattr(block, "_compiled_call_impl", None))


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_regions(module: torch.nn.Module, min_repeats: int = MIN_REPEATS, deep: bool = False) -> list[Region]:
    """Groups of >= ``min_repeats`` identical, hook-free blocks in ``ModuleList`` attributes.

    ``deep=False``: the module's top-level lists only (``blocks``, ``double_blocks``,
    ``single_blocks``, ...), one region per list and signature: a DiT's stacks.
    ``deep=True``: lists at any depth, identical blocks counted across lists (a UNet's
    ``transformer_blocks``: SDXL has 70 in 14 lists, of two widths), one region per signature;
    lists inside a block already in a region are not searched again.
    """
    if not deep:
        regions: list[Region] = []
        for path, child in module.named_children():
            if not isinstance(child, torch.nn.ModuleList):
                continue
            groups: dict[str, list[torch.nn.Module]] = {}
            for block in child:
                if not _has_hooks(block):
                    groups.setdefault(block_signature(block), []).append(block)
            for sig, blocks in groups.items():
                if len(blocks) >= min_repeats:
                    regions.append(Region(path, sig, tuple(blocks)))
        return regions
    lists = [(path, m) for path, m in module.named_modules() if isinstance(m, torch.nn.ModuleList)]
    sigs: dict[int, str] = {}
    counts: dict[str, int] = {}
    for _, lst in lists:
        for block in lst:
            if id(block) not in sigs and not _has_hooks(block):
                sigs[id(block)] = block_signature(block)
                counts[sigs[id(block)]] = counts.get(sigs[id(block)], 0) + 1
    taken: set[int] = set()  # blocks in a region and everything inside them
    found: dict[str, tuple[str, list[torch.nn.Module]]] = {}
    for path, lst in lists:  # pre-order: outer lists first
        if id(lst) in taken:
            continue
        for block in lst:
            sig = sigs.get(id(block))
            if sig is None or id(block) in taken or counts[sig] < min_repeats:
                continue
            found.setdefault(sig, (path, []))[1].append(block)
            taken.update(id(m) for m in block.modules())
    return [Region(path, sig, tuple(blocks)) for sig, (path, blocks) in found.items()]


@dataclass(frozen=True)
class DropKeys:
    """A block hook (see :class:`~nexfort_engine.compiler.CompiledModule`) that drops ``keys`` from
    the dict a block gets as keyword ``option``, unless that dict holds a non-empty value under one
    of ``unless``; the caller's dict is never changed (a shallow copy is passed). A host supplies
    the names: values it writes per block position that its blocks read only when ``unless`` is
    set. A plain class of this package, so it travels to a background compile's child process
    (:mod:`nexfort_engine.background`), which cannot import the host's own modules."""

    option: str
    keys: tuple[str, ...]
    unless: tuple[str, ...] = ()

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        d = kwargs.get(self.option)
        if not isinstance(d, dict) or not any(k in d for k in self.keys):
            return args, kwargs
        if any(d.get(k) for k in self.unless):
            return args, kwargs
        return args, {**kwargs, self.option: {k: v for k, v in d.items() if k not in self.keys}}


def region_share(module: torch.nn.Module, regions: list[Region]) -> float:
    """Share of the module's parameters inside ``regions``."""
    total = _param_count(module)
    inside = sum(_param_count(b) for r in regions for b in r.blocks)
    return inside / total if total else 0.0


def select_regions(module: torch.nn.Module, regional: bool | None) -> list[Region]:
    """What to compile regionally: ``False`` -> nothing (whole model); ``True`` -> every region
    found at any depth (a UNet's transformer blocks too, see :func:`find_regions`); ``None``
    (auto) -> the top-level regions if they hold >= ``MIN_SHARE`` of the weights (DiTs).

    Auto does not take nested stacks (SDXL's transformer blocks hold 85 % of its weights): measured
    on an H200 that compiles SDXL in 18 s instead of 294 s, but steady speed drops from 26.7 to
    24.8 it/s and varied between 17.5 and 25.6 it/s over a resolution sweep (BENCHMARKS.md, run18),
    so it is the ``"regional": true`` choice, not the default."""
    if regional is False:
        return []
    if regional is True:
        return find_regions(module, deep=True)
    regions = find_regions(module)
    if region_share(module, regions) < MIN_SHARE:
        return []
    return regions


def blocks_module(regions: list[Region]) -> torch.nn.Module:
    """The regions' blocks in one container (what regional compilation hands to Inductor), for
    decisions that look at the compiled modules only; the blocks themselves are not changed."""
    return torch.nn.ModuleList(b for r in regions for b in r.blocks)


def regions_key(regions: list[Region]) -> str:
    """Cache-key suffix for a regional decision: ``.regional`` for top-level stacks (the keys
    written before deep regions existed), plus a digest of the regions when any is nested."""
    if not regions:
        return ""
    if all("." not in r.path for r in regions):
        return ".regional"
    names = ",".join(sorted(f"{r.path}:{r.signature}:{len(r.blocks)}" for r in regions))
    return ".regional." + hashlib.sha256(names.encode()).hexdigest()[:8]


def _copy_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def copy(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


def _forward_on_copies(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = _copy_inputs(args, kwargs)
    return type(self).forward(self, *args, **kwargs)


def block_forward(cls: type) -> Callable[..., Any]:
    """What is compiled for a block class: its ``forward`` on in-graph copies of its floating
    tensor arguments.

    Why: ComfyUI's blocks update their inputs in place (Flux: ``img += gate * attn(...)``). A graph
    that mutates an input which CUDA-graph trees do not manage (the first block's input comes from
    the eager glue, every later one from that block) is run kernel by kernel instead of replayed
    (cudagraph_trees ``non_cudagraph_managed_mutation_hint``), so a regional Flux step was bound by
    Python launch overhead (BENCHMARKS.md, run20). Copied inside the graph, the update is
    functional: Inductor fuses each copy into its consumers, the caller's tensor is left as it was
    (ComfyUI uses the returned values), and every graph replays.

    Each class gets its own code object, so Dynamo's per-code cache (and its recompile limit) is
    per block class, as it is for the class's own ``forward``."""
    code = _forward_on_copies.__code__.replace(co_name=f"{cls.__name__}_forward_on_copies")
    return types.FunctionType(code, _forward_on_copies.__globals__, code.co_name)


def compile_block_forward(region: Region, compiler: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """``compiler(fn)`` applied to :func:`block_forward` of the blocks' class (Dynamo caches on
    that code object, so all twins, and all regions of that class, share the cache)."""
    cls = type(region.blocks[0])
    fn = _block_forwards.get(cls)
    if fn is None:
        fn = _block_forwards[cls] = block_forward(cls)
    return compiler(fn)


#: one wrapper (one code object, one Dynamo cache) per block class for the process
_block_forwards: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


class _BlockCall:
    """What a block's ``_compiled_call_impl`` points at while installed."""

    __slots__ = ("block", "fn", "before")

    def __init__(self, block: torch.nn.Module, fn: Callable[..., Any], before: Prepare | None):
        self.block = block
        self.fn = fn
        self.before = before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            args, kwargs = self.before(args, kwargs)
        return self.fn(self.block, *args, **kwargs)


class Installer:
    """Points each region block's ``_compiled_call_impl`` at its compiled function for one call."""

    def __init__(
        self,
        regions: list[Region],
        fns: list[Callable[..., Any]],
        before: Prepare | None = None,
    ) -> None:
        self.calls = [(b, _BlockCall(b, fn, before)) for r, fn in zip(regions, fns, strict=True) for b in r.blocks]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = []
        try:
            for block, call in self.calls:
                saved.append((block, block.__dict__.get("_compiled_call_impl")))
                block.__dict__["_compiled_call_impl"] = call
            yield
        finally:
            for block, old in saved:
                block.__dict__["_compiled_call_impl"] = old
