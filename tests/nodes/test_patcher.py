"""``nodes/patcher.py`` in-process over real ComfyUI objects (tiny SD1.5 UNet, TAESD VAE), backend eager.

The clone is compiled and the original untouched; LoRA-like weight patches reach the compiled
graph (outputs equal eager's) without a recompile when the strength changes or the patch goes
away; the compiled VAE decodes/encodes like eager, tiled decode included.
"""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

import nexfort_engine

EAGER = {"mode": "O2", "backend": "eager"}
TOL = 1e-4  # max abs error relative to the output scale (backend eager: same kernels)


@pytest.fixture(scope="module")
def unet(comfy_inproc):
    return tm.tiny_sd15(seed=3)


def _nx_wrappers(mp):
    from comfy.patcher_extension import WrappersMP

    return mp.wrappers.get(WrappersMP.APPLY_MODEL, {}).get("nexfort", [])


def _sample(mp, h=64, w=96, cfg=5.0, steps=3):
    return tm.sample(mp, h, w, 1, steps, cfg, 77)


def test_clone_is_compiled_original_untouched(patcher, unet, fresh_stats):
    cfg = nexfort_engine.parse_options(EAGER)
    opts_before = dict(unet.model_options)
    c = patcher.compile_model_patcher(unet, cfg, node_id="7")
    assert c is not unet and c.model is unet.model  # a clone sharing the weights
    assert _nx_wrappers(c) and not _nx_wrappers(unet)
    assert c.model_options["nexfort_config"]["backend"] == "eager"
    assert "nexfort_config" not in unet.model_options and unet.model_options.keys() == opts_before.keys()
    ref = _sample(unet)
    out = _sample(c)
    assert tm.rel_err(out, ref) <= TOL
    # the swap is scoped to the call: the base model keeps its own diffusion model
    assert not isinstance(unet.model.diffusion_model, nexfort_engine.CompiledModule)
    s = fresh_stats()
    assert s["compiles"] >= 1 and s["fallbacks"] == 0
    [rec] = [r for r in s["models"].values() if r["compiles"]]
    assert rec["node_ids"] == ["7"] and rec["state"] == "compiled"
    # compiling a compiled clone again replaces the wrapper instead of nesting it
    again = patcher.compile_model_patcher(c, cfg)
    assert len(_nx_wrappers(again)) == 1
    assert tm.rel_err(_sample(again), ref) <= TOL


def test_the_conditioning_moves_once_per_sampling(patcher, unet, fresh_stats, monkeypatch):
    """The SAMPLER_SAMPLE wrapper hands each CPU tensor condition of the sampling's processed
    conditioning to the move once (on a GPU: pinned, asynchronous copies), leaves other conditions
    and the user's conditioning alone, and the image is unchanged."""
    import comfy.conds
    from comfy.patcher_extension import WrappersMP

    cfg = nexfort_engine.parse_options(EAGER)
    c = patcher.compile_model_patcher(unet, cfg)
    [wrapper] = c.wrappers[WrappersMP.SAMPLER_SAMPLE]["nexfort"]
    from nexfort_engine.background import CARRIED

    assert getattr(wrapper, CARRIED) and "<locals>" in wrapper.__qualname__  # a child gets a stand-in
    assert not unet.wrappers.get(WrappersMP.SAMPLER_SAMPLE, {}).get("nexfort")
    ref = _sample(unet)

    seen = []  # (id of the conditioning dict, keys moved) per sampling
    real = patcher.move_conds

    def moving(conds, move):
        moved = []

        def recorded(t):
            moved.append(tuple(t.shape))
            return t.clone()  # a new tensor, as a device copy is

        n = real(conds, recorded)
        seen.append((n, moved))
        return n

    # on a CPU the wrapper moves nothing: a guider whose model loads on a GPU calls the move
    monkeypatch.setattr(patcher, "move_conds", moving)
    guider_conds = {"positive": [{"model_conds": {
        "c_crossattn": comfy.conds.CONDCrossAttn(torch.ones(1, 3, 4)),
        "constant": comfy.conds.CONDConstant(5)}}]}
    user_tensor = guider_conds["positive"][0]["model_conds"]["c_crossattn"].cond
    assert real(guider_conds, lambda t: t.clone()) == 1
    moved = guider_conds["positive"][0]["model_conds"]
    assert moved["c_crossattn"].cond is not user_tensor and torch.equal(moved["c_crossattn"].cond, user_tensor)
    assert isinstance(moved["c_crossattn"], comfy.conds.CONDCrossAttn) and moved["constant"].cond == 5
    assert real({"negative": [{"model_conds": {"x": comfy.conds.CONDRegular(torch.ones(2, device="meta"))}}]},
                lambda t: t) == 0  # not a CPU tensor: left as it is

    class Guider:
        model_patcher = type("P", (), {"load_device": torch.device("cuda")})()
        conds = {"positive": [{"model_conds": {"c_crossattn": comfy.conds.CONDCrossAttn(torch.ones(1, 3, 4))}}]}

    calls = []
    out = wrapper(lambda g, *a, **k: calls.append((g, a, k)) or "sampled", Guider, 1, x=2)
    assert out == "sampled" and calls == [(Guider, (1,), {"x": 2})] and seen and seen[0][0] == 1
    assert tm.rel_err(_sample(c), ref) <= TOL


