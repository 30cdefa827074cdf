"""Microbenchmark: Flux's fp8 GEMM shapes, cuBLAS (what ``nexfort::fp8_mm_cached`` runs) against
what Inductor's max-autotune picks for the same ``torch._scaled_mm``.

The fp8 graphs call cuBLAS through an opaque op (the weight comes from the engine's cache), so
Inductor never tunes these products. Run98/99's profiles show where cuBLAS's tiles fit badly: the
double blocks' text stream (512 rows: 96-288 tiles of 128 x 128 on 132 SMs) ran at 870 TFLOP/s
against about 1375 for the image stream, and the single blocks' ``linear2`` (4608 x 15360 x 3072:
864 tiles, 6.5 waves). This times, from CUDA-graph replays, each shape's rowwise-scaled
``_scaled_mm`` (bf16 out, bias, fast accumulation) as cuBLAS runs it and as a
``torch.compile(mode="max-autotune-no-cudagraphs")`` of the same call runs it (Inductor's Triton
templates, persistent TMA ones included, against ATen), so a later change can route the shapes
where a template wins.

    python3 benchmarks/fp8_gemm_shapes.py --output-json out.json [--cases "double txt qkv,single linear2"]

Result (run101, BENCHMARKS.md fourteenth session): cuBLAS as fast or faster on every shape that
finished; the autotuner's own timings preferred Triton templates that measured 21-55 % slower.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402
from nexfort_engine import fp8  # noqa: E402

#: name -> (M, K, N, calls per Flux step at 1024²)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "double txt qkv": (512, 3072, 9216, 19),
    "double txt mlp2": (512, 12288, 3072, 19),
    "single linear2": (4608, 15360, 3072, 38),
    "double txt proj": (512, 3072, 3072, 19),
    "double txt mlp1": (512, 3072, 12288, 19),
    "double img proj": (4096, 3072, 3072, 19),
    "double img mlp2": (4096, 12288, 3072, 19),
    "single linear1": (4608, 3072, 21504, 38),
}


def _mm(xq: torch.Tensor, wq: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), bias=b, out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def measure(name: str, calls: int) -> dict[str, Any]:
    m, k, n, per_step = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    xq, sx = fp8.quantize_rowwise(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen))
    wq, sw = fp8.quantize_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 2 * m * k * n
    row: dict[str, Any] = {"case": name, "mkn": [m, k, n], "calls_per_step": per_step}
    ref = _mm(xq, wq, sx, sw, b)
    for label, fn in [("cublas", _mm), ("inductor max-autotune", torch.compile(_mm, mode="max-autotune-no-cudagraphs",
                                                                             dynamic=False))]:
        try:
            out = fn(xq, wq, sx, sw, b)
            seconds = metrics.time_graph(lambda fn=fn: fn(xq, wq, sx, sw, b), calls)
        except Exception as exc:  # a template that fails here: say why
            row[label] = f"failed: {type(exc).__name__}: {exc}"[:400]
            continue
        row[label] = {"us": round(seconds * 1e6, 2), "TFLOP/s": round(flops / seconds / 1e12, 1),
                      "ms_per_step": round(seconds * 1e3 * per_step, 3),
                      "max_abs_vs_cublas": float((out.float() - ref.float()).abs().max())}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--cases", default=",".join(SHAPES),
                   help="comma-separated shape names (autotuning takes 65-111 s per shape on an H200)")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in SHAPES]:
        p.error(f"unknown case(s) {unknown}; valid: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        sys.stderr.write("fp8_gemm_shapes needs a CUDA device\n")
        return 2
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = "TRITON,ATEN"
    if hasattr(ic.triton, "enable_persistent_tma_matmul"):
        ic.triton.enable_persistent_tma_matmul = True
    metrics.run_kernel_cases(cases, lambda name: measure(name, a.calls), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
