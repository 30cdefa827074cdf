"""Every cuDNN execution plan for 16-bit attention at the models' shapes, timed on the GPU.

PyTorch's cuDNN attention builds the first plan cuDNN's heuristics offer. This script builds the
same operation graph through ``nvidia-cudnn-frontend`` (``cudnn``), asks for every plan (heuristic
modes A, B and the fallback list), builds each, checks it against ``torch``'s SDPA and times it,
beside ``torch``'s own cuDNN and flash kernels. A plan much faster than ``torch``'s cuDNN call
would be a lever for the models whose step is bound by attention (PixArt-α's 72-wide heads).

    python -m benchmarks.attention_plans --output-json out.json

GPU only (needs ``cudnn``: ``pip install nvidia-cudnn-frontend``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import metrics

#: name: (batch, heads, sequence, head dim, dtype): self-attention of the issue's models at 1024²
SHAPES: dict[str, tuple[int, int, int, int, torch.dtype]] = {
    "pixart_self": (2, 16, 4096, 72, torch.float16),
    "sdxl_self": (2, 10, 4096, 64, torch.float16),
    "flux_joint": (1, 24, 4608, 128, torch.bfloat16),
}


def bnhd(b: int, h: int, n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A [b, h, n, d] view of [b, n, h, d] memory, as ComfyUI's attention passes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)


def time_ms(fn: Any, iters: int = 30) -> float:
    """ms per call of ``fn``, CUDA events around ``iters`` calls (``metrics.time_op``)."""
    return 1000.0 * metrics.time_op(fn, torch.device("cuda"), iters=iters, warmup=3)


def _torch_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    rows: dict[str, float] = {}
    ref = None
    for name, backend in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION), ("torch_flash", SDPBackend.FLASH_ATTENTION),
                          ("torch_default", None)):
        try:
            if backend is None:
                rows[name] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v))
            else:
                with sdpa_kernel([backend]):
                    rows[name] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v))
                    if ref is None:
                        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        except Exception as exc:  # a backend that does not take this shape
            rows[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]  # type: ignore[assignment]
    if ref is None:
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return rows, ref


def _plans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor) -> list[dict[str, Any]]:
    import cudnn

    dt = cudnn.data_type.HALF if q.dtype == torch.float16 else cudnn.data_type.BFLOAT16
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv = (g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=dt)
                  for n, t in (("q", q), ("k", k), ("v", v)))
    out = torch.empty_like(q)  # same [b, n, h, d] memory
    o, _ = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, generate_stats=False, attn_scale=1.0 / math.sqrt(q.shape[-1]))
    o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(dt)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    count = int(g.get_execution_plan_count())
    rows: list[dict[str, Any]] = []
    pack = {tq: q, tk: k, tv: v, o: out}
    for i in range(count):
        row: dict[str, Any] = {"index": i}
        try:
            row["name"] = g.get_plan_name_at_index(i)
        except Exception:  # older bindings
            pass
        try:
            t0 = time.perf_counter()
            g.build_plan_at_index(i)
            row["build_s"] = round(time.perf_counter() - t0, 3)
            ws = torch.empty(max(int(g.get_workspace_size_plan_at_index(i)), 1), device="cuda", dtype=torch.uint8)
            row["workspace"] = ws.numel()

            def run(i: int = i, ws: torch.Tensor = ws) -> None:
                g.execute_plan_at_index(pack, ws, i, handle=handle)

            out.zero_()
            run()
            torch.cuda.synchronize()
            row["max_err_vs_fp32"] = float((out.float() - ref).abs().max())
            row["ms"] = time_ms(run)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-json")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    result: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                              "cudnn": torch.backends.cudnn.version(), "shapes": {}}
    try:
        import cudnn

        result["cudnn_frontend"] = cudnn.__version__
    except ImportError as exc:
        result["cudnn_frontend"] = f"missing: {exc}"
    for name in args.shapes:
        b, h, n, d, dtype = SHAPES[name]
        q, k, v = (bnhd(b, h, n, d, dtype, seed) for seed in (1, 2, 3))
        flops = 4.0 * b * h * n * n * d
        torch_rows, ref = _torch_rows(q, k, v)
        entry: dict[str, Any] = {"shape": [b, h, n, d], "dtype": str(dtype), "gflop": flops / 1e9, **torch_rows}
        torch_err = float((F.scaled_dot_product_attention(q, k, v).float() - ref).abs().max())
        entry["torch_default_max_err_vs_fp32"] = torch_err
        if not str(result["cudnn_frontend"]).startswith("missing"):
            try:
                entry["plans"] = _plans(q, k, v, ref)
            except Exception as exc:
                entry["plans_error"] = f"{type(exc).__name__}: {exc}"[:400]
        for row in entry.get("plans", []):
            if "ms" in row:
                row["tflops"] = round(flops / row["ms"] / 1e9, 1)
        result["shapes"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "plans"}), flush=True)
        for row in entry.get("plans", []):
            print("  ", json.dumps(row), flush=True)
    text = json.dumps(result, indent=1)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