def _patch_key(mp) -> str:
    # the output conv: a weight whose patch visibly changes the result of this tiny random model
    # (a middle-block attention projection does not, at these sizes)
    return "diffusion_model.out.2.weight"


def _patched(mp, key, delta, strength):
    m = mp.clone()
    m.add_patches({key: (delta,)}, strength)
    return m


def _lora_sweep(patcher, unet, fresh_stats, plan):
    cfg = nexfort_engine.parse_options(EAGER)
    key = _patch_key(unet)
    w = unet.model_state_dict()[key]
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(11)) * w.abs().mean() * 4
    results, compiles = {}, {}
    for step, strength in enumerate(plan):
        base = unet.clone() if strength is None else _patched(unet, key, delta, strength)
        compiled = patcher.compile_model_patcher(base, cfg)
        out = _sample(compiled)
        ref = _sample(base)
        assert tm.rel_err(out, ref) <= TOL, f"step {step} (strength {strength})"
        results[step] = out
        compiles[step] = fresh_stats()["compiles"]
    assert fresh_stats()["fallbacks"] == 0
    return results, compiles


def test_lora_like_weight_patch_equal_eager_no_recompile(patcher, unet, fresh_stats):
    # unpatched, patched 1.0, patched 0.3, unpatched again, patched 1.0 again
    results, compiles = _lora_sweep(patcher, unet, fresh_stats, [None, 1.0, 0.3, None, 1.0])
    # the patch really changed the output, and removing it restored the unpatched result
    assert tm.rel_err(results[1], results[0]) > 1e-3 and tm.rel_err(results[2], results[1]) > 1e-3
    scale = results[0].abs().max().item()
    torch.testing.assert_close(results[3], results[0], rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(results[4], results[1], rtol=1e-5, atol=1e-5 * scale)
    # after the first patch: other strengths, removal and re-adding never compile again
    assert compiles[1] == compiles[2] == compiles[3] == compiles[4], compiles


def test_first_weight_patch_does_not_recompile(patcher, comfy_inproc, fresh_stats):
    fresh_unet = tm.tiny_sd15(seed=4)  # its parameters never patched yet
    _results, compiles = _lora_sweep(patcher, fresh_unet, fresh_stats, [None, 1.0])
    assert compiles[1] == compiles[0], compiles


def test_newer_comfys_allocation_recorder_is_off_inside_a_compiled_call(patcher, unet, fresh_stats, monkeypatch):
    """ComfyUI 0.34+ parses ``--disable-comfy-compiler`` into ``args.disable_comfy_compiler``
    (False by default) and reads it on every model forward; the host (0.3.75) has no such option,
    so the test gives its real ``args`` the attribute as that parser would. A second APPLY_MODEL
    wrapper registered after nexfort's runs inside it and sees the option on, with the compiled
    model in place; after the call, and for the original (uncompiled) model, it is off again."""
    import comfy.cli_args
    from comfy.patcher_extension import WrappersMP

    args = comfy.cli_args.args
    assert not hasattr(args, "disable_comfy_compiler")  # the host: nothing to switch
    with patcher.comfy_allocation_recorder_off() as switched:
        assert not switched and not hasattr(args, "disable_comfy_compiler")

    monkeypatch.setattr(args, "disable_comfy_compiler", False, raising=False)
    seen: list[tuple[bool, bool]] = []

    def probe(executor, *a, **kw):
        compiled = isinstance(executor.class_obj.diffusion_model, nexfort_engine.CompiledModule)
        seen.append((compiled, args.disable_comfy_compiler))
        return executor(*a, **kw)

    c = patcher.compile_model_patcher(unet, nexfort_engine.parse_options(EAGER))
    c.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "probe", probe)
    plain = unet.clone()
    plain.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "probe", probe)
    ref = _sample(plain)
    n_plain = len(seen)
    out = _sample(c)
    assert tm.rel_err(out, ref) <= TOL
    assert seen[:n_plain] and all(s == (False, False) for s in seen[:n_plain])
    assert seen[n_plain:] and all(s == (True, True) for s in seen[n_plain:]), seen
    assert args.disable_comfy_compiler is False
    # a user who started ComfyUI with --disable-comfy-compiler keeps it
    args.disable_comfy_compiler = True
    _sample(c)
    assert args.disable_comfy_compiler is True


