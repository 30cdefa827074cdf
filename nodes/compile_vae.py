"""Nexfort Compile VAE: VAE -> VAE with compiled decode/encode (plain and tiled paths)."""

from __future__ import annotations

from comfy_api.latest import io

from .common import DOCS_URL, build_config, mode_inputs, validate_options
from .patcher import compile_vae


class NexfortCompileVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="NexfortCompileVAE",
            display_name="Nexfort Compile VAE",
            category="nexfort/compile",
            description="Compile the VAE's decode and encode with nexfort (tiled decode/encode included, one graph "
            "for every tile and image size). Falls back to eager with a warning if compiling fails. "
            f"Help: {DOCS_URL}/modes.md",
            inputs=[io.Vae.Input("vae", tooltip="The VAE to compile."), *mode_inputs(False)],
            outputs=[io.Vae.Output(tooltip="A copy of the VAE whose decode/encode are compiled on first use.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, mode: str = "O2", memory_format: str = "contiguous", options: str = "") -> bool | str:
        return validate_options(options, mode, memory_format)

    @classmethod
    def execute(cls, vae, mode, memory_format, dynamic, options) -> io.NodeOutput:
        config = build_config(mode, memory_format, dynamic, options)
        return io.NodeOutput(compile_vae(vae, config, node_id=cls.hidden.unique_id))
