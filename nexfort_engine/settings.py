"""What each mode flag means: one table from flags to concrete, *scoped* torch settings.

Nothing here assigns a process-wide setting. :func:`resolve` turns a :class:`CompileConfig`
into a :class:`Settings` value holding

* ``inductor``: Inductor config patches, handed to ``compile_fx(config_patches=...)`` so they
  apply to our compile only;
* ``dynamo`` / ``fx``: Dynamo and symbolic-shape config patches, entered with
  ``torch._dynamo.config.patch`` around each call of the compiled module (compiles happen inside
  calls);
* ``runtime``: backend switches read at kernel-dispatch time (TF32, reduced-precision
  reductions, cuDNN benchmark), set on entry to each compiled call and restored on exit;
* ``fp8``: whether token-wise linears run in fp8 (:mod:`nexfort_engine.fp8`), a mode entered
  around each compiled call and traced into the graph.

GPU-only flags on a machine without CUDA are dropped with a single logged warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from . import indexing
from .options import FLAGS, PRESETS, CompileConfig
from .passes import gelu_epilogue as gelu_epilogue_pass
from .passes import tuned_linear as tuned_linear_pass
from .reductions import DEFAULT_LIMIT

log = logging.getLogger(__name__)

#: Mode flag -> Inductor config patches (the README's table is generated from this).
FLAG_INDUCTOR: dict[str, dict[str, Any]] = {
    # Convolutions stay with cuDNN: autotuning them against Triton templates cost SDXL 129 s of a
    # cold compile for 18 convolution shapes, and cuDNN won 17 of them (the 18th, the 4-channel
    # output conv, went to a Triton template at 31 us; BENCHMARKS.md, ninth session, run63).
    "max-autotune": {
        "max_autotune": True,
        "max_autotune_gemm": True,
        "max_autotune_pointwise": True,
        "coordinate_descent_tuning": True,
        "max_autotune_conv_backends": "ATEN",
    },
    # No ``permute_fusion``: its linear/permute rewrites match nothing in ComfyUI's UNets and DiTs
    # (tests/engine/test_permute_fusion.py checks this on traced graphs), yet on GPU it runs a full fake
    # ShapeProp over the graph before the cache lookup: ~7 s of every SDXL compile, warm ones too.
    # No ``aggressive_fusion`` (fusing nodes that share no buffer): over a whole dynamic-shape UNet
    # its extra fusion candidates are checked in sympy; Inductor's scheduler took 25.4 s of an SDXL
    # cold compile with it and 10.7 s without on one H200 (SD2.1 13.9 -> 8.6 s), at the same speed
    # (SDXL 31.36-31.42 vs 31.44-31.52 it/s, SD2.1, PixArt, Flux O3 unchanged; BENCHMARKS.md,
    # twentieth session). A user's ``inductor.aggressive_fusion`` option still turns it on.
    "max-optimize": {
        "epilogue_fusion": True,
        "shape_padding": True,
        "pattern_matcher": True,
    },
    "cudagraphs": {
        "triton.cudagraphs": True,
        "triton.cudagraph_trees": True,
        # keep CUDA graphs under dynamic shape: one recorded graph per concrete shape
        "triton.cudagraph_skip_dynamic_graphs": False,
        "triton.cudagraph_dynamic_shape_warn_limit": None,
        # CUDA graphs between the ops a replay cannot run (host calls: host_call.py), at compile and
        # at load alike (torch 2.11's default; a saved graph loaded under other patches than it was
        # compiled with failed to load: run276's warm start traced again)
        "graph_partition": True,
    },
    "freezing": {"freezing": True},
    "low-precision": {},
    "cache-all": {
        "fx_graph_cache": True,
        "autotune_local_cache": True,
        "fx_graph_remote_cache": False,
    },
    "benchmark": {},
    "jit": {
        "max_autotune": False,
        "coordinate_descent_tuning": False,
        "triton.autotune_pointwise": False,
    },
    "disable-runtime-fusion": {
        "pattern_matcher": False,
        "epilogue_fusion": False,
        "aggressive_fusion": False,
    },
}

#: Mode flag -> runtime switches (see :func:`runtime_overrides`).
FLAG_RUNTIME: dict[str, dict[str, bool]] = {
    "low-precision": {
        "matmul_allow_tf32": True,
        "cudnn_allow_tf32": True,
        "matmul_fp16_reduction": True,
        "matmul_bf16_reduction": True,
        "sdp_fp16_bf16_reduction": True,
    },
    "benchmark": {"cudnn_benchmark": True},
}

#: Flags that only mean something with CUDA.
GPU_ONLY = ("max-autotune", "cudagraphs", "low-precision", "benchmark")

#: The seeds' option keys -> (where, key).
SEED_KEYS: dict[str, tuple[str, str]] = {
    "inductor.optimize_linear_epilogue": ("inductor", "epilogue_fusion"),
    "triton.fuse_attention_allow_fp16_reduction": ("runtime", "sdp_fp16_bf16_reduction"),
    "overrides.conv_benchmark": ("runtime", "cudnn_benchmark"),
    "overrides.matmul_allow_tf32": ("runtime", "matmul_allow_tf32"),
    "overrides.matmul_allow_fp16_accumulation": ("runtime", "matmul_fp16_accumulation"),
}

#: Always on: dynamic shape with one graph for every resolution/batch/length (see shapes.py),
#: no persistent remote caches.
BASE_INDUCTOR: dict[str, Any] = {"fx_graph_cache": True, "fx_graph_remote_cache": False}

_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    """One warning per distinct message, not per compile."""
    if msg not in _warned:
        _warned.add(msg)
        log.warning("nexfort: %s", msg)


@dataclass(frozen=True)
class Settings:
    inductor: dict[str, Any] = field(default_factory=dict)
    runtime: dict[str, bool] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    #: fp8 token-wise linears (changes the compiled graph, so part of :meth:`digest`)
    fp8: bool = False
    #: inner reductions of rows up to this many elements are single-pass kernels (0: Inductor's
    #: default); on for GPU compiles: LayerNorms, fp8's per-row quantization (:mod:`.reductions`)
    persistent_rows: int = 0
    #: 32-bit ``ks*`` arguments in Triton kernels that index in 32 bits (:mod:`.indexing`)
    int32_size_args: bool = False
    #: fp8 graphs: GELU/GEGLU/concat producers quantized by nexfort::quant_rows (passes/fuse_quant.py)
    fused_quant: bool = False
    #: queries/keys normalised and rotated by nexfort::rms_norm_rope (passes/fuse_rope.py)
    fused_rope: bool = False
    #: those attentions in fp8 through nexfort::sdpa_fp8 (passes/fp8_attention.py)
    fp8_attention: bool = False
    #: cuDNN attention ahead of flash in callers' SDPA priority lists (passes/sdpa_priority.py)
    sdpa_cudnn_first: bool = False
    #: linear + tanh-GELU as nexfort::linear_gelu, a GEMM with a GELU epilogue (passes/gelu_epilogue.py)
    gelu_epilogue: bool = False
    #: 16-bit linears as nexfort::tuned_linear, the GEMM algorithm measured per shape (passes/tuned_linear.py)
    tuned_gemm: bool = False
    #: the preset's max-autotune left out (``autotune_pays`` false: a UNet compiled whole; or no fp8
    #: linears); the effective inductor settings, and so :meth:`digest`, show it already
    autotune_skipped: bool = False

    def digest(self, config: CompileConfig) -> str:
        """Hash of what actually shapes the compiled artifacts on this machine (cache keys):
        the effective settings, not the flags as written, so e.g. O2 and O3 on a CPU share an
        entry (their GPU-only flags are dropped there)."""
        d = config.to_dict()
        for k in ("flags", "overrides", "mode"):
            d.pop(k, None)
        d.update(inductor=self.inductor, runtime=self.runtime)
        # the config's requests; what counts is the effective value (fp8 here, regional in the
        # entry's structure key: compiler.py), so keys made before these options stay valid
        d.pop("fp8", None)
        d.pop("regional", None)
        d.pop("background", None)  # where it compiles, not what: a background compile fills the same entry
        d.pop("compile_workers", None)  # how many processes compile, not what runs: any count fills one entry
        d.pop("static_first", None)  # the order graphs are made in, not what runs: the dynamic entry is the same
        d.pop("spatial_multiple", None)  # the effective multiple is in the structure key (compiler.py)
        if self.fp8:
            d["fp8"] = True
        if self.persistent_rows:
            d["persistent_rows"] = self.persistent_rows
        d.pop("int32_size_args", None)  # the effective value, only when on (older keys stay valid)
        if self.int32_size_args:
            d["int32_size_args"] = True
        d.pop("fused_quant", None)  # the effective value, only when on (older keys stay valid)
        if self.fused_quant:
            d["fused_quant"] = True
        d.pop("fused_rope", None)  # the effective value, only when on (older keys stay valid)
        if self.fused_rope:
            d["fused_rope"] = True
        d.pop("fp8_attention", None)  # the effective value, only when on (older keys stay valid)
        if self.fp8_attention:
            d["fp8_attention"] = True
        d.pop("sdpa_cudnn_first", None)  # the effective value, only when on
        if self.sdpa_cudnn_first:
            d["sdpa_cudnn_first"] = True
        d.pop("gelu_epilogue", None)  # the effective value, only when on
        if self.gelu_epilogue:
            d["gelu_epilogue"] = True
        d.pop("tuned_gemm", None)  # the effective value, only when on
        if self.tuned_gemm:
            d["tuned_gemm"] = True
        blob = json.dumps(d, sort_keys=True, default=repr).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def cuda_available() -> bool:
    # is_available() does not initialise a CUDA context
    return torch.cuda.is_available()


#: CUDA capabilities without fp8 whose GeForce parts (Turing, Ampere GA10x) run fp16 tensor-core
#: math twice as fast accumulating in fp16 (the professional cards of the same capabilities gain
#: less; none of these was measured here). Not sm80 (A100) nor sm89+/sm90 (fp8 GPUs), where fp32
#: accumulation runs at the full rate: on an H200, fp16 accumulation made SD2.1 768² 3.5 % slower
#: (72.8 vs 75.5 it/s) and lossy (BENCHMARKS.md, sixth session).
FP16_ACCUMULATION_CAPABILITIES = ((7, 5), (8, 6), (8, 7))


def fp16_accumulation_pays(capability: tuple[int, int] | None) -> bool:
    """Whether a GPU of this CUDA capability gains from accumulating fp16 GEMMs in fp16."""
    return capability is not None and tuple(capability) in FP16_ACCUMULATION_CAPABILITIES


def resolve(
    config: CompileConfig,
    *,
    cuda: bool | None = None,
    fp8_capable: bool = False,
    fp16_accumulation: bool = False,
    fp8_pays: bool = True,
    fp8_attention_capable: bool = False,
    autotune_pays: bool = True,
    cudnn_attention_preferred: bool = False,
) -> Settings:
    """Flags + overrides -> scoped settings for this machine.

    ``fp8_capable``: the device has fp8 tensor cores (:func:`nexfort_engine.fp8.fp8_supported`).
    ``fp8_pays``: the model is wide enough for fp8 GEMMs to repay the activations' quantization
    (:func:`nexfort_engine.fp8.pays_off`); auto fp8 needs it, ``"fp8": true`` does not.
    ``fp8_attention_capable``: cuDNN's fp8 attention runs on the device
    (:func:`nexfort_engine.fp8_attention.cudnn_supported`); auto fp8 attention needs it.
    ``autotune_pays``: max-autotune repays its compile on this model; when false (a convolutional
    UNet compiled whole) a preset's ``max-autotune`` (O3) is left out, as it is where no fp8 linears
    run (16-bit GEMMs stay on cuBLAS, which beat Inductor's templates), while a mode string that
    names it keeps it.
    ``cudnn_attention_preferred``: torch's own attention order starts with cuDNN on the device
    (:func:`nexfort_engine.passes.sdpa_priority.device_prefers_cudnn`); auto ``sdpa_cudnn_first``
    follows it.
    ``fp16_accumulation``: the device's fp16 GEMMs run faster accumulating in fp16
    (:func:`fp16_accumulation_pays`); ``low-precision`` then turns that on.
    fp8 linears are on with ``"fp8": true`` on such a GPU or on CPU (correct, not faster: for
    tests), and with ``fp8`` unset (auto) when the mode has ``low-precision`` (O3) on such a GPU
    and ``fp8_pays``.
    """
    cuda = cuda_available() if cuda is None else cuda
    inductor: dict[str, Any] = dict(BASE_INDUCTOR)
    runtime: dict[str, bool] = {}
    dropped = tuple(f for f in config.flags if f in GPU_ONLY and not cuda)
    if dropped:
        _warn_once(f"no CUDA device: ignoring GPU-only mode flag(s) {', '.join(dropped)}")
    # auto (None): on with the low-precision flag (O3) on a GPU with fp8 tensor cores: issue 6's
    # definition of low precision ("fp8 matmuls where the GPU has them"). Measured on an H200
    # (BENCHMARKS.md, fourth session): Flux +32 % over bf16 (regional, 9.58 vs 7.25 it/s), SDXL
    # +1 % (static), at a large error against fp32 on random weights and +1.8 GB (SDXL) / +11 GB
    # (Flux) of fp8 weight copies; O2 never turns it on. Only for models wide enough to repay the
    # activations' quantization (``fp8_pays``, fp8.pays_off): SDXL O2 + fp8 measured 30.96 vs 31.00
    # it/s (ninth session), PixArt 27.76 vs 27.67. ``"fp8": true`` forces it (also on CPU:
    # correct, not faster, for tests), ``false`` keeps O3 in bf16/fp16.
    low_precision = "low-precision" in config.flags and "low-precision" not in dropped
    wanted = config.fp8 is True or (config.fp8 is None and low_precision and fp8_pays)
    fp8 = wanted and (fp8_capable or (config.fp8 is True and not cuda))
    if config.fp8 is True and not fp8:
        _warn_once("this GPU has no fp8 tensor cores (needs sm89+): ignoring \"fp8\": true")
    # O3's max-autotune on a convolutional UNet compiled whole: SDXL ran 6.5 % slower with it (its
    # GEMMs are already at 76 % of the fp16 peak with cuBLAS) and its cold compile did not finish in
    # 380 s twice (run234, and the fortieth session with fp8; SD2.1's static one not in 9 min): the
    # preset leaves it out there (without it SDXL O3 + fp8 compiled cold in 47 s, 32.68 it/s).
    # Nor where no fp8 linears run (16-bit GEMMs): cuBLAS beat every Inductor GEMM template on
    # PixArt-α's and Flux's shapes (run292), and PixArt O3 ran 2.4 % slower than O2 in one call for
    # a 77 s cold compile against 6 s (run294, fifty-second session)
    autotune_skipped = ((not autotune_pays or not fp8) and "max-autotune" in config.flags and cuda
                        and config.mode.strip() in PRESETS)
    for flag in config.flags:
        if flag in dropped or (flag == "max-autotune" and autotune_skipped):
            continue
        inductor.update(FLAG_INDUCTOR[flag])
        runtime.update(FLAG_RUNTIME.get(flag, {}))
    if config.dynamic and inductor.get("coordinate_descent_tuning"):
        # max-autotune's coordinate-descent tuning of pointwise/reduction kernels is not reused
        # by a second process for dynamic-shape kernels: on an H200 a warm start of Flux O3 spent
        # 39.8 of its 56.5 s re-tuning (cold: 86.9 s) for +1-2 % speed (BENCHMARKS.md, fourth
        # session). Static shapes keep it (PixArt O3 static started warm in 11.6 s). An explicit
        # "inductor.coordinate_descent_tuning" option still wins (overrides come next).
        inductor["coordinate_descent_tuning"] = False
    if not inductor.get("max_autotune_pointwise"):
        # Inductor's default benchmarks the candidate block sizes of every pointwise kernel at its
        # first call: 10.0 s of SD2.1's first sampling step and 8.6 s of SDXL's in a cold compile
        # on an H100 (cached afterwards). The heuristic's one config ran as fast: SD2.1 13.04-13.08
        # vs 13.16-13.26 ms per step, SDXL 30.36-30.50 vs 30.25-30.32 it/s (BENCHMARKS.md, run186).
        # Reductions are still tuned; max-autotune tunes pointwise kernels too; the
        # "triton.autotune_pointwise" option wins (overrides come next).
        inductor["triton.autotune_pointwise"] = False
    if low_precision and not fp8 and fp16_accumulation:
        # "... fp16 accumulation otherwise" (issue 6): on GPUs without fp8 whose tensor cores
        # gain from it, cuBLAS fp16 GEMMs accumulate in fp16
        # (torch.backends.cuda.matmul.allow_fp16_accumulation); bf16 GEMMs are unaffected. An
        # explicit "overrides.matmul_allow_fp16_accumulation" still wins (overrides come next).
        runtime["matmul_fp16_accumulation"] = True
    for key, value in config.overrides:
        if key in SEED_KEYS:
            where, target = SEED_KEYS[key]
            (inductor if where == "inductor" else runtime)[target] = value
        elif key.startswith("inductor."):
            inductor[key[len("inductor."):]] = value
        else:  # triton.*
            inductor[key] = value
    if not cuda:
        runtime = {}
    # single-pass kernels for rows up to DEFAULT_LIMIT elements (reductions.py) on the GPU: the fp8
    # path's per-row activation quantization (measured 1.3-1.9x faster kernels, fourth session) and
    # the LayerNorms of every model (SDXL's 640/1280-wide rows ran as looped reductions at about
    # half their memory speed, eighth session); the CPU backend has no such choice
    rows = DEFAULT_LIMIT if cuda else 0
    # fp8 graphs: wide GELU/GEGLU/concat rows quantized in one Triton kernel (rowwise_quant.py):
    # Flux's 12288/15360-wide rows 2-2.5x faster than Inductor's two kernels (H200, tenth session)
    fused_quant = fp8 and (config.fused_quant if config.fused_quant is not None else cuda and _has_triton())
    # Flux-family query/key RMSNorm + rotary embedding in one Triton kernel (rope.py): the same
    # function with eager's roundings, so in every mode that compiles with Inductor on the GPU
    fused_rope = config.fused_rope if config.fused_rope is not None else (
        cuda and config.backend == "inductor" and _has_triton()
    )
    # fp8 attention (fp8_attention.py) takes its queries and keys from the fused rotary op: with the
    # fp8 linears (O3's low precision) where cuDNN's fp8 attention runs; forced, also on CPU (twin)
    fp8_attention = bool(fused_rope) and (
        config.fp8_attention if config.fp8_attention is not None else fp8 and fp8_attention_capable
    )
    # attention inside compiled graphs: where torch itself prefers cuDNN (Hopper), a caller's
    # flash-first priority (ComfyUI 0.29+) does not demote it (passes/sdpa_priority.py)
    sdpa_cudnn_first = (config.sdpa_cudnn_first if config.sdpa_cudnn_first is not None
                        else cuda and cudnn_attention_preferred)
    # DiT MLPs: the tanh-GELU in the GEMM's epilogue (cuBLASLt) instead of a pass over the wide
    # activation: PixArt's fc1 0.140 against 0.174 ms on an H200 (fifty-second session)
    gelu_epilogue = gelu_epilogue_pass.wanted(config.gelu_epilogue, cuda=cuda, inductor=config.backend == "inductor")
    # 16-bit linears with the cuBLASLt algorithm measured per shape (gemm_tuning.py): only when asked
    # for; it did not speed up PixArt-α's step (run305, passes/tuned_linear.py)
    tuned_gemm = tuned_linear_pass.wanted(config.tuned_gemm)
    return Settings(
        inductor=inductor,
        runtime=runtime,
        dropped=dropped,
        fp8=fp8,
        persistent_rows=rows,
        int32_size_args=indexing.wanted(config.int32_size_args, cuda=cuda, dynamic=config.dynamic),
        fused_quant=bool(fused_quant),
        fused_rope=bool(fused_rope),
        fp8_attention=bool(fp8_attention),
        sdpa_cudnn_first=bool(sdpa_cudnn_first),
        gelu_epilogue=bool(gelu_epilogue),
        tuned_gemm=bool(tuned_gemm),
        autotune_skipped=bool(autotune_skipped),
    )


def _has_triton() -> bool:
    from .rowwise_quant import triton_available

    return triton_available()


def _runtime_switches() -> dict[str, tuple[Any, Any]]:
    """name -> (getter, setter) for each runtime switch."""
    b = torch.backends

    def attr(obj: Any, name: str) -> tuple[Any, Any]:
        return (lambda: getattr(obj, name), lambda v: setattr(obj, name, v))

    sw = {
        "matmul_allow_tf32": attr(b.cuda.matmul, "allow_tf32"),
        "cudnn_allow_tf32": attr(b.cudnn, "allow_tf32"),
        "matmul_fp16_reduction": attr(b.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        "matmul_bf16_reduction": attr(b.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
        "cudnn_benchmark": attr(b.cudnn, "benchmark"),
    }
    if hasattr(b.cuda.matmul, "allow_fp16_accumulation"):  # torch >= 2.7
        sw["matmul_fp16_accumulation"] = attr(b.cuda.matmul, "allow_fp16_accumulation")
    if hasattr(b.cuda, "allow_fp16_bf16_reduction_math_sdp"):
        sw["sdp_fp16_bf16_reduction"] = (
            b.cuda.fp16_bf16_reduction_math_sdp_allowed,
            b.cuda.allow_fp16_bf16_reduction_math_sdp,
        )
    return sw


@contextlib.contextmanager
def runtime_overrides(runtime: dict[str, bool]) -> Iterator[None]:
    """Set backend switches for the duration of one compiled call, then restore them."""
    if not runtime:
        yield
        return
    switches = _runtime_switches()
    saved: list[tuple[Any, Any]] = []
    try:
        for name, value in runtime.items():
            if name not in switches:
                continue
            getter, setter = switches[name]
            saved.append((setter, getter()))
            setter(value)
        yield
    finally:
        for setter, old in reversed(saved):
            setter(old)


def flag_table() -> str:
    """Markdown table of flag -> settings (kept in the README)."""
    rows = ["| flag | meaning | Inductor patches | runtime switches |", "| - | - | - | - |"]
    for flag, meaning in FLAGS.items():
        ind = ", ".join(f"`{k}={v}`" for k, v in FLAG_INDUCTOR.get(flag, {}).items()) or "—"
        rt = ", ".join(f"`{k}`" for k in FLAG_RUNTIME.get(flag, {})) or "—"
        gpu = " (GPU only)" if flag in GPU_ONLY else ""
        rows.append(f"| `{flag}`{gpu} | {meaning} | {ind} | {rt} |")
    return "\n".join(rows)
