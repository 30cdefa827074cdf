"""What a GEMM epilogue would save on the DiTs' MLPs and gated residuals, timed on the GPU.

Two rewrites, each against what the compiled graph runs now (a cuBLAS GEMM with its bias, then
Inductor's pointwise kernel):

* ``gelu``: ``linear`` + tanh-GELU as one cuBLASLt call (``torch._addmm_activation(...,
  use_gelu=True)``, cuBLASLt's GELU_BIAS epilogue) instead of the GEMM and a pointwise pass over
  the wide activation (PixArt-α's 8192 × 4608, Flux's 4608 × 12288).
* ``gated``: ``x + gate * linear(a)`` (adaLN-Zero's residual) as one batched GEMM that
  accumulates into ``x`` (``baddbmm`` with the weight scaled by each sample's gate).

Each row: ms for both forms (GEMM and pointwise timed in one sequence) and the error of each
against a float32 computation of the same thing.

``--autotune`` adds, for the MLP rows, Inductor's max-autotune on ``gelu(linear(...))``: its Triton
GEMM templates against cuBLAS, the GELU fused into a template's epilogue where one wins (Inductor
prints its choices and their timings to the log).

    python -m benchmarks.gemm_epilogues --output-json out.json [--autotune [--persistent-tma] [--only-autotune]]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import metrics

#: name: (batch, tokens, in features, out features, dtype)
MLP_SHAPES = {
    "pixart_fc1": (2, 4096, 1152, 4608, torch.float16),
    "flux_mlp_in": (1, 4096, 3072, 12288, torch.bfloat16),
}
GATED_SHAPES = {
    "pixart_attn_out": (2, 4096, 1152, 1152, torch.float16),
    "pixart_fc2": (2, 4096, 4608, 1152, torch.float16),
}


def _time_ms(fn: Any, iters: int = 50) -> float:
    """ms per call of ``fn``, CUDA events around ``iters`` calls (``metrics.time_op``)."""
    return 1000.0 * metrics.time_op(fn, torch.device("cuda"), iters=iters, warmup=5)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def mlp_row(b: int, n: int, k: int, m: int, dtype: torch.dtype) -> dict[str, Any]:
    x = torch.randn(b * n, k, device="cuda", dtype=dtype)
    w = torch.randn(m, k, device="cuda", dtype=dtype) / k**0.5
    bias = torch.randn(m, device="cuda", dtype=dtype) * 0.1
    ref = F.gelu(F.linear(x.float(), w.float(), bias.float()), approximate="tanh")
    two = F.gelu(F.linear(x, w, bias), approximate="tanh")
    one = torch._addmm_activation(bias, x, w.t(), use_gelu=True)
    erf = F.gelu(F.linear(x.float(), w.float(), bias.float()))
    return {
        "shape": [b * n, k, m], "dtype": str(dtype),
        "gemm_ms": _time_ms(lambda: F.linear(x, w, bias)),
        "gemm_then_gelu_ms": _time_ms(lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")),
        "gelu_epilogue_ms": _time_ms(lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)),
        "err_two_kernels": _err(two, ref), "err_epilogue": _err(one, ref),
        "epilogue_vs_erf_gelu": _err(one, erf),
    }


#: plain linears of PixArt-α's block, for ``--autotune``
LINEAR_SHAPES = {
    "pixart_qkv": (2, 4096, 1152, 3456, torch.float16),
    "pixart_proj": (2, 4096, 1152, 1152, torch.float16),
    "pixart_fc2": (2, 4096, 4608, 1152, torch.float16),
}


def autotuned_row(b: int, n: int, k: int, m: int, dtype: torch.dtype, gelu: bool = True) -> dict[str, Any]:
    x = torch.randn(b * n, k, device="cuda", dtype=dtype)
    w = torch.randn(m, k, device="cuda", dtype=dtype) / k**0.5
    bias = torch.randn(m, device="cuda", dtype=dtype) * 0.1

    def fn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, w, bias)
        return F.gelu(y, approximate="tanh") if gelu else y

    torch._dynamo.reset()
    compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
    with torch.no_grad():
        compiled(x, w, bias)
        ms = _time_ms(lambda: compiled(x, w, bias))
    default = torch.compile(fn, dynamic=False)
    with torch.no_grad():
        torch._dynamo.reset()
        default(x, w, bias)
        ms_default = _time_ms(lambda: default(x, w, bias))
    return {"max_autotune_ms": ms, "inductor_default_ms": ms_default}


def gated_row(b: int, n: int, k: int, m: int, dtype: torch.dtype) -> dict[str, Any]:
    a = torch.randn(b, n, k, device="cuda", dtype=dtype)
    x = torch.randn(b, n, m, device="cuda", dtype=dtype)
    w = torch.randn(m, k, device="cuda", dtype=dtype) / k**0.5
    bias = torch.randn(m, device="cuda", dtype=dtype) * 0.1
    gate = torch.randn(b, 1, m, device="cuda", dtype=dtype)
    ref = x.float() + gate.float() * F.linear(a.float(), w.float(), bias.float())

    def now() -> torch.Tensor:
        return x + gate * F.linear(a, w, bias)

    def fused() -> torch.Tensor:
        ws = (w.t().unsqueeze(0) * gate).to(dtype)  # [b, k, m], each sample's gate on its columns
        return torch.baddbmm(x + gate * bias, a, ws)

    return {
        "shape": [b, n, k, m], "dtype": str(dtype),
        "gemm_ms": _time_ms(lambda: F.linear(a, w, bias)),
        "gemm_then_gate_ms": _time_ms(now),
        "baddbmm_ms": _time_ms(fused),
        "err_now": _err(now(), ref), "err_baddbmm": _err(fused(), ref),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-json")
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--persistent-tma", action="store_true",
                    help="with --autotune: Inductor's persistent TMA GEMM templates among the candidates")
    ap.add_argument("--only-autotune", action="store_true", help="skip the epilogue rows")
    ap.add_argument("--autotune-shapes", nargs="*", help="names from MLP_SHAPES / LINEAR_SHAPES (default: all)")
    args = ap.parse_args()
    if args.persistent_tma:
        import torch._inductor.config as inductor_config

        inductor_config.triton.enable_persistent_tma_matmul = True
    torch.manual_seed(0)
    result: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                              "persistent_tma": args.persistent_tma}
    if not args.only_autotune:
        result["mlp"] = {n: mlp_row(*s) for n, s in MLP_SHAPES.items()}
        result["gated"] = {n: gated_row(*s) for n, s in GATED_SHAPES.items()}
    if args.autotune:
        pick = set(args.autotune_shapes or [*MLP_SHAPES, *LINEAR_SHAPES])
        result["autotuned"] = {n: autotuned_row(*s) for n, s in MLP_SHAPES.items() if n in pick}
        result["autotuned"].update({n: autotuned_row(*s, gelu=False) for n, s in LINEAR_SHAPES.items() if n in pick})
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
