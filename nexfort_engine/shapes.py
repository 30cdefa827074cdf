"""Dynamic-shape policy: one graph for every resolution, batch size, sequence length and step count.

Plain ``torch.compile(dynamic=True)`` recompiles a diffusion backbone on a typical sweep because

* *duck sizing* gives equal sizes one symbol: a square latent ties H to W (and a 4-step schedule
  ties ``sample_sigmas`` to the 4 latent channels), so the first non-square image or other step
  count recompiles;
* sizes 0 and 1 are specialised: batch 1 (cfg 1) and batch 2 (cfg > 1) are two graphs.

Only the dimensions that vary between prompts are made symbolic (:func:`mark_dynamic_dims`):
batch, spatial/temporal and sequence dimensions; channel and feature dimensions stay static.
Anything else that changes later becomes dynamic through Dynamo's automatic-dynamic mechanism
(one recompile, counted with its reason). Duck sizing is off (``use_duck_shape=False``), so H and
W (and the schedule length) get their own symbols. Floats (sigma, cfg) are not specialised, so
changing them never recompiles. All of it is scoped config patches entered around each compiled
call, never process-wide assignments.

Conv nets (UNets, VAEs) get their image input with the spatial sizes traced as multiples of 8
(:func:`fold_spatial`): exact downsampling arithmetic and divisible loop bounds in the generated
code instead of runtime floor divisions.

Batch 1 vs batch >= 2: by default a size of 1 is specialised, so cfg 1 and cfg > 1 are two graphs
(the issue's bound is 2). ``size_oblivious=True`` (option) compiles with backed size-oblivious
semantics so both share one graph; it is off by default because Inductor computed NaN for a tiny
PixArt at batch 1 from a graph compiled at batch 2 with it on (tests/engine, strict xfail).

Cost, measured (BENCHMARKS.md): on an H200 a symbolic-shape UNet compiles in ~230 s and runs
~25 % slower than a static-shape graph (SD2.1 768², with CUDA graphs: 53.5 vs 71.7 it/s);
``dynamic=False`` trades one (cached) compile per resolution for that speed.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from typing import Any, Callable

import torch


def _existing(cfg: Any, patches: dict[str, Any]) -> dict[str, Any]:
    # torch 2.11 .. 2.14 differ a little; only patch the keys this torch has
    return {k: v for k, v in patches.items() if hasattr(cfg, k)}


def dynamo_patches(dynamic: bool) -> dict[str, Any]:
    p: dict[str, Any] = {"specialize_float": False, "cache_size_limit": 64}
    if dynamic:
        p.update(automatic_dynamic_shapes=True)
    return p


def fx_patches(dynamic: bool, size_oblivious: bool = False) -> dict[str, Any]:
    return {"use_duck_shape": False, "backed_size_oblivious": size_oblivious} if dynamic else {}


#: a config change that returns its own undo (torch's ``_make_closure_patcher`` form)
Change = Callable[[], Callable[[], None]]


def _noop() -> None:
    return None


def _change(cfg: Any, changes: dict[str, Any]) -> Change:
    """``changes`` to ``cfg`` as a :data:`Change` that touches only the keys whose value differs at
    the time (most already hold the wanted value). Through torch's closure patcher (what Dynamo uses
    on its own hot path; an alias is set under the name it stands for) where this torch has it and
    every key resolves; ``cfg.patch`` otherwise."""
    config = getattr(cfg, "_config", {})
    names: dict[str, str] = {}
    for k in changes:
        alias = getattr(config.get(k), "alias", None)
        module, _, target = (alias or "").rpartition(".")
        names[k] = target if alias and module == cfg.__name__ and target in config else k
    closure = getattr(cfg, "_make_closure_patcher", None)
    direct = closure is not None and all(getattr(config.get(n), "alias", 1) is None for n in names.values())

    @functools.cache
    def patcher(keys: tuple[str, ...]) -> Change:
        subset = {k: changes[k] for k in keys}
        if direct:
            assert closure is not None
            return closure(**{names[k]: v for k, v in subset.items()})

        def change() -> Callable[[], None]:
            patch = cfg.patch(subset)
            patch.__enter__()
            return lambda: patch.__exit__(None, None, None)

        return change

    def change() -> Callable[[], None]:
        keys = tuple(k for k, v in changes.items() if getattr(cfg, k) != v)
        return patcher(keys)() if keys else _noop

    return change


@functools.cache
def _policy_changes(dynamic: bool, size_oblivious: bool) -> tuple[Change, ...]:
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    out = []
    for cfg, patches in ((dynamo_config, dynamo_patches(dynamic)), (fx_config, fx_patches(dynamic, size_oblivious))):
        changes = _existing(cfg, patches)
        if changes:
            out.append(_change(cfg, changes))
    return tuple(out)


class _Applied:
    """Applies :data:`Change` s on entry and undoes them, last first, on exit (re-entrant: each
    entry is its own object)."""

    __slots__ = ("_changes", "_undo")

    def __init__(self, changes: tuple[Change, ...]) -> None:
        self._changes = changes
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> None:
        for change in self._changes:
            self._undo.append(change())

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            self._undo.pop()()


def shape_policy(dynamic: bool, size_oblivious: bool = False) -> contextlib.AbstractContextManager[None]:
    """Enter the dynamic-shape policy for one compiled call. It is entered around every call of a
    compiled model, a step's host work: the changes are built once per policy and applied through
    torch's closure patcher (a fresh ``config.patch`` per call cost ~80 us of host time a call)."""
    return _Applied(_policy_changes(dynamic, size_oblivious))


