"""Microbenchmark: cuDNN attention at Flux's 1024² shape by the memory layout of its operands.

Flux O3's profile shows cuDNN's attention at about 468 us per call in the model against about
400 us in ``attention_kernels.py`` (contiguous operands). In the model the operands lie as
the fused query/key op writes them (``[B, L, H, D]`` storage) and, in the single blocks, the values
are a slice of ``linear1``'s output (``[B, L, 3 * H * D + mlp]``: a token stride of 21504
elements). This times, from CUDA-graph replays, ``scaled_dot_product_attention`` pinned to cuDNN
for each layout, and the copy that would make the values contiguous, so the question "is the
in-model slowdown the layout?" has a measured answer.

    python3 benchmarks/attention_layouts.py --output-json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402

B, H, L, D = 1, 24, 4608, 128
#: Flux's single-block linear1 output width: q, k, v (3 x 3072) and the MLP's input (12288)
LINEAR1 = 3 * H * D + 4 * H * D
CASES = [
    "q k v contiguous [B, H, L, D]",
    "q k v [B, L, H, D] storage",
    "q k [B, L, H, D] storage, v contiguous [B, H, L, D]",
    "q k [B, L, H, D] storage, v a slice of linear1's output (single block)",
    "q k v slices of linear1's output",
    "copy v out of linear1's output into [B, L, H, D]",
]


def _blhd(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).permute(0, 2, 1, 3)


def measure(name: str, calls: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fused = torch.randn(B, L, LINEAR1, device="cuda", dtype=torch.bfloat16, generator=gen)
    sliced = [fused[..., i * H * D:(i + 1) * H * D].view(B, L, H, D).permute(0, 2, 1, 3) for i in range(3)]
    if name == CASES[0]:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    elif name == CASES[1]:
        q, k, v = (_blhd(gen) for _ in range(3))
    elif name == CASES[2]:
        q, k = _blhd(gen), _blhd(gen)
        v = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    elif name == CASES[3]:
        q, k, v = _blhd(gen), _blhd(gen), sliced[2]
    elif name == CASES[4]:
        q, k, v = sliced
    else:
        dst = torch.empty(B, L, H, D, device="cuda", dtype=torch.bfloat16)
        seconds = metrics.time_graph(lambda: dst.copy_(sliced[2].permute(0, 2, 1, 3)), calls)
        return {"case": name, "us": round(seconds * 1e6, 2), "GB/s": round(2 * dst.numel() * 2 / seconds / 1e9, 1)}

    def call() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    out = call()
    seconds = metrics.time_graph(call, calls)
    return {"case": name, "us": round(seconds * 1e6, 2), "TFLOP/s": round(4 * B * H * L * L * D / seconds / 1e12, 1),
            "strides": {"q": list(q.stride()), "v": list(v.stride()), "out": list(out.stride())}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("attention_layouts needs a CUDA device\n")
        return 2
    metrics.run_kernel_cases(CASES, lambda name: measure(name, a.calls), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
