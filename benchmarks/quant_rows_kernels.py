"""Microbenchmark: fp8 per-row activation quantization, Inductor's kernels vs ``nexfort::quant_rows``.

For each hot quantization of the fp8 path (SDXL's GEGLU rows, Flux's GELU rows and its
single-block ``cat(attention, gelu(mlp))`` rows, at 1024² sizes) this times

* ``inductor``: ``quantize_rowwise(producer(...))`` compiled by Inductor the way nexfort compiles
  it (:func:`nexfort_engine.reductions.persistent_rows`), what the fp8 graphs ran until now;
* ``inductor producer only``: the bf16 producer alone (what a bf16 model pays there);
* ``triton ...``: :func:`nexfort_engine.rowwise_quant.triton_quant_rows` with the producer fused,
  for several launch configurations (``auto`` = :func:`launch_config`; one-pass rows held in
  ``chunks x width`` registers), ``exact``, ``fast`` (approximate division in the GELU, one
  reciprocal per row) and, for the tanh GELU, ``hw-tanh`` (``fast`` with the GPU's
  ``tanh.approx.f32``);
* ``inductor producer + triton none``: the producer materialised in bf16, then the kernel;

and compares each kernel's fp8 output with Inductor's (fraction of differing bytes, largest
difference in units of the row's scale). GB/s counts the single-pass traffic: the producer's
inputs read once, fp8 values and scales written once.

    python3 benchmarks/quant_rows_kernels.py --output-json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402
from nexfort_engine.fp8 import quantize_rowwise  # noqa: E402
from nexfort_engine.reductions import DEFAULT_LIMIT, persistent_rows  # noqa: E402
from nexfort_engine.rowwise_quant import chunk_width, launch_config, triton_quant_rows  # noqa: E402

#: time each call eagerly (the host's launches included: kernels under ~50 us measure the host;
#: the default replays the calls from a CUDA graph, metrics.time_graph)
EAGER_TIMING = False

#: (one_pass, BLOCK, num_warps); a one-pass BLOCK is the chunk width (raised until at most
#: MAX_CHUNKS chunks hold the row; 65536: the whole row in one chunk, the kernel before chunks)
CONFIGS = [(False, 4096, 8)] + [(True, b, w) for b in (1024, 2048, 4096, 65536) for w in (4, 8, 16, 32)]


def _geglu(h: torch.Tensor) -> torch.Tensor:
    a, gate = h.chunk(2, dim=-1)
    return a * F.gelu(gate)


#: name -> (rows, h width, a width (0: none), prologue, h's row stride, column offset of h)
CASES: dict[str, tuple[int, int, int, str, int, int]] = {
    "sdxl geglu 640-level (4096 tokens x2)": (8192, 5120, 0, "geglu", 5120, 0),
    "sdxl geglu 1280-level (1024 tokens x2)": (2048, 10240, 0, "geglu", 10240, 0),
    "flux double mlp gelu 12288": (4608, 12288, 0, "gelu_tanh", 12288, 0),
    # single block: mlp = linear1's output [:, 9216:] (row stride 21504), a = attention [4608, 3072]
    "flux single cat(attn, gelu(mlp)) 15360": (4608, 12288, 3072, "gelu_tanh", 21504, 9216),
}


def _producer(prologue: str, has_a: bool) -> Callable[..., torch.Tensor]:
    def f(h: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
        if prologue == "geglu":
            x = _geglu(h)
        elif prologue == "gelu_tanh":
            x = F.gelu(h, approximate="tanh")
        else:
            x = F.gelu(h)
        return torch.cat([a, x], dim=-1) if has_a else x

    return f


def _inductor(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with persistent_rows(DEFAULT_LIMIT):
            return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=False)


def _compare(q: torch.Tensor, s: torch.Tensor, q0: torch.Tensor, s0: torch.Tensor) -> dict[str, float]:
    differ = (q.view(torch.uint8) != q0.view(torch.uint8)).float().mean().item()
    deq = q.float() * s
    deq0 = q0.float() * s0
    return {
        "bytes_differing": round(differ, 6),
        "max_diff_in_scales": round(float(((deq - deq0).abs() / s0).max()), 3),
        "scale_max_rel": float(((s - s0).abs() / s0).max()),
    }


def measure(name: str, iters: int) -> dict[str, Any]:
    m, hw, ka, prologue, stride, offset = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(m, stride, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = base[:, offset:offset + hw]
    a = torch.randn(m, ka, device="cuda", dtype=torch.bfloat16, generator=gen) if ka else None
    producer = _producer(prologue, a is not None)
    k_out = ka + (hw // 2 if prologue == "geglu" else hw)
    traffic = (h.numel() + (a.numel() if a is not None else 0)) * 2 + m * k_out + m * 4
    row: dict[str, Any] = {"case": name, "rows": m, "row_width": k_out, "single_pass_MB": round(traffic / 1e6, 1)}

    def record(label: str, fn: Callable[[], Any]) -> Any:
        out = fn()
        seconds = metrics.time_op(fn, h.device, iters, blocks=3, warmup=5) if EAGER_TIMING else metrics.time_graph(fn, iters)
        row[label] = {"us": round(seconds * 1e6, 2), "GB/s": round(traffic / seconds / 1e9, 1)}
        return out

    quant = _inductor(lambda h, a: quantize_rowwise(producer(h, a)))
    q0, s0 = record("inductor", lambda: quant(h, a))
    prod = _inductor(producer)
    record("inductor producer only", lambda: prod(h, a))
    auto = launch_config(k_out - ka, ka)
    forms = [("exact", False, False), ("fast", True, False)] + ([("hw-tanh", True, True)] if prologue == "gelu_tanh" else [])
    for config in [None, *CONFIGS]:
        one_pass, b, w = config or auto
        kh = k_out - ka
        shape = f"{-(-kh // chunk_width(kh, b))}x{chunk_width(kh, b)}" if one_pass else f"two-pass {b}"
        for form, fast, hw in forms:
            if config is not None and form == "exact":
                continue
            label = f"triton {shape} x{w}" + (" (auto)" if config is None else "") + f" {form}"
            if label in row:  # a requested chunk that resolves to one measured already
                continue
            q, s = record(label, lambda config=config, fast=fast, hw=hw: triton_quant_rows(
                h, a, prologue, config=config, fast=fast, hw_tanh=hw))
            row[label].update(_compare(q, s, q0, s0))
    x = prod(h, a)
    q, s = record("inductor producer + triton none", lambda: triton_quant_rows(prod(h, a), None, "none"))
    row["inductor producer + triton none"].update(_compare(q, s, q0, s0))
    del x
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    p.add_argument("--eager-timing", action="store_true", help="time eager calls (runs before 92 did)")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    global EAGER_TIMING
    EAGER_TIMING = a.eager_timing
    if not torch.cuda.is_available():
        sys.stderr.write("quant_rows_kernels needs a CUDA device\n")
        return 2
    wanted = [w.strip() for w in a.cases.split(",") if w.strip()]
    names = [n for n in CASES if not wanted or any(w in n for w in wanted)]
    metrics.run_kernel_cases(names, lambda name: measure(name, a.iters), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
