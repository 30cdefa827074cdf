"""Microbenchmark: the fp8 path's per-row activation quantization, fused with its producer.

Times the Inductor kernels for ``quantize_rowwise(producer(x))`` at the row widths of SDXL and
Flux (GEGLU, GELU, LayerNorm, Flux's single-block concat), compiled with Inductor's default
reduction heuristic and with :func:`nexfort_engine.reductions.persistent_rows`, next to the
producer alone (what bf16 pays). Checks both give bit-identical fp8 values and scales.

    python3 benchmarks/quant_kernels.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402
from nexfort_engine.fp8 import quantize_rowwise  # noqa: E402
from nexfort_engine.reductions import persistent_rows  # noqa: E402


def geglu(h: torch.Tensor) -> torch.Tensor:
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate)


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def layer_norm(h: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, h.shape[-1:])


def single_cat(h: torch.Tensor) -> torch.Tensor:  # Flux single block: cat(attn, gelu(mlp))
    return torch.cat([h[..., :3072], F.gelu(h[..., 3072:], approximate="tanh")], dim=-1)


#: (name, producer, rows M, input width, row width K)
CASES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], int, int]] = [
    ("sdxl geglu 640-block", geglu, 8192, 5120),
    ("sdxl geglu 1280-block", geglu, 2048, 10240),
    ("sdxl layernorm 640", layer_norm, 8192, 640),
    ("sdxl layernorm 1280", layer_norm, 2048, 1280),
    ("flux layernorm 3072", layer_norm, 4608, 3072),
    ("flux gelu 12288", gelu_tanh, 4608, 12288),
    ("flux single cat 15360", single_cat, 4608, 15360),
]


def _backend(limit: int) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with persistent_rows(limit):
            return compile_fx(gm, example_inputs)

    return backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--output-json")
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    rows = []
    for name, producer, m, width in CASES:
        x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)

        def quant(h: torch.Tensor, producer: Callable = producer) -> tuple[torch.Tensor, torch.Tensor]:
            return quantize_rowwise(producer(h))

        row: dict[str, Any] = {"case": name, "rows": m, "input_width": width}
        outs = {}
        for label, fn, limit in (("producer only (bf16)", producer, 0), ("default", quant, 0),
                                 ("persistent rows", quant, 16384)):
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend=_backend(limit), dynamic=False)
            out = compiled(x)
            seconds = metrics.time_op(lambda c=compiled, x=x: c(x), x.device, args.iters, warmup=5)
            row[label + " ms"] = round(1000.0 * seconds, 4)
            outs[label] = out
        q0, s0 = outs["default"]
        q1, s1 = outs["persistent rows"]
        row["row_width"] = int(q0.shape[-1])
        row["identical"] = bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1))
        # single-pass traffic: read the producer's input (bf16), write fp8 + fp32 scales
        ideal_mb = (x.numel() * 2 + q0.numel() + s0.numel() * 4) / 1e6
        row["single_pass_MB"] = round(ideal_mb, 1)
        for label in ("default", "persistent rows"):
            row[label + " GB/s"] = round(ideal_mb / 1e3 / (row[label + " ms"] / 1e3), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": rows}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
