"""Microbenchmark: single-token fp8 linears (a DiT block's adaLN modulation), ``_scaled_mm`` vs a weight-only Triton product.

For Flux's modulation linears at batch 1 and 2 (3072 -> 9216 single block, 3072 -> 18432 double
block) this times, each call replayed from a CUDA graph of ``--calls`` calls (these kernels are
shorter than a Python call, so eager timing would measure the host):

* ``scaled_mm``: the activation quantized by row, then ``torch._scaled_mm`` with the cached e4m3
  weight (what the fp8 graphs ran before: cuBLAS picks 128-row tiles for one row);
* ``bf16 linear``: ``F.linear`` with the 16-bit weight (what a bf16 model runs);
* ``triton BNxBKxWxS``: :func:`benchmarks.fp8_gemv.triton_gemv` (an experiment, not in the engine)
  for several launch configurations (``auto`` = :data:`benchmarks.fp8_gemv.GEMV_CONFIG`), with its
  error against the float32 twin.

Each case replays the same weight, which then stays in L2 (28-56 MB of e4m3 against the H200's
L2): the kernel times here are better than in a model, where the weights come from memory.

GB/s counts the e4m3 weight read once (the bf16 row: the 16-bit weight).

    python3 benchmarks/fp8_gemv_kernels.py --output-json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (
    fp8_gemv,  # noqa: E402
    metrics,  # noqa: E402
)
from nexfort_engine import fp8  # noqa: E402

#: (BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 4),
           (64, 256, 4, 4), (64, 256, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3)]
#: name -> (rows, in features, out features)
CASES: dict[str, tuple[int, int, int]] = {
    "flux single-block modulation, batch 1": (1, 3072, 9216),
    "flux double-block modulation, batch 1": (1, 3072, 18432),
    "flux double-block modulation, batch 2": (2, 3072, 18432),
}


def measure(name: str, calls: int) -> dict[str, Any]:
    m, k, n = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    wq, ws = fp8.quantize_rowwise(w)
    ref = fp8_gemv.torch_gemv(x, wq, ws, b).float()
    row: dict[str, Any] = {"case": name, "rows": m, "k": k, "n": n}

    def record(label: str, fn: Callable[[], torch.Tensor], nbytes: int) -> None:
        out = fn()
        seconds = metrics.time_graph(fn, calls)
        row[label] = {"us": round(seconds * 1e6, 2), "GB/s": round(nbytes / seconds / 1e9, 1),
                      "max_rel_err": round(float((out.float() - ref).abs().max() / ref.abs().max()), 5)}

    def scaled() -> torch.Tensor:
        xq, sx = fp8.quantize_rowwise(x)
        return fp8._scaled_mm(xq, wq, sx, ws, b)

    record("scaled_mm", scaled, wq.numel())
    record("bf16 linear", lambda: F.linear(x, w, b), w.numel() * 2)
    for config in [None, *CONFIGS]:
        label = "triton " + "x".join(map(str, config or fp8_gemv.GEMV_CONFIG)) + (" (auto)" if config is None else "")
        if config == fp8_gemv.GEMV_CONFIG:
            continue
        record(label, lambda config=config: fp8_gemv.triton_gemv(x, wq, ws, b, config=config), wq.numel())
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("fp8_gemv_kernels needs a CUDA device\n")
        return 2
    metrics.run_kernel_cases(list(CASES), lambda name: measure(name, a.calls), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
