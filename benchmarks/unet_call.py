"""Time one compiled UNet call outside the sampler: cold compile, a second resolution, steady state.

For compiler-side changes measured on a machine without a GPU (the shape policy, graph passes):
an SD1.5-topology UNet (4 levels, 3 downsamples, the real block classes from ComfyUI) at a small
width, compiled by the engine with the given options into a fresh cache directory, then

* ``cold_s``: the first call (Dynamo + Inductor + the C++/Triton kernel builds);
* ``second_size_s``: a call at another resolution and prompt length (no new graph expected);
* ``ms_per_call``: median of ``--repeat`` calls at the first resolution after warm-up;
* with ``--profile``, the top ops and (CPU) the time spent in the generated code per call;
* the generated code's size and how many runtime floor divisions (``c10::div_floor_integer`` on
  CPU, ``//`` in Triton index math on the GPU) it contains.

    python benchmarks/unet_call.py --options '{"mode": "O2"}' --output-json out.json
    python benchmarks/unet_call.py --options '{"mode": "O2", "spatial_multiple": 1}'

Each configuration runs in its own process (a fresh Dynamo and Inductor state).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: SD1.5's topology (channel_mult 1, 2, 4, 4; attention on the first three levels) at a small width
UNET_CONFIG = {
    "model_channels": 32, "in_channels": 4, "out_channels": 4, "num_res_blocks": [1, 1, 1, 1],
    "channel_mult": [1, 2, 4, 4], "transformer_depth": [1, 1, 1, 0], "transformer_depth_output": [1, 1, 1, 1, 1, 1, 0, 0],
    "context_dim": 64, "num_heads": 2, "num_head_channels": -1, "use_linear_in_transformer": False,
    "adm_in_channels": None, "use_spatial_transformer": True, "legacy": False,
    "transformer_depth_middle": 1, "use_temporal_resblock": False, "use_temporal_attention": False,
    "dims": 2, "num_classes": None, "image_size": 32, "use_checkpoint": False,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--options", default='{"mode": "O2"}', help="nexfort options JSON")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", type=int, nargs=2, default=(512, 512), metavar=("H", "W"), help="pixels (latent = /8)")
    p.add_argument("--second-size", type=int, nargs=2, default=(512, 768), metavar=("H", "W"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--cache-dir", type=Path, default=None, help="default: a fresh temporary directory (cold)")
    p.add_argument("--profile", action="store_true", help="print the 15 ops with the most self time per call")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()

    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="nexfort_unet_call_"))
    os.environ["NEXFORT_CACHE_DIR"] = str(cache)
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO))
    import tiny_models as tm  # ComfyUI booted the way the tests do (--cpu on a CPU machine)
    import torch

    import nexfort_engine

    tm.boot()
    import comfy.supported_models

    device = torch.device(args.device)
    model = tm.init_weights(comfy.supported_models.SD15(dict(UNET_CONFIG)).get_model({}), 0)
    unet = model.diffusion_model.to(device)
    compiled = nexfort_engine.compile(unet, args.options, label="unet_call")

    def inputs(h: int, w: int, ctx: int, seed: int = 0) -> tuple:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(args.batch, 4, h // 8, w // 8, generator=g).to(device)
        t = (torch.rand(args.batch, generator=g) * 999).to(device)
        c = torch.randn(args.batch, ctx, UNET_CONFIG["context_dim"], generator=g).to(device)
        return x, t, c

    def call(fn, x, t, c):
        out = fn(x, t, c, transformer_options={})
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    x, t, c = inputs(*args.size, 77)
    t0 = time.perf_counter()
    out = call(compiled, x, t, c)
    cold = time.perf_counter() - t0
    err = (out - unet(x, t, c, transformer_options={})).abs().max().item()
    x2, t2, c2 = inputs(*args.second_size, 154, seed=1)
    t0 = time.perf_counter()
    call(compiled, x2, t2, c2)
    second = time.perf_counter() - t0
    for _ in range(3):
        call(compiled, x, t, c)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        call(compiled, x, t, c)
        times.append(time.perf_counter() - t0)
    eager = []
    for _ in range(max(3, args.repeat // 2)):
        t0 = time.perf_counter()
        call(unet, x, t, c)
        eager.append(time.perf_counter() - t0)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                call(compiled, x, t, c)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        print(averages.table(sort_by=key, row_limit=15, max_name_column_width=70))
        # on CPU the generated C++ kernels run inside the compiled graph's call without events of
        # their own: its self time is the time in Inductor's code (library ops are listed apart)
        generated_us = sum(e.self_cpu_time_total for e in averages if e.key.startswith("## Call CompiledFxGraph"))
        profiled = {"generated_code_ms_per_call": round(generated_us / 3 / 1e3, 2)}
    else:
        profiled = {}

    code = [f.read_text(errors="replace") for f in cache.rglob("*.py")]
    kernels = "\n".join(code)
    stats = nexfort_engine.stats()["models"][compiled.label]
    result = {
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu x{os.cpu_count()}",
        "options": json.loads(args.options),
        "fold": compiled._nx_fold,
        "cold_s": round(cold, 2),
        "second_size_s": round(second, 3),
        "ms_per_call": round(statistics.median(times) * 1e3, 2),
        "eager_ms_per_call": round(statistics.median(eager) * 1e3, 2),
        "max_abs_err_vs_eager": err,
        "graphs": stats["compiles"],
        "recompiles": stats["recompiles"],
        "fallbacks": stats["fallbacks"],
        "code_chars": len(kernels),
        **profiled,
        "runtime_floor_divisions": len(re.findall(r"div_floor_integer|\bks\d+\b\)?\s*//|//\s*\(?\bks\d+", kernels)),
    }
    print(json.dumps(result, indent=1))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