def varying_dims(t: torch.Tensor) -> tuple[int, ...]:
    """Dimensions expected to vary between prompts.

    ``[B, C, *spatial]`` (images, video latents): batch and spatial/temporal dims, not channels.
    ``[B, L, D]`` / ``[B, D]`` (text context, pooled vectors, tokens): all but the feature dim.
    ``[N]`` (timesteps, sigmas, guidance): the length.
    """
    n = t.dim()
    if n == 0:
        return ()
    if n == 1:
        return (0,)
    if n >= 4:
        return (0, *range(2, n))
    return tuple(range(n - 1))


#: tensors already seen in one model call, by id, with a weak reference to the tensor (an id is
#: only trusted while its tensor lives; a strong one would keep every block's activations alive
#: until the call ends) and what was made of it (``None``: the tensor itself): a regional model
#: hands the same tensors (Flux's RoPE table, the modulation vector, the options' tensors) to every
#: block of its stacks
Memo = dict[int, tuple[Any, Any]]


def _seen(memo: Memo, v: torch.Tensor) -> tuple[Any, Any] | None:
    hit = memo.get(id(v))
    return hit if hit is not None and hit[0]() is v else None


def mark_dynamic_dims(args: tuple, kwargs: dict, marked: Memo | None = None) -> None:
    """Mark the varying dims of every floating/int tensor input (also inside dicts/lists) dynamic,
    and the others (channels, features) static: a block class used at two widths (SDXL's
    transformer blocks at 640 and 1280 under regional compilation) then gets one graph per width,
    instead of Dynamo's automatic-dynamic making the feature size symbolic on the second width.
    Tensors in ``marked`` are skipped, and those marked here are added to it."""

    def visit(v: Any, depth: int = 0) -> None:
        if isinstance(v, torch.Tensor):
            if marked is not None:
                if _seen(marked, v) is not None:
                    return
                marked[id(v)] = (weakref.ref(v), None)
            if not isinstance(v, torch.nn.Parameter):
                # a view's base is traced too (its strides feed the view's): mark both
                for t in (v, v._base) if v._base is not None else (v,):
                    dims = varying_dims(t)
                    if dims:
                        torch._dynamo.maybe_mark_dynamic(t, list(dims))
                    for d in range(t.dim()):
                        if d not in dims:
                            torch._dynamo.mark_static(t, d)
        elif depth < 3 and isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)
        elif depth < 3 and isinstance(v, (list, tuple)):
            for x in v:
                visit(x, depth + 1)

    for a in args:
        visit(a)
    for a in kwargs.values():
        visit(a)


