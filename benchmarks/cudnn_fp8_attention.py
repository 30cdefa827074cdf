"""Microbenchmark (go/no-go for an engine path): cuDNN's fp8 attention (``sdpa_fp8`` through the
``nvidia-cudnn-frontend`` Python package) against cuDNN's bf16 attention at Flux's 1024² shape.

cuDNN's fp8 forward on Hopper takes e4m3 q, k, v with one descale factor each, quantizes the
softmax probabilities to e4m3 (``scale_s``), and writes an e4m3 output (``scale_o``; a 16-bit
output needs Blackwell). Inputs are what a DiT feeds attention (RMS-normalised q/k with
per-channel gains, Gaussian v: ``attention_kernels.inputs``), quantized per tensor: ``448 /
amax``. The output scale is ``448 / amax(v)`` (an attention output is a convex combination of
value rows, so ``|o| <= max |v|``), the probabilities' ``448`` (``p <= 1``).

The fp8 side is the engine's own path (``nexfort_engine.fp8_attention``: ``quantize_tensor``,
``pack_scales``, the op ``nexfort::sdpa_fp8``), so this measures what a compiled model runs.

Reports, per layout of q/k/v (contiguous ``[B, H, L, D]``; ``[B, L, H, D]`` storage, what the
fused query/key op writes): microseconds per call (events over ``--iters`` calls, best of 3), the
quantization of q, k, v (one Inductor kernel each, amax + scale), and the error (relative L2)
against float32 attention, with bf16 cuDNN's error for comparison.

    pip install nvidia-cudnn-frontend==1.20.0
    python3 benchmarks/cudnn_fp8_attention.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernels import bench, inputs, rel  # noqa: E402
from nexfort_engine import fp8_attention  # noqa: E402

#: the engine's per-tensor quantization, one compiled kernel pair per input (as in a compiled model)
quantize_tensor = torch.compile(fp8_attention.quantize_tensor, dynamic=False)


def _layout(t: torch.Tensor, blhd: bool) -> torch.Tensor:
    """``t`` [B, H, L, D] as a view of ``[B, L, H, D]`` storage when ``blhd``."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if blhd else t.contiguous()


def measure(blhd: bool, iters: int, shape: tuple[int, int, int, int]) -> dict[str, Any]:
    q, k, v = (_layout(t, blhd) for t in inputs(*shape))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    row: dict[str, Any] = {"layout": "[B, L, H, D] storage" if blhd else "contiguous [B, H, L, D]", "shape": list(shape)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        bf16 = F.scaled_dot_product_attention(q, k, v)
        row["bf16 cudnn us"] = round(bench(F.scaled_dot_product_attention, (q, k, v), iters), 1)
    row["bf16 cudnn rel err"] = round(rel(bf16, ref), 5)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_tensor(t) for t in (q, k, v))
    row["quantize q k v us"] = round(bench(lambda: [quantize_tensor(t) for t in (q, k, v)], (), iters), 1)
    scales = fp8_attention.pack_scales(dq, dk, dv)
    sdpa = torch.ops.nexfort.sdpa_fp8.default
    out = sdpa(q8, k8, v8, scales)  # builds the graph (or warns and runs the 16-bit fallback)
    torch.cuda.synchronize()
    if fp8_attention._graph_for(q8, k8, v8, out) is None:  # the engine's graph for these operands
        row["fp8 cudnn"] = "unsupported: the engine fell back to 16-bit attention (its warning says why)"
        return row
    o = out.float() * dv
    row["fp8 cudnn us"] = round(bench(sdpa, (q8, k8, v8, scales), iters), 1)
    row["fp8 cudnn rel err"] = round(rel(o, ref), 5)
    row["speed-up vs bf16 (kernel only)"] = round(row["bf16 cudnn us"] / row["fp8 cudnn us"], 3)
    row["speed-up vs bf16 (with quantization)"] = round(
        row["bf16 cudnn us"] / (row["fp8 cudnn us"] + row["quantize q k v us"]), 3)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("cudnn_fp8_attention needs a CUDA device\n")
        return 2
    import cudnn

    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn_frontend": cudnn.__version__,
            "cudnn_backend": cudnn.backend_version(), "torch_cudnn": torch.backends.cudnn.version()}
    print(json.dumps(info), flush=True)
    rows = []
    for shape in [(1, 24, 4608, 128), (2, 10, 4096, 64)]:
        for blhd in (False, True):
            row = measure(blhd, a.iters, shape)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.output_json:
        a.output_json.write_text(json.dumps({**info, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
