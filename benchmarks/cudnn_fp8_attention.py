"""Microbenchmark (go/no-go for an engine path): cuDNN's fp8 attention (``sdpa_fp8`` through the
``nvidia-cudnn-frontend`` Python package) against cuDNN's bf16 attention at Flux's 1024² shape.

cuDNN's fp8 forward on Hopper takes e4m3 q, k, v with one descale factor each, quantizes the
softmax probabilities to e4m3 (``scale_s``), and writes an e4m3 output (``scale_o``; a 16-bit
output needs Blackwell). Inputs are what a DiT feeds attention (RMS-normalised q/k with
per-channel gains, Gaussian v: ``attention_kernels.inputs``), quantized per tensor: ``448 /
amax``. The output scale is ``448 / amax(v)`` (an attention output is a convex combination of
value rows, so ``|o| <= max |v|``), the probabilities' ``448`` (``p <= 1``).

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
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernels import bench, inputs, rel  # noqa: E402
from nexfort_engine.fp8 import FP8_DTYPE  # noqa: E402
from nexfort_engine.rowwise_quant import FP8_MAX  # noqa: E402


@torch.compile(dynamic=False)
def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values of ``t`` scaled by ``448 / amax``, and the descale ``amax / 448`` ([1, 1, 1, 1])."""
    amax = t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * (FP8_MAX / amax)).to(FP8_DTYPE), (amax / FP8_MAX).reshape(1, 1, 1, 1)


def fp8_scalars(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sdpa_fp8``'s scale inputs ([1, 1, 1, 1] float32) for per-tensor descales of q, k and v:
    probabilities scaled by 448 (``p <= 1``), the output by ``448 / amax(v)`` (``|o| <= max |v|``)."""
    one = torch.ones(1, 1, 1, 1, device=dq.device)
    return {"descale_q": dq, "descale_k": dk, "descale_v": dv, "descale_s": one / FP8_MAX,
            "scale_s": one * FP8_MAX, "scale_o": (1.0 / dv).reshape(1, 1, 1, 1)}


class Fp8Sdpa:
    """One cuDNN fp8 attention graph for a fixed shape and strides."""

    def __init__(self, handle: Any, shape: tuple[int, int, int, int], stride: tuple[int, ...],
                 keep_amax: bool = False) -> None:
        import cudnn

        b, h, n, d = shape
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        self.q, self.k, self.v = (g.tensor(name=n_, dim=list(shape), stride=list(stride), data_type=fp8)
                                  for n_ in ("q", "k", "v"))
        self.scalars = {n_: g.tensor(name=n_, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
                        for n_ in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        o, _, amax_s, amax_o = g.sdpa_fp8(q=self.q, k=self.k, v=self.v, **self.scalars, generate_stats=False,
                                          attn_scale=1.0 / math.sqrt(d), name="sdpa_fp8")
        o.set_output(True).set_dim(list(shape)).set_stride(list(stride)).set_data_type(fp8)
        amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.amax_s, self.amax_o = o, amax_s, amax_o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.handle = g, handle
        self.workspace_size = max(g.get_workspace_size(), 1)
        #: the last call's (amax_s, amax_o), kept when ``keep_amax`` (the microbenchmark; not in a
        #: compiled model, where the tensor would live in a CUDA graph's pool)
        self.keep_amax = keep_amax
        self.amax_bufs = torch.zeros(2)

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scalars: dict[str, torch.Tensor],
                 out: torch.Tensor) -> torch.Tensor:
        # workspace and amax outputs per call: an object holding device tensors made inside a CUDA
        # graph's memory pool (a compiled model's first call) breaks CUDA-graph trees' accounting
        workspace = torch.empty(self.workspace_size, device=q8.device, dtype=torch.uint8)
        amax = torch.empty(2, device=q8.device, dtype=torch.float32)
        pack = {self.q: q8, self.k: k8, self.v: v8, self.o: out, self.amax_s: amax[0:1], self.amax_o: amax[1:2]}
        pack.update({self.scalars[n]: t for n, t in scalars.items()})
        self.graph.execute(pack, workspace, handle=self.handle)
        if self.keep_amax:
            self.amax_bufs = amax
        return out


def _layout(t: torch.Tensor, blhd: bool) -> torch.Tensor:
    """``t`` [B, H, L, D] as a view of ``[B, L, H, D]`` storage when ``blhd``."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if blhd else t.contiguous()


def measure(handle: Any, blhd: bool, iters: int, shape: tuple[int, int, int, int]) -> dict[str, Any]:
    q, k, v = (_layout(t, blhd) for t in inputs(*shape))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    row: dict[str, Any] = {"layout": "[B, L, H, D] storage" if blhd else "contiguous [B, H, L, D]", "shape": list(shape)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        bf16 = F.scaled_dot_product_attention(q, k, v)
        row["bf16 cudnn us"] = round(bench(F.scaled_dot_product_attention, (q, k, v), iters), 1)
    row["bf16 cudnn rel err"] = round(rel(bf16, ref), 5)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_tensor(t) for t in (q, k, v))
    row["quantize q k v us"] = round(bench(lambda: [quantize_tensor(t) for t in (q, k, v)], (), iters), 1)
    try:
        sdpa = Fp8Sdpa(handle, shape, tuple(q8.stride()), keep_amax=True)
    except Exception as exc:  # not supported here: say why
        row["fp8 cudnn"] = f"unsupported: {type(exc).__name__}: {exc}"[:600]
        return row
    scalars = fp8_scalars(dq, dk, dv)
    scale_o = scalars["scale_o"]
    out = torch.empty_like(q8)
    sdpa(q8, k8, v8, scalars, out)
    torch.cuda.synchronize()
    o = out.float() / scale_o
    row["fp8 cudnn us"] = round(bench(sdpa, (q8, k8, v8, scalars, out), iters), 1)
    row["fp8 cudnn rel err"] = round(rel(o, ref), 5)
    row["fp8 amax_s, amax_o"] = [round(float(x), 4) for x in sdpa.amax_bufs]
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

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn_frontend": cudnn.__version__,
            "cudnn_backend": cudnn.backend_version(), "torch_cudnn": torch.backends.cudnn.version()}
    print(json.dumps(info), flush=True)
    rows = []
    for shape in [(1, 24, 4608, 128), (2, 10, 4096, 64)]:
        for blhd in (False, True):
            row = measure(handle, blhd, a.iters, shape)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.output_json:
        a.output_json.write_text(json.dumps({**info, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