#: views up to this many elements are copied before a compiled block sees them (see below)
SMALL_VIEW_NUMEL = 1 << 22


def _block_input(v: Any, dynamic: bool) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if dynamic and v._base is not None:
        if v.numel() <= SMALL_VIEW_NUMEL:
            return v.clone(memory_format=torch.contiguous_format)
        if not v.requires_grad:
            v = v.detach()  # the same memory, no longer a view (see prepare_block_inputs)
    return v if v.is_contiguous() else v.contiguous()


def prepare_block_inputs(args: tuple, kwargs: dict, dynamic: bool = True, memo: Memo | None = None,
                         marked: Memo | None = None) -> tuple[tuple, dict]:
    """Inputs of a regionally compiled block (regions.py): one layout for every block, and under
    dynamic shape the varying dims marked.

    * Non-contiguous tensors are made contiguous: the first block of a stack often gets a
      transposed view (Wan's patch embedding ``flatten(2).transpose(1, 2)``) and the others a
      contiguous tensor, and the strides are guarded, so the stack would compile twice.
    * Under dynamic shape, small views are copied into their own storage: block inputs are often
      small views of tables built in the eager glue (Flux/Wan RoPE ``pe = emb.unsqueeze(1)``);
      Dynamo fakes a view from its base, whose ``[B, L, ...]`` layout the heuristics of
      :func:`varying_dims` misread, so the sequence length would be guarded in the base's strides
      and every new resolution would recompile. That costs a few MB of copies per step.
    * Under dynamic shape, large views are passed as plain tensors on the same memory
      (``detach()``): Dynamo guards a view input through its base (``2 <= img._base.size()[0]``
      for Flux's first double block on the GPU, whose input is a view of the patch embedding's
      output), and the next block, given a plain tensor, failed that guard and compiled the stack
      a second time (BENCHMARKS.md, fourth session).

    ``memo`` and ``marked`` (emptied by the caller at each model call) make each tensor's input
    and its marks once per model call instead of once per block: a block's host time sits on the
    step's critical path whenever the host waits for the GPU.
    """
    memo = {} if memo is None else memo
    args = tuple(_block_input_once(a, dynamic, memo) for a in args)
    kwargs = {k: _block_input_once(v, dynamic, memo) for k, v in kwargs.items()}
    if dynamic:
        mark_dynamic_dims(args, kwargs, marked)
    return args, kwargs


def _block_input_once(v: Any, dynamic: bool, memo: Memo) -> Any:
    """:func:`_block_input` made once per tensor for the blocks of one model call: the copy of a
    small view (a RoPE table) handed to every block is made once, not once per block (compiled
    blocks work on in-graph copies of their inputs, so one block cannot change it for the next)."""
    if not isinstance(v, torch.Tensor):
        return v
    hit = _seen(memo, v)
    if hit is not None:
        return v if hit[1] is None else hit[1]
    out = _block_input(v, dynamic)
    memo[id(v)] = (weakref.ref(v), None if out is v else out)
    return out


def to_memory_format(args: tuple, kwargs: dict, memory_format: torch.memory_format) -> tuple[tuple, dict]:
    """Convert 4-D floating tensor arguments to ``memory_format`` (channels_last for conv nets)."""

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point():
            return v.contiguous(memory_format=memory_format)
        return v

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


#: a module with at least this many convolutions is a conv net (UNet, VAE), not a DiT's patch embed
MIN_CONVS = 4

#: the multiple a conv net's spatial sizes are traced as under dynamic shape (see :func:`fold_spatial`)
SPATIAL_MULTIPLE = 8


def spatial_multiple(module: torch.nn.Module, requested: int | None, dynamic: bool) -> int:
    """The multiple the image input's spatial sizes are traced as: ``requested`` if given, else
    :data:`SPATIAL_MULTIPLE` for conv nets (UNets, VAEs) and 1 for the rest; always 1 with static
    shapes (the sizes are constants there)."""
    if not dynamic:
        return 1
    if requested is not None:
        return requested
    return SPATIAL_MULTIPLE if conv_count(module) >= MIN_CONVS else 1


