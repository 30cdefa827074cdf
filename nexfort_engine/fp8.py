"""fp8 linears: rowwise e4m3 ``torch._scaled_mm`` for token-wise ``F.linear`` calls, weights
quantized once per weight version.

What: :class:`Fp8LinearMode` is a ``TorchFunctionMode`` that routes eligible
``torch.nn.functional.linear`` calls (ComfyUI's ops and plain ``nn.Linear`` both call it) to
:func:`fp8_linear_cached`: the activation is quantized per row (token) *inside the graph* (so
Inductor fuses it with the op that produced it) and handed, with the live bf16/fp16 weight, to the
opaque custom op ``nexfort::fp8_mm_cached``. That op looks the weight up in a process-wide
:class:`WeightCache` of per-output-channel e4m3 copies (fp32 scales) and runs ``torch._scaled_mm``.
:func:`fp8_linear` (both operands quantized every call) and :func:`fp8_linear_reference` (the torch
twin: same quantization, fp32 matmul) keep their meaning; the cached path gives the same numbers.

Why it is safe:

* A cached copy is used only while it is *fresh*: same storage (address, shape, strides, dtype,
  device and the storage object itself) and same ``weight._version`` as when it was quantized.
  In-place patches (``w.copy_``, ``w += d``: LoRA) bump the version; replaced parameters have
  another storage. Either way the copy is re-quantized *in place* on the next call, without a
  recompile. Inference tensors (created under ``torch.inference_mode``, as ComfyUI loads models)
  have no version counter: for them a replaced parameter is seen, an in-place patch is not, and
  the host must call :meth:`WeightCache.invalidate` (or :meth:`ModuleWeights.invalidate`).
* CUDA-graph replays skip the op's Python, so staleness is also handled outside the graph:
  :meth:`ModuleWeights.refresh`, called by the compiler before every compiled call, re-quantizes
  changed weights in place (the buffers' addresses, which a captured graph reads, never change)
  and makes copies for weights that replaced known-eligible ones, so a re-recorded graph captures
  the cache, not an in-graph quantization.
* Buffers are allocated only outside compiled calls (in ``refresh``): a miss inside a call
  quantizes that weight inline (the numbers are the same) and queues it for the next refresh, so
  no buffer ever lives in a CUDA-graph memory pool. Inside a stream capture the op never touches
  the cache except to read a fresh copy (and then marks it captured).
* Memory: one fp8 copy (half the bf16 size) plus N fp32 scales per eligible weight. The cache
  holds weak references only; a copy whose weight's storage died is freed at once (weakref
  callback) unless a CUDA graph captured it: such a graph replays whenever weights sit at its
  addresses again, so those copies stay, re-quantized in place for any weight found at that
  address, until :func:`clear_cache`. :meth:`ModuleWeights.release` (the compiled module fell
  back or was collected) frees the module's uncaptured copies.
* Only token-wise linears are converted (:func:`eligible`): inputs with a sequence dimension and
  shapes fp8 kernels accept. Timestep/adaLN/pooled-embedding MLPs (2-D inputs) are tiny and
  precision-sensitive, so they stay in the model's dtype. The decision uses static properties
  only (rank, feature sizes, dtype), never the token count, so it holds under dynamic shape.
* Dynamic rowwise scales follow each row's range: the error is that of e4m3 rounding (about
  3-4% relative-L2 on random data), with no calibration to go stale.
* Inference only: a call that needs gradients passes through unchanged (``_scaled_mm`` has no
  backward). The eager fallback runs outside the mode and is the untouched model.

Weights the model *stores* in e4m3 (ComfyUI's ``weight_dtype: fp8_e4m3fn``, fp8 checkpoints) reach
``F.linear`` cast up to bf16 at every call, a new tensor each time that the cache cannot keep:
``passes/fp8_stored.py`` rewrites those ``fp8_mm_cached`` calls to :func:`fp8_mm_stored`, which runs
``_scaled_mm`` on the stored tensor itself (twin: :func:`fp8_mm_stored_reference`).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

__all__ = [
    "CACHE",
    "Fp8LinearMode",
    "ModuleWeights",
    "WeightCache",
    "clear_cache",
    "eligible",
    "fp8_linear",
    "fp8_linear_cached",
    "fp8_linear_reference",
    "fp8_mm_stored",
    "fp8_mm_stored_reference",
    "fp8_supported",
    "model_width",
    "pays_off",
    "quantize_rowwise",
    "scale_rowwise",
]

FP8_DTYPE = torch.float8_e4m3fn
#: ``_scaled_mm`` needs the contraction (K) and output (N) sizes aligned to 16 bytes of fp8.
ALIGN = 16
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: fp8 tensor cores: Ada (sm89) and Hopper (sm90) and newer.
MIN_CAPABILITY = (8, 9)
#: auto fp8 (O3) only for models at least this wide (:func:`pays_off`)
MIN_AUTO_WIDTH = 2048


def scale_rowwise(t: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise` up to the final cast: (float32 ``t / scale`` clamped to ``dtype``'s
    range, fp32 scales [..., 1])."""
    fmax = torch.finfo(dtype).max
    t32 = t.float()
    amax = t32.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=1e-12) / fmax
    return (t32 / scale).clamp(-fmax, fmax), scale


