"""Nexfort Compile ControlNet: CONTROL_NET -> CONTROL_NET with a compiled control model."""

from __future__ import annotations

from comfy_api.latest import io

from .common import DOCS_URL, build_config, mode_inputs, validate_options
from .patcher import compile_controlnet


class NexfortCompileControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="NexfortCompileControlNet",
            display_name="Nexfort Compile ControlNet",
            category="nexfort/compile",
            description="Compile a ControlNet with nexfort, between Load ControlNet and Apply ControlNet. ComfyUI "
            "runs a ControlNet beside the diffusion model at every step, uncompiled; this compiles it at its "
            "first step (dynamic shape, persistent cache). Control-LoRAs and T2I adapters pass through "
            "uncompiled. Falls back to eager with a warning if compiling fails. "
            f"Help: {DOCS_URL}/controlnet-and-patches.md",
            inputs=[io.ControlNet.Input("control_net", tooltip="The ControlNet to compile (from Load ControlNet)."),
                    *mode_inputs(False)],
            outputs=[io.ControlNet.Output(tooltip="A copy of the ControlNet whose model is compiled on first use.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, mode: str = "O2", memory_format: str = "contiguous", options: str = "") -> bool | str:
        return validate_options(options, mode, memory_format)

    @classmethod
    def execute(cls, control_net, mode, memory_format, dynamic, options) -> io.NodeOutput:
        config = build_config(mode, memory_format, dynamic, options)
        return io.NodeOutput(compile_controlnet(control_net, config, node_id=cls.hidden.unique_id))
