"""The only module that knows ComfyUI's ModelPatcher wrappers, VAE objects, folder_paths and UI.

* Models: :func:`compile_model_patcher` clones the ModelPatcher and registers one
  ``WrappersMP.APPLY_MODEL`` wrapper (the hook ComfyUI's own TorchCompileModel helper uses). At
  sampling time the wrapper swaps ``diffusion_model`` for the engine's lazily compiled module for
  the duration of the call. One compiled module per (diffusion model object, config) is kept in a
  weak map, so clones and re-queued prompts reuse it; LoRA and other weight patches are written
  by ComfyUI into the live parameters, which the compiled graph reads (no recompile, nothing
  stale).
* Low-VRAM / partial offload: ComfyUI then casts weights per layer on the fly; that path is run
  eager for that call, with one warning and a counted fallback.
* Newer ComfyUI's dynamic VRAM (its layers page weights in through ctypes calls Dynamo cannot
  trace): a model is made a regular ModelPatcher first (``clone(disable_dynamic=True)``, as its own
  TorchCompileModel does); a model that cannot be, and a VAE, run uncompiled with a warning.
* Newer ComfyUI's allocation recorder (``--disable-comfy-compiler``, 0.34+): switched off for the
  duration of each compiled call (:func:`comfy_allocation_recorder_off`).
* ComfyUI 0.3.75's ``scaled_fp8`` linears (fp8 checkpoints with scales) scale the weight or the
  input, whichever is smaller: a size test Dynamo guards on, so resolutions crossing it compiled
  again. While traced, their class runs one form (:func:`one_branch_scaled_fp8`); eager calls are
  unchanged.
* ``"fp8_weights": true``: the linears inside the model's block stacks are swapped, through the
  clone's object patches, for engine layers that store the weight in e4m3 with one scale
  (``nexfort_engine/fp8_weights.py``; made once per original layer, on the offload device). ComfyUI
  puts the originals back when another patcher of the model loads; while the clone is loaded
  (an ``ON_LOAD`` callback) they are kept on the offload device. LoRA and other weight patches go
  through the layers' ``convert_weight``/``set_weight``, as for ComfyUI's own scaled fp8 linears.
* VAEs: :func:`compile_vae` returns a shallow copy of the VAE whose ``first_stage_model`` is a
  proxy with compiled ``decode``/``encode`` (used by the plain and the tiled paths alike).
* ControlNets: :func:`compile_controlnet` returns ComfyUI's own copy of the ControlNet
  (``ControlNet.copy()``, as *Apply ControlNet* makes) whose ``control_model`` is a proxy with a
  compiled ``forward``; its ModelPatcher (loading, offload) keeps the real module. Kinds whose model
  is not built at load time (Control-LoRA: built at each sampling) or that are not a ``ControlNet``
  (T2I adapters) pass through uncompiled, with a warning. Under CUDA graphs its outputs are copied
  out of the graph's memory pool (ComfyUI keeps them past the next replay).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import torch

import nexfort_engine
from nexfort_engine import counters, host_call
from nexfort_engine.background import CARRIED
from nexfort_engine.cache import ENV_CACHE_DIR
from nexfort_engine.fp8_weights import Fp8StoredLinear, storable, stored_copy
from nexfort_engine.options import CompileConfig
from nexfort_engine.regions import DropKeys
from nexfort_engine.transfer import to_device_async

from . import host_patches

log = logging.getLogger(__name__)

WRAPPER_KEY = "nexfort"
#: attribute (in the module's plain __dict__, not a registered submodule) holding
#: {config digest.method: CompiledModule}. The compiled module refers back to its module, so a
#: weak map keyed by the module would never let go of it; this reference cycle is collected
#: with the module when ComfyUI drops a checkpoint.
_ATTR = "_nexfort_compiled"
_warned_lowvram: set[int] = set()


def cache_root() -> str:
    """ComfyUI's internal (not HTTP-exposed) user dir ``<user>/__nexfort``, or $NEXFORT_CACHE_DIR."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return env
    import folder_paths

    return folder_paths.get_system_user_directory("nexfort")


