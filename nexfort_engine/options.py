"""Compile options: mode strings, presets and JSON -> one frozen :class:`CompileConfig`.

This module only parses and validates; it does not touch torch's configuration. What each flag
means in Dynamo/Inductor/cuDNN terms lives in :mod:`nexfort_engine.settings`.

Accepted input (the OneDiff nexfort seeds' shape)::

    {"mode": "max-optimize:max-autotune:low-precision", "memory_format": "channels_last",
     "dynamic": true, "fullgraph": false, "fuse_qkv_projections": true,
     "options": {"inductor.optimize_linear_epilogue": false, "overrides.matmul_allow_tf32": true}}

as a dict or a JSON string. Every unknown flag, key or bad value raises :class:`OptionsError`
(a ``ValueError``) whose message names the valid choices.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

__all__ = [
    "BACKENDS",
    "FLAGS",
    "MEMORY_FORMATS",
    "PRESETS",
    "CompileConfig",
    "OptionsError",
    "parse_options",
]


class OptionsError(ValueError):
    """Invalid compile options; the message names the valid values."""


#: Every mode flag, with the one-line meaning shown in errors and docs.
FLAGS: dict[str, str] = {
    "max-autotune": "autotune GEMM and pointwise kernels (slow first compile, cached afterwards); convolutions stay with cuDNN",
    "max-optimize": "the fusions and padding that pay at run time: epilogue fusion, shape padding, pattern rewrites",
    "cudagraphs": "CUDA graphs (per-shape graph trees) to remove CPU launch overhead",
    "freezing": "inline weights as constants (fastest; weight patches such as LoRA then need a recompile)",
    "low-precision": (
        "reduced-precision math: fp8 linears where the GPU has fp8 tensor cores and the model is at "
        "least 2048 wide (the \"fp8\" option overrides), else fp16 GEMMs accumulating in fp16 where that is faster (Turing/"
        "Ampere GeForce-class GPUs), fp16/bf16 reduced-precision matmul/SDPA reductions, TF32"
    ),
    "cache-all": "persist every compile artifact (FX graph, AOTAutograd, autotune, portable cache)",
    "benchmark": "cuDNN benchmark mode for convolutions",
    "jit": "fast compile: no autotuning, cheaper Inductor settings",
    "disable-runtime-fusion": "turn off Inductor's pattern-matcher and epilogue fusions (fastest compile)",
}

#: Presets (the seeds' suggested combinations), expanded into flags.
PRESETS: dict[str, tuple[str, ...]] = {
    # fast compile: default Inductor, no autotuning, everything cached
    "O1": ("jit", "cache-all"),
    # recommended: accurate (no reduced precision), dynamic resolution, LoRA-safe (no freezing);
    # CUDA graphs are bit-for-bit the same math and removed most launch overhead in our runs.
    # cuDNN "benchmark" searches algorithms anew in every process (SDXL warm start +0.9 s, a VAE
    # decode's first call +0.8-4.6 s) and pays on SD2.1 768² under dynamic shape (79.3 vs 74.6 it/s
    # in one call; SDXL and its VAE the same either way; BENCHMARKS.md, runs 135-136 and 143)
    "O2": ("max-optimize", "benchmark", "cudagraphs", "cache-all"),
    # fastest: + autotuning and reduced-precision math (slow first compile, then cached); its
    # autotuning is left out on a convolutional UNet compiled whole (settings.resolve: SDXL was slower)
    "O3": ("max-optimize", "max-autotune", "benchmark", "cudagraphs", "low-precision", "cache-all"),
}

MEMORY_FORMATS = ("contiguous", "channels_last")
BACKENDS = ("inductor", "aot_eager", "eager")

#: Top-level keys accepted in the options dict.
TOP_LEVEL_KEYS = (
    "mode",
    "memory_format",
    "dynamic",
    "fullgraph",
    "fuse_qkv_projections",
    "options",
    "backend",
    "size_oblivious",
    "fp8",
    "regional",
    "spatial_multiple",
    "group_norm_rewrite",
    "int32_size_args",
    "fused_quant",
    "fused_rope",
    "fp8_attention",
    "background",
    "compile_workers",
    "static_first",
    "fp8_weights",
    "sdpa_cudnn_first",
    "gelu_epilogue",
    "tuned_gemm",
)

#: Seed keys with a fixed meaning (see settings.SEED_KEYS for what they map to).
SEED_OPTION_KEYS = (
    "inductor.optimize_linear_epilogue",
    "triton.fuse_attention_allow_fp16_reduction",
    "overrides.conv_benchmark",
    "overrides.matmul_allow_tf32",
    "overrides.matmul_allow_fp16_accumulation",
)


@dataclass(frozen=True)
class CompileConfig:
    """Everything that decides how a module is compiled. Hashable and canonical."""

    flags: tuple[str, ...] = PRESETS["O2"]
    memory_format: str = "contiguous"
    dynamic: bool = True
    fullgraph: bool = False
    fuse_qkv_projections: bool = False
    backend: str = "inductor"
    #: reason about sizes 0/1 obliviously so batch 1 and batch 2 share one graph (shapes.py).
    #: Off by default: Inductor produced NaN for a DiT at batch 1 from a batch-2 graph with it on.
    size_oblivious: bool = False
    #: fp8 token-wise linears (fp8.py): True = on where the GPU has fp8 (and on CPU: correct, not
    #: faster); None (auto) = on under low-precision (O3) on such a GPU for models >= 2048 wide
    #: (fp8.pays_off: Flux, not SDXL/PixArt, where it measured no faster); False = off
    fp8: bool | None = None
    #: regional compilation (regions.py): compile each stack of identical blocks once; None = auto
    #: (on when top-level stacks hold most of the weights: DiTs such as PixArt, Flux, Wan), True =
    #: also nested stacks (a UNet's transformer blocks: SDXL compiles in 18 s instead of 294 s)
    regional: bool | None = None
    #: dynamic shape: trace the image input's spatial sizes as multiples of this (shapes.py:
    #: fold_spatial); None = auto (8 for conv nets, 1 otherwise), 1 = as they come
    spatial_multiple: int | None = None
    #: GroupNorm reduced in channels-last memory order (passes/group_norm.py); None = auto (on for a
    #: conv net's forward - a UNet, not a VAE's decode - where Inductor keeps it channels-last: GPU,
    #: shapes.layout_patches; dynamic and static shape), True/False = always/never
    group_norm_rewrite: bool | None = None
    #: 32-bit symbolic size arguments in Inductor's Triton kernels that index in 32 bits
    #: (indexing.py); None = auto (on on the GPU under dynamic shape), True/False = always/never
    int32_size_args: bool | None = None
    #: fp8 graphs: quantize the activations of GELU / GEGLU / concat producers with rows of at least
    #: 2560 elements in one Triton kernel (passes/fuse_quant.py, rowwise_quant.py); None = auto (on
    #: on the GPU when Triton is installed), True/False = always/never (True on CPU: the torch twin)
    fused_quant: bool | None = None
    #: DiT attention: per-head RMSNorm of queries/keys and their rotary embedding (Flux-family
    #: blocks) in one Triton kernel (passes/fuse_rope.py, rope.py); None = auto (on on the GPU with
    #: the Inductor backend when Triton is installed), True/False = always/never (True on CPU: the
    #: torch twin)
    fused_rope: bool | None = None
    #: DiT attention in fp8 (fp8_attention.py, passes/fp8_attention.py): queries and keys from the
    #: fused norm + rotary op (fused_rope) in e4m3, cuDNN's fp8 attention; None = auto (on with
    #: fp8 linears - O3 - where the fused rotary op runs and cuDNN's fp8 attention does: Hopper with
    #: nvidia-cudnn-frontend installed), True/False = always (True on CPU: the torch twin) / never
    fp8_attention: bool | None = None
    #: a cold compile runs in a child process while calls run eager, the compiled graphs are
    #: loaded from the cache once it is done (background.py); a warm cache loads at the first call
    background: bool = False
    #: processes a whole-graph cold compile is spread over (split.py): the traced graph is cut into
    #: this many parts, compiled at once by child processes and the caller; None = auto, 1 = one
    #: graph compiled in the caller
    compile_workers: int | None = None
    #: dynamic shape, cold entry: the first call compiles a static-shape graph for its own shape
    #: (about half the work of a dynamic one), and a child process compiles the dynamic graph into
    #: the cache meanwhile; calls of that shape run the static graph, other shapes eager until the
    #: dynamic graph is loaded (compiler.py, background.py). None = auto (on for a whole model's
    #: saved forward, decode or encode graph - a UNet, a VAE - on a CUDA device with a cache
    #: directory), True/False = where it can / never
    static_first: bool | None = None
    #: linear weights inside the model's block stacks stored in e4m3 with one scale each while it
    #: is compiled (fp8_weights.py; the host swaps the layers in and keeps the originals off the
    #: device): half the weights' memory of bf16, lossy (one rounding per weight); off by default
    fp8_weights: bool = False
    #: attention inside compiled graphs: cuDNN ahead of flash in a caller's backend priority list
    #: (ComfyUI 0.29+ puts flash first; passes/sdpa_priority.py); None = auto (on where torch's own
    #: order starts with cuDNN: Hopper / datacenter Blackwell with cuDNN > 9.15), True/False =
    #: always (also on CPU: the graph changes, the CPU runs neither kernel) / never
    sdpa_cudnn_first: bool | None = None
    #: a linear followed by tanh-GELU as one cuBLASLt GEMM with the GELU in its epilogue
    #: (passes/gelu_epilogue.py: DiT MLPs); None = auto (on on the GPU with the Inductor backend),
    #: True/False = always (on CPU: the torch twin) / never
    gelu_epilogue: bool | None = None
    #: 16-bit linears with the cuBLASLt algorithm measured fastest for their shape, searched once
    #: and kept in the cache directory (gemm_tuning.py, passes/tuned_linear.py); None = auto (on on
    #: the GPU with the Inductor backend, without fp8 linears or max-autotune), True/False = always
    #: (on CPU: the torch twin) / never
    tuned_gemm: bool | None = None
    #: extra ``inductor.*`` / ``triton.*`` / ``overrides.*`` settings, sorted (key, value) pairs
    overrides: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    #: the mode string as the user wrote it (for display only; not part of the identity)
    mode: str = field(default="O2", compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["overrides"] = dict(self.overrides)
        d["flags"] = list(self.flags)
        return d

    def digest(self) -> str:
        """Stable short hash of the identity fields (used in cache keys). The node glue looks its
        compiled model up by it at every step: computed once (the config is frozen)."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            cached = self.__dict__["_digest"] = self._digest()
        return cached

    def _digest(self) -> str:
        d = self.to_dict()
        d.pop("mode", None)
        if not d["fp8_weights"]:  # added later: configs without it keep their digest (and caches)
            d.pop("fp8_weights")
        if d["sdpa_cudnn_first"] is None:  # added later; the effective value is in Settings.digest
            d.pop("sdpa_cudnn_first")
        if d["gelu_epilogue"] is None:  # added later; the effective value is in Settings.digest
            d.pop("gelu_epilogue")
        if d["tuned_gemm"] is None:  # added later; the effective value is in Settings.digest
            d.pop("tuned_gemm")
        blob = json.dumps(d, sort_keys=True, default=repr).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        return ":".join(self.flags) or "default"


