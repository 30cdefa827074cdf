"""The Cache Manager's text report says how each model was compiled, from the engine's counters."""

from __future__ import annotations

import pytest
from pack_modules import nodes_module

import nexfort_engine
from nexfort_engine import counters
from nexfort_engine.cache import CacheStore


@pytest.fixture
def cache_manager(comfy_inproc):
    # nodes/__init__.py is not executed (it registers the nodes)
    with nodes_module("cache_manager") as mod:
        yield mod


def test_report_names_regions_fp8_and_the_spatial_multiple(cache_manager, tmp_path, fresh_stats):
    counters.set_info("UNetModel:aa", state="compiled", spatial_multiple=8, group_norms_rewritten=61,
                      channels_last_weights=97, fp8=False, fp8_skipped="model width 1280 < 2048",
                      autotune_skipped="convolutional UNet compiled whole")
    counters.bump("UNetModel:aa", "compiles")
    counters.set_info("PixArt:bb", state="compiled", regions=["blocks[x28]"], fp8=True, rope_fused=4,
                      attention_fp8=2, fp8_stored_weights=13, sdpa_cudnn_first=2, gelu_epilogues=28)
    counters.add_reason("UNetModel:aa", "recompile", "0/0: tensor 'x' rank mismatch. expected 6, actual 4")
    text = cache_manager.report(CacheStore(tmp_path))
    unet = next(line for line in text.splitlines() if line.strip().startswith("UNetModel:aa"))
    pixart = next(line for line in text.splitlines() if line.strip().startswith("PixArt:bb"))
    assert "whole model, latent sizes traced as multiples of 8, 61 GroupNorms in channels-last order" in unet
    assert "97 conv weights made channels-last" in unet and "conv weights" not in pixart
    assert "regional: blocks[x28], fp8 linears" in pixart and "multiples" not in pixart
    assert "GroupNorm" not in pixart
    assert "4 query/key norm + rotary embeddings fused, 2 attentions in fp8 (cuDNN)" in pixart
    assert "attentions in fp8" not in unet
    assert ", cuDNN attention ahead of flash in 2 priority list(s)" in pixart and "ahead of flash" not in unet
    assert ", 28 linear + GELU pairs as one GEMM (GELU in its epilogue)" in pixart and "GELU" not in unet
    assert ", 13 fp8 GEMMs on the weights as stored (e4m3)" in pixart and "as stored" not in unet
    assert "fp8 linears left off (model width 1280 < 2048)" in unet and "left off" not in pixart
    assert ", max-autotune left off (convolutional UNet compiled whole)" in unet
    assert "recompile: 0/0: tensor 'x' rank mismatch" in text
    assert "host call" not in text
    counters.set_info("UNetModel:aa", host_patches=70, host_calls=70)
    unet = next(line for line in cache_manager.report(CacheStore(tmp_path)).splitlines()
                if line.strip().startswith("UNetModel:aa"))
    assert ("70 host-reading attention patch(es) run as 70 host call(s) in the graph (CUDA graphs, where on, "
            "between them)") in unet
    assert "background compile" not in text  # the option was off
    counters.set_info("UNetModel:aa", background="done in 147.3s")
    assert "    background compile: done in 147.3s" in cache_manager.report(CacheStore(tmp_path))
    assert "compile workers" not in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", compile_parts="6 parts, 5 from child processes")
    assert "    compile workers: 6 parts, 5 from child processes" in cache_manager.report(CacheStore(tmp_path))
    assert "slowest worker" not in cache_manager.report(CacheStore(tmp_path))
    assert "while tracing" not in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", compile_parts_streamed={"streamed": 2, "at_s": [5.374, 9.21]})
    assert "    parts shipped while tracing: 2, at 5.4, 9.2s\n" in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", compile_parts_streamed={"streamed": 2, "at_s": [5.374, 9.21],
                                                               "dropped": "part 0: mul changed after the cut"})
    assert ("    parts shipped while tracing: 2, at 5.4, 9.2s (dropped: part 0: mul changed after the cut; the "
            "traced graph was cut whole)") in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", compile_parts_slowest_child={
        "part": 2, "compile_s": 19.908, "phases_s": {"create_aot_dispatcher_function": 18.85,
                                                     "compile_fx_inner": 12.62, "GraphLowering.codegen": 7.77,
                                                     "Scheduler.codegen": 5.6}})
    assert ("    slowest worker: part 2, 19.9s (create_aot_dispatcher_function 18.9s, compile_fx_inner 12.6s, "
            "GraphLowering.codegen 7.8s)") in cache_manager.report(CacheStore(tmp_path))
    assert "parts' compile" not in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", compile_parts_each=[
        {"part": 0, "nodes": 262, "kernels": 26, "where": "here", "compile_s": 18.93},
        {"part": 1, "nodes": 667, "kernels": 9, "where": "child", "compile_s": 33.294},
        {"part": 2, "nodes": 625, "kernels": 12}])  # a part its worker did not deliver: no time
    assert ("    parts' compile: 0 (here) 18.9s (262 nodes, 26 kernels), 1 33.3s (667 nodes, 9 kernels)"
            in cache_manager.report(CacheStore(tmp_path)))
    assert "size guards from the parts" not in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", precompiled_late_size_guards=["81920*s33*s53*s92 <= 2147483647",
                                                                    "16*s33*s53*s92 <= 2147483647"])
    assert ("    size guards from the parts' compile: 2, checked on every call (e.g. 81920*s33*s53*s92 <= "
            "2147483647)") in cache_manager.report(CacheStore(tmp_path))
    assert nexfort_engine.stats()["models"]["UNetModel:aa"]["spatial_multiple"] == 8
    assert "first call:" not in cache_manager.report(CacheStore(tmp_path))
    counters.set_info("UNetModel:aa", trace_stand_ins=743)
    for name, seconds in (("setup", 0.41), ("verify", 0.02), ("dynamo_trace", 20.06), ("children_received", 23.42),
                          ("guards_built", 30.33), ("children_compiled", 42.02), ("trace_and_compile", 42.79),
                          ("cut", 1.34), ("load", 2.69), ("first_run", 3.52), ("settle", 1.31), ("commit", 0.25)):
        counters.set_phase("UNetModel:aa", name, seconds)
    text = cache_manager.report(CacheStore(tmp_path))
    assert ("    first call: setup 0.4s, cache check 0.0s, trace 20.1s, parts with the workers at 23.4s, guards built "
            "at 30.3s, workers done at 42.0s, trace and compile 42.8s, load 2.7s, first run 3.5s, garbage "
            "collection 1.3s, cache commit 0.2s") in text
    assert "743 F.linear traced through a stand-in" in next(
        line for line in text.splitlines() if line.strip().startswith("UNetModel:aa"))


