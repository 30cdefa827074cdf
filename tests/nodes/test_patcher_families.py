"""The pack's glue (``compile_model_patcher``) on every tiny family of the zoo: one UNet (SD1.5) and
six DiTs (PixArt-alpha, Flux, SD3, Lumina 2, Wan 2.1, Qwen-Image), built through ComfyUI's own
model classes, sampled through ComfyUI's real sampler. Backend eager (the logic under test is the
wrapper, not Inductor's code): outputs equal the unwrapped model's, the compile is counted under
the node id, nothing falls back. And with Inductor, the DiTs that build their position ids with
``torch.linspace(steps=n)`` compiled whole: one graph over three resolutions (trace_ops.py).
"""

from __future__ import annotations

import pytest
import tiny_models as tm

import nexfort_engine

EAGER = {"mode": "O2", "backend": "eager"}
TOL = 1e-4


@pytest.mark.parametrize("family", ["sd15", "pixart", "flux", "sd3", "lumina2", "wan21", "qwen_image"])
def test_compile_model_patcher_on_each_family(patcher, comfy_inproc, fresh_stats, family):
    mp = tm.FAMILIES[family](seed=11)
    cfg = nexfort_engine.parse_options(EAGER)
    compiled = patcher.compile_model_patcher(mp, cfg, node_id=f"n-{family}")
    (h, w) = tm.RESOLUTIONS[family][1]  # non-square
    cfg_scale = 1.0 if family == "flux" else 5.0
    for steps in (2, 3):
        ref = tm.sample(mp, h, w, 1, steps, cfg_scale, 77, seed=steps)
        out = tm.sample(compiled, h, w, 1, steps, cfg_scale, 77, seed=steps)
        assert tm.rel_err(out, ref) <= TOL, f"{family}: compiled sampling differs from eager"
    s = fresh_stats()
    recs = [r for r in s["models"].values() if f"n-{family}" in r["node_ids"]]
    assert len(recs) == 1, s["models"].keys()
    rec = recs[0]
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    # a new step count reuses the graph (the schedule length is symbolic)
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]


@pytest.mark.inductor
@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_linspace_position_ids_compile_once_for_every_resolution(patcher, comfy_inproc, fresh_stats, family):
    """Flux and Qwen-Image (and Wan 2.1, left out for the suite's time: the same ``trace_ops.linspace``)
    build their rotary position ids with ``torch.linspace(steps=n)``
    over the latent's patches; compiled whole (a saved graph), that length stays symbolic
    (trace_ops.linspace): three resolutions, two step counts and two prompt lengths are one graph,
    and the images equal eager's. Before, every resolution compiled another graph (a guard such as
    ``((1 + W) // 2) == 4``)."""
    mp = tm.FAMILIES[family](seed=21)
    cfg = nexfort_engine.parse_options({"mode": "O2", "regional": False})
    compiled = patcher.compile_model_patcher(mp, cfg, node_id=f"ls-{family}")
    cfg_scale = 1.0 if family == "flux" else 4.0
    for i, (h, w) in enumerate(tm.RESOLUTIONS[family]):
        steps, ctx = (2, 12) if i % 2 == 0 else (3, 20)
        ref = tm.sample(mp, h, w, 1, steps, cfg_scale, ctx, seed=i)
        out = tm.sample(compiled, h, w, 1, steps, cfg_scale, ctx, seed=i)
        assert tm.rel_err(out, ref) <= 1e-4, (family, h, w)
    rec = next(r for r in fresh_stats()["models"].values() if f"ls-{family}" in r["node_ids"])
    assert rec["precompiled"] == "on" and rec["fallbacks"] == 0, rec
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]


@pytest.mark.inductor
def test_linspace_through_torch_compile_gets_the_right_graph_for_each_resolution(
        patcher, comfy_inproc, fresh_stats, monkeypatch):
    """The same model compiled whole through ``torch.compile`` (no saved graph: ``NEXFORT_PRECOMPILE=0``,
    as fp8 graphs are): one graph for 64x64, 64x96 and 96x64, equal to eager. Before, linspace
    specialised each resolution, and torch's AOTAutograd cache served the 96x64 call the 64x96
    graph (its height's and width's position ids swapped: 3 % off)."""
    monkeypatch.setenv("NEXFORT_PRECOMPILE", "0")
    mp = tm.FAMILIES["qwen_image"](seed=21)
    cfg = nexfort_engine.parse_options({"mode": "O2", "regional": False})
    compiled = patcher.compile_model_patcher(mp, cfg, node_id="ls-tc")
    for i, (h, w) in enumerate(tm.RESOLUTIONS["qwen_image"]):
        ref = tm.sample(mp, h, w, 1, 2, 4.0, 12, seed=i)
        out = tm.sample(compiled, h, w, 1, 2, 4.0, 12, seed=i)
        assert tm.rel_err(out, ref) <= 1e-4, (h, w, tm.rel_err(out, ref))
    rec = next(r for r in fresh_stats()["models"].values() if "ls-tc" in r["node_ids"])
    assert rec["precompiled"] == "off" and rec["fallbacks"] == 0, rec
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]


