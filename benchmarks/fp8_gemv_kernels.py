"""Microbenchmark: single-token fp8 linears (a DiT block's adaLN modulation), ``_scaled_mm`` vs weight-only Triton products.

For Flux's modulation linears at batch 1 and 2 (3072 -> 9216 single block, 3072 -> 18432 double
block) this times, each call replayed from a CUDA graph of ``--calls`` calls (these kernels are
shorter than a Python call, so eager timing would measure the host):

* ``scaled_mm``: the activation (``silu(vec)``) quantized by row, then ``torch._scaled_mm`` with
  the cached e4m3 weight (what the fp8 graphs ran before the weight-only product: cuBLAS picks
  128-row tiles for one row);
* ``bf16 linear``: ``F.linear`` with the 16-bit weight (what a bf16 model runs);
* ``rows BNxBKxW``: :func:`benchmarks.fp8_gemv.triton_gemv_rows` (the register-only form, silu in
  the kernel) for several launch configurations (``auto`` = ``fp8_gemv.ROWS_CONFIG``; run98 called
  these ``engine``: the form was in the engine for that run);
* ``dot BNxBKxWxS``: the earlier ``tl.dot`` experiment, :func:`benchmarks.fp8_gemv.triton_gemv`
  (``auto`` only), with silu as its own kernel;

each with its error against the float32 twin. These cases replay the same weight, which then stays
in L2 (28-56 MB of e4m3 against the H200's L2). The ``flux step`` case is what a model sees: the 76
modulation products of one Flux step (19 double blocks x 2, 38 single blocks), each with its own
weight (3.2 GB of e4m3: from memory), replayed as one graph; its ``us`` is per step. The ``stacked``
case is the same bytes as one product (every block's modulation reads the same ``silu(vec)``).

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

#: the register-only kernel's (BLOCK_N, BLOCK_K, num_warps)
CONFIGS = [(4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 4),
           (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (64, 256, 8)]
#: name -> (rows, in features, out features)
CASES: dict[str, tuple[int, int, int]] = {
    "flux single-block modulation, batch 1": (1, 3072, 9216),
    "flux double-block modulation, batch 1": (1, 3072, 18432),
    "flux double-block modulation, batch 2": (2, 3072, 18432),
}
STEP = "flux step: 76 modulation products, distinct weights"
STACKED = "flux step: the 76 products' weights stacked, one product"
DOT_LABEL = "dot " + "x".join(map(str, fp8_gemv.GEMV_CONFIG)) + " (auto)"


def _rows_variants(configs: list[tuple[int, int, int]]) -> list[tuple[str, tuple[int, int, int] | None]]:
    """(label, config) of the register-only form: the default (``None``, "auto") and each other
    configuration of ``configs``."""
    return [("rows " + "x".join(map(str, config or fp8_gemv.ROWS_CONFIG)) + (" (auto)" if config is None else ""),
             config) for config in [None, *configs] if config != fp8_gemv.ROWS_CONFIG]


@torch.compile(dynamic=False)
def _silu_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu + the rowwise quantization as one Inductor kernel, as the model's graph runs it."""
    return fp8.quantize_rowwise(F.silu(x))


def _silu_quant_mm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    xq, sx = _silu_quant(x)
    return fp8._scaled_mm(xq, wq, sx, ws, b)