def _foldable(v: Any, multiple: int) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.is_floating_point()
        and v.dim() >= 4
        # a quotient of 1 would be specialised (Dynamo's 0/1 rule): one more graph for tiny images
        and all(s % multiple == 0 and s >= 2 * multiple for s in v.shape[2:])
    )


def fold_spatial(args: tuple, multiple: int, mark: bool = True) -> tuple:
    """Pass the image input (``args[0]``, ``[B, C, *S]``) as ``[B, C, S0/m, m, S1/m, m, ...]``: the
    same memory, with each spatial size split into a dynamic quotient and a static ``m``.

    Under dynamic shape Dynamo gives H and W symbols of their own, so Inductor can assume nothing
    about them: every index that splits a flattened spatial extent (GroupNorm groups, channels-last
    pointwise kernels, a stride-2 convolution's ``(H - 1) // 2 + 1``, the UNet's skip
    concatenations) becomes a runtime integer division, and vectorised loops need a tail (on CPU:
    ``c10::div_floor_integer`` in 1815 places of a tiny UNet's code; none with the fold,
    BENCHMARKS.md). Traced as ``8 * h`` the sizes are divisible by what the kernels need, the
    downsampling arithmetic is exact (``(8h - 1) // 2 + 1 = 4h``) and sympy has less to simplify.
    The compiled function gets the split view and :func:`unfolding` merges it back as its first
    traced op (a free reshape). Images whose sizes are not multiples of ``multiple`` are passed
    as they are: Dynamo guards the input's rank, so they make one more graph (counted, with
    Dynamo's reason), as do sizes below ``2 * multiple`` (a quotient of 1 is specialised). Latents
    of images in multiples of 64 pixels from 128 up (every common SD/SDXL size) are multiples of 8.

    The view is detached so Dynamo sees a plain tensor on the same memory, not a view whose base
    it would trace (and guard) too (see :func:`prepare_block_inputs`). ``mark=False``: no dynamic
    marks (a precompiled graph's guards expect none, :mod:`nexfort_engine.precompile`).
    """
    if multiple <= 1 or not args or not _foldable(args[0], multiple):
        return args
    x = args[0]
    split: list[int] = [x.shape[0], x.shape[1]]
    for s in x.shape[2:]:
        split += [s // multiple, multiple]
    folded = x.view(split).detach()
    if not mark:
        return (folded, *args[1:])
    quotients = list(range(2, folded.dim(), 2))
    torch._dynamo.maybe_mark_dynamic(folded, [0, *quotients])
    for d in range(1, folded.dim()):
        if d not in quotients:
            torch._dynamo.mark_static(folded, d)
    return (folded, *args[1:])


def _merged(x: Any, ndim: int) -> Any:
    """The image input back at rank ``ndim`` if :func:`fold_spatial` split it, else as it is."""
    folded_rank = 2 + 2 * (ndim - 2)
    if isinstance(x, torch.Tensor) and ndim >= 4 and x.dim() == folded_rank:
        merged = [x.shape[0], x.shape[1]]
        for d in range(2, folded_rank, 2):
            merged.append(x.shape[d] * x.shape[d + 1])
        x = x.reshape(merged)
    return x


def _renamed(call: Callable[..., Any], name: str, qualname: str) -> Callable[..., Any]:
    code = call.__code__.replace(co_name=name, co_qualname=qualname) if hasattr(call.__code__, "co_qualname") else (
        call.__code__.replace(co_name=name)
    )
    return types.FunctionType(code, call.__globals__, name, call.__defaults__, call.__closure__)


def unfolding(fn: Callable[..., Any], ndim: int) -> Callable[..., Any]:
    """``fn`` taking its image input either as it is (rank ``ndim``) or split by :func:`fold_spatial`
    (rank ``2 + 2 * (ndim - 2)``), which it merges back before calling ``fn``."""

    def call(x: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(_merged(x, ndim), *args, **kwargs)

    # Dynamo keeps graphs and automatic-dynamic state per code object: each wrapper gets a code
    # object of its own, or the wrappers of a VAE's decode and encode (or of two models) would
    # share one cache and fail each other's guards (recompiles, measured on the tiny VAE)
    name = f"nexfort_unfold_{getattr(fn, '__name__', 'fn')}"
    return _renamed(call, name, name)


def unfolding_method(fn: Callable[..., Any], ndim: int) -> Callable[..., Any]:
    """:func:`unfolding` for an unbound method ``fn(self, x, ...)``: the module stays the first
    argument, named ``self`` (:mod:`nexfort_engine.precompile` checks guards on it once per
    process). Its qualified name says it is nested, so torch's AOT pickler saves it by code and
    closure (``fn`` by reference)."""

    def call(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, _merged(x, ndim), *args, **kwargs)

    name = f"nexfort_unfold_method_{getattr(fn, '__name__', 'fn')}"
    return _renamed(call, name, f"unfolding_method.<locals>.{name}")


def traced_sizes(shape_env: Any) -> dict[Any, Any]:
    """Each symbol of a shape environment -> the size it had in the trace (``backed_var_to_val``
    since torch 2.12, ``var_to_val`` before)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return values if values is not None else shape_env.var_to_val


def detached(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor (also inside dicts/lists/tuples, as
    :func:`mark_dynamic_dims` visits them) replaced by a new tensor object on the same memory:
    marks set on those for a trace leave the caller's tensors unmarked."""

    def copy(v: Any, depth: int = 0) -> Any:
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            return v.detach()
        if depth < 3 and isinstance(v, dict):
            return type(v)((k, copy(x, depth + 1)) for k, x in v.items()) if type(v) is dict else v
        if depth < 3 and type(v) in (list, tuple):
            return type(v)(copy(x, depth + 1) for x in v)
        return v

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


def conv_count(module: torch.nn.Module) -> int:
    return sum(isinstance(m, torch.nn.modules.conv._ConvNd) for m in module.modules())


def layout_patches(module: torch.nn.Module, cuda: bool) -> dict[str, Any]:
    """Inductor patches for a conv net's layout: channels-last activations on the GPU, Inductor's
    layout choice off on CPU.

    Inductor converts a conv net's activations to channels-last (the layout cuDNN's convolutions
    run natively) only when a heuristic agrees (``GraphLowering.decide_layout_opt``): it declines
    as soon as a convolution has a symbolic size (pytorch#102670), and its node-count rule also
    declined SDXL once fp8 quantization added nodes. cuDNN then transposes every input and output
    of every convolution: on an H200, SD2.1 768² with symbolic shapes spent 3.6 of 19 GPU-ms per
    step in ``nchwToNhwc``/``nhwcToNchw`` kernels, SDXL with fp8 2.3 of 36, the static bf16 graphs
    none (BENCHMARKS.md, runs 12 and 14). ``force_layout_optimization`` makes Inductor take the
    channels-last layout regardless (for the static bf16 graphs, what it already chose); weights
    stay as they are (live parameters, LoRA-safe), Inductor converts them inside the graph.
    Static and symbolic shapes alike.

    On CPU the opposite: Inductor's own layout optimization is turned off. There it chose
    channels-last for the tiny SD1.5 UNet and then copied every conv weight to channels-last
    inside the graph on every call; oneDNN's convolutions reorder their operands themselves. Same
    process, 2 cores, batch 2, ms per call with the layout choice / without: 41.5 / 30.0 at an 8x8
    latent (eager 30-36), 383-399 / 358-362 at 32x32, 2214 / 2242 at 64x64 (eager 2345), all
    within noise or faster (BENCHMARKS.md, nineteenth session).
    """
    if conv_count(module) < MIN_CONVS:
        return {}
    if not cuda:
        return {"layout_optimization": False}
    return {"force_layout_optimization": True}
