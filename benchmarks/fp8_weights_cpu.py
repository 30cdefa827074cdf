"""CPU time of ``"fp8_weights"``'s rounding (the compile node's work when ComfyUI loaded the
checkpoint to the CPU), for Flux-dev's block-linear shapes: the shipped
``nexfort_engine.fp8_weights.quantize_per_tensor`` against the whole-tensor formula it replaced
(``abs().amax()``, one fp32 temporary, four passes). Checks both give the same bits, and extrapolates
to the 11.9 B values of Flux-dev's block stacks.

    python benchmarks/fp8_weights_cpu.py [--threads N] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nexfort_engine import fp8_weights  # noqa: E402
from nexfort_engine.fp8_weights import E4M3, E4M3_MAX, HEADROOM, quantize_per_tensor  # noqa: E402

#: Flux-dev's block linears: (out, in) -> how many. 19 double blocks x (image, text): qkv, proj,
#: two MLP layers, modulation (18432); 38 single blocks: linear1, linear2, modulation (9216)
FLUX_SHAPES = {(9216, 3072): 76, (3072, 3072): 38, (12288, 3072): 38, (3072, 12288): 38,
               (18432, 3072): 38, (21504, 3072): 38, (3072, 15360): 38}


def whole_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula before f674f3d (same bits): the reference twin."""
    amax = w.abs().amax().float()
    scale = torch.where(amax > 0, amax * HEADROOM / E4M3_MAX, torch.ones_like(amax))
    x = w.to(torch.float32, copy=True)
    x.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX)
    return x.to(E4M3), scale


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--chunk", type=int, default=0,
                   help="elements per fp32 working block (0: the shipped fp8_weights.CPU_CHUNK)")
    p.add_argument("--output-json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk:
        fp8_weights.CPU_CHUNK = args.chunk
    gen = torch.Generator().manual_seed(0)
    rows = []
    total = {"whole_tensor": 0.0, "shipped": 0.0}
    for (out_f, in_f), count in FLUX_SHAPES.items():
        w = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).to(torch.bfloat16)
        row = {"shape": [out_f, in_f], "count": count}
        for name, fn in (("whole_tensor", whole_tensor), ("shipped", quantize_per_tensor)):
            fn(w)  # first touch of the allocator's pages for this size
            best = min(_timed(fn, w) for _ in range(3))
            row[f"{name}_ms"] = round(best * 1e3, 2)
            total[name] += best * count
        q_new, s_new = quantize_per_tensor(w)
        q_old, s_old = whole_tensor(w)
        row["same_bits"] = bool(torch.equal(s_new, s_old) and torch.equal(q_new.view(torch.uint8),
                                                                         q_old.view(torch.uint8)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"threads": torch.get_num_threads(), "chunk": fp8_weights.CPU_CHUNK, "torch": torch.__version__, "rows": rows,
           "flux_blocks_s": {k: round(v, 2) for k, v in total.items()},
           "values": sum(a * b * c for (a, b), c in FLUX_SHAPES.items())}
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(doc, indent=1))
    return 0 if all(r["same_bits"] for r in rows) else 1


def _timed(fn, w: torch.Tensor) -> float:
    t = time.perf_counter()
    fn(w)
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
