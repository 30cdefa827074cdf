"""benchmarks/text_to_image.py on CPU with tiny twins: valid JSON and Markdown, eager and nexfort.

The tool runs in subprocesses (as on a GPU machine), so ComfyUI never enters the pytest process.
nexfort runs with ``{"backend": "eager"}``: Dynamo traces the real ComfyUI model through the pack's
APPLY_MODEL wrapper, without Inductor's 50-100 s CPU compile. Speed is not asserted (CI machines
are shared); the structure of the results, the counters and the eager-vs-compiled error are, and the
FLOPs per step against a hand count of the tiny Flux (the nexfort run uses cfg 2, so the sampler
batches cond + uncond and the count must double).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench_module(module: str):
    """``benchmarks.<module>``, imported with the repo on ``sys.path`` for the import only."""
    import importlib

    sys.path.insert(0, str(REPO))
    try:
        return importlib.import_module(f"benchmarks.{module}")
    finally:
        sys.path.remove(str(REPO))


def _ev(name, start, end, device="DeviceType.CUDA"):
    """A profiler event as ``metrics`` reads it (name, time range, device type)."""
    from types import SimpleNamespace as NS

    return NS(name=name, time_range=NS(start=start, end=end), device_type=device)
HOST = Path(os.environ.get("NEXFORT_HOST") or REPO / ".host" / "ComfyUI").resolve()
TOOL = REPO / "benchmarks" / "text_to_image.py"

pytestmark = pytest.mark.skipif(not (HOST / "comfy").is_dir(), reason=f"no ComfyUI host at {HOST}: run `make host`")


def _bench(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    md = tmp_path / f"{name}.md"
    cmd = [sys.executable, str(TOOL), "--comfy-root", str(HOST), "--device", "cpu", "--tiny", "--model", "flux",
           "--steps", "3", "--repeat", "1", "--cache-dir", str(tmp_path / "cache"),
           "--output-json", str(out), "--output-markdown", str(md), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "RESULT model=flux" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "nexfort-bench/1"
    assert doc["env"]["torch"] and doc["env"]["comfyui"]
    assert md.read_text().startswith("### Metric")
    return doc["runs"][0]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("bench")
    return {
        "none": _bench(tmp, "none", "--compiler", "none", "--profile"),
        "nexfort": _bench(tmp, "nexfort", "--compiler", "nexfort", "--compiler-config", '{"backend": "eager"}',
                          "--cfg", "2", "--profile-host", "--vae-decode", "--offload-device", "cpu",
                          "--weights-device", "cpu"),
        "_dir": {"path": str(tmp)},
    }


def test_eager_run(results):
    r = results["none"]
    assert r["compiler"] == "none" and r["model"] == "flux" and r["tiny"]
    assert r["dtype"] == "float32"  # ComfyUI picks float32 on the CPU
    assert r["it_s"] > 0 and r["e2e_s"] > 0 and r["warmup_s"] > 0
    assert r["runs"][0]["steps_seen"] == 3
    # on the CPU the host clock is the step clock: 2 intervals of 3 steps, their median in ms
    run = r["runs"][0]
    assert 0 < run["host_ms_per_step"] <= 2 * 1000.0 / run["it_s"]
    # the per-step times behind it: on the CPU both clocks are the host's, so the lists agree, and
    # the run's own it/s is their mean rate
    assert len(run["step_ms"]) == len(run["host_step_ms"]) == 2
    assert run["step_ms"] == run["host_step_ms"]
    assert abs(2000.0 / sum(run["step_ms"]) - run["it_s"]) <= 0.01 * run["it_s"]
    assert run["t0_perf_s"] > 0
    assert r["latent_finite"] and r["latent_std"] > 0
    assert r["compiles"] == 0 and r["peak_mem_gib"] is None
    assert {"gc_ms", "gc_collections", "host_copy_waits", "cudagraph_replays"} <= set(run)


def test_nexfort_run(results):
    r = results["nexfort"]
    assert r["compiler"] == "nexfort"
    assert r["compiler_config_resolved"]["backend"] == "eager"
    assert r["compiles"] >= 1 and r["fallbacks"] == 0, r.get("fallback_reasons")
    assert r["it_s"] > 0 and r["warmup_s"] > 0
    # where the warm-up went: Dynamo's phase timers (nested, each >= 0.5 s), at most the warm-up
    phases = r["compile_phases_s"]
    assert all(0.5 <= v <= r["warmup_s"] + 1 for v in phases.values()), (phases, r["warmup_s"])
    # the eager backend runs the same kernels: the compiled latent equals eager's up to rounding
    err = r["err_vs_eager"]
    assert err["finite"] and err["max_abs"] < 1e-3, err
    # --vae-decode: the first image is the first sampling and its decode (Flux's 16 latent channels)
    assert r["vae_first_decode_s"] > 0 and r["vae_decode_ms"] > 0
    assert abs(r["first_image_s"] - (r["warmup_s"] + r["vae_first_decode_s"])) < 1e-6
    # the compile node's own run is timed apart from the first sampling
    assert r["weights_device"] == "cpu" and r["offload_device"] == "cpu"
    assert 0 <= r["compile_node_s"] < r["warmup_s"], (r["compile_node_s"], r["warmup_s"])
    assert results["none"]["weights_device"] == "load" and results["none"]["compile_node_s"] < 0.01
    # the tuned-GEMM record: per model (none on CPU: the pass is for 16-bit CUDA linears), and the table's counters
    assert r["tuned_linears"] and set(r["tuned_linears"].values()) == {0}, r["tuned_linears"]
    assert isinstance(r["gemm_tuning"], dict) and "gemm_tuning" not in results["none"]


def test_controlnet_run(tmp_path):
    """``--controlnet 0.5 --compile-controlnet`` on the tiny SDXL: ComfyUI's ControlNet class,
    compiled by the pack's glue, runs beside the compiled UNet for the first half of the steps; the
    compiled latent equals eager's (both with the control), the ControlNet compiled one graph and
    the UNet two (with and without the ``control`` input), the second one reported as a recompile
    that names it."""
    out = tmp_path / "cn.json"
    cmd = [sys.executable, str(TOOL), "--comfy-root", str(HOST), "--device", "cpu", "--tiny", "--model", "sdxl",
           "--steps", "4", "--repeat", "1", "--cache-dir", str(tmp_path / "cache"), "--output-json", str(out),
           "--compiler", "nexfort", "--compiler-config", '{"backend": "eager"}', "--controlnet", "0.5",
           "--compile-controlnet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    r = json.loads(out.read_text())["runs"][0]
    assert r["controlnet_end_percent"] == 0.5 and r["controlnet_params"] > 0
    assert r["fallbacks"] == 0, r["fallback_reasons"]
    assert r["controlnet_compiled"] and r["compiles"] == 3 and r["recompiles"] == 1, r["recompile_reasons"]
    assert "control" in r["recompile_reasons"][0]
    assert r["err_vs_eager"]["finite"] and r["err_vs_eager"]["max_abs"] < 1e-3, r["err_vs_eager"]
    with pytest.raises(ValueError, match="not a UNet"):
        _bench_module("models").build_controlnet(_bench_module("models").get_spec("flux", tiny=True), None, None, None)


def test_patch_run(tmp_path):
    """``--patch pag`` on the tiny SDXL: ComfyUI's Perturbed-Attention Guidance node on the compiled
    model (and on the eager reference): the latent equals eager's; the guidance pass's other options
    compile a second graph, once; nothing breaks the graph."""
    out = tmp_path / "pag.json"
    cmd = [sys.executable, str(TOOL), "--comfy-root", str(HOST), "--device", "cpu", "--tiny", "--model", "sdxl",
           "--steps", "3", "--repeat", "1", "--cache-dir", str(tmp_path / "cache"), "--output-json", str(out),
           "--compiler", "nexfort", "--compiler-config", '{"backend": "eager"}', "--patch", "pag"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    r = json.loads(out.read_text())["runs"][0]
    assert r["patch"] == "pag" and r["fallbacks"] == 0, r["fallback_reasons"]
    assert r["compiles"] == 2 and r["graph_breaks"] == 0, (r["recompile_reasons"], r["graph_break_reasons"])
    assert r["err_vs_eager"]["finite"] and r["err_vs_eager"]["max_abs"] < 1e-3, r["err_vs_eager"]
    with pytest.raises(SystemExit):
        _bench_module("text_to_image").parse_args(["--patch", "nope"])


def test_weights_on_the_cpu_need_the_cpu_as_offload_device():
    tool = _bench_module("text_to_image")
    assert tool.parse_args(["--weights-device", "cpu", "--offload-device", "cpu"]).weights_device == "cpu"
    with pytest.raises(SystemExit):
        tool.parse_args(["--weights-device", "cpu"])


def test_report_merges_runs(results, tmp_path):
    report = _bench_module("report")
    d = Path(results["_dir"]["path"])
    docs = report.load([d / "none.json", d / "nexfort.json"])
    md = report.render(docs)
    assert "| PyTorch (eager) iteration speed |" in md
    nexfort_row = next(line for line in md.splitlines() if line.startswith("| nexfort iteration speed"))
    assert "it/s (" in nexfort_row and "%)" in nexfort_row  # speed-up against the eager column
    summary = [line for line in md.splitlines() if line.startswith("| CPU | flux |")]
    assert len(summary) == 2
    assert "### Where the time goes" in md  # the eager run was profiled
    msg = report.chart(docs, tmp_path / "chart.png")
    assert msg.startswith("chart written") or "matplotlib is not installed" in msg


def _tiny_flux_flops() -> tuple[int, int]:
    """(all, attention) FLOPs of one tiny-Flux call at batch 1, 64x64 pixels, by hand from its config:
    2*tokens*in*out per linear layer, 4*heads*L*L*head_dim per joint attention over L tokens."""
    models = _bench_module("models")
    spec = models.get_spec("flux", tiny=True)
    c = spec.unet_config
    hid, p = c["hidden_size"], c["patch_size"]
    mlp, heads = int(hid * c["mlp_ratio"]), c["num_heads"]
    t_img = (spec.height // 8 // p) * (spec.width // 8 // p)
    t_txt = spec.text_len
    t_all = t_img + t_txt

    def lin(tokens: int, i: int, o: int) -> int:
        return 2 * tokens * i * o

    embed = (lin(t_img, c["in_channels"] * p * p, hid) + 2 * (lin(1, 256, hid) + lin(1, hid, hid))  # img, time, guidance
             + lin(1, c["vec_in_dim"], hid) + lin(1, hid, hid) + lin(t_txt, c["context_in_dim"], hid))
    double = 2 * lin(1, hid, 6 * hid) + sum(
        lin(t, hid, 3 * hid) + lin(t, hid, hid) + lin(t, hid, mlp) + lin(t, mlp, hid) for t in (t_img, t_txt))
    single = lin(1, hid, 3 * hid) + lin(t_all, hid, 3 * hid + mlp) + lin(t_all, hid + mlp, hid)
    final = lin(1, hid, 2 * hid) + lin(t_img, hid, c["out_channels"] * p * p)
    blocks = c["depth"] + c["depth_single_blocks"]
    attn = blocks * 4 * heads * t_all * t_all * (hid // heads)
    total = embed + c["depth"] * double + c["depth_single_blocks"] * single + final + attn
    return total, attn


def test_flops_and_peak(results):
    total, attn = _tiny_flux_flops()
    r = results["none"]
    assert r["flops_model_calls"] == 1 and r["flops_model_batch"] == [1]  # cfg 1: no uncond pass
    assert r["attention_function"] == "attention_pytorch" and r["flops_attention_counted"]
    # the CPU SDPA kernel is counted (torch's FlopCounterMode alone has no formula for it)
    assert sum(n for op, n in r["flops_by_op"].items() if "attention" in op) == attn
    assert abs(r["flops_per_step"] - total) <= 0.02 * total, (r["flops_per_step"], total, r["flops_by_op"])
    n = results["nexfort"]
    assert n["flops_model_batch"] == [2] and n["flops_per_step"] == 2 * r["flops_per_step"]  # cfg 2: cond + uncond

    for run in (r, n):
        peak = run["device_peak_tflops"]
        assert set(peak) == {"fp32", "fp16", "bf16", "fp8"}
        assert peak["fp32"] > 0 and peak["fp8"] is None  # no fp8 matmul on the CPU
        assert run["device_peak_method"]["n"] == 512
        assert run["device_peak_method"]["statistic"] == "median block"
        best = run["device_peak_best_tflops"]
        assert best["fp32"] >= peak["fp32"] and best["fp8"] is None
        low, high = run["device_peak_method"]["spread_tflops"]["fp32"]
        assert low <= high
        assert run["peak_dtype"] == "fp32"
        assert run["achieved_tflops"] == pytest.approx(run["flops_per_step"] * run["it_s"] / 1e12)
        assert run["pct_of_peak"] == pytest.approx(100 * run["achieved_tflops"] / peak["fp32"])


def test_block_times_warms_up_then_times_each_block():
    metrics = _bench_module("metrics")
    calls = []
    import torch

    secs = metrics.block_times(lambda: calls.append(1), torch.device("cpu"), iters=4, blocks=3, warm_s=0.05)
    assert len(secs) == 3 and all(s > 0 for s in secs)
    assert len(calls) > 12  # the warm-up ran for 50 ms (many calls) before the 3 x 4 timed ones
    calls.clear()
    metrics.block_times(lambda: calls.append(1), torch.device("cpu"), iters=2, blocks=2)
    assert len(calls) == 1 + 4  # no warm-up time: one call, then the blocks


def test_report_tflops_column(results):
    report = _bench_module("report")
    d = Path(results["_dir"]["path"])
    md = report.render(report.load([d / "none.json", d / "nexfort.json"]))
    head = next(line for line in md.splitlines() if line.startswith("| GPU |"))
    col = [c.strip() for c in head.split("|")].index("TFLOP/s (% peak)")
    for line in (line for line in md.splitlines() if line.startswith("| CPU | flux |")):
        assert line.split("|")[col].strip().endswith("% fp32)"), line
    # results written before these fields existed still render, with an empty cell
    old = sorted((REPO / "benchmarks" / "results").glob("*/run*.json"))
    if old:
        md_old = report.render(report.load(old[:1]))
        row = next(line for line in md_old.splitlines() if line.startswith("| NVIDIA"))
        assert row.split("|")[col].strip() == ""


def test_profile_breakdown(results):
    """--profile: one profiled sampling run, op time per step by category (CPU: self time of aten ops)."""
    p = results["none"]["profile"]
    assert p["steps"] == 3 and p["wall_ms_per_step"] > 0
    assert 0 < p["gpu_busy_ms_per_step"] <= p["wall_ms_per_step"]
    cats = p["by_category_ms_per_step"]
    assert cats.get("gemm", 0) > 0  # aten::mm / addmm / linear of the tiny Flux
    assert abs(sum(cats.values()) - p["gpu_busy_ms_per_step"]) < 0.01 * p["gpu_busy_ms_per_step"] + 0.01 * len(cats)
    top = p["top_kernels"]
    assert top and top[0]["ms_per_step"] >= top[-1]["ms_per_step"]


def test_profile_host_and_cudagraph_state(results):
    """--profile-host: one cProfile'd sampling run, Python time per step by function; every
    compiled row carries the CUDA-graph
    trees' state (on the CPU: Inductor's counters only, no tree manager)."""
    r = results["nexfort"]
    h = r["profile_host"]
    assert h["steps"] == 3 and h["wall_ms_per_step"] > 0
    cum = h["top_cumulative"]
    assert cum and all(a["cum_ms_per_step"] >= b["cum_ms_per_step"] for a, b in zip(cum, cum[1:]))
    # the sampling run itself is profiled: ComfyUI's sampler covers most of the wall time
    assert any("samplers.py" in row["fn"] for row in cum), [row["fn"] for row in cum]
    assert cum[0]["cum_ms_per_step"] >= 0.5 * h["wall_ms_per_step"]
    assert all(row["self_ms_per_step"] >= 0 and row["calls_per_step"] > 0 for row in h["top_self"])
    cg = r["cudagraphs"]
    assert "error" not in cg and isinstance(cg["counters"], dict) and "functions" not in cg


def test_host_waits_counts_what_a_sampling_waited_for():
    """The bench's per-sampling counters: garbage collections, host-copy waits (one per copy), and
    CUDA-graph tree replays/warm-ups (none on the CPU); the patched methods are put back after."""
    import gc
    import time

    import torch

    from nexfort_engine import host_call

    HostWaits = _bench_module("text_to_image").HostWaits

    class SlowEvent:
        def synchronize(self) -> None:
            time.sleep(0.01)

    before = host_call.HostCopied.__dict__["_host"]
    sigmas = torch.tensor([14.6, 0.0])
    wrapped = host_call.HostCopied._wrap(sigmas, sigmas.clone(), [SlowEvent()])
    with HostWaits() as waits:
        for _ in range(3):
            assert wrapped.detach().cpu()[0].item() == sigmas[0].item()
        gc.collect()
    got = waits.summary()
    assert got["host_copy_waits"] == 1 and got["host_copy_wait_ms"] >= 10.0
    assert got["gc_collections"] >= 1 and got["gc_ms"] > 0
    assert got["cudagraph_replays"] == got["cudagraph_records"] == got["cudagraph_warmups"] == 0
    assert host_call.HostCopied.__dict__["_host"] is before and waits._on_gc not in gc.callbacks


def test_kernel_category():
    kernel_category = _bench_module("metrics").kernel_category

    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_category("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert kernel_category("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc") == "conv"
    assert kernel_category("triton_red_fused_native_group_norm_silu_3") == "triton"
    assert kernel_category("triton_poi_fused_add_convolution_native_group_norm_silu_6") == "triton"
    assert kernel_category("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_56") == "triton"
    assert kernel_category("triton_tem_fused_mm_0") == "gemm"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert kernel_category("aten::mm") == "gemm" and kernel_category("aten::addmm") == "gemm"


def test_idle_gaps():
    """The gap analysis of ``--profile`` on a made-up event list: two streams overlapping, one
    gap under the threshold, two over it; host ops credited by their time inside each gap."""
    idle_gaps = _bench_module("metrics").idle_gaps


    events = [
        _ev("k1", 0, 100), _ev("k2", 50, 300),  # overlapping: busy until 300
        _ev("k3", 310, 400),  # a 10 us gap: under the 20 us threshold
        _ev("k4", 500, 600),  # a 100 us gap after k3
        _ev("k5", 1000, 1100),  # a 400 us gap after k4
        _ev("aten::copy_", 600, 900, "DeviceType.CPU"), _ev("aten::linear", 850, 1200, "DeviceType.CPU"),
        _ev("aten::mm", 420, 450, "DeviceType.CPU"), _ev("cudaLaunchKernel", 700, 710, "DeviceType.CPU"),
    ]
    out = idle_gaps(events, steps=2)
    assert out["idle_ms_per_step"] == 0.25 and out["gaps_per_step"] == 1.0 and out["span_ms_per_step"] == 0.55
    first, second = out["largest"]
    assert (first["us"], first["after_kernel"], first["before_kernel"]) == (400.0, "k4", "k5")
    assert first["host_ops"] == ["aten::copy_ 300.0us", "aten::linear 150.0us"]
    assert (second["us"], second["after_kernel"], second["before_kernel"], second["host_ops"]) == (
        100.0, "k3", "k4", ["aten::mm 30.0us"])
    assert idle_gaps([_ev("k1", 0, 1)], steps=1) == {} and idle_gaps([], steps=1) == {}


def test_calls_by_position():
    """Mean duration of each call position within a step: two steps of attention (two blocks of one
    kind, then one of another); a kernel whose calls do not divide into the steps is left out."""
    calls_by_position = _bench_module("metrics").calls_by_position


    events = [_ev("attn", -50, -1),  # a call before the sampling loop
              _ev("attn", 0, 10), _ev("attn", 20, 32), _ev("attn", 40, 60),  # step 1
              _ev("attn", 100, 110), _ev("attn", 120, 130), _ev("attn", 140, 162),  # step 2
              _ev("odd", 0, 1), _ev("odd", 2, 3), _ev("odd", 4, 5),
              _ev("attn", 200, 300, "DeviceType.CPU")]
    # "odd": 3 calls over 2 steps is not one per step plus a few outside the loop
    assert calls_by_position(events, ["attn", "odd"], steps=2) == {"attn": [10.0, 11.0, 21.0]}
    assert calls_by_position(events, ["attn"], steps=2, max_calls=2) == {}


def test_unet_call_tool_reports_the_fold_and_the_generated_code(tmp_path):
    """benchmarks/unet_call.py (compiler-side A/B outside the sampler) with the eager backend: it
    runs, the fold is on by default and off with spatial_multiple 1, one graph over two sizes."""
    tool = REPO / "benchmarks" / "unet_call.py"
    results = {}
    for sm in (None, 1):
        options = {"mode": "O2", "backend": "eager", "spatial_multiple": sm}
        out = tmp_path / f"fold{sm}.json"
        cmd = [sys.executable, str(tool), "--options", json.dumps(options), "--size", "128", "128",
               "--second-size", "128", "192", "--repeat", "2", "--cache-dir", str(tmp_path / f"c{sm}"),
               "--output-json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "NEXFORT_HOST": str(HOST)})
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        results[sm] = json.loads(out.read_text())
    assert results[None]["fold"] == 8 and results[1]["fold"] == 1
    for r in results.values():
        assert r["graphs"] == 1 and r["recompiles"] == 0 and r["fallbacks"] == 0
        assert r["max_abs_err_vs_eager"] == 0.0 and r["cold_s"] > 0 and r["ms_per_call"] > 0


def test_profile_warm_start_script(tmp_path):
    """benchmarks/profile_warm_start.sh (a device tool) on CPU: a cold run fills the cache, the warm
    child runs under cProfile, and the profile, its text summary and the child's result come out."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "ComfyUI").symlink_to(HOST)
    out = tmp_path / "out"
    env = {**os.environ, "NEXFORT_DEVICE_WORK": str(work), "OUT": str(out), "PYTHON": sys.executable}
    args = "--device cpu --tiny --model flux --steps 3 --compiler-config '{\"backend\": \"eager\"}'"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "profile_warm_start.sh"), "tiny", args],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT model=flux" in proc.stdout and "tiny warm-up" in proc.stdout
    assert (out / "tiny_warm.prof").stat().st_size > 0
    summary = (out / "tiny_warm.txt").read_text()
    assert "cumulative" in summary and "nexfort_engine" in summary
    child = json.loads((out / "tiny_child.json").read_text())["runs"][0]
    assert child["warmup_s"] > 0 and child["cache_dir_was_empty"] is False