def _dynamic(mp, error=None, delegate=True):
    """``mp`` as newer ComfyUI's dynamic-VRAM ModelPatcher declares itself (the host, 0.3.75, has
    none): ``is_dynamic()``, ``clone(disable_dynamic=True)`` returning a regular ModelPatcher (or
    raising ``error``, as ComfyUI does for a loader that recorded no way to rebuild the model, or
    whose checkpoint file is gone), and, with ``delegate``, ``get_non_dynamic_delegate()`` (such a
    clone)."""
    from comfy.model_patcher import ModelPatcher

    class DynamicModelPatcher(ModelPatcher):
        demoted = 0
        delegated = 0

        def is_dynamic(self):
            return True

        def clone(self, disable_dynamic=False):
            n = super().clone()
            if disable_dynamic:
                if error is not None:
                    raise error
                type(self).demoted += 1
                n.__class__ = ModelPatcher
            return n

        if delegate:
            def get_non_dynamic_delegate(self):
                type(self).delegated += 1
                return self.clone(disable_dynamic=True)

    d = mp.clone()
    d.__class__ = DynamicModelPatcher
    return d


def test_a_dynamic_vram_model_is_compiled_as_a_regular_one(patcher, unet, fresh_stats):
    from comfy.model_patcher import ModelPatcher

    # a config of its own: the module's compiled twin for EAGER may exist from the tests above
    cfg = nexfort_engine.parse_options({"mode": "O1", "backend": "eager"})
    dyn = _dynamic(unet)
    c = patcher.compile_model_patcher(dyn, cfg, node_id="3")
    assert type(dyn).delegated == type(dyn).demoted == 1 and type(c) is ModelPatcher and _nx_wrappers(c)
    assert tm.rel_err(_sample(c), _sample(unet)) <= TOL
    s = fresh_stats()
    assert s["compiles"] >= 1 and s["fallbacks"] == 0
    # a ComfyUI with clone(disable_dynamic=...) but no get_non_dynamic_delegate
    old = _dynamic(unet, delegate=False)
    c = patcher.compile_model_patcher(old, cfg)
    assert type(old).demoted == 1 and type(c) is ModelPatcher and _nx_wrappers(c)


