"""A ControlNet on a compiled UNet, through the pack's glue and ComfyUI's real sampler.

ComfyUI runs the ControlNet itself (uncompiled, its own ModelPatcher) and hands its residuals to
the UNet as the ``control`` keyword, a dict of lists the UNet pops from (``apply_control``). So
the compiled graph takes them as inputs: the image must equal eager's, the control must reach it
(the image differs from the uncontrolled one), and strength, step count and resolution changes
must not compile again. A ControlNet that stops before the last step (``end_percent`` < 1) passes
no ``control`` from then on: a second input structure, so a second graph, compiled once and
reported as a recompile whose reason names ``control``.

The ControlNet is ComfyUI's own class (``comfy.cldm.cldm.ControlNet``) sized for the tiny SD1.5
UNet, with random weights; backend ``aot_eager`` (the logic under test is the glue and Dynamo's
handling of the inputs, not Inductor's code; the shipped workflow runs it through Inductor on a
real server, tests/test_host_integration.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import tiny_models as tm
import torch

import nexfort_engine

OPTIONS = {"mode": "O2", "backend": "aot_eager"}
TOL = 1e-4


def _tiny_controlnet(seed: int = 5) -> Any:
    """A ``comfy.controlnet.ControlNet`` whose model matches ``tm.tiny_sd15``'s UNet."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops

    config = {
        "model_channels": 32, "in_channels": 4, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
        "transformer_depth": [1, 1], "context_dim": 64, "num_heads": 2, "num_head_channels": -1,
        "use_linear_in_transformer": False, "adm_in_channels": None, "use_spatial_transformer": True,
        "legacy": False, "transformer_depth_middle": 1, "use_temporal_resblock": False,
        "use_temporal_attention": False, "dims": 2, "num_classes": None, "image_size": 32,
        "use_checkpoint": False, "hint_channels": 3, "operations": comfy.ops.disable_weight_init,
        "dtype": torch.float32, "device": torch.device("cpu"),
    }
    model = tm.init_weights(comfy.cldm.cldm.ControlNet(**config), seed).eval()
    return comfy.controlnet.ControlNet(model, load_device=torch.device("cpu"))


def _sample(mp: Any, control: Any | None, h: int, w: int, steps: int, strength: float = 0.9,
            end: float = 1.0) -> torch.Tensor:
    """``tm.sample``'s conditioning with the ControlNet applied to both, as ControlNetApplyAdvanced
    does (a copy with the hint, strength and percent range; the control image at pixel size)."""
    import comfy.sample

    gen = torch.Generator().manual_seed(0)
    latent = torch.zeros(1, 4, h // 8, w // 8)
    noise = torch.randn(latent.shape, generator=gen)
    pos, neg = tm._conds(tm.SPECS["sd15"], 77, 1)
    if control is not None:
        hint = torch.rand(1, 3, h, w, generator=torch.Generator().manual_seed(3))
        applied = control.copy().set_cond_hint(hint, strength, (0.0, end))
        for cond in (pos, neg):
            cond[0][1]["control"] = applied
            cond[0][1]["control_apply_to_uncond"] = False
    return comfy.sample.sample(mp, noise, steps, 5.0, "euler", "normal", pos, neg, latent, seed=0,
                               disable_pbar=True)


def _record(stats: dict, node_id: str) -> dict:
    recs = [r for r in stats["models"].values() if node_id in r["node_ids"]]
    assert len(recs) == 1, sorted(stats["models"])
    return recs[0]


@pytest.fixture(scope="module")
def controlnet(comfy_inproc):
    return _tiny_controlnet()


def test_a_controlnet_reaches_the_compiled_unet_and_changes_compile_nothing(
        patcher, comfy_inproc, fresh_stats, controlnet):
    mp = tm.tiny_sd15(seed=11)
    compiled = patcher.compile_model_patcher(mp, nexfort_engine.parse_options(OPTIONS), node_id="cn-on")
    runs = [((64, 64), 3, 0.9), ((64, 64), 4, 0.5), ((64, 96), 3, 0.9)]  # step count, strength, size
    for (h, w), steps, strength in runs:
        ref = _sample(mp, controlnet, h, w, steps, strength)
        out = _sample(compiled, controlnet, h, w, steps, strength)
        assert tm.rel_err(out, ref) <= TOL, ((h, w), steps, strength, tm.rel_err(out, ref))
        uncontrolled = _sample(mp, None, h, w, steps)
        assert tm.rel_err(out, uncontrolled) > 1e-2, "the control did not reach the compiled UNet"
    rec = _record(fresh_stats(), "cn-on")
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]