#: what turns an on-by-default ``NEXFORT_*`` environment switch off
SWITCH_OFF = ("0", "false", "no", "off")


def env_switch(name: str) -> bool:
    """Whether the environment switch ``name`` (on unless set to one of :data:`SWITCH_OFF`) is on."""
    return os.environ.get(name, "1").strip().lower() not in SWITCH_OFF


def _choices(values: Any) -> str:
    return ", ".join(repr(v) for v in values)


def parse_mode(mode: str) -> tuple[str, ...]:
    """``"O3"`` or ``"max-autotune:cudagraphs"`` -> canonical, de-duplicated flag tuple."""
    if not isinstance(mode, str):
        raise OptionsError(f"mode must be a string like 'O2' or 'max-autotune:cudagraphs', got {mode!r}")
    flags: list[str] = []
    for part in (p.strip() for p in mode.split(":")):
        if not part:
            continue
        if part in PRESETS:
            flags.extend(PRESETS[part])
        elif part in FLAGS:
            flags.append(part)
        else:
            raise OptionsError(
                f"unknown mode flag {part!r}; valid presets: {_choices(PRESETS)}; "
                f"valid flags: {_choices(FLAGS)}"
            )
    order = list(FLAGS)
    return tuple(sorted(set(flags), key=order.index))


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise OptionsError(f"{key!r} must be true or false, got {value!r}")