def quantize_rowwise(t: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [..., K] -> (fp8 values, fp32 scales [..., 1]) with ``t ~= q * scale`` per row.

    The scale maps each row's absolute maximum onto the fp8 format's largest finite value.
    """
    scaled, scale = scale_rowwise(t, dtype)
    return scaled.to(dtype), scale


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` is a token-wise linear the fp8 path takes.

    Static properties only (rank, feature sizes, dtypes, autograd state), so the answer is the
    same for every token count / resolution under dynamic shape.
    """
    if x.dim() < 3 or weight.dim() != 2:
        return False
    out_features, in_features = weight.shape
    if in_features % ALIGN or out_features % ALIGN or x.shape[-1] != in_features:
        return False
    if x.dtype not in INPUT_DTYPES or weight.dtype != x.dtype:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def model_width(module: torch.nn.Module) -> int:
    """The width of ``module``'s linears: the parameter-weighted median of ``min(in, out)``
    features over its 2-D ``nn.Linear`` weights (SDXL 1280, PixArt-alpha 1152, Wan 2.1 1.3B 1536,
    Flux 3072) and those stored in e4m3 (:class:`~nexfort_engine.fp8_weights.Fp8StoredLinear`,
    ``"fp8_weights"``); 0 without linears."""
    from .fp8_weights import Fp8StoredLinear

    widths: list[tuple[int, int]] = []
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, (torch.nn.Linear, Fp8StoredLinear)) and isinstance(w, torch.Tensor) and w.dim() == 2:
            widths.append((min(w.shape), w.numel()))
    total = sum(n for _, n in widths)
    seen = 0
    for width, n in sorted(widths):
        seen += n
        if 2 * seen >= total:
            return width
    return 0


def pays_off(module: torch.nn.Module, min_width: int = MIN_AUTO_WIDTH) -> bool:
    """Whether auto fp8 (``"fp8": null`` under ``low-precision``, O3) is worth it for ``module``.

    fp8 GEMMs save time in proportion to the GEMMs' work, while quantizing each linear's input
    costs a pass over the activations whatever the width, so narrow models lose what they gain.
    Measured on an H200 (BENCHMARKS.md): Flux (3072 wide) 9.6-9.8 it/s against 7.25 in bf16;
    SDXL (1280) 30.96 against 31.00 (its GEMMs 14.75 -> 10.95 ms per step, its quantization
    kernels +5.2 ms) and PixArt-alpha (1152) 27.76 against 27.67, each at a 10-80x larger error
    against fp32. ``"fp8": true`` still forces it."""
    return model_width(module) >= min_width