def test_a_controlnet_that_stops_early_compiles_a_second_graph_once(patcher, comfy_inproc, fresh_stats, controlnet):
    mp = tm.tiny_sd15(seed=11)
    compiled = patcher.compile_model_patcher(mp, nexfort_engine.parse_options(OPTIONS), node_id="cn-end")
    for (h, w), steps in [((64, 64), 4), ((64, 96), 6), ((96, 64), 4)]:
        ref = _sample(mp, controlnet, h, w, steps, end=0.5)
        out = _sample(compiled, controlnet, h, w, steps, end=0.5)
        assert tm.rel_err(out, ref) <= TOL, ((h, w), steps, tm.rel_err(out, ref))
        assert tm.rel_err(out, _sample(mp, controlnet, h, w, steps)) > 1e-3, "the control did not stop at 50 %"
    rec = _record(fresh_stats(), "cn-end")
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    # one graph with the control, one without; sizes and step counts reuse them
    assert rec["compiles"] == 2 and rec["recompiles"] == 1, rec["recompile_reasons"]
    assert "control" in rec["recompile_reasons"][0], rec["recompile_reasons"]


def _record_of_kind(stats: dict, node_id: str, kind: str) -> dict:
    recs = [r for label, r in stats["models"].items() if node_id in r["node_ids"] and label.startswith(kind)]
    assert len(recs) == 1, sorted(stats["models"])
    return recs[0]


def test_a_compiled_controlnet_equals_eager_and_compiles_once(patcher, comfy_inproc, fresh_stats, controlnet):
    """*Nexfort Compile ControlNet*'s glue: ComfyUI's own copy of the ControlNet whose model runs
    compiled (the input ControlNet untouched), beside a compiled UNet: the image equals eager's, and
    strength, step count and size changes compile neither again."""
    mp = tm.tiny_sd15(seed=11)
    config = nexfort_engine.parse_options(OPTIONS)
    compiled_cn = patcher.compile_controlnet(controlnet, config, node_id="ccn")
    assert compiled_cn is not controlnet and controlnet.control_model.__class__.__name__ == "ControlNet"
    assert compiled_cn.control_model.dtype == controlnet.control_model.dtype  # ComfyUI reads it
    # under CUDA graphs (O2 on a GPU) its outputs are copied out of the graph's pool: ComfyUI keeps
    # them past the next replay
    on_gpu = patcher.compile_controlnet(controlnet, nexfort_engine.parse_options({"mode": "O2"}))
    assert on_gpu.control_model._config.flags == nexfort_engine.parse_options({"mode": "O2"}).flags
    outs = {"middle": [torch.ones(2)], "output": [torch.zeros(3), None]}
    copied = patcher._copied_out(outs)
    assert list(copied) == ["middle", "output"] and len(copied["output"]) == 2 and copied["output"][1] is None
    assert torch.equal(copied["middle"][0], outs["middle"][0])
    assert copied["middle"][0].data_ptr() != outs["middle"][0].data_ptr()
    assert copied["output"][0].data_ptr() != outs["output"][0].data_ptr()
    compiled = patcher.compile_model_patcher(mp, config, node_id="ccn-unet")
    # sizes whose convolution inputs stay on one side of oneDNN's line: on the CPU a convolution's
    # graph guards on where oneDNN takes over (input numel > 20480; the hint encoder's 256-channel
    # conv at 64x96 is above it, at 64x64 and 64x80 not; its 96-channel one at 48x64 below, at 64x64
    # above); GPU graphs have no such guard (README, *Dynamic shape without recompiles*)
    for (h, w), steps, strength in [((64, 64), 3, 0.9), ((64, 80), 4, 0.5), ((80, 64), 3, 0.9)]:
        ref = _sample(mp, controlnet, h, w, steps, strength)
        out = _sample(compiled, compiled_cn, h, w, steps, strength)
        assert tm.rel_err(out, ref) <= TOL, ((h, w), steps, strength, tm.rel_err(out, ref))
    stats = fresh_stats()
    for node_id, kind in (("ccn", "ControlNet"), ("ccn-unet", "UNetModel")):
        rec = _record_of_kind(stats, node_id, kind)
        assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
        assert rec["compiles"] == 1 and rec["recompiles"] == 0, (kind, rec["recompile_reasons"])
        assert rec["calls"] >= 3 + 4 + 3 - 1, (kind, rec["calls"])  # a call per step (cond and uncond batched)
    # compiling the compiled copy again wraps the real model, not the proxy
    again = patcher.compile_controlnet(compiled_cn, config, node_id="ccn")
    assert again.control_model.inner is controlnet.control_model


def test_what_is_not_a_controlnet_passes_through_uncompiled(patcher, comfy_inproc, fresh_stats):
    import comfy.controlnet

    other = comfy.controlnet.ControlBase()  # as a T2I adapter: no control_model to compile
    assert patcher.compile_controlnet(other, nexfort_engine.parse_options(OPTIONS), node_id="t2i") is other
    rec = _record(fresh_stats(), "t2i")
    assert rec["state"] == "fallback" and rec["fallbacks"] == 1
    assert "only ControlNets are compiled" in rec["fallback_reasons"][0], rec["fallback_reasons"]
