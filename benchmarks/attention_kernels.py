"""Microbenchmark: attention at the diffusion models' sizes, cuDNN/flash bf16 SDPA vs an 8-bit
Triton attention kernel (the experiment in :mod:`benchmarks.fp8_attention`).

For each case (Flux-dev 1024²: 24 heads × 4608 tokens × 128; SD-class 64-wide heads) this times
SDPA on each available backend and the Triton kernel for each (q/k dtype, P·V dtype, launch
configuration), from already-quantized operands (``kernel``), and the quantizations compiled by
Inductor on their own (``quantize``: in a model they are fused into the kernels that make q and k).
Error: relative L2 against float32 SDPA on the same inputs, next to bf16 SDPA's own.
TFLOP/s counts 4·N²·D per head (both products).

    python3 benchmarks/attention_kernels.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import fp8_attention as fa  # noqa: E402

CASES = {
    "flux 1024² (24 x 4608 x 128)": (1, 24, 4608, 128),
    "sd 64-wide (10 x 4096 x 64) x2": (2, 10, 4096, 64),
}
CONFIGS = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3)]
#: (q/k dtype, P·V in fp8, exponentials two per instruction in fp16)
VARIANTS = [("int8", True, False), ("int8", True, True), ("fp8", True, True), ("int8", False, True)]


def bench(fn: Callable[..., Any], fn_args: tuple[Any, ...], iters: int, **kwargs: Any) -> float:
    """Best of 3 blocks, us per call of ``fn(*fn_args, **kwargs)``."""
    fn(*fn_args, **kwargs)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(*fn_args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / iters)
    return best


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def inputs(b: int, h: int, n: int, d: int) -> tuple[torch.Tensor, ...]:
    """Roughly what a DiT feeds attention: RMS-normalised q/k with per-channel gains (some
    channels larger, as learned norms make them), plain Gaussian v."""
    g = torch.Generator(device="cuda").manual_seed(0)
    gain = 1 + 2 * torch.rand(d, device="cuda", generator=g)
    q = torch.randn(b, h, n, d, device="cuda", generator=g) * gain
    k = torch.randn(b, h, n, d, device="cuda", generator=g) * gain
    v = torch.randn(b, h, n, d, device="cuda", generator=g)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, pv: bool) -> Any:
    return fa.quantize_tokens(q, dtype), fa.quantize_tokens(k, dtype), fa.quantize_channels(v) if pv else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: list[dict[str, Any]] = []
    for name, (b, h, n, d) in CASES.items():
        q, k, v = inputs(b, h, n, d)
        flops = 4 * b * h * n * n * d
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())

        def row(label: str, us: float, out: torch.Tensor | None, name: str = name, flops: int = flops,
                ref: torch.Tensor = ref, **extra: Any) -> None:
            r = {"case": name, "impl": label, "us": round(us, 1), "tflops": round(flops / us / 1e6, 1), **extra}
            if out is not None:
                r["rel_err"] = round(rel(out, ref), 5)
            rows.append(r)
            print(json.dumps(r), flush=True)

        # layouts: [B, H, N, D] contiguous, and [B, N, H, D] storage seen as [B, H, N, D] (what a
        # model's qkv.view(B, N, 3, H, D).permute(...) hands over)
        bnhd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            for layout, qkv in (("bhnd", (q, k, v)), ("bnhd", bnhd)):
                try:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        out = F.scaled_dot_product_attention(*qkv)
                        us = bench(F.scaled_dot_product_attention, qkv, args.iters)
                    row(f"sdpa {backend.lower()} bf16 {layout}", us, out, out_stride=list(out.stride()))
                except Exception as e:  # noqa: BLE001 - a backend this GPU/build lacks
                    rows.append({"case": name, "impl": f"sdpa {backend.lower()}", "error": str(e)[:200]})
        for qk, pv, exp16 in VARIANTS:
            dtype = torch.int8 if qk == "int8" else fa.FP8_DTYPE
            q8, qs = fa.quantize_tokens(q, dtype)
            k8, ks = fa.quantize_tokens(k, dtype)
            v8, vs = fa.quantize_channels(v) if pv else (v, qs)
            scale = d ** -0.5
            for cfg in CONFIGS:
                try:
                    out = fa.triton_fp8_attention(q8, qs, k8, ks, v8, vs, scale, pv, q.dtype, config=cfg,
                                                  exp_f16x2=exp16)
                    us = bench(fa.triton_fp8_attention, (q8, qs, k8, ks, v8, vs, scale, pv, q.dtype), args.iters,
                               config=cfg, exp_f16x2=exp16)
                    row(f"triton qk={qk} pv={'fp8' if pv else 'bf16'} exp={'f16x2' if exp16 else 'f32'} {cfg}",
                        us, out)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    rows.append({"case": name, "impl": f"triton qk={qk} pv={pv} {cfg}", "error": str(e)[:300]})
                    print(rows[-1], flush=True)

            if exp16:
                continue
            torch._dynamo.reset()  # one compile per case and variant, not recompiles of one
            cq = torch.compile(quant, dynamic=False)
            t0 = time.perf_counter()
            cq(q, k, v, dtype, pv)
            us = bench(cq, (q, k, v, dtype, pv), args.iters)
            row(f"quantize qk={qk} pv={'fp8' if pv else 'bf16'} (inductor, alone)", us, None,
                compile_s=round(time.perf_counter() - t0, 1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