def test_summary_lists_every_run_of_an_ab_call():
    """An A/B call has several runs per compiler in one column: the summary lists each, eager first,
    with the benchmark knobs that tell them apart in the config cell."""
    report = _bench_module("report")

    def run(compiler, it_s, **extra):
        return {"model": "flux", "height": 64, "width": 64, "steps": 2, "batch": 1, "compiler": compiler,
                "compiler_config": '{"mode": "O3"}' if compiler == "nexfort" else "", "it_s": it_s, **extra}

    rows = report.flatten([{"env": {"gpu": "G"}, "runs": [
        run("nexfort", 11.0, attention_experiment="cudnn-fp8"), run("nexfort", 12.0), run("none", 6.0)]}])
    lines = [line for line in report.summary_table(rows).splitlines() if line.startswith("| G |")]
    assert len(lines) == 3 and "| none |" in lines[0]
    assert "attention=cudnn-fp8` | 11.00 | 1.83x" in lines[1] and '{"mode": "O3"}` | 12.00 | 2.00x' in lines[2]


def test_probe_records_cudagraph_input_copies(tmp_path):
    """``NX_PROBE_CG_COPIES=1`` wraps CUDA-graph trees' input copy: the copy still happens, and the
    probe's exit record lists what was copied (here on CPU tensors, through the real method)."""
    out = tmp_path / "probe.jsonl"
    code = (
        "import types, torch\n"
        "from torch._inductor import cudagraph_trees as m\n"
        "node = types.SimpleNamespace(non_static_input_idx=[0, 2], expanded_dims=[[], [], []])\n"
        "dst = [torch.zeros(4, 8), torch.zeros(2), torch.zeros(3)]\n"
        "src = [torch.ones(4, 8), torch.ones(2), torch.nn.Parameter(torch.ones(3))]\n"
        "m.CUDAGraphNode._copy_inputs_and_remove_from_src(node, dst, src)\n"
        "assert dst[0].sum() == 32 and dst[2].sum() == 3 and dst[1].sum() == 0 and src[0] is None\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "benchmarks" / "probe_site"), "NX_PROBE_CG_COPIES": "1",
           "NX_PROBE_OUT": str(out)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    rec = json.loads(out.read_text().splitlines()[-1])
    (copies,) = rec["cudagraph_copies"]
    assert copies["calls"] == 1 and copies["tensors"] == 2 and copies["parameters"] == 1
    assert copies["bytes"] == 4 * 8 * 4 + 3 * 4
    assert copies["largest"][0] == [128, 0, [4, 8], "torch.float32", False]
