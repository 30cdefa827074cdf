"""Real Inductor on CPU: compiled vs eager numerics per preset, and the engine's counters.

Cold Inductor compiles cost 50-100 s on 2 cores, so this file compiles few graphs: the tiny
SD1.5 UNet with O1, O2 and O3 (O2 and O3 reduce to the same settings on CPU, see
test_settings.py, but are separate cache entries) and the tiny PixArt DiT with O2, all into the
session cache. Tolerance (fp32): max |compiled - eager| <= 1e-3 x max |eager|.
bf16 is not compiled here (another cold compile per model); the fp32 bound is the contract.
"""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

import nexfort_engine

pytestmark = pytest.mark.inductor

FP32_TOL = 1e-3

CASES = [("sd15", "O1"), ("sd15", "O2"), ("sd15", "O3"), ("pixart", "O2")]


@pytest.mark.parametrize("family, mode", CASES, ids=["sd15-O1", "sd15-O2", "sd15-O3", "pixart-O2"])
def test_compiled_matches_eager_and_second_shape_does_not_recompile(zoo, nx_cache, fresh_stats, family, mode):
    mp = zoo[family]
    dm = mp.model.diffusion_model
    cm = nexfort_engine.compile(dm, {"mode": mode}, cache_dir=nx_cache, label=f"{family}-{mode}")
    (h0, w0), (h1, w1) = tm.RESOLUTIONS[family][:2]
    out0 = tm.call_diffusion(mp, h0, w0, 2, 77, diffusion_model=cm)
    ref0 = tm.call_diffusion(mp, h0, w0, 2, 77)
    assert tm.rel_err(out0, ref0) <= FP32_TOL
    s = fresh_stats()
    rec = s["models"][cm.label]
    # O2 and O3 share an entry on CPU: O3 may load O2's saved graph (nexfort_engine/precompile.py)
    assert rec["compiles"] + rec["cache_hits"] >= 1 and rec["fallbacks"] == 0 and rec["state"] == "compiled"
    assert rec["cache_hits"] + rec["cache_misses"] >= 1
    compiles = rec["compiles"]
    # another resolution and prompt length: same graph
    out1 = tm.call_diffusion(mp, h1, w1, 2, 154, seed=1, diffusion_model=cm)
    ref1 = tm.call_diffusion(mp, h1, w1, 2, 154, seed=1)
    assert tm.rel_err(out1, ref1) <= FP32_TOL
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == compiles and rec["recompiles"] == 0, rec["recompile_reasons"]
    # the entry was committed with the artifacts
    assert cm.cache_entry is not None and (cm.cache_entry.path / "manifest.json").exists()


def test_batch_change_compiles_at_most_one_more_graph(zoo, nx_cache, fresh_stats):
    """The O2 UNet from above (a cache hit now): cfg 5 (batch 2) then cfg 1 (batch 1).

    Batch 1 is specialised by default (size_oblivious off): at most one more graph, never wrong."""
    mp = zoo["sd15"]
    cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2"}, cache_dir=nx_cache)
    for batch in (2, 1, 2, 1):
        out = tm.call_diffusion(mp, 64, 64, batch, 77, diffusion_model=cm)
        assert tm.rel_err(out, tm.call_diffusion(mp, 64, 64, batch, 77)) <= FP32_TOL
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] <= 2 and rec["recompiles"] <= 1, rec["recompile_reasons"]


def test_pixart_batch_one_after_batch_two_is_correct(zoo, nx_cache, fresh_stats):
    """With size_oblivious on, Inductor returned NaN here (batch-1 call of a batch-2 graph); the
    default policy specialises batch 1 and must match eager."""
    mp = zoo["pixart"]
    cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2"}, cache_dir=nx_cache)
    (h, w) = tm.RESOLUTIONS["pixart"][1]
    for batch in (2, 1):
        out = tm.call_diffusion(mp, h, w, batch, 154, seed=1, diffusion_model=cm)
        ref = tm.call_diffusion(mp, h, w, batch, 154, seed=1)
        assert torch.isfinite(out).all(), f"batch {batch}: compiled output has NaN/inf"
        assert tm.rel_err(out, ref) <= FP32_TOL


def test_sampler_through_compiled_unet(zoo, nx_cache, fresh_stats):
    """The O2 UNet from above (a cache hit now) inside ComfyUI's sampler, cfg 5, 3 steps."""
    mp = zoo["sd15"]
    cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2"}, cache_dir=nx_cache)
    c = tm.with_diffusion_model(mp, cm)
    out = tm.sample(c, 64, 96, 1, 3, 5.0)
    ref = tm.sample(mp, 64, 96, 1, 3, 5.0)
    assert tm.rel_err(out, ref) <= FP32_TOL
    s = fresh_stats()
    assert s["fallbacks"] == 0 and s["recompiles"] == 0
