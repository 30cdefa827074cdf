"""Microbenchmark: the engine's cuDNN fp8 attention graph (``nexfort_engine.fp8_attention._Graph``)
by operand and output memory layout, timed as CUDA-graph replays (``metrics.time_graph``: no
host overhead).

The engine writes the output in ``[B, L, H, D]`` memory (what Flux's next linear reads) and gets
queries/keys in that layout from the fused rotary kernel. The kernel alone took 286 µs at Flux's
shape in run100 (contiguous ``[B, H, L, D]`` in and out); this measures each combination.

    python3 benchmarks/fp8_attention_layouts.py --output-json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402
from nexfort_engine import fp8_attention as fa  # noqa: E402
from nexfort_engine.fp8 import FP8_DTYPE  # noqa: E402


def _tensor(shape: tuple[int, int, int, int], blhd: bool) -> torch.Tensor:
    b, h, n, d = shape
    if blhd:
        return torch.empty(b, n, h, d, device="cuda", dtype=FP8_DTYPE).permute(0, 2, 1, 3)
    return torch.empty(b, h, n, d, device="cuda", dtype=FP8_DTYPE)


SHAPES = {"flux": (1, 24, 4608, 128), "sd": (2, 10, 4096, 64)}
#: case names: shape, then the operands' and the output's layout (bhld: contiguous [B, H, L, D];
#: blhd: [B, L, H, D] memory viewed as [B, H, L, D], the engine's)
CASES = [f"{s}:{i}:{o}" for s in SHAPES for i in ("bhld", "blhd") for o in ("bhld", "blhd")]


def measure(case: str, calls: int = 20) -> dict:
    name, ins, outs = case.split(":")
    shape = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q8, k8, v8 = (_tensor(shape, ins == "blhd").copy_((torch.randn(shape, device="cuda", generator=gen) * 40)
                                                      .to(FP8_DTYPE)) for _ in range(3))
    out = _tensor(shape, outs == "blhd")
    one = torch.full((1,), 1 / 40, device="cuda")
    scales = fa.pack_scales(one, one, one)
    graph = fa._Graph(fa._handle(q8.device), q8, k8, v8, out)
    seconds = metrics.time_graph(lambda: graph(q8, k8, v8, scales, out), calls)
    return {"shape": list(shape), "in": "[B,L,H,D]" if ins == "blhd" else "[B,H,L,D]",
            "out": "[B,L,H,D]" if outs == "blhd" else "[B,H,L,D]", "us_per_call": round(seconds * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA-graph replay")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not (torch.cuda.is_available() and fa.cudnn_supported("cuda")):
        sys.stderr.write("needs a GPU with cuDNN's fp8 attention and nvidia-cudnn-frontend\n")
        return 2
    metrics.run_kernel_cases(CASES, lambda case: measure(case, a.calls), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