def measure(name: str, calls: int, configs: list[tuple[int, int, int]]) -> dict[str, Any]:
    m, k, n = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    wq, ws = fp8.quantize_rowwise(w)
    ref = fp8_gemv.torch_gemv(x.float(), wq, ws, b.float(), "silu")
    row: dict[str, Any] = {"case": name, "rows": m, "k": k, "n": n}

    def record(label: str, fn: Callable[[], torch.Tensor], nbytes: int) -> None:
        out = fn()
        seconds = metrics.time_graph(fn, calls)
        row[label] = {"us": round(seconds * 1e6, 2), "GB/s": round(nbytes / seconds / 1e9, 1),
                      "max_rel_err": round(float((out.float() - ref).abs().max() / ref.abs().max()), 5)}

    record("scaled_mm", lambda: _silu_quant_mm(x, wq, ws, b), wq.numel())
    record("bf16 linear", lambda: F.linear(F.silu(x), w, b), w.numel() * 2)
    record(DOT_LABEL,
           lambda: fp8_gemv.triton_gemv(F.silu(x), wq, ws, b), wq.numel())
    for label, config in _rows_variants(configs):
        record(label, lambda config=config: fp8_gemv.triton_gemv_rows(x, wq, ws, b, "silu", config=config), wq.numel())
    return row


def measure_step(configs: list[tuple[int, int, int]]) -> dict[str, Any]:
    """One Flux step's modulation products over distinct weights (the model's memory traffic)."""
    k = 3072
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for n in [18432] * 38 + [9216] * 38:
        wq, ws = fp8.quantize_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
        weights.append((wq, ws, torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    nbytes = sum(wq.numel() for wq, _, _ in weights)
    row: dict[str, Any] = {"case": STEP, "products": len(weights), "weight_GB": round(nbytes / 1e9, 3)}

    def record(label: str, one: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        seconds = metrics.time_graph(lambda: [one(*wt) for wt in weights], 1)
        row[label] = {"us": round(seconds * 1e6, 1), "GB/s": round(nbytes / seconds / 1e9, 1)}

    record("scaled_mm", lambda wq, ws, b: _silu_quant_mm(x, wq, ws, b))
    record(DOT_LABEL,
           lambda wq, ws, b: fp8_gemv.triton_gemv(F.silu(x), wq, ws, b))
    for label, config in _rows_variants(configs):
        record(label, lambda wq, ws, b, config=config: fp8_gemv.triton_gemv_rows(x, wq, ws, b, "silu", config=config))
    return row


def measure_stacked(configs: list[tuple[int, int, int]]) -> dict[str, Any]:
    """The same bytes as :func:`measure_step` in one product: every block's modulation reads the same
    ``silu(vec)``, so one step's 76 weights stacked ([1,050,624, 3072] e4m3) give all of them in a
    single launch (no per-call ramp-up and tail). What batching the modulation across blocks
    would run."""
    k, n = 3072, 38 * 18432 + 38 * 9216
    gen = torch.Generator(device="cuda").manual_seed(0)
    wq = torch.empty(n, k, device="cuda", dtype=torch.float8_e4m3fn)
    ws = torch.empty(n, 1, device="cuda", dtype=torch.float32)
    for i in range(0, n, 65536):  # quantized in slices: a bf16 copy of the whole is 6.5 GB
        wq[i:i + 65536], ws[i:i + 65536] = fp8.quantize_rowwise(
            torch.randn(min(65536, n - i), k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    row: dict[str, Any] = {"case": STACKED, "rows": n, "weight_GB": round(wq.numel() / 1e9, 3)}

    def record(label: str, fn: Callable[[], torch.Tensor]) -> None:
        seconds = metrics.time_graph(fn, 2)
        row[label] = {"us": round(seconds * 1e6, 1), "GB/s": round(wq.numel() / seconds / 1e9, 1)}

    record("scaled_mm", lambda: _silu_quant_mm(x, wq, ws, b))
    for label, config in _rows_variants(configs):
        record(label, lambda config=config: fp8_gemv.triton_gemv_rows(x, wq, ws, b, "silu", config=config))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true", help="the default configuration only")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("fp8_gemv_kernels needs a CUDA device\n")
        return 2
    configs = [] if a.no_sweep else CONFIGS
    metrics.run_kernel_cases([STEP, STACKED, *CASES],
                             lambda name: (measure_step(configs) if name == STEP else measure_stacked(configs)
                                           if name == STACKED else measure(name, a.calls, configs)),
                             a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