@pytest.mark.parametrize("error", [
    RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized."),
    FileNotFoundError("model.safetensors"),
], ids=["no-init", "file-gone"])
def test_a_dynamic_vram_model_that_cannot_be_made_regular_runs_uncompiled(patcher, unet, fresh_stats, caplog, error):
    dyn = _dynamic(unet, error=error)
    with caplog.at_level("WARNING"):
        c = patcher.compile_model_patcher(dyn, nexfort_engine.parse_options(EAGER), node_id="4")
    assert c is not dyn and not _nx_wrappers(c) and c.is_dynamic()
    assert "--disable-dynamic-vram" in caplog.text
    assert tm.rel_err(_sample(c), _sample(unet)) <= TOL  # the user's run goes on, eager
    s = fresh_stats()
    assert s["compiles"] == 0 and s["fallbacks"] == 1
    [rec] = [r for r in s["models"].values() if r["fallbacks"]]
    assert rec["node_ids"] == ["4"] and "--disable-dynamic-vram" in rec["fallback_reasons"][0]
    assert type(error).__name__ in rec["fallback_reasons"][0]


# -- VAE ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vae(comfy_inproc):
    import comfy.sd
    import comfy.taesd.taesd

    taesd = comfy.taesd.taesd.TAESD(latent_channels=4)
    sd = {k: v.clone() for k, v in tm.init_weights(taesd, seed=5).state_dict().items()}
    v = comfy.sd.VAE(sd=sd)
    tm.init_weights(v.first_stage_model, seed=5)
    return v


def test_compile_vae_decode_encode_equal_eager(patcher, vae, fresh_stats):
    cfg = nexfort_engine.parse_options(EAGER)
    cv = patcher.compile_vae(vae, cfg, node_id="9")
    assert cv is not vae and vae.first_stage_model is not cv.first_stage_model
    assert not isinstance(vae.first_stage_model, patcher._CompiledVAEModel)
    gen = torch.Generator().manual_seed(0)
    for h, w in [(8, 8), (8, 12), (12, 8)]:
        lat = torch.randn(1, 4, h, w, generator=gen)
        ref = vae.decode(lat)
        out = cv.decode(lat)
        assert out.shape == ref.shape and tm.rel_err(out, ref) <= TOL
        img = ref.clamp(0, 1)
        assert tm.rel_err(cv.encode(img), vae.encode(img)) <= TOL
    s = fresh_stats()
    labels = {k.split(":")[0] for k, r in s["models"].items() if r["compiles"]}
    assert labels == {"TAESD.decode", "TAESD.encode"} and s["fallbacks"] == 0
    assert s["recompiles"] <= 2, s["recompile_reasons"]  # at most one per method over 3 sizes
    # compiling a compiled VAE again wraps the original model, not the proxy
    assert patcher.compile_vae(cv, cfg).first_stage_model.inner is vae.first_stage_model


def test_a_compiled_vae_hands_the_models_attributes_through(patcher, vae):
    """Newer ComfyUI's ``VAE.decode`` asks ``first_stage_model`` for optional attributes with
    ``getattr`` (0.38: ``preferred_decode_tile``, ``comfy_has_chunked_io``, ...): the stand-in
    answers with the real model's, and a missing one stays missing (the default applies)."""
    inner = vae.first_stage_model
    cv = patcher.compile_vae(vae, nexfort_engine.parse_options(EAGER))
    proxy = cv.first_stage_model
    assert isinstance(proxy, patcher._CompiledVAEModel) and proxy.inner is inner
    inner.preferred_decode_tile = (96, 96)
    inner.comfy_has_chunked_io = True
    try:
        assert proxy.preferred_decode_tile == (96, 96) and getattr(proxy, "comfy_has_chunked_io", False) is True
        assert getattr(proxy, "decode_output_shape", None) is None
        assert getattr(proxy, "comfy_decode_estimate_is_reliable", "default") == "default"
    finally:
        del inner.preferred_decode_tile, inner.comfy_has_chunked_io


