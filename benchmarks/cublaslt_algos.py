"""Every cuBLASLt algorithm for the DiTs' linears, timed against the one torch runs.

``F.linear(x, w, b)`` on a 16-bit CUDA tensor goes to cuBLASLt with its bias epilogue
(``gemm_and_bias``): torch asks ``cublasLtMatmulAlgoGetHeuristic`` for one algorithm and runs it.
PixArt-α's profile shows the same GEMM work at two rates: fc2 (K 4608) at ~850 TFLOP/s, fc1 and
qkv (K 1152) at ~580: four times the output tiles, each with a quarter of the main loop, so each
tile's prologue and epilogue weigh four times as much. This benchmark asks cuBLASLt for up to
``--algos`` candidates per shape (the same descriptors torch builds: column-major ``D = Wᵀ·x``,
fp32 accumulation, the bias or GELU_BIAS epilogue), times each with CUDA events, checks its output
against ``F.linear`` and reports the best against torch's own call - whether an algorithm choice
(a tuned-GEMM op, paid once per shape and cached) could be a lever at all.

Driven through ``ctypes`` on the cuBLASLt that torch has loaded (no build step), by the engine's own
binding (``nexfort_engine/cublaslt.py``, which ``nexfort::tuned_linear`` runs its choices with).

    python -m benchmarks.cublaslt_algos --output-json out.json [--algos 32] [--workspace-mib 32]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import metrics
from nexfort_engine.cublaslt import Lt

#: name: (tokens M, in features K, out features N, dtype, epilogue)
SHAPES: dict[str, tuple[int, int, int, torch.dtype, str]] = {
    "pixart_qkv": (8192, 1152, 3456, torch.float16, "bias"),
    "pixart_proj": (8192, 1152, 1152, torch.float16, "bias"),
    "pixart_fc1_gelu": (8192, 1152, 4608, torch.float16, "gelu_bias"),
    "pixart_fc1": (8192, 1152, 4608, torch.float16, "bias"),
    "pixart_fc2": (8192, 4608, 1152, torch.float16, "bias"),
    "flux_img_qkv": (4096, 3072, 9216, torch.bfloat16, "bias"),
    "flux_mlp_in_gelu": (4096, 3072, 12288, torch.bfloat16, "gelu_bias"),
    "flux_mlp_out": (4096, 12288, 3072, torch.bfloat16, "bias"),
    "flux_single_in": (4608, 3072, 21504, torch.bfloat16, "bias"),
    "flux_single_out": (4608, 15360, 3072, torch.bfloat16, "bias"),
}

def _ms(fn: Any, iters: int) -> float:
    return 1000.0 * metrics.time_op(fn, torch.device("cuda"), iters=iters, blocks=3, warmup=5)


def _interleaved(graphs: dict[str, torch.cuda.CUDAGraph], calls: int, rounds: int) -> dict[str, float]:
    """Median ms per call of each graph (``metrics.capture_graph``; O2 replays its steps as graphs
    too, so no host cost is timed), the graphs replayed in turn ``rounds`` times (clock and thermal
    drift fall on every one alike)."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def shape_row(lt: Lt, m: int, k: int, n: int, dtype: torch.dtype, epilogue: str, count: int,
              workspace_bytes: int, iters: int, search: int = 0, finalists: int = 6,
              rounds: int = 9, screen_s: float = 30.0) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=g) * 0.1
    if epilogue == "gelu_bias":
        def torch_call() -> torch.Tensor:
            return torch._addmm_activation(bias, x, w.t(), use_gelu=True)
    else:
        def torch_call() -> torch.Tensor:
            return F.linear(x, w, bias)
    ref = torch_call()
    tol = 0.05 * float(ref.float().abs().max())
    flops = 2.0 * m * k * n
    torch_ms = _ms(torch_call, iters)
    d = lt.build(m, k, n, dtype, epilogue)
    ws = torch.empty(max(workspace_bytes, 1), device="cuda", dtype=torch.uint8)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    heur = lt.heuristics(d, count, workspace_bytes)
    t0 = time.perf_counter()
    extra = lt.enumerate(d, workspace_bytes, search) if search else []
    enum_s = time.perf_counter() - t0
    random.Random(0).shuffle(extra)  # the screen's time limit then samples every algorithm id alike
    algos = []
    deadline = time.perf_counter() + screen_s
    for i, h in enumerate(heur + extra):
        if i >= len(heur) and time.perf_counter() > deadline:
            break
        entry: dict[str, Any] = {"rank": i if i < len(heur) else None, "source": "heuristic" if i < len(heur)
                                 else "search", "workspace": int(h.workspace_size),
                                 "waves": round(h.waves_count, 3), **lt.config(h.algo), "_algo": h.algo}
        try:
            out.zero_()
            lt.matmul(d, h.algo, w, x, bias, out, ws)
            torch.cuda.synchronize()
            entry["max_diff_vs_torch"] = float((out.float() - ref.float()).abs().max())
            if entry["max_diff_vs_torch"] < tol:
                if i < len(heur):
                    entry["ms"] = _ms(lambda h=h: lt.matmul(d, h.algo, w, x, bias, out, ws), iters)
                else:  # a quick screen: the finalists are re-timed below
                    entry["ms"] = 1000.0 * metrics.time_op(lambda h=h: lt.matmul(d, h.algo, w, x, bias, out, ws),
                                                           torch.device("cuda"), iters=4, blocks=1, warmup=1)
                entry["tflops"] = flops / entry["ms"] / 1e9
        except RuntimeError as exc:
            entry["error"] = str(exc)
        algos.append(entry)
    timed = sorted((a for a in algos if "ms" in a), key=lambda a: a["ms"])
    # the finalists (and the heuristic's first, torch's own choice) re-timed as CUDA graphs, interleaved
    chosen = timed[:finalists] + [a for a in algos[:1] if "ms" in a and a not in timed[:finalists]]
    calls = 20
    graphs = {"torch": metrics.capture_graph(torch_call, calls)}
    for j, a in enumerate(chosen):
        graphs[f"c{j}"] = metrics.capture_graph(lambda a=a: lt.matmul(d, a["_algo"], w, x, bias, out, ws), calls)
    med = _interleaved(graphs, calls, rounds)
    for j, a in enumerate(chosen):
        a["graph_ms"] = med[f"c{j}"]
    best = min(chosen, key=lambda a: a["graph_ms"]) if chosen else None
    for a in algos:
        a.pop("_algo")
    return {
        "shape": [m, k, n], "dtype": str(dtype), "epilogue": epilogue,
        "torch_ms": torch_ms, "torch_graph_ms": med["torch"], "torch_tflops": flops / med["torch"] / 1e9,
        "heuristic_first_graph_ms": algos[0].get("graph_ms") if algos else None,
        "best": best, "speedup_vs_torch": (med["torch"] / best["graph_ms"]) if best else None,
        "best_tflops": flops / best["graph_ms"] / 1e9 if best else None,
        "heuristic_candidates": len(heur), "searched_candidates": len(extra),
        "screened": len(algos) - len(heur), "search_s": enum_s,
        "algos": algos,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--algos", type=int, default=32, help="candidates asked of the heuristic per shape")
    ap.add_argument("--workspace-mib", type=float, nargs="+", default=[1.0, 32.0],
                    help="workspace limits to ask with (torch's own is printed in the result's env)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--search", type=int, default=0,
                    help="also enumerate up to this many configurations per shape beyond the heuristic's")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved CUDA-graph rounds for the finalists")
    ap.add_argument("--screen-seconds", type=float, default=30.0, help="time limit per shape for the searched ones")
    ap.add_argument("--engine", action="store_true",
                    help="run the engine's own search (nexfort_engine.gemm_tuning.search) per shape instead")
    args = ap.parse_args()
    if args.engine:
        from nexfort_engine import gemm_tuning

        rows = {}
        for name in args.shapes:
            m, k, n, dtype, epi = SHAPES[name]
            rows[name] = entry = gemm_tuning.search(m, k, n, dtype, epi)
            print(f"{name}: {entry['screened']} screened in {entry['seconds']:.2f} s, torch {entry['torch_ms']:.4f} ms, "
                  f"best {entry.get('best_ms')} = {entry.get('speedup')}x, bit-identical {entry.get('bit_identical')}, "
                  f"chosen {entry['config']}", flush=True)
        with open(args.output_json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
        return
    lt = Lt()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "cublaslt_version": lt.version,
                              "rows": {}}
    for mib in args.workspace_mib:
        for name in args.shapes:
            m, k, n, dtype, epi = SHAPES[name]
            row = shape_row(lt, m, k, n, dtype, epi, args.algos, int(mib * 2**20), args.iters, args.search,
                            rounds=args.rounds, screen_s=args.screen_seconds)
            result["rows"][f"{name}@{mib:g}MiB"] = row
            best = row["best"] or {}
            print(f"{name} ws {mib:g} MiB: torch {row['torch_graph_ms']:.4f} ms in graphs "
                  f"({row['torch_tflops']:.0f} TFLOP/s), heuristic first {row['heuristic_first_graph_ms']}, "
                  f"best {best.get('graph_ms')} = {row['speedup_vs_torch'] or 0:.3f}x ({best.get('source')} "
                  f"rank {best.get('rank')}, algo {best.get('id')} tile {best.get('tile_id')} stages "
                  f"{best.get('stages_id')} swizzle {best.get('cta_swizzling')} custom {best.get('custom_option')} "
                  f"cluster {best.get('cluster_shape_id')}) of {row['heuristic_candidates']} + "
                  f"{row['searched_candidates']} found ({row['screened']} screened) in {row['search_s']:.1f} s", flush=True)
            with open(args.output_json, "w") as fh:
                json.dump(result, fh, indent=1)
    result["seconds"] = time.perf_counter() - t0
    with open(args.output_json, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
