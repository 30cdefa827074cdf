"""Microbenchmark: the engine's cuDNN fp8 attention graph (``nexfort_engine.fp8_attention._Graph``)
by operand and output memory layout, timed as CUDA-graph replays (no host overhead).

The engine writes the output in ``[B, L, H, D]`` memory (what Flux's next linear reads) and gets
queries/keys in that layout from the fused rotary kernel. The kernel alone took 286 µs at Flux's
shape in run100 (contiguous ``[B, H, L, D]`` in and out); this measures each combination.

    python3 benchmarks/fp8_attention_layouts.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nexfort_engine import fp8_attention as fa  # noqa: E402
from nexfort_engine.fp8 import FP8_DTYPE  # noqa: E402


def _tensor(shape: tuple[int, int, int, int], blhd: bool) -> torch.Tensor:
    b, h, n, d = shape
    if blhd:
        return torch.empty(b, n, h, d, device="cuda", dtype=FP8_DTYPE).permute(0, 2, 1, 3)
    return torch.empty(b, h, n, d, device="cuda", dtype=FP8_DTYPE)


def measure(shape: tuple[int, int, int, int], in_blhd: bool, out_blhd: bool, calls: int = 20) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q8, k8, v8 = (_tensor(shape, in_blhd).copy_((torch.randn(shape, device="cuda", generator=gen) * 40)
                                                .to(FP8_DTYPE)) for _ in range(3))
    out = _tensor(shape, out_blhd)
    one = torch.full((1,), 1 / 40, device="cuda")
    scales = fa.pack_scales(one, one, one)
    graph = fa._Graph(fa._handle(q8.device), q8, k8, v8, out)
    graph(q8, k8, v8, scales, out)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph(q8, k8, v8, scales, out)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(cg, stream=stream):
            for _ in range(calls):
                graph(q8, k8, v8, scales, out)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        cg.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return {"shape": list(shape), "in": "[B,L,H,D]" if in_blhd else "[B,H,L,D]",
            "out": "[B,L,H,D]" if out_blhd else "[B,H,L,D]", "us_per_call": round(best, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not (torch.cuda.is_available() and fa.cudnn_supported("cuda")):
        sys.stderr.write("needs a GPU with cuDNN's fp8 attention and nvidia-cudnn-frontend\n")
        return 2
    rows = []
    for shape in [(1, 24, 4608, 128), (2, 10, 4096, 64)]:
        for in_blhd in (False, True):
            for out_blhd in (False, True):
                row = measure(shape, in_blhd, out_blhd)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.output_json:
        a.output_json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
