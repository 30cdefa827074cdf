"""Does cuDNN's benchmark mode pay for a VAE decode? (GPU; a measurement, not part of the engine.)

The engine's ``benchmark`` flag turns on ``torch.backends.cudnn.benchmark`` per compiled call:
cuDNN then times every algorithm for each new convolution shape at its first call, in every new
process. For the UNets it did not change the speed (BENCHMARKS.md, SD2.1 static and SDXL dynamic)
but cost SDXL's warm start about 0.9 s. A VAE is almost all convolutions, so it is measured here:
ComfyUI's own SDXL-family ``AutoencoderKL`` (``vae_decode.sdxl_vae``: the bench's random weights,
bf16; run136 ran before the weights were initialised: its times stand, its values were never
read) decodes a 1024² latent; each mode runs in a new process (the search results live in the process) and reports the first decode
(which includes the search) and the median of the next ones. Inductor lowers convolutions to the
same cuDNN calls, so eager decode speed stands for the compiled one here.

    python3 benchmarks/vae_cudnn_benchmark.py --comfy-root /path/to/ComfyUI
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.vae_decode import sdxl_vae  # noqa: E402 - the repository root first


def child(comfy_root: str, benchmark: bool, layout: str, size: int, repeat: int) -> dict:
    vae = sdxl_vae(comfy_root)
    import torch

    torch.backends.cudnn.benchmark = benchmark
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    vae = vae.to(memory_format=fmt)
    z = torch.randn(1, 4, size // 8, size // 8, device="cuda", dtype=torch.bfloat16).to(memory_format=fmt)
    times = []
    with torch.inference_mode():
        for _ in range(repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            vae.decode(z)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return {"benchmark": benchmark, "layout": layout, "size": size, "first_s": round(times[0], 3),
            "median_ms": round(statistics.median(times[1:]) * 1000, 2), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-root", required=True)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of off/on per layout")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        bench, layout = args.child.split(",")
        print(json.dumps(child(args.comfy_root, bench == "on", layout, args.size, args.repeat)))
        return 0
    for _ in range(args.rounds):
        for layout in ("contiguous", "channels_last"):
            for mode in ("off", "on"):
                out = subprocess.run([sys.executable, __file__, "--comfy-root", args.comfy_root, "--size", str(args.size),
                                      "--repeat", str(args.repeat), "--child", f"{mode},{layout}"],
                                     capture_output=True, text=True, check=False)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
                print(lines[-1] if lines else json.dumps({"mode": mode, "layout": layout, "error": out.stderr[-500:]}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