def test_a_compiled_vae_saves_and_loads_the_vaes_own_keys(patcher, vae, tmp_path):
    """ComfyUI's VAESave / CheckpointSave write ``VAE.get_sd()``: the compiled VAE's is the
    original's, key for key, and a VAE loaded from it decodes as the original does."""
    import comfy.sd
    import comfy.utils

    cv = patcher.compile_vae(vae, nexfort_engine.parse_options(EAGER))
    sd = cv.get_sd()
    ref = vae.get_sd()
    assert list(sd) == list(ref) and not any(k.startswith("inner.") for k in sd)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    path = tmp_path / "vae.safetensors"
    comfy.utils.save_torch_file(sd, str(path))
    loaded = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)))
    lat = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.decode(lat), vae.decode(lat))
    # and back into the proxy: the inner model's parameters take the values
    before = {k: v.clone() for k, v in ref.items()}
    missing, unexpected = cv.first_stage_model.load_state_dict({k: torch.zeros_like(v) for k, v in ref.items()})
    assert not missing and not unexpected
    assert all(not v.any() for v in vae.first_stage_model.state_dict().values())
    vae.first_stage_model.load_state_dict(before)


def test_a_dynamic_vram_vae_runs_uncompiled_with_a_warning(patcher, vae, fresh_stats, caplog):
    import copy

    dyn = copy.copy(vae)
    dyn.patcher = _dynamic(vae.patcher)
    dyn.first_stage_model = patcher.compile_vae(vae, nexfort_engine.parse_options(EAGER)).first_stage_model
    with caplog.at_level("WARNING"):
        out_vae = patcher.compile_vae(dyn, nexfort_engine.parse_options(EAGER), node_id="5")
    # the plain model again, where the VAE had been given the compiled proxy before
    assert out_vae is not dyn and out_vae.first_stage_model is vae.first_stage_model
    assert "--disable-dynamic-vram" in caplog.text
    lat = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert tm.rel_err(out_vae.decode(lat), vae.decode(lat)) <= TOL
    s = fresh_stats()
    assert s["compiles"] == 0 and s["fallbacks"] == 1
    assert s["models"]["TAESD.decode"]["node_ids"] == ["5"]


def test_compiled_vae_tiled_decode(patcher, vae, fresh_stats):
    cfg = nexfort_engine.parse_options(EAGER)
    cv = patcher.compile_vae(vae, cfg)
    lat = torch.randn(1, 4, 24, 20, generator=torch.Generator().manual_seed(1))
    ref = vae.decode_tiled(lat, tile_x=8, tile_y=8, overlap=2)
    out = cv.decode_tiled(lat, tile_x=8, tile_y=8, overlap=2)
    assert out.shape == ref.shape and tm.rel_err(out, ref) <= TOL
    s = fresh_stats()
    assert s["fallbacks"] == 0 and any(k.startswith("TAESD.decode") and r["compiles"] for k, r in s["models"].items())


def test_compiled_vae_folds_aligned_latents_and_images(patcher, vae, fresh_stats):
    """Under dynamic shape the VAE (a conv net) gets its latent / image with the spatial sizes
    traced as multiples of 8 (shapes.fold_spatial): two aligned sizes, one graph per method.
    The multiple is given explicitly (the auto default is 8 too): another config than the tests
    above, so these are fresh compiled modules, not theirs with their graphs (the VAE is shared)."""
    cfg = nexfort_engine.parse_options({**EAGER, "spatial_multiple": 8})
    cv = patcher.compile_vae(vae, cfg)
    gen = torch.Generator().manual_seed(2)
    # both sizes above the CPU's mkldnn-convolution threshold (a size guard of its own, CPU only)
    for h, w in [(24, 24), (24, 32)]:
        lat = torch.randn(1, 4, h, w, generator=gen)
        ref = vae.decode(lat)
        assert tm.rel_err(cv.decode(lat), ref) <= TOL
        img = ref.clamp(0, 1)  # 8x the latent: 192 x 192, 192 x 256 pixels
        assert tm.rel_err(cv.encode(img), vae.encode(img)) <= TOL
    s = fresh_stats()
    compiled = {k.split(":")[0]: r for k, r in s["models"].items() if r["compiles"]}
    assert set(compiled) == {"TAESD.decode", "TAESD.encode"}
    assert all(r["compiles"] == 1 and r["recompiles"] == 0 for r in compiled.values()), {
        k: r["recompile_reasons"] for k, r in compiled.items()}
    per_method = cv.first_stage_model.inner.__dict__[patcher._ATTR]
    assert {cm._nx_fold for cm in per_method.values()} == {8}


