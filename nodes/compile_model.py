"""Nexfort Compile Model: MODEL -> MODEL, compiled lazily at the first sampling step."""

from __future__ import annotations

from comfy_api.latest import io

from .common import DOCS_URL, build_config, mode_inputs, validate_options
from .patcher import compile_model_patcher


class NexfortCompileModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="NexfortCompileModel",
            display_name="Nexfort Compile Model",
            category="nexfort/compile",
            description="Compile the diffusion model (UNet or DiT) with nexfort (torch.compile + Inductor) at the "
            "first sampling step. Dynamic shape, persistent cache, LoRA-safe; falls back to eager with a "
            f"warning if compiling fails. Help: {DOCS_URL}/modes.md",
            inputs=[io.Model.Input("model", tooltip="The model to compile (from a loader, LoRA, etc.)."), *mode_inputs(True)],
            outputs=[io.Model.Output(tooltip="The same model, compiled at its first sampling step.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, mode: str = "O2", memory_format: str = "contiguous", options: str = "") -> bool | str:
        return validate_options(options, mode, memory_format)

    @classmethod
    def execute(cls, model, mode, memory_format, dynamic, fuse_qkv, options) -> io.NodeOutput:
        config = build_config(mode, memory_format, dynamic, options, fuse_qkv)
        return io.NodeOutput(compile_model_patcher(model, config, node_id=cls.hidden.unique_id))