def _as_optional_bool(key: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise OptionsError(f"{key!r} must be true, false or null (auto), got {value!r}")


#: valid ``spatial_multiple`` values (shapes.fold_spatial; 1: trace the image's sizes as they come)
SPATIAL_MULTIPLES = (1, 2, 4, 8, 16)


def _as_spatial_multiple(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in SPATIAL_MULTIPLES):
        return value
    raise OptionsError(
        f"'spatial_multiple' must be null (auto) or one of {_choices(SPATIAL_MULTIPLES)}, got {value!r}"
    )


#: the most processes a compile is spread over (``compile_workers``)
MAX_COMPILE_WORKERS = 32


def _as_workers(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_COMPILE_WORKERS):
        return value
    raise OptionsError(
        f"'compile_workers' must be null (auto) or a whole number from 1 to {MAX_COMPILE_WORKERS}, got {value!r}"
    )


def _validate_override(key: str, value: Any) -> None:
    if key in SEED_OPTION_KEYS:
        if not isinstance(value, bool):
            raise OptionsError(f"option {key!r} must be true or false, got {value!r}")
        return
    prefix, _, rest = key.partition(".")
    if prefix not in ("inductor", "triton") or not rest:
        raise OptionsError(
            f"unknown option key {key!r}; valid keys: {_choices(SEED_OPTION_KEYS)}, "
            "or any Inductor config key as 'inductor.<key>' / 'triton.<key>'"
        )
    from torch._inductor import config as inductor_config  # local: keep `import` cheap

    known = inductor_config.get_config_copy()
    ikey = rest if prefix == "inductor" else f"triton.{rest}"
    if ikey not in known:
        close = sorted(k for k in known if k.split(".")[-1].startswith(ikey.split(".")[-1][:4]))[:8]
        hint = f"; did you mean one of {_choices(close)}" if close else ""
        raise OptionsError(f"option {key!r}: {ikey!r} is not an Inductor config key{hint}")
    default = known[ikey]
    if default is not None and not callable(default) and value is not None:
        if isinstance(default, bool) and not isinstance(value, bool):
            raise OptionsError(f"option {key!r} must be true or false, got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise OptionsError(f"option {key!r} must be a number, got {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise OptionsError(f"option {key!r} must be a string, got {value!r}")


def load_json(text: str) -> dict[str, Any]:
    """The options JSON string -> dict ("" -> {}); OptionsError with line/column otherwise."""
    text = (text or "").strip()
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionsError(
            f"options is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            'expected e.g. {"mode": "O2", "memory_format": "channels_last"}'
        ) from e
    if not isinstance(obj, dict):
        raise OptionsError(f"options must be a JSON object, got {type(obj).__name__}")
    return obj


def parse_options(options: CompileConfig | Mapping[str, Any] | str | None = None) -> CompileConfig:
    """Parse the seeds' options (dict or JSON string) into a validated :class:`CompileConfig`."""
    if isinstance(options, CompileConfig):
        return options
    if options is None:
        options = {}
    if isinstance(options, str):
        options = load_json(options)
    if not isinstance(options, Mapping):
        raise OptionsError(f"options must be a JSON object / dict, got {type(options).__name__}")

    unknown = [k for k in options if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise OptionsError(f"unknown option key(s) {_choices(unknown)}; valid keys: {_choices(TOP_LEVEL_KEYS)}")

    mode = options.get("mode", "O2")
    flags = parse_mode(mode)
    memory_format = options.get("memory_format", "contiguous")
    if memory_format not in MEMORY_FORMATS:
        raise OptionsError(f"memory_format {memory_format!r} is not valid; choose one of {_choices(MEMORY_FORMATS)}")
    backend = options.get("backend", "inductor")
    if backend not in BACKENDS:
        raise OptionsError(f"backend {backend!r} is not valid; choose one of {_choices(BACKENDS)}")
    extra = options.get("options", {}) or {}
    if not isinstance(extra, Mapping):
        raise OptionsError(f"'options' must be an object of setting -> value, got {type(extra).__name__}")
    for key, value in extra.items():
        _validate_override(str(key), value)

    return CompileConfig(
        flags=flags,
        memory_format=memory_format,
        dynamic=_as_bool("dynamic", options.get("dynamic", True)),
        fullgraph=_as_bool("fullgraph", options.get("fullgraph", False)),
        fuse_qkv_projections=_as_bool("fuse_qkv_projections", options.get("fuse_qkv_projections", False)),
        backend=backend,
        size_oblivious=_as_bool("size_oblivious", options.get("size_oblivious", False)),
        fp8=_as_optional_bool("fp8", options.get("fp8")),
        regional=_as_optional_bool("regional", options.get("regional")),
        spatial_multiple=_as_spatial_multiple(options.get("spatial_multiple")),
        group_norm_rewrite=_as_optional_bool("group_norm_rewrite", options.get("group_norm_rewrite")),
        int32_size_args=_as_optional_bool("int32_size_args", options.get("int32_size_args")),
        fused_quant=_as_optional_bool("fused_quant", options.get("fused_quant")),
        fused_rope=_as_optional_bool("fused_rope", options.get("fused_rope")),
        fp8_attention=_as_optional_bool("fp8_attention", options.get("fp8_attention")),
        background=_as_bool("background", options.get("background", False)),
        compile_workers=_as_workers(options.get("compile_workers")),
        static_first=_as_optional_bool("static_first", options.get("static_first")),
        fp8_weights=_as_bool("fp8_weights", options.get("fp8_weights", False)),
        sdpa_cudnn_first=_as_optional_bool("sdpa_cudnn_first", options.get("sdpa_cudnn_first")),
        gelu_epilogue=_as_optional_bool("gelu_epilogue", options.get("gelu_epilogue")),
        tuned_gemm=_as_optional_bool("tuned_gemm", options.get("tuned_gemm")),
        overrides=tuple(sorted((str(k), v) for k, v in extra.items())),
        mode=str(mode),
    )