def test_compiled_vae_decode_in_the_background(patcher, vae, fresh_stats, tmp_path, monkeypatch):
    """``"background": true`` on the VAE node: the decode method and ComfyUI's VAE model travel to
    the child, which compiles ``decode`` (eager backend here: the child's run is what is checked);
    decodes run eager meanwhile, then through the engine."""
    import time

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    cfg = nexfort_engine.parse_options({"backend": "eager", "background": True})
    cv = patcher.compile_vae(vae, cfg, node_id="9")
    lat = torch.randn(1, 4, 8, 12, generator=torch.Generator().manual_seed(1))
    ref = vae.decode(lat)
    assert tm.rel_err(cv.decode(lat), ref) <= TOL
    (label, rec), = fresh_stats()["models"].items()
    assert label.startswith("TAESD.decode") and rec["state"] == "background", rec
    cm = vae.first_stage_model.__dict__[patcher._ATTR][f"{cfg.digest()}.decode"]
    deadline = time.monotonic() + 300
    while not cm._nx_job.done():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert tm.rel_err(cv.decode(lat), ref) <= TOL
    rec = fresh_stats()["models"][label]
    assert rec["background"].startswith("done in "), rec["background"]
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0


@pytest.mark.inductor
def test_compiled_vae_decode_static_first(patcher, vae, fresh_stats, tmp_path, monkeypatch):
    """``"static_first"`` on the VAE node (auto on a GPU for a decode): the first decode compiles a
    static graph for its latent size, a child compiles the any-size decode graph, and the first
    decode of another size loads that one: nothing compiled here, no recompile. Under inference
    mode, as ComfyUI runs its nodes."""
    import time

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    cfg = nexfort_engine.parse_options({"mode": "O1", "static_first": True})
    cv = patcher.compile_vae(vae, cfg, node_id="9")
    gen = torch.Generator().manual_seed(3)
    # both sizes above the CPU's mkldnn-convolution threshold (a size guard of its own, CPU only)
    a, b = torch.randn(1, 4, 24, 24, generator=gen), torch.randn(1, 4, 24, 32, generator=gen)
    with torch.inference_mode():
        ref_a, ref_b = vae.decode(a), vae.decode(b)
        out_a = cv.decode(a)

        def records() -> tuple[dict, dict]:
            models = {k: r for k, r in fresh_stats()["models"].items() if k.startswith("TAESD.decode")}
            twin = [r for k, r in models.items() if " (static)" in k]
            main = [r for k, r in models.items() if " (static)" not in k]
            assert len(main) == 1 and len(twin) == 1, models
            return main[0], twin[0]

        main, twin = records()
        assert main["static_first"].startswith("static graph for (1, 4, 24, 24) in "), main
        assert twin["compiles"] == 1 and main["state"] == "background", (main, twin)
        cm = vae.first_stage_model.__dict__[patcher._ATTR][f"{cfg.digest()}.decode"]
        deadline = time.monotonic() + 600
        while not cm._nx_job.done():
            assert time.monotonic() < deadline, "the child did not finish"
            time.sleep(0.5)
        out_a2 = cv.decode(a)  # the static graph still fits its size
        out_b = cv.decode(b)  # another size: the child's dynamic graph, loaded
    main, twin = records()
    assert main["background"].startswith("done in "), main["background"]
    assert main["compiles"] == 0 and main["recompiles"] == 0 and main["cache_hits"] == 1, main
    assert twin["state"] == "retired" and twin["calls"] == 2 and main["fallbacks"] == 0
    for got, want in ((out_a, ref_a), (out_a2, ref_a), (out_b, ref_b)):
        assert got.shape == want.shape and tm.rel_err(got, want) <= 1e-3
