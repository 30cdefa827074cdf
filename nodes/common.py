"""Inputs shared by the compile nodes and their queue-time validation."""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from nexfort_engine.options import MEMORY_FORMATS, CompileConfig, OptionsError, load_json, parse_options

#: The mode dropdown: the seeds' presets and flag combinations.
MODES = [
    "O2",
    "O1",
    "O3",
    "max-autotune",
    "max-optimize:max-autotune",
    "max-optimize:max-autotune:low-precision",
    "max-optimize:max-autotune:freezing:benchmark:cudagraphs",
    "cudagraphs:benchmark:max-autotune:low-precision:cache-all",
    "jit:disable-runtime-fusion",
]


def mode_inputs(include_fuse_qkv: bool) -> list[Any]:
    inputs = [
        io.Combo.Input(
            "mode",
            options=MODES,
            default="O2",
            tooltip="Compile mode. O1: fast compile. O2 (recommended): accurate, dynamic resolution, LoRA-safe. "
            "O3: lowest precision, fastest: fp8 linears on Ada/Hopper for wide DiTs such as Flux (lossy), "
            "autotuning of the fp8 graphs (left out where no fp8 linears run, and on a UNet compiled whole such as "
            "SDXL: slower there, with a much longer compile), CUDA graphs, "
            "reduced-precision math. Flags can be combined with ':'; "
            "for any other combination put {\"mode\": \"...\"} in options.",
        ),
        io.Combo.Input(
            "memory_format",
            options=list(MEMORY_FORMATS),
            default="contiguous",
            tooltip="Layout of the inputs passed to the compiled model. On GPUs nexfort already runs "
            "convolution-heavy models (UNets, VAEs) channels-last inside the compiled graph, weights included, "
            "so contiguous is as fast (SDXL's VAE decode measured the same either way).",
        ),
        io.Boolean.Input(
            "dynamic",
            default=True,
            tooltip="Dynamic shape: one compiled graph for every resolution, batch size, prompt length and "
            "step count (no recompiles). Turn off only for a single fixed shape.",
        ),
    ]
    if include_fuse_qkv:
        inputs.append(
            io.Boolean.Input(
                "fuse_qkv",
                default=False,
                tooltip="Fuse the query/key/value projections of self-attention into one matmul (graph pass).",
            )
        )
    inputs.append(
        io.String.Input(
            "options",
            default="",
            multiline=True,
            tooltip='Advanced JSON, the nexfort options format, e.g. {"mode": "max-autotune:cudagraphs", '
            '"options": {"inductor.coordinate_descent_tuning": true}}. Keys here override the widgets. '
            '{"regional": true} compiles a UNet\'s transformer blocks once each (SDXL: ~17 s instead of '
            'minutes, a few % slower); {"fp8": true} runs linears in fp8 on Ada/Hopper (O3 does '
            'that by default there for models at least 2048 wide, e.g. Flux; {"fp8": false} keeps O3 in '
            'bf16/fp16); {"background": true} compiles a cold model in a separate process while sampling '
            'runs uncompiled, then switches to the compiled model (no wait for the first image; SDXL '
            'compiled after ~1 min on an H100; needs GPU memory for a second copy of the weights '
            'while it compiles); {"compile_workers": 1} '
            "compiles a UNet's graph in this process only (by default on a GPU, up to 8 processes "
            "compile parts of it at once: SDXL ~51 s cold on an H100 host, where ComfyUI's own compile "
            "took 81 s; the workers get the graph's parts, not the weights). "
            'By default on a GPU, a UNet\'s first compile is static-shape for the first size (SDXL '
            "~31-40 s cold on an H100, ComfyUI's own 79-80 s) while a background process compiles the "
            "any-size graph, used from the first other size on (other sizes run uncompiled until it is "
            'ready; a VAE\'s decode and encode do the same: SDXL\'s VAE 25-29 s instead of 42-45 s '
            'before its first 1024² image); {"static_first": false} compiles the any-size graph at once. '
            '{"fp8_weights": true} stores the block linears\' weights in fp8 while this model runs (half '
            'the weight memory of a bf16 model, lossy; with O3 the fp8 matmuls read them directly). '
            "On Hopper, compiled graphs run cuDNN attention ahead of flash, which newer ComfyUI puts "
            'first (cuDNN is 1.6-1.9x faster there); {"sdpa_cudnn_first": false} keeps ComfyUI\'s order. '
            "Validated when the prompt is queued.",
        )
    )
    return inputs


def build_config(
    mode: str, memory_format: str, dynamic: bool, options: str, fuse_qkv: bool = False
) -> CompileConfig:
    """Widgets + advanced JSON -> CompileConfig (JSON keys win). Raises OptionsError."""
    merged: dict[str, Any] = {
        "mode": mode,
        "memory_format": memory_format,
        "dynamic": dynamic,
        "fuse_qkv_projections": fuse_qkv,
    }
    merged.update(load_json(options))
    return parse_options(merged)


def validate_options(options: str | None, mode: str = "O2", memory_format: str = "contiguous") -> bool | str:
    """Queue-time check of the dropdowns and the advanced JSON: True, or the error text ComfyUI shows.

    ComfyUI 0.3.75 checks V3 ``Combo`` values only at execution (its queue-time check handles V1
    list-typed combos only), so ``mode`` and ``memory_format`` are checked here too (newer ComfyUI
    checks them at queue time, except inputs that ``validate_inputs`` takes, as these are).
    """
    if mode not in MODES:
        return f"nexfort: mode {mode!r} is not in the list; valid modes: {', '.join(repr(m) for m in MODES)}"
    if memory_format not in MEMORY_FORMATS:
        return (f"nexfort: memory_format {memory_format!r} is not in the list; valid: "
                f"{', '.join(repr(m) for m in MEMORY_FORMATS)}")
    try:
        build_config(mode, memory_format, True, options or "")
    except OptionsError as e:
        return f"nexfort: {e}"
    return True