def test_report_shows_the_prewarm(cache_manager, tmp_path, fresh_stats, monkeypatch):
    from nexfort_engine import prewarm

    assert "prewarm:" not in cache_manager.report(CacheStore(tmp_path))  # idle: not started here
    monkeypatch.setattr(prewarm, "_status", {"state": "done", "listed": 700, "imported": 300, "present": 398,
                                             "failed": 2, "seconds": 1.66})
    text = cache_manager.report(CacheStore(tmp_path))
    assert "prewarm: done, 698 of 700 modules loaded in 1.7s, 2 failed" in text


def test_report_names_graph_breaks_and_the_calls_saved_graphs_do_not_serve(cache_manager, tmp_path, fresh_stats):
    counters.set_info("UNetModel:cc", state="compiled", precompiled="on")
    counters.bump("UNetModel:cc", "compiles")
    text = cache_manager.report(CacheStore(tmp_path))
    assert "graph break" not in text and "saved graphs:" not in text
    counters.bump("UNetModel:cc", "graph_breaks")
    counters.add_reason("UNetModel:cc", "graph_break", "Unsupported Tensor.item() call with capture_scalar_outputs=False")
    counters.set_info("UNetModel:cc", precompiled="on; 1 call structure(s) through torch.compile (the trace broke: "
                      "UserError: x (at comfy_extras/nodes_model_downscale.py:37 in input_block_patch))")
    text = cache_manager.report(CacheStore(tmp_path))
    assert "compiles=1, recompiles=0, hits=0, graph breaks=1 (" in text
    assert "    graph break: Unsupported Tensor.item() call with capture_scalar_outputs=False" in text
    assert "    saved graphs: on; 1 call structure(s) through torch.compile" in text
    assert "nodes_model_downscale.py:37 in input_block_patch" in text


def test_report_shows_tuned_linears_and_the_gemm_table(cache_manager, tmp_path, fresh_stats):
    import json

    from nexfort_engine import gemm_tuning

    counters.set_info("PixArt:cc", state="compiled", regions=["blocks[x28]"], tuned_linears=112)
    text = cache_manager.report(CacheStore(tmp_path))
    assert ", 112 linears with the GEMM algorithm measured per shape" in text
    assert "GEMM tuning" not in text  # no table, nothing searched
    entry = {"m": 8192, "k": 1152, "n": 4608, "dtype": "float16", "epilogue": "gelu_bias"}
    (tmp_path / gemm_tuning.TABLE_FILE).write_text(json.dumps({"format": gemm_tuning.FORMAT_VERSION, "entries": {
        "a": {**entry, "config": {"id": 66, "tile_id": 20}}, "b": {**entry, "n": 1152, "config": None}}}))
    counters.bump_section(gemm_tuning.SECTION, "searched", 2)
    counters.set_section(gemm_tuning.SECTION, search_seconds=2.5)
    text = cache_manager.report(CacheStore(tmp_path))
    assert ("GEMM tuning: 2 shapes measured, 1 with a faster algorithm than torch's; this session searched 2 "
            "in 2.5s, read 0 from the table") in text