def _flatten(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    out_shape = (*x.shape[:-1], weight.shape[0])
    return x.reshape(-1, x.shape[-1]), out_shape


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on fp8 tensor cores: rowwise-scaled ``torch._scaled_mm``.

    ``_scaled_mm`` wants a row-major first and a column-major second operand (``wq.t()`` of a
    contiguous ``wq``), K and N multiples of 16, and bf16 output with rowwise scales on CUDA.
    """
    x2, out_shape = _flatten(x, weight)
    xq, sx = quantize_rowwise(x2)
    wq, sw = quantize_rowwise(weight)
    # a bf16 model's bias goes into the GEMM's epilogue (no extra pass over the output); fp16
    # models add it in the cast Inductor fuses anyway. Fast accumulation: Hopper's fp8 MMA
    # accumulates partial sums in reduced precision, part of what low precision trades.
    fused = _fused_bias(x, bias)
    out = _scaled_mm(xq, wq, sx, sw, bias if fused else None)
    return _epilogue(out, x, bias, fused, out_shape)


def _fused_bias(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bias is not None and x.dtype == torch.bfloat16 and bias.dtype == torch.bfloat16


def _scaled_mm(
    xq: torch.Tensor, wq: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """xq [M, K] @ wq [N, K].T with rowwise scales sx [M, 1], sw [N, 1]: bf16 [M, N]."""
    return torch._scaled_mm(
        xq.contiguous(), wq.contiguous().t(), scale_a=sx, scale_b=sw.t(),
        bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True,
    )


def _epilogue(
    out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, fused: bool, out_shape: tuple[int, ...]
) -> torch.Tensor:
    if bias is not None and not fused:
        out = out.float() + bias.float()
    return out.to(x.dtype).reshape(out_shape)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of :func:`fp8_linear`: same quantization, dequantized fp32 matmul."""
    x2, out_shape = _flatten(x, weight)
    xq, sx = quantize_rowwise(x2)
    wq, sw = quantize_rowwise(weight)
    out = (xq.float() * sx) @ (wq.float() * sw).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(out_shape)


# -- the weight cache

#: (device, data_ptr, shape, strides, dtype): where a weight lives and how it is laid out
_Key = tuple[str, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _key(weight: torch.Tensor) -> _Key:
    return (str(weight.device), weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype)


def _version(weight: torch.Tensor) -> int | None:
    """``weight._version``; ``None`` for inference tensors, which have no version counter."""
    return None if weight.is_inference() else weight._version


@dataclass
class _Entry:
    """One weight's fp8 copy. ``q``/``scale`` are rewritten in place, never reallocated."""

    q: torch.Tensor
    scale: torch.Tensor
    storage: weakref.ref  # the weight's storage: identity of what was quantized
    tensor: weakref.ref  # the tensor last quantized: the source for refresh()
    version: int | None
    #: read inside a CUDA-graph capture: a replay may read ``q``/``scale`` without our Python
    captured: bool = False
    #: marked by :meth:`WeightCache.invalidate`: the weight changed where no counter shows it
    stale: bool = False

    def fresh(self, weight: torch.Tensor) -> bool:
        return not self.stale and self.storage() is weight.untyped_storage() and self.version == _version(weight)

    def quantize(self, weight: torch.Tensor, on_death: Callable[[weakref.ref], None]) -> None:
        with torch.no_grad():
            q, scale = quantize_rowwise(weight)
            self.q.copy_(q)
            self.scale.copy_(scale)
        self.bind(weight, on_death)

    def bind(self, weight: torch.Tensor, on_death: Callable[[weakref.ref], None]) -> None:
        storage = weight.untyped_storage()
        if self.storage() is not storage:
            self.storage = weakref.ref(storage, on_death)
        self.tensor = weakref.ref(weight)
        self.version = _version(weight)
        self.stale = False


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class WeightCache:
    """Per-output-channel fp8 copies of linear weights, one per weight storage, re-quantized in
    place when the weight changes. Thread-safe; see the module docstring for the rules."""

    def __init__(self) -> None:
        # reentrant: a weight's death (a weakref callback) may come while this thread holds it
        self._lock = threading.RLock()
        self._entries: dict[_Key, _Entry] = {}
        #: misses seen by the op, quantized inline; :meth:`refresh` makes their copies
        self._pending: dict[_Key, weakref.ref] = {}
        #: bumped when a new weight is queued (ModuleWeights rescans its module then)
        self.generation = 0
        #: bumped whenever a copy is made, re-quantized, marked stale or freed: a module whose
        #: weights are unchanged since it last saw this value needs no refresh
        self.epoch = 0
        self.stats = {"hits": 0, "inline": 0, "quantized": 0, "requantized": 0, "dropped": 0}

    def lookup(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 weight [N, K], fp32 scales [N, 1]) for ``weight``: the cached copy when fresh,
        re-quantized in place when stale, quantized inline (and queued) when there is none."""
        key = _key(weight)
        capturing = _capturing(weight)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if entry.fresh(weight):
                    entry.captured |= capturing
                    self.stats["hits"] += 1
                    return entry.q, entry.scale
                if not capturing:  # in a capture the rewrite would be recorded, not run
                    entry.quantize(weight, self._on_death(key))
                    self.stats["requantized"] += 1
                    self.epoch += 1
                    return entry.q, entry.scale
            elif key not in self._pending:
                self._pending[key] = weakref.ref(weight)
                self.generation += 1
                self.epoch += 1
            self.stats["inline"] += 1
        return quantize_rowwise(weight)

    def refresh(self, weights: Iterable[torch.Tensor] = ()) -> int:
        """Outside compiled calls: make copies for queued misses and for ``weights``, re-quantize
        stale copies in place, drop copies of dead weights no CUDA graph captured. Returns how
        many weights were (re-)quantized."""
        n = 0
        with self._lock, torch.no_grad():
            pending, self._pending = self._pending, {}
            sources = [w for w in (r() for r in pending.values()) if w is not None]
            done: set[_Key] = set()  # checked here: the sweep below skips them
            for w in [*sources, *weights]:
                key = _key(w)
                done.add(key)
                entry = self._entries.get(key)
                if entry is None:
                    q, scale = quantize_rowwise(w)
                    entry = _Entry(q.contiguous(), scale.contiguous(), _dead_ref, _dead_ref, None)
                    entry.bind(w, self._on_death(key))
                    self._entries[key] = entry
                    self.stats["quantized"] += 1
                    n += 1
                elif not entry.fresh(w):
                    entry.quantize(w, self._on_death(key))
                    self.stats["requantized"] += 1
                    n += 1
            for key, entry in list(self._entries.items()):
                if key in done:
                    continue
                if entry.storage() is None:  # the weight is gone
                    if not entry.captured:
                        del self._entries[key]
                        self.stats["dropped"] += 1
                    continue
                w = entry.tensor()
                if w is not None and _key(w) == key and not entry.fresh(w):
                    entry.quantize(w, self._on_death(key))
                    self.stats["requantized"] += 1
                    n += 1
            if n or pending:
                self.epoch += 1
        return n

    def _on_death(self, key: _Key) -> Callable[[weakref.ref], None]:
        """A weight storage's weakref callback: its copy goes at once (a model unloaded between
        compiled calls frees its fp8 copies too), unless a CUDA graph captured it."""
        this = weakref.ref(self)

        def dead(ref: weakref.ref) -> None:
            cache = this()
            if cache is None:
                return
            with cache._lock:
                entry = cache._entries.get(key)
                if entry is not None and entry.storage is ref and not entry.captured:
                    del cache._entries[key]
                    cache.stats["dropped"] += 1
                    cache.epoch += 1

        return dead

    def keys(self) -> set[_Key]:
        with self._lock:
            return set(self._entries) | set(self._pending)

    def invalidate(self, keys: Iterable[_Key] | None = None) -> None:
        """Mark copies stale (all, or those of ``keys``): for in-place changes the version
        counter cannot see (inference tensors). The next lookup or :meth:`refresh` re-quantizes
        them in place from their live weight; a stale copy is never taken for a dead one."""
        with self._lock:
            for key in self._entries if keys is None else keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.stale = True
            self.epoch += 1

    def release(self, keys: Iterable[_Key] | None = None) -> None:
        """Free copies: all (only when no CUDA graph that captured one can run again), or those of
        ``keys`` that no graph captured (another compiled module may share the weights and have
        captured them; an uncaptured copy is simply made again at its next refresh)."""
        with self._lock:
            self.epoch += 1
            if keys is None:
                self._entries.clear()
                self._pending.clear()
                return
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and not entry.captured:
                    del self._entries[key]
                self._pending.pop(key, None)

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.q.nbytes + e.scale.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


class _DeadRef:
    """A weak reference that is always dead: a new entry's placeholder until :meth:`_Entry.bind`."""

    def __call__(self) -> None:
        return None


_dead_ref: Any = _DeadRef()

#: the process-wide cache the custom op reads (CUDA graphs capture its buffers' addresses)
CACHE = WeightCache()


def clear_cache() -> None:
    """Free every cached fp8 weight. Only when no compiled module that used fp8 will run again."""
    CACHE.release()


class ModuleWeights:
    """The cache seen from one compiled module: which of its parameters the fp8 op used, found by
    attribute (module, name) so a parameter *replaced* by a host (ComfyUI's LoRA patching sets a
    new ``Parameter``) is quantized by :meth:`refresh` before the call that captures it."""

    def __init__(self, module: torch.nn.Module, cache: WeightCache = CACHE) -> None:
        self._module = module
        self._cache = cache
        self._slots: dict[tuple[int, str], tuple[torch.nn.Module, str]] = {}
        self._generation = -1
        #: every key this module's weights had: freed by :meth:`release`
        self.keys: set[_Key] = set()
        #: after a refresh: (parameter dict, name, parameter, address, version) per slot and the
        #: cache's epoch; :meth:`refresh` returns at once while all of them still hold
        self._seen: list[tuple[dict, str, torch.Tensor, int, int | None]] | None = None
        self._epoch = -1

    def _rescan(self) -> None:
        known = self._cache.keys()
        for mod in self._module.modules():
            for name, p in mod._parameters.items():
                if p is not None and _key(p) in known:
                    self._slots[(id(mod), name)] = (mod, name)
        self._generation = self._cache.generation

    def weights(self) -> list[torch.Tensor]:
        out = []
        for mod, name in self._slots.values():
            w = mod._parameters.get(name)
            if w is not None:
                out.append(w)
        return out

    def refresh(self) -> int:
        """Before each compiled call: see :meth:`WeightCache.refresh`.

        Fast path: when the cache has changed nothing since this module's last refresh (its
        epoch and generation) and every slot still holds the same parameter, at the same address,
        with the same version counter, there is nothing to do. That check costs well under a
        microsecond per weight; the full refresh about 5 us per weight (2.6 ms per call for 500
        weights on a 2-core CI machine), host time that a sampler's per-step synchronisation puts
        in front of every step's first kernel. Changes no counter shows (in-place writes to
        inference tensors) still need :meth:`invalidate`, as before."""
        if self._unchanged():
            return 0
        if self._generation != self._cache.generation:
            self._rescan()
        weights = self.weights()
        n = self._cache.refresh(weights)
        self.keys.update(_key(w) for w in weights)
        self._seen = [
            (mod._parameters, name, w, w.data_ptr(), _version(w))
            for (mod, name), w in ((slot, slot[0]._parameters.get(slot[1])) for slot in self._slots.values())
            if w is not None
        ]
        self._epoch = self._cache.epoch
        return n

    def _unchanged(self) -> bool:
        if self._seen is None or self._epoch != self._cache.epoch or self._generation != self._cache.generation:
            return False
        for params, name, w, ptr, version in self._seen:
            p = params.get(name)
            if p is not w or p.data_ptr() != ptr or (version is not None and p._version != version):
                return False
        return True

    def invalidate(self) -> None:
        """Re-quantize this module's weights at the next refresh (after an in-place change to
        inference tensors, which have no version counter)."""
        self._cache.invalidate([_key(w) for w in self.weights()])

    def release(self) -> None:
        """Free this module's copies that no CUDA graph captured (see :meth:`WeightCache.release`)."""
        self._cache.release(self.keys)
        self.keys.clear()


@torch.library.custom_op("nexfort::fp8_mm_cached", mutates_args=())
def fp8_mm_cached(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``xq [M, K]`` (e4m3, scales ``x_scale [M, 1]``) times ``weight [N, K]``'s cached rowwise
    e4m3 copy: bf16 ``[M, N]``, ``bias`` (bf16, or None) added in the GEMM's epilogue."""
    wq, w_scale = CACHE.lookup(weight)
    return _scaled_mm(xq, wq, x_scale, w_scale, bias)


@fp8_mm_cached.register_fake
def _(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def _stored_scales(weight: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """Per-output-channel fp32 scales [N, 1] for a weight stored in e4m3 with one (or no) scale."""
    n = weight.shape[0]
    if w_scale is None:
        return torch.ones((n, 1), device=weight.device, dtype=torch.float32)
    return w_scale.to(device=weight.device, dtype=torch.float32).reshape(1, 1).expand(n, 1).contiguous()


@torch.library.custom_op("nexfort::fp8_mm_stored", mutates_args=())
def fp8_mm_stored(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``xq [M, K]`` (e4m3, scales ``x_scale [M, 1]``) times a weight the model *stores* in e4m3
    (``weight [N, K]``, times ``w_scale``, a one-element tensor, when given): bf16 ``[M, N]``, no
    copy of the weight and no cast of it (passes/fp8_stored.py puts this op where the graph cast a
    stored e4m3 weight up to bf16/fp16 for :func:`fp8_mm_cached`)."""
    return _scaled_mm(xq, weight, x_scale, _stored_scales(weight, w_scale), bias)


@fp8_mm_stored.register_fake
def _(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None,
      bias: torch.Tensor | None) -> torch.Tensor:
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=torch.bfloat16)


def fp8_mm_stored_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                            w_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Torch twin of :func:`fp8_mm_stored`: the same operands dequantized, an fp32 matmul, the
    result rounded to bf16 as ``_scaled_mm``'s output is."""
    out = (xq.float() * x_scale) @ (weight.float() * _stored_scales(weight, w_scale)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def fp8_linear_cached(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp8_linear` with the weight's quantization taken from :data:`CACHE` (the same
    numbers): only the activation is quantized here, in the caller's graph."""
    x2, out_shape = _flatten(x, weight)
    xq, sx = quantize_rowwise(x2)
    fused = _fused_bias(x, bias)
    out = fp8_mm_cached(xq.contiguous(), sx, weight, bias if fused else None)
    return _epilogue(out, x, bias, fused, out_shape)


def fp8_supported(device: torch.device | str) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA sm89+) and torch has ``_scaled_mm``.

    CPU runs the fp8 path correctly but not faster, so it is only used there when forced.
    """
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def _linear_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``F.linear(input, weight, bias=None)``'s arguments, positional or by keyword."""
    names = ("input", "weight", "bias")
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(vals) < 2:
        return None, None, None
    return vals[0], vals[1], vals[2] if len(vals) > 2 else None


class Fp8LinearMode(torch.overrides.TorchFunctionMode):
    """Routes eligible ``F.linear`` calls to the fp8 path; every other call passes through.

    Enter it around a ``torch.compile``'d call: Dynamo traces the mode, so the activation's
    quantization and the cached-weight op land in the graph (call :meth:`ModuleWeights.refresh`
    before each call). ``reference=True`` uses :func:`fp8_linear_reference`, ``cached=False``
    :func:`fp8_linear` (the weight quantized in the graph too).
    """

    def __init__(self, reference: bool = False, cached: bool = True) -> None:
        super().__init__()
        self.reference = reference
        self.cached = cached

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(args, kwargs)
            if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and eligible(x, weight):
                if self.reference:
                    return fp8_linear_reference(x, weight, bias)
                if self.cached:
                    return fp8_linear_cached(x, weight, bias)
                return fp8_linear(x, weight, bias)
        return func(*args, **kwargs)