#: Regional compilation of a UNet's transformer blocks: ``BasicTransformerBlock.forward`` reads
#: ``transformer_options["block"]`` (e.g. ``("input", 4)``) and ``["block_index"]``, so each of
#: SDXL's 70 blocks would trace its own graph although the values only matter to attention
#: patches. Without patches they are dropped from a shallow copy; with patches the block gets them
#: unchanged (correct, one graph per position). An engine class, so a background compile's child
#: process can rebuild it without importing this pack.
comfy_block_hook = DropKeys(
    option="transformer_options", keys=("block", "block_index"), unless=("patches", "patches_replace"))


@contextlib.contextmanager
def comfy_allocation_recorder_off() -> Iterator[bool]:
    """Newer ComfyUI (0.34+, with comfy-aimdo) records each model forward's allocations ("Comfy
    model compiler", ``--disable-comfy-compiler``): some model forwards (MiniMax, Qwen-Image 2.1,
    LTX-AV) call ``malloc_graph_begin``/``prefetch_queue_pop`` around their blocks, whose
    ``threading.get_ident()`` Dynamo cannot trace and whose recorded allocations a compiled graph
    (its CUDA-graph pool) does not make. ComfyUI reads ``args.disable_comfy_compiler`` on every
    forward, so it is set for the duration of a compiled call and put back after; on ComfyUI
    without the option (0.3.75-0.33) nothing is touched. Yields whether it was switched off here."""
    import comfy.cli_args

    args = comfy.cli_args.args
    if getattr(args, "disable_comfy_compiler", True) is not False:  # no such option, or already off
        yield False
        return
    args.disable_comfy_compiler = True
    try:
        yield True
    finally:
        args.disable_comfy_compiler = False


def _child_globals() -> tuple[tuple[str, str, Any], ...]:
    """What a background compile's child process sets before it imports ComfyUI's modules: the
    command line this ComfyUI parsed (``comfy.model_management`` reads ``--cpu``, ``--fp16-vae``
    and the like when imported)."""
    try:
        import comfy.cli_args
    except ImportError:
        return ()
    return (("comfy.cli_args", "args", comfy.cli_args.args),)


def _compiled_for(module: torch.nn.Module, config: CompileConfig, label: str, method: str = "forward"):
    per_module = module.__dict__.get(_ATTR)
    if per_module is None:
        per_module = {}
        object.__setattr__(module, _ATTR, per_module)
    key = f"{config.digest()}.{method}"
    cm = per_module.get(key)
    if cm is None:
        # ComfyUI writes weight patches (LoRA) as Parameter(requires_grad=False); loaded weights
        # have requires_grad=True. Align them once (inference only) so the first patch does not
        # fail Dynamo's requires_grad guard and recompile.
        for p in module.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
        cm = nexfort_engine.compile(module, config, cache_dir=cache_root(), label=label, method=method,
                                    block_hook=comfy_block_hook, child_globals=_child_globals())
        per_module[key] = cm
    return cm


def _one_branch_forward(original: Any) -> Any:
    """ComfyUI 0.3.75's ``scaled_fp8`` Linear forward with one form for every input size while
    Dynamo traces it; eager calls run ``original`` unchanged.

    The original scales the smaller of weight and input (``if weight.numel() < input.numel()``).
    Under dynamic shape that comparison of a static and a symbolic size is a guard, so each
    resolution or prompt length that crosses it compiled the model again (the tiny Flux: 3 graphs
    over 4 resolutions). Traced, the scale always multiplies the weight: Inductor fuses that
    product with the weight's cast (a cost independent of the input), and O3's fp8 path then reads
    the stored e4m3 weight and its scale directly (``nexfort_engine/passes/fp8_stored.py``)."""
    import comfy.ops

    def forward_comfy_cast_weights(self: Any, input: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return original(self, input)
        weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True)
        x = torch.nn.functional.linear(input, weight * self.scale_weight.to(device=weight.device, dtype=weight.dtype),
                                       bias)
        comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
        return x

    forward_comfy_cast_weights._nexfort_one_branch = True  # type: ignore[attr-defined]
    forward_comfy_cast_weights.__wrapped__ = original  # type: ignore[attr-defined]
    return forward_comfy_cast_weights


