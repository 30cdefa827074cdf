"""GroupNorm under nexfort on the GPU: ATen's F.group_norm vs the channels-last-order rewrite.

A stack of SD-UNet-like ResBlock halves (GroupNorm -> SiLU -> 3x3 conv -> + embedding ->
GroupNorm -> SiLU -> 3x3 conv -> residual) at SD2.1 768² level sizes, compiled with nexfort O2
(static and dynamic shape), with and without ``"group_norm_rewrite"``. Prints and writes (JSON)
ms per call (CUDA graphs replayed, CUDA events, median of 5 blocks of 20 calls; host-bound for
small nets), the GPU time per call of all kernels and of the normalisation kernels
(torch.profiler), and the error against a float32 twin.

    python benchmarks/group_norm_kernels.py --output-json gn.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nexfort_engine  # noqa: E402


class Half(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.n1 = torch.nn.GroupNorm(32, c)
        self.c1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.e = torch.nn.Linear(1280, c)
        self.n2 = torch.nn.GroupNorm(32, c)
        self.c2 = torch.nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.e(F.silu(emb))[:, :, None, None]
        return x + self.c2(F.silu(self.n2(h)))


class Net(torch.nn.Module):
    def __init__(self, c: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Half(c) for _ in range(depth))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, emb)
        return x


def time_calls(fn, *args) -> float:
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    blocks = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            fn(*args)
        b.record()
        torch.cuda.synchronize()
        blocks.append(a.elapsed_time(b) / 20)
    return statistics.median(blocks)


def kernel_ms(fn, *args) -> tuple[float, float]:
    """GPU time per call of all kernels, and of the normalisation kernels (ATen's decomposition:
    "group_norm" in the name; the rewrite: "var_mean")."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn(*args)
        torch.cuda.synchronize()
    evts = [e for e in prof.key_averages() if str(e.device_type).endswith("CUDA")]
    total = sum(e.self_device_time_total for e in evts)
    norm = sum(e.self_device_time_total for e in evts if "group_norm" in e.key or "var_mean" in e.key)
    return total / 1000.0 / 10, norm / 1000.0 / 10


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--depth", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    levels = [(320, 96), (640, 48), (1280, 24)]
    rows = []
    for c, s in levels:
        ref = Net(c, args.depth).cuda().eval()
        x32 = torch.randn(2, c, s, s, device="cuda")
        e32 = torch.randn(2, 1280, device="cuda")
        with torch.no_grad():
            y32 = ref(x32, e32)
            net = copy.deepcopy(ref).half()
            x, e = x32.half(), e32.half()
            y_eager = net(x, e)
            eager_err = (y_eager.float() - y32).abs().max().item()
            for dynamic in (False, True):
                for rewrite in (False, True):
                    opts = {"mode": "O2", "dynamic": dynamic, "group_norm_rewrite": rewrite}
                    cm = nexfort_engine.compile(copy.deepcopy(net), opts)
                    y = cm(x, e)
                    err = (y.float() - y32).abs().max().item()
                    ms = time_calls(cm, x, e)
                    busy, gn = kernel_ms(cm, x, e)
                    row = {"channels": c, "size": s, "dynamic": dynamic, "rewrite": rewrite,
                           "ms_per_call": round(ms, 4), "gpu_ms_per_call": round(busy, 4),
                           "norm_kernel_ms": round(gn, 4),
                           "err_vs_fp32": err, "eager_err_vs_fp32": eager_err,
                           "stats": nexfort_engine.stats()["models"].get(cm.label, {})}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "stats"}), flush=True)
    if args.output_json:
        args.output_json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
