"""A VAE decode (or encode) through nexfort, by memory format (GPU; a measurement, not part of the engine).

ComfyUI's SDXL-family ``AutoencoderKL`` (random weights, bf16) decodes a 1024² latent, eager and
compiled by the engine as the *Nexfort Compile VAE* node compiles it (``first_stage_model.decode``,
O2 unless ``--mode``), once per ``memory_format``. Each compiled run is a new process on its own
cache directory (the cold compile), followed by a second process on that cache (the warm start).
Reports per run: the first decode (compile or load included), the median decode after it, the
max abs difference from eager's output in the same process, and (unless ``--no-fp32-reference``)
eager's and the compiled decode's relative L2 error against a float32 decode with the same
weights, and their ratio (lossless: at most 1.5). ``--method encode`` times a 1024² image's encode
(``first_stage_model.encode``) instead; ``--options`` adds engine options (``{"static_first":
true}``), ``--other-size`` one call at another size after any background compile is done.

    python3 benchmarks/vae_decode.py --comfy-root /path/to/ComfyUI --cache-root /tmp/vae_cache
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
            "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def sdxl_vae(comfy_root: str) -> Any:
    """ComfyUI's SDXL-family ``AutoencoderKL`` on the GPU in bf16, with the bench's random weights
    (ComfyUI's layers skip weight init: uninitialised memory decodes to NaN)."""
    sys.path[:0] = [comfy_root, str(ROOT)]
    import torch
    from comfy.ldm.models.autoencoder import AutoencoderKL

    from benchmarks.models import init_weights

    torch.manual_seed(0)
    return init_weights(AutoencoderKL(ddconfig=dict(DDCONFIG), embed_dim=4).eval()).to("cuda", torch.bfloat16)


def _input(method: str, size: int) -> Any:
    """A decode's latent (size/8 squared, 4 channels) or an encode's image (size squared, in [-1, 1])."""
    import torch

    if method == "decode":
        return torch.randn(1, 4, size // 8, size // 8, device="cuda", dtype=torch.bfloat16)
    return torch.rand(1, 3, size, size, device="cuda", dtype=torch.bfloat16) * 2 - 1


def child(args: argparse.Namespace, fmt: str, cache: str | None) -> dict:
    vae = sdxl_vae(args.comfy_root)
    import torch

    import nexfort_engine
    from benchmarks.metrics import latent_error
    from benchmarks.text_to_image import compiling_in_background

    def timed(fn) -> tuple[float, list[float], torch.Tensor]:
        times, out = [], None
        for _ in range(args.repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(z)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times[0], times[1:], out

    with torch.inference_mode():  # as ComfyUI runs its nodes: the latents are inference tensors too
        z = _input(args.method, args.size)
        ref32 = None
        if args.fp32_reference:  # same weights upcast, decoded in float32, freed before timing
            twin = copy.deepcopy(vae).float()
            ref32 = getattr(twin, args.method)(z.float()).float()
            del twin
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        eager_first, eager_times, ref = timed(getattr(vae, args.method))
        rec = {"memory_format": fmt, "eager_ms": round(statistics.median(eager_times) * 1000, 2)}
        if ref32 is not None:
            rec["eager_rel_l2_vs_fp32"] = latent_error(ref, ref32)["rel_l2"]
        rec["eager_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        if fmt != "eager":
            options = {"mode": args.mode, "memory_format": fmt, **json.loads(args.options)}
            cm = nexfort_engine.compile(vae, options, cache_dir=cache, method=args.method)
            torch.cuda.reset_peak_memory_stats()
            first, times, out = timed(cm)
            stats = nexfort_engine.stats()
            rec.update(options=options, first_s=round(first, 2), compiled_ms=round(statistics.median(times) * 1000, 2),
                       max_abs_vs_eager=float((out.float() - ref.float()).abs().max()),
                       compiles=stats["compiles"], cache_hits=stats["cache_hits"], fallbacks=stats["fallbacks"],
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                       static_first=[m.get("static_first") for m in stats["models"].values() if m.get("static_first")])
            if ref32 is not None:  # lossless: compiled error vs float32 at most 1.5x eager's
                rec["compiled_rel_l2_vs_fp32"] = latent_error(out, ref32)["rel_l2"]
                rec["error_ratio"] = round(rec["compiled_rel_l2_vs_fp32"] / rec["eager_rel_l2_vs_fp32"], 3)
            if args.other_size:  # another size once no child compiles: the hand-over (static first)
                # decode on meanwhile, as a user would: a model leaves "background" at a call
                t0, waits = time.perf_counter(), 0
                while compiling_in_background() and time.perf_counter() - t0 < args.background_wait:
                    cm(z)
                    torch.cuda.synchronize()
                    waits += 1
                    time.sleep(0.5)
                rec["background_wait_s"], rec["background_decodes"] = round(time.perf_counter() - t0, 2), waits
                rec["background"] = {k: m.get("background") for k, m in nexfort_engine.stats()["models"].items()
                                     if m.get("background")}
                z2 = _input(args.method, args.other_size)
                before = nexfort_engine.stats()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cm(z2)
                torch.cuda.synchronize()
                rec["other_size_first_s"] = round(time.perf_counter() - t0, 2)
                t0 = time.perf_counter()
                cm(z2)
                torch.cuda.synchronize()
                rec["other_size_ms"] = round((time.perf_counter() - t0) * 1000, 2)
                after = nexfort_engine.stats()
                rec["other_size_new_compiles"] = after["compiles"] - before["compiles"]
                rec["other_size_recompiles"] = after["recompiles"] - before["recompiles"]
                rec["recompile_reasons"] = [str(r)[:600] for r in after.get("recompile_reasons") or []]
                rec["peak_gib_after"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    rec.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, mode=args.mode, size=args.size,
               method=args.method)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-root", required=True)
    ap.add_argument("--cache-root", required=True)
    ap.add_argument("--mode", default="O2")
    ap.add_argument("--method", choices=["decode", "encode"], default="decode",
                    help="what is compiled and timed: a 1024² decode (default) or a 1024² image's encode")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--formats", default="contiguous,channels_last")
    ap.add_argument("--options", default="{}", help="engine options JSON merged into the mode's, e.g. "
                    '\'{"static_first": true}\'')
    ap.add_argument("--other-size", type=int, default=0,
                    help="after the timed decodes (and any background compile), decode once at this size")
    ap.add_argument("--background-wait", type=float, default=300.0)
    ap.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false",
                    help="skip the float32 decode the errors are measured against")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child, args.cache)))
        return 0
    for fmt in args.formats.split(","):
        cache = str(Path(args.cache_root) / fmt)
        for run in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--comfy-root", args.comfy_root, "--cache-root",
                                  args.cache_root, "--mode", args.mode, "--size", str(args.size), "--repeat",
                                  str(args.repeat), "--child", fmt, "--cache", cache, "--options", args.options,
                                  "--method", args.method,
                                  "--other-size", str(args.other_size), "--background-wait", str(args.background_wait),
                                  *([] if args.fp32_reference else ["--no-fp32-reference"])],
                                 capture_output=True, text=True, check=False)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            rec = json.loads(lines[-1]) if lines else {"memory_format": fmt, "error": out.stderr[-800:]}
            rec["run"] = run
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