def _is_scaled_fp8_forward(fn: Any) -> bool:
    """Whether ``fn`` is ComfyUI's ``scaled_fp8_ops`` Linear forward (0.3.75) with its shape test and
    without ComfyUI's own fp8 matmul (``fp8_matrix_mult``, left as it is)."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "_nexfort_one_branch", False):
        return False
    if not {"numel", "scale_weight", "cast_bias_weight"} <= set(code.co_names):
        return False
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
    flag = cells.get("fp8_matrix_mult")
    try:
        return flag is not None and flag.cell_contents is False
    except ValueError:  # an empty cell
        return False


def one_branch_scaled_fp8(module: torch.nn.Module) -> int:
    """Give the ``scaled_fp8`` Linear classes in ``module`` :func:`_one_branch_forward` (once per
    class); returns how many classes were changed."""
    n = 0
    for cls in {type(m) for m in module.modules()}:
        fn = cls.__dict__.get("forward_comfy_cast_weights")
        if fn is not None and _is_scaled_fp8_forward(fn):
            cls.forward_comfy_cast_weights = _one_branch_forward(fn)
            n += 1
    return n


#: a module path inside a stack of blocks (Flux's double_blocks/single_blocks, a UNet's
#: input_blocks/middle_block/output_blocks and transformer_blocks, PixArt's and Wan's blocks,
#: Lumina's layers): the embedders and the final layer outside them keep their precision
_IN_BLOCKS = re.compile(r"(^|\.)(\w*blocks?|layers)\.")
#: the stored copy of an original linear, in its ``__dict__`` with the address, shape, dtype and
#: device of the weight it was made from: a node run again on the same model reuses it (and the
#: graph compiled with it). No reference to the weight is kept (it may be a backup ComfyUI frees).
_FP8_ATTR = "_nexfort_fp8_stored"


def _stored_copy_of(module: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                    device: Any) -> Fp8StoredLinear:
    made = module.__dict__.get(_FP8_ATTR)
    ident = (weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device,
             None if bias is None else bias.data_ptr())
    if made is not None and made[0] == ident:
        return made[1]
    with torch.no_grad():
        new = stored_copy(module, weight, bias).to(device)  # rounded where the weight is; only e4m3 bytes move
    new.dequantize_for_patches = _patches_take_dequantized_weights()
    object.__setattr__(module, _FP8_ATTR, (ident, new))
    return new


@functools.cache
def _patches_take_dequantized_weights() -> bool:
    """Whether this ComfyUI's low-VRAM weight patch adds a LoRA to the weight it is handed as it is
    (newer ComfyUI: its quantized layers hand it the dequantized weight) rather than converting it
    with the layer's ``convert_weight`` first and rounding back with ``set_weight`` (0.3.75). Asked
    of ComfyUI's own ``LowVramPatch`` with an empty patch list: does it call the convert function?"""
    import comfy.model_patcher

    converted: list[bool] = []

    def convert(weight: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        converted.append(True)
        return weight

    def set_back(weight: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return weight

    try:
        comfy.model_patcher.LowVramPatch("w", {"w": []}, convert, set_back)(torch.zeros(16, 16))
    except Exception as e:  # noqa: BLE001 - a host whose patch looks otherwise: its newer protocol
        log.debug("nexfort: ComfyUI's LowVramPatch probe failed (%s): weight functions get dequantized weights", e)
        return True
    return not converted


def _original(patcher: Any, key: str, current: torch.Tensor | None) -> torch.Tensor | None:
    """The unpatched tensor at ``key``: ComfyUI's backup while a patched clone of the model is
    loaded (clones share it), else the tensor in the model."""
    bk = getattr(patcher, "backup", {}).get(key)
    return current if bk is None else bk.weight


#: the namespace of a clone's weight-patch id with stored copies (made from the model's id)
_FP8_UUID_NS = uuid.UUID("9b3f3c1e-5c0a-4d4e-9a51-6f8a2f0c7e21")


def _stood_in_for(patcher: Any) -> list[torch.nn.Module]:
    """The original linears whose stored copies from ``patcher`` are in the model now."""
    backup = getattr(patcher, "object_patches_backup", {})
    originals = []
    for key, new in patcher.object_patches.items():
        orig = backup.get(key)
        if not isinstance(new, Fp8StoredLinear) or not isinstance(orig, torch.nn.Module):
            continue
        try:
            now = functools.reduce(getattr, key.split("."), patcher.model)
        except AttributeError:
            continue
        if now is new:
            originals.append(orig)
    return originals


def _park_originals(patcher: Any, *_: Any) -> None:
    """ON_LOAD callback: while the stored copies stand in, the originals they stand in for wait on
    the offload device. They are out of the model, so ComfyUI's load, which has just placed the
    copies, does not move them."""
    for orig in _stood_in_for(patcher):
        orig.to(patcher.offload_device)


def store_fp8_weights(patcher: Any) -> int:
    """Give ``patcher`` (a clone) object patches that swap each storable linear inside the diffusion
    model's block stacks for its e4m3 stored copy; returns how many. Already-swapped layers (another
    of our clones is loaded) are looked up in the shared object-patch backup, and weights a loaded
    clone has patched (a LoRA) in ComfyUI's shared weight backup: the originals are the source.

    The clone gets its own weight-patch id (``patches_uuid``, derived from the model's, so a node run
    again gets the same one): its weights are not the model's. That is what makes ComfyUI load it
    for real when another patcher of the model was loaded last (an eager run, the last prompt's
    clone), and unload it for real when that patcher loads again: with a shared id ComfyUI only
    swaps the object patches and loads nothing, and the copies stayed on the CPU (moved at every
    call: Flux-dev at 0.45 it/s) while the bf16 originals stayed on the GPU, or the originals came
    back parked on the CPU for the next patcher. ON_LOAD then parks the originals."""
    from comfy.patcher_extension import CallbacksMP

    dm = patcher.get_model_object("diffusion_model")
    backup = getattr(patcher, "object_patches_backup", {})
    n = 0
    for name, mod in list(dm.named_modules()):
        key = f"diffusion_model.{name}"
        orig = backup.get(key, mod)
        if not name or not _IN_BLOCKS.search(name + ".") or not storable(orig):
            continue
        weight = _original(patcher, f"{key}.weight", orig.weight)
        bias = _original(patcher, f"{key}.bias", orig.bias)
        patcher.add_object_patch(key, _stored_copy_of(orig, weight, bias, patcher.offload_device))
        n += 1
    if n:
        patcher.patches_uuid = uuid.uuid5(_FP8_UUID_NS, str(patcher.patches_uuid))
        patcher.remove_callbacks_with_key(CallbacksMP.ON_LOAD, WRAPPER_KEY)
        patcher.add_callback_with_key(CallbacksMP.ON_LOAD, WRAPPER_KEY, _park_originals)
    return n


def _progress(node_id: str | None, text: str) -> None:
    try:
        from server import PromptServer

        PromptServer.instance.send_progress_text(text, node_id)
    except Exception:  # noqa: BLE001 - UI nicety only (no server in-process)
        pass


def _lowvram_fallback(owner: Any, label: str) -> None:
    """A partially offloaded (low VRAM) model's call runs eager: the first time per ``owner``, one
    warning and a counted fallback with its reason."""
    if id(owner) in _warned_lowvram:
        return
    _warned_lowvram.add(id(owner))
    log.warning("nexfort: %s is partially offloaded (low VRAM): running eager", label)
    counters.bump(label, "fallbacks")
    counters.add_reason(label, "fallback", "low-VRAM / partial offload active: ran eager")
    counters.set_info(label, state="fallback")


def _is_dynamic(patcher: Any) -> bool:
    """Whether ``patcher`` is newer ComfyUI's dynamic-VRAM ModelPatcher (0.3.75 has none)."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    return bool(callable(is_dynamic) and is_dynamic())


def _not_compiled(label: str, why: str, node_id: str | None) -> None:
    """A dynamic-VRAM model left uncompiled: one warning, a counted fallback and its reason."""
    log.warning("nexfort: %s is loaded with ComfyUI's dynamic VRAM (%s): not compiled; start ComfyUI with "
                "--disable-dynamic-vram to compile it", label, why)
    counters.bump(label, "fallbacks")
    counters.add_reason(label, "fallback", f"dynamic VRAM ({why}): not compiled; start ComfyUI with "
                                           "--disable-dynamic-vram")
    counters.set_info(label, state="fallback", node_id=node_id)


def _traceable_clone(model: Any) -> tuple[Any, str | None]:
    """A clone of ``model`` whose diffusion model Dynamo can trace and ``None``, or a plain clone and
    why it could not be made traceable.

    Newer ComfyUI's dynamic VRAM (on by default on NVIDIA since it came) pages each layer's weights
    in inside the layer's call, through ctypes, which Dynamo cannot trace. Its own TorchCompileModel
    demotes such a ModelPatcher to a regular one first (``clone(disable_dynamic=True)``), and so do
    we, through ``get_non_dynamic_delegate`` where it exists (a clone whose rebuilt model the dynamic
    patcher keeps, so the next prompt reuses it and its compiled graph). ComfyUI 0.3.75 has no
    dynamic patchers (no ``is_dynamic``): a plain clone."""
    if not _is_dynamic(model):
        return model.clone(), None
    try:
        delegate = getattr(model, "get_non_dynamic_delegate", None)
        return (delegate() if callable(delegate) else model.clone(disable_dynamic=True)), None
    except Exception as e:  # noqa: BLE001 - no recorded way to rebuild it, its file gone, memory: run it as it is
        return model.clone(), f"{type(e).__name__}: {e}"


def move_conds(conds: Any, move: Any) -> int:
    """Each CPU tensor condition (``model_conds``: text embeddings, pooled vectors, Flux's guidance)
    of a sampling's processed conditioning replaced by a copy holding ``move(tensor)``; how many."""
    import comfy.conds

    moved = 0
    for entries in (conds or {}).values():
        for entry in entries or ():
            model_conds = entry.get("model_conds") if isinstance(entry, dict) else None
            for key, cond in list((model_conds or {}).items()):
                if (isinstance(cond, comfy.conds.CONDRegular) and isinstance(cond.cond, torch.Tensor)
                        and cond.cond.device.type == "cpu" and not cond.cond.requires_grad):
                    model_conds[key] = cond._copy_with(move(cond.cond))
                    moved += 1
    return moved


def conds_on_device(executor: Any, guider: Any, *args: Any, **kwargs: Any) -> Any:
    """``WrappersMP.SAMPLER_SAMPLE``: the sampling's conditioning on the GPU once, before its steps.

    ComfyUI keeps the conditioning on the CPU and, every step, concatenates cond and uncond there and
    hands the model CPU tensors, which our model wrapper then stages through pinned memory and
    copies in: host work and a copy in the GPU's stream each step (Flux's 512x4096 text embedding
    is 8 MB a step). Moved here once, ComfyUI's per-step concatenation runs on the GPU and the model
    gets device tensors. Safe: the processed conditioning (``model_conds``) is ComfyUI's
    per-sampling copy (``encode_model_conds``), the values and dtypes are unchanged, and every cond
    of a sampling lands on the same device, as ComfyUI's ``can_concat`` requires."""
    device = getattr(getattr(guider, "model_patcher", None), "load_device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        move_conds(getattr(guider, "conds", None), lambda t: to_device_async(t, device))
    return executor(guider, *args, **kwargs)



def compile_model_patcher(model: Any, config: CompileConfig, node_id: str | None = None) -> Any:
    """Clone ``model`` (a ModelPatcher) and register the nexfort APPLY_MODEL wrapper on the clone.
    A dynamic-VRAM ModelPatcher that cannot be made a regular one is returned cloned, uncompiled,
    with a warning and a counted fallback."""
    from comfy.patcher_extension import WrappersMP

    m, why = _traceable_clone(model)
    m.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    m.remove_wrappers_with_key(WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY)
    if why is not None:
        _not_compiled(type(model.get_model_object("diffusion_model")).__name__,
                      f"cannot be made a regular model: {why}", node_id)
        return m

    if config.fp8_weights:
        n = store_fp8_weights(m)
        log.info("nexfort: %d linear weights stored in fp8 (e4m3, one scale each) while this model runs", n)
        counters.set_info(type(m.get_model_object("diffusion_model")).__name__, fp8_weight_layers=n, node_id=node_id)

    if one_branch_scaled_fp8(m.get_model_object("diffusion_model")):
        log.info("nexfort: scaled fp8 linears traced with one form for every input size (no recompile "
                 "when a resolution crosses ComfyUI's weight-or-input test)")

    def nexfort_apply_model(executor: Any, *args: Any, **kwargs: Any) -> Any:
        base = executor.class_obj  # comfy.model_base.BaseModel
        diffusion_model = base.diffusion_model
        if isinstance(diffusion_model, nexfort_engine.CompiledModule):  # nested wrappers
            return executor(*args, **kwargs)
        compiled = _compiled_for(diffusion_model, config, type(diffusion_model).__name__)
        counters.set_info(compiled.label, node_id=node_id)
        if getattr(base, "model_lowvram", False):
            _lowvram_fallback(base, compiled.label)
            return executor(*args, **kwargs)
        # ComfyUI re-patches weights whenever the patch set changes; in place (weight_inplace_update)
        # on inference tensors that is invisible to version counters: tell the engine
        patches = getattr(base, "current_weight_patches_uuid", None)
        if compiled.__dict__.get("_nexfort_patches") != patches:
            compiled.__dict__["_nexfort_patches"] = patches
            compiled.weights_changed()
        first = compiled._nx_compiled is None and compiled.failed is None
        if first:
            _progress(node_id, "nexfort: compiling (first step)…")
        base.diffusion_model = compiled
        # the conditioning ComfyUI keeps on the CPU, copied without a host-GPU synchronisation
        # (ComfyUI's own per-step copies come from pageable memory: the GPU then idles each step)
        x = args[0] if args else kwargs.get("x")
        if isinstance(x, torch.Tensor) and x.is_cuda:
            kwargs = {k: to_device_async(v, x.device) for k, v in kwargs.items()}
            args = tuple(to_device_async(v, x.device) if i >= 2 else v for i, v in enumerate(args))
        # attention patches that read the host (IPAdapter's and the like): host calls in one graph
        options = args[5] if len(args) > 5 else kwargs.get("transformer_options")
        options, live = host_patches.prepare(options)
        if live is not None:
            if len(args) > 5:
                args = (*args[:5], options, *args[6:])
            else:
                kwargs["transformer_options"] = options
            n = host_patches.swapped(options)
            if compiled.__dict__.get("_nexfort_host_patches") != n:
                compiled.__dict__["_nexfort_host_patches"] = n
                counters.set_info(compiled.label, host_patches=n)
                log.info("nexfort: %s: %d attention patch(es) read the sigma on the host (IPAdapter-like): "
                         "they run as host calls inside one graph", compiled.label, n)
        try:
            with comfy_allocation_recorder_off(), host_call.live(live):
                return executor(*args, **kwargs)
        finally:
            base.diffusion_model = diffusion_model
            if first:
                rec = counters.snapshot()["models"].get(compiled.label, {})
                _progress(node_id, f"nexfort: {rec.get('state', '?')} ({rec.get('compile_seconds', 0):.1f}s)")

    # among every call's transformer_options, called by ComfyUI around the model, never by it: a
    # background compile's child may get it without its closure (background.CARRIED)
    setattr(nexfort_apply_model, CARRIED, True)
    m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, nexfort_apply_model)

    def nexfort_sampler_sample(executor: Any, guider: Any, *args: Any, **kwargs: Any) -> Any:
        return conds_on_device(executor, guider, *args, **kwargs)

    # a closure, marked: a background compile's child gets it as a stand-in, never imports the pack
    setattr(nexfort_sampler_sample, CARRIED, True)
    m.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY, nexfort_sampler_sample)
    m.model_options["nexfort_config"] = config.to_dict()
    return m


class _Proxy(torch.nn.Module):
    """Stands in for a module ComfyUI holds outside a ModelPatcher wrapper (a VAE's, a ControlNet's):
    the attributes ComfyUI reads and the state dict are the real module's."""

    def __init__(self, inner: torch.nn.Module, config: CompileConfig, node_id: str | None) -> None:
        super().__init__()
        self.inner = inner
        self._config = config
        self._node_id = node_id

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    # the module's own keys: ComfyUI's savers (VAE.get_sd(): VAESave, CheckpointSave) read the state
    # dict, which would otherwise carry an ``inner.`` prefix
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.load_state_dict(*args, **kwargs)


class _CompiledVAEModel(_Proxy):
    """Stands in for ``VAE.first_stage_model``: compiled ``decode``/``encode``, the rest delegated."""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        cm = _compiled_for(self.inner, self._config, f"{type(self.inner).__name__}.{method}", method=method)
        counters.set_info(cm.label, node_id=self._node_id)
        return cm(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("decode", *args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("encode", *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def compile_vae(vae: Any, config: CompileConfig, node_id: str | None = None) -> Any:
    """Shallow-copy ``vae`` (a comfy.sd.VAE) with a compiled decode/encode; the input is untouched.
    A VAE loaded with newer ComfyUI's dynamic VRAM pages its weights in inside each layer's call,
    which Dynamo cannot trace, and ComfyUI offers no regular twin of it: the copy runs eager, with a
    warning and a counted fallback."""
    if config.fp8_weights:
        log.warning("nexfort: \"fp8_weights\" stores a diffusion model's linears in fp8; a VAE keeps its weights "
                    "(ignored here)")
    inner = vae.first_stage_model
    if isinstance(inner, _CompiledVAEModel):
        inner = inner.inner
    new = copy.copy(vae)
    if _is_dynamic(getattr(vae, "patcher", None)):
        _not_compiled(f"{type(inner).__name__}.decode", "a VAE", node_id)
        new.first_stage_model = inner
        return new
    new.first_stage_model = _CompiledVAEModel(inner, config, node_id)
    return new


class _CompiledControlModel(_Proxy):
    """Stands in for a ControlNet's ``control_model``: compiled ``forward``, the rest delegated (ComfyUI
    reads e.g. its ``dtype``). Partially offloaded (low VRAM: ComfyUI casts its weights per layer),
    a call runs eager with one warning and a counted fallback, as a diffusion model's does."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.inner
        cm = _compiled_for(inner, self._config, type(inner).__name__)
        counters.set_info(cm.label, node_id=self._node_id)
        if getattr(inner, "model_lowvram", False):
            _lowvram_fallback(inner, cm.label)
            return inner(*args, **kwargs)
        with comfy_allocation_recorder_off():
            out = cm(*args, **kwargs)
        if "cudagraphs" in self._config.flags:
            out = _copied_out(out)
        return out


def _copied_out(out: Any) -> Any:
    """The ControlNet's outputs (a dict of lists of tensors) copied out of a CUDA graph's memory pool.
    ComfyUI keeps them past the next replay (merges them with the previous ControlNet's, scales them
    in place by the strength): left in the pool, a later replay overwrote them ("accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run", SDXL on an H200, run266).
    The copies cost far less than the launches CUDA graphs save (SDXL's ControlNet: 20.6 it/s with
    them against 18.5-19.1 compiled without, runs 267-270)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):
        return {k: _copied_out(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(_copied_out(v) for v in out)
    return out


def compile_controlnet(control_net: Any, config: CompileConfig, node_id: str | None = None) -> Any:
    """ComfyUI's copy of ``control_net`` (a ``comfy.controlnet.ControlNet``) whose ``control_model``
    runs compiled; the input is untouched. Anything else is returned as it is, with a warning and a
    counted fallback naming why."""
    import comfy.controlnet

    kind = type(control_net).__name__
    inner = getattr(control_net, "control_model", None)
    why = None
    if not isinstance(control_net, comfy.controlnet.ControlNet):
        why = f"a {kind} (only ControlNets are compiled)"
    elif isinstance(control_net, getattr(comfy.controlnet, "ControlLora", ())) or inner is None:
        why = f"a {kind}: its model is built at each sampling"
    elif _is_dynamic(getattr(control_net, "control_model_wrapped", None)):
        why = "loaded with ComfyUI's dynamic VRAM; start ComfyUI with --disable-dynamic-vram to compile it"
    if why is not None:
        log.warning("nexfort: the control net is %s: not compiled", why)
        counters.bump(kind, "fallbacks")
        counters.add_reason(kind, "fallback", f"not compiled: {why}")
        counters.set_info(kind, state="fallback", node_id=node_id)
        return control_net
    if config.fp8_weights:
        log.warning("nexfort: \"fp8_weights\" stores a diffusion model's linears in fp8; a ControlNet keeps its "
                    "weights (ignored here)")
    if isinstance(inner, _CompiledControlModel):
        inner = inner.inner
    new = control_net.copy()
    new.control_model = _CompiledControlModel(inner, config, node_id)
    return new