@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_regional_dit_through_the_glue_with_lora_like_patches(patcher, comfy_inproc, fresh_stats, family):
    """Deeper tiny DiTs compile regionally (the auto default) through the node glue; a weight patch
    on a block (how ComfyUI applies a LoRA) reaches the shared block graph: equal to eager, patched
    output differs from unpatched, strength changes and removal never compile again."""
    import torch

    mp = tm.tiny_pixart(seed=12, depth=5) if family == "pixart" else tm.tiny_flux(seed=12, depth=4, depth_single=4)
    cfg = nexfort_engine.parse_options(EAGER)
    block = "blocks.4" if family == "pixart" else "single_blocks.3"
    key = next(k for k, v in mp.model_state_dict().items()
               if k.startswith(f"diffusion_model.{block}.") and k.endswith(".weight") and v.dim() == 2)
    w = mp.model_state_dict()[key]
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * w.abs().mean() * 8
    (h, w_px) = tm.RESOLUTIONS[family][1]
    cfg_scale = 1.0 if family == "flux" else 5.0
    outs, compiles = [], []
    for strength in (None, 1.0, 0.5, None):
        base = mp.clone()
        if strength is not None:
            base.add_patches({key: (delta,)}, strength)
        compiled = patcher.compile_model_patcher(base, cfg, node_id=f"r-{family}")
        out = tm.sample(compiled, h, w_px, 1, 3, cfg_scale, 77)
        ref = tm.sample(base, h, w_px, 1, 3, cfg_scale, 77)
        assert tm.rel_err(out, ref) <= TOL, f"strength {strength}"
        outs.append(out)
        compiles.append(fresh_stats()["compiles"])
    assert tm.rel_err(outs[1], outs[0]) > 1e-3 and tm.rel_err(outs[2], outs[1]) > 1e-3
    assert tm.rel_err(outs[3], outs[0]) <= TOL
    assert compiles[0] == compiles[1] == compiles[2] == compiles[3], compiles
    rec = next(r for r in fresh_stats()["models"].values() if f"r-{family}" in r["node_ids"])
    assert rec["regions"] and rec["fallbacks"] == 0 and rec["recompiles"] == 0, rec


def test_fp8_sees_in_place_lora_on_inference_tensors(patcher, comfy_inproc, fresh_stats):
    """ComfyUI loads checkpoints under ``torch.inference_mode`` (weights without a version counter)
    and a ``weight_inplace_update`` patcher writes LoRA deltas into them in place. The fp8 path's
    cached weight copies must follow: the glue tells the engine when the patch set changes."""
    import torch

    from nexfort_engine import fp8

    with torch.inference_mode():
        mp = tm.tiny_pixart(seed=13, depth=4)
    mp.weight_inplace_update = True
    # whole model: under regional compilation fp8 covers the blocks only, the reference covers all
    cfg = nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "fp8": True, "regional": False})
    key = next(k for k, v in mp.model_state_dict().items()
               if k.startswith("diffusion_model.blocks.2.") and k.endswith(".weight") and v.dim() == 2
               and v.shape[0] % 16 == 0 and v.shape[1] % 16 == 0)
    w = mp.model_state_dict()[key]
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * w.abs().mean() * 8
    (h, w_px) = tm.RESOLUTIONS["pixart"][1]
    outs, refs = [], []
    with torch.inference_mode():
        for strength in (None, 1.0, None):
            base = mp.clone()
            if strength is not None:
                base.add_patches({key: (delta,)}, strength)
            compiled = patcher.compile_model_patcher(base, cfg, node_id="fp8-inplace")
            outs.append(tm.sample(compiled, h, w_px, 1, 3, 5.0, 77))
            with fp8.Fp8LinearMode(cached=False):  # same numbers, weights quantized from the live ones
                refs.append(tm.sample(base, h, w_px, 1, 3, 5.0, 77))
    for out, ref in zip(outs, refs, strict=True):
        assert tm.rel_err(out, ref) <= 1e-3
    assert tm.rel_err(outs[1], outs[0]) > 5e-2  # the patch reached the fp8 copies
    assert tm.rel_err(outs[2], outs[0]) <= 1e-3
    rec = next(r for r in fresh_stats()["models"].values() if "fp8-inplace" in r["node_ids"])
    assert rec["fp8"] and rec["fallbacks"] == 0 and rec["recompiles"] == 0, rec


