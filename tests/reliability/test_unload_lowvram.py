"""Model unload/reload between prompts, and ComfyUI's low-VRAM (partial offload) path.

* Server: a compiled prompt; ``POST /free {"unload_models": true}`` (ComfyUI unloads the model, the
  node cache keeps the patcher: the same compiled module is reused) and another prompt; then
  ``{"unload_models": true, "free_memory": true}`` (node cache dropped: the checkpoint is loaded
  from disk again, a new diffusion module compiles from the persistent cache) and another prompt.
  Each output equals its eager twin; nothing falls back.
* Low VRAM: on CPU it cannot happen inside a server — ComfyUI refuses ``--lowvram``/``--novram``
  together with ``--cpu`` (one argparse group; asserted below), and on a CPU device it always
  loads models whole (``VRAMState.DISABLED``). So the glue's branch is tested in-process: a tiny
  SD1.5 ``ModelPatcher`` is really partially loaded (``ModelPatcher.load(lowvram_model_memory=1)``
  sets ``model_lowvram`` and per-layer weight casting), run through the nexfort APPLY_MODEL
  wrapper: it runs eager, equals the plain model, and reports one fallback with its reason; loaded
  whole again, the same wrapper compiles.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from reliability_helpers import REPO, assert_same_output, engine, lora_graph, next_seed, one_record, run_ok


def _free(srv, **flags) -> None:
    mark = len(srv.log_text())
    srv.request("POST", "/free", flags)
    time.sleep(1.5)  # the prompt worker applies the flags when it wakes up (set_flag notifies it)
    assert srv.running and len(srv.log_text()) >= mark


def _pair(srv, prefix):
    seed = next_seed()
    compiled = run_ok(srv, lora_graph(seed=seed, prefix=prefix))
    eager = run_ok(srv, lora_graph(seed=seed, compiled=False, prefix=f"{prefix}_eager"))
    assert_same_output(compiled, eager, prefix)


@pytest.mark.integration
@pytest.mark.inductor
def test_unload_and_reload_between_prompts(srv):
    _pair(srv, "nx_unload0")
    before = engine(srv)
    log0 = srv.log_text().count("Requested to load")

    _free(srv, unload_models=True)
    _pair(srv, "nx_unload1")
    assert srv.log_text().count("Requested to load") > log0, "the model was not loaded again after /free"

    _free(srv, unload_models=True, free_memory=True)
    _pair(srv, "nx_unload2")
    after = engine(srv)
    assert after["fallbacks"] == before["fallbacks"], after["fallback_reasons"]
    _, rec = one_record(srv, "2")
    assert rec["state"] == "compiled", rec
    assert after["cache_misses"] == before["cache_misses"], "the reloaded model should compile from the cache"


def test_comfyui_refuses_lowvram_with_cpu(comfy_host):
    for flag in ("--lowvram", "--novram"):
        proc = subprocess.run([sys.executable, "main.py", "--cpu", flag], cwd=comfy_host, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and f"argument {flag}: not allowed with argument --cpu" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def glue(comfy_host):
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models
    from pack_modules import nodes_module

    tiny_models.boot()
    with nodes_module("patcher", pkg="_nexfort_glue_under_test") as mod:  # its relative imports work
        yield mod, tiny_models


def test_glue_runs_eager_and_reports_fallback_when_model_lowvram(glue, tmp_path, monkeypatch):
    import torch

    import nexfort_engine
    from nexfort_engine.options import parse_options

    patcher, tiny_models = glue
    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    nexfort_engine.reset_stats()
    mp = tiny_models.tiny_sd15(seed=3)
    m = patcher.compile_model_patcher(mp, parse_options({"backend": "eager"}), node_id="lowvram")
    gen = torch.Generator().manual_seed(0)
    spec = mp.model.nexfort_tiny
    x = torch.randn(1, spec.latent_channels, 8, 8, generator=gen)
    t = torch.tensor([500.0])
    ctx = torch.randn(1, 77, spec.context_dim, generator=gen)
    opts = {"wrappers": m.wrappers}  # what ComfyUI's sampler passes down (samplers.py)

    reference = mp.model.apply_model(x, t, c_crossattn=ctx)  # no wrapper: plain eager

    m.load(torch.device("cpu"), lowvram_model_memory=1)  # ComfyUI's real partial load
    try:
        assert m.model.model_lowvram, "ModelPatcher.load(lowvram_model_memory=1) did not partially load"
        out = m.model.apply_model(x, t, c_crossattn=ctx, transformer_options=opts)
    finally:
        m.unpatch_model()
    assert torch.equal(out, reference), "the low-VRAM path must run the plain eager model"
    stats = nexfort_engine.stats()
    assert stats["fallbacks"] == 1 and stats["compiles"] == 0, stats
    assert any("low-VRAM" in r for r in stats["fallback_reasons"]), stats["fallback_reasons"]

    m.load(torch.device("cpu"), full_load=True)
    try:
        assert not m.model.model_lowvram
        out2 = m.model.apply_model(x, t, c_crossattn=ctx, transformer_options=opts)
    finally:
        m.unpatch_model()
    assert torch.allclose(out2, reference, atol=1e-5), float((out2 - reference).abs().max())
    stats = nexfort_engine.stats()
    assert stats["compiles"] == 1 and stats["fallbacks"] == 1, stats
    nexfort_engine.reset_stats()
