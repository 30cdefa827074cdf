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


#: where the longer help lives (linked from the node descriptions; tooltips stay one line)
DOCS_URL = "https://github.com/nexfort/comfyui-nexfort/blob/main/docs"


def mode_inputs(include_fuse_qkv: bool) -> list[Any]:
    inputs = [
        io.Combo.Input(
            "mode",
            options=MODES,
            default="O2",
            tooltip="O2: accurate, any resolution, LoRA-safe (default). O1: fastest compile. "
            "O3: fp8 on Ada/Hopper for wide DiTs (Flux), lossy. See docs/modes.md.",
        ),
        io.Combo.Input(
            "memory_format",
            options=list(MEMORY_FORMATS),
            default="contiguous",
            tooltip="Layout of the model's inputs; conv nets already run channels-last inside the graph.",
        ),
        io.Boolean.Input(
            "dynamic",
            default=True,
            tooltip="One graph for every resolution, batch, prompt length and step count. Off: one compile per size.",
        ),
    ]
    if include_fuse_qkv:
        inputs.append(
            io.Boolean.Input(
                "fuse_qkv",
                default=False,
                tooltip="Fuse self-attention's query/key/value projections into one matmul.",
            )
        )
    inputs.append(
        io.String.Input(
            "options",
            default="",
            multiline=True,
            tooltip='Advanced JSON that overrides the widgets, e.g. {"background": true}. Keys: docs/modes.md.',
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