def test_scaled_fp8_linears_compile_once_over_resolutions(patcher, comfy_inproc, fresh_stats):
    """ComfyUI 0.3.75's ``scaled_fp8`` linears (an fp8 checkpoint with one scale per weight) scale
    the weight or the input, whichever has fewer elements: under dynamic shape that test of the
    token count is a guard, and resolutions crossing it compiled again (3 graphs over these four).
    The glue has the traced calls scale the weight always: one graph, equal to eager (scales of 0.5:
    exact in bf16 either way), and eager calls keep ComfyUI's own forward."""
    import comfy.ops
    import torch

    if not hasattr(comfy.ops, "scaled_fp8_ops"):  # newer ComfyUI loads such checkpoints as QuantizedTensor
        pytest.skip("this ComfyUI has no scaled_fp8 ops (test_fp8_stored covers its mixed-precision linears)")
    mp = tm.tiny_flux(seed=15, weight_dtype=torch.float8_e4m3fn, scaled_fp8=True)
    linears = [m for m in mp.model.diffusion_model.modules() if getattr(m, "scale_weight", None) is not None]
    assert len(linears) > 10
    for m in linears:
        m.scale_weight.fill_(0.5)
    cfg = nexfort_engine.parse_options(EAGER)
    compiled = patcher.compile_model_patcher(mp, cfg, node_id="scaled-fp8")
    forward = type(linears[0]).forward_comfy_cast_weights
    assert forward._nexfort_one_branch and patcher._is_scaled_fp8_forward(forward.__wrapped__)
    for i, (h, w) in enumerate([(64, 64), (128, 128), (256, 256), (64, 256)]):
        ref = tm.sample(mp, h, w, 1, 2, 1.0, 20, seed=i)
        out = tm.sample(compiled, h, w, 1, 2, 1.0, 20, seed=i)
        assert tm.rel_err(out, ref) <= TOL, (h, w)
    rec = next(r for r in fresh_stats()["models"].values() if "scaled-fp8" in r["node_ids"])
    assert rec["fallbacks"] == 0 and rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
    # a second compile of the same model does not wrap the forward twice
    patcher.compile_model_patcher(mp, cfg, node_id="scaled-fp8-2")
    assert type(linears[0]).forward_comfy_cast_weights is forward


def test_regional_unet_transformer_blocks_through_the_glue(patcher, comfy_inproc, fresh_stats):
    """``regional: true`` on a UNet: its transformer blocks (two widths) compile once per width; the
    glue's block hook drops ComfyUI's per-block position keys, so 14 blocks are 2 graphs and a sweep
    over resolutions, steps and prompt lengths adds none. With an attention patch (which needs the
    position) the keys stay and the result still equals eager."""
    mp = tm.tiny_sd15(seed=14, depth=2)
    cfg = nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "regional": True})
    compiled = patcher.compile_model_patcher(mp, cfg, node_id="unet-regional")
    for (h, w), steps, ctx in [((64, 64), 3, 77), ((64, 96), 2, 154), ((96, 64), 3, 77)]:
        ref = tm.sample(mp, h, w, 1, steps, 5.0, ctx)
        out = tm.sample(compiled, h, w, 1, steps, 5.0, ctx)
        assert tm.rel_err(out, ref) <= TOL
    rec = next(r for r in fresh_stats()["models"].values() if "unet-regional" in r["node_ids"])
    assert len(rec["regions"]) == 2 and rec["fallbacks"] == 0, rec
    assert rec["compiles"] == 2 and rec["recompiles"] == 0, rec["recompile_reasons"]

    calls = []

    def attn2_scale(q, k, v, extra_options):  # an attn2 replace patch at one position
        import comfy.ldm.modules.attention as attention

        calls.append(extra_options["block"])
        return attention.optimized_attention(q, k, v * 0.5, extra_options["n_heads"])

    patched = mp.clone()
    patched.set_model_attn2_replace(attn2_scale, "input", 1, 0)
    compiled_p = patcher.compile_model_patcher(patched, cfg, node_id="unet-regional-patched")
    ref = tm.sample(patched, 64, 64, 1, 3, 5.0, 77)
    out = tm.sample(compiled_p, 64, 64, 1, 3, 5.0, 77)
    assert tm.rel_err(out, ref) <= TOL
    assert calls and set(calls) == {("input", 1)}  # reached through the compiled block, at its position
