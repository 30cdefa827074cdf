"""Microbenchmark: a DiT block's LayerNorm + modulation + fp8 quantization, Inductor's kernel vs ``nexfort::quant_rows_ln_mod``.

For the adaLN inputs of Flux's blocks at 1024² (single block: 4608 tokens; double block: 4096
image and 512 text tokens; 3072 wide) this times

* ``inductor``: ``quantize_rowwise(addcmul(shift, layer_norm(x), 1 + scale))`` compiled by
  Inductor the way nexfort compiles it (:func:`nexfort_engine.reductions.persistent_rows`), what
  the fp8 graphs ran before the op;
* ``inductor producer only``: the bf16 ``addcmul(shift, layer_norm(x), 1 + scale)`` alone (what a
  bf16 model pays there);
* ``triton BLOCKxWARPS``: :func:`nexfort_engine.rowwise_quant.triton_quant_rows_ln_mod` (``1 +
  scale`` in the kernel) for several launch configurations (``auto`` = :func:`ln_mod_config`);

each call replayed from a CUDA graph of ``--calls`` calls (run88 timed them eagerly: 40-86 us
per call whatever the size, the host's launch time, not the kernels'), and compares each kernel's
fp8 output with Inductor's (fraction of differing bytes, largest
difference in units of the row's scale). GB/s counts ``x`` read once, fp8 values and scales
written once.

    python3 benchmarks/ln_mod_kernels.py --output-json out.json
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
from benchmarks.quant_rows_kernels import _compare, _inductor  # noqa: E402
from nexfort_engine.fp8 import quantize_rowwise  # noqa: E402
from nexfort_engine.rowwise_quant import ln_mod_config, triton_quant_rows_ln_mod  # noqa: E402

#: (BLOCK, num_warps)
CONFIGS = [(1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16)]
#: name -> (batch, tokens, width)
CASES: dict[str, tuple[int, int, int]] = {
    "flux single block 4608 x 3072": (1, 4608, 3072),
    "flux double block image 4096 x 3072": (1, 4096, 3072),
    "flux double block text 512 x 3072": (1, 512, 3072),
}
EPS = 1e-6


def _producer(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(shift, F.layer_norm(x, x.shape[-1:], eps=EPS), 1 + scale)


def measure(name: str, calls: int) -> dict[str, Any]:
    b, n, d = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 + 0.5
    mod = torch.randn(b, 1, 6 * d, device="cuda", dtype=torch.bfloat16, generator=gen)  # Modulation's output
    shift, scale = mod[..., :d], mod[..., d:2 * d]
    traffic = x.numel() * 2 + b * n * d + b * n * 4
    row: dict[str, Any] = {"case": name, "rows": b * n, "row_width": d, "single_pass_MB": round(traffic / 1e6, 1)}

    def record(label: str, fn: Callable[[], Any]) -> Any:
        out = fn()
        seconds = metrics.time_graph(fn, calls)
        row[label] = {"us": round(seconds * 1e6, 2), "GB/s": round(traffic / seconds / 1e9, 1)}
        return out

    quant = _inductor(lambda x, scale, shift: quantize_rowwise(_producer(x, scale, shift).reshape(-1, d)))
    q0, s0 = record("inductor", lambda: quant(x, scale, shift))
    prod = _inductor(_producer)
    record("inductor producer only", lambda: prod(x, scale, shift))
    auto = ln_mod_config(d)
    for config in [None, *CONFIGS]:
        block, _, warps = auto if config is None else (config[0], 0, config[1])
        label = f"triton {block}x{warps}" + (" (auto)" if config is None else "")
        if label in row or f"{label} (auto)" in row:
            continue
        q, s = record(label, lambda config=config: triton_quant_rows_ln_mod(x, scale, shift, EPS, 1.0, config=config))
        row[label].update(_compare(q, s, q0, s0))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph (each timed from replays)")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("ln_mod_kernels needs a CUDA device\n")
        return 2
    metrics.run_kernel_cases(list(CASES), lambda name: measure(name, a.calls), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
