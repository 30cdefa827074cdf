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

Driven through ``ctypes`` on the cuBLASLt that torch has loaded (no build step).

    python -m benchmarks.cublaslt_algos --output-json out.json [--algos 32] [--workspace-mib 32]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import random
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import metrics

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

_CUDA_R_16F, _CUDA_R_32F, _CUDA_R_16BF = 2, 0, 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
_PREF_MAX_WORKSPACE_BYTES = 1
_EPILOGUE = {"bias": 4, "gelu_bias": 36}
# cublasLtMatmulAlgoConfigAttributes_t: name -> (attribute, its C type; the size must match)
_ALGO_CONFIG: dict[str, tuple[int, Any]] = {
    "id": (0, ctypes.c_int32), "tile_id": (1, ctypes.c_uint32), "splitk_num": (2, ctypes.c_int32),
    "reduction_scheme": (3, ctypes.c_uint32), "cta_swizzling": (4, ctypes.c_uint32),
    "custom_option": (5, ctypes.c_uint32), "stages_id": (6, ctypes.c_uint32),
    "inner_shape_id": (7, ctypes.c_uint16), "cluster_shape_id": (8, ctypes.c_uint16)}
# cublasLtMatmulAlgoCapAttributes_t
_CAP_SWIZZLE, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_EPILOGUE_MASK, _CAP_STAGES_IDS = 2, 6, 7, 12, 13
#: cublasLtClusterShape_t values tried in the exhaustive search: auto, 1x1x1, 2x1x1, 1x2x1, 2x2x1
_CLUSTERS = (0, 2, 3, 5, 6)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch has mapped (after one CUDA matmul), else the first one dlopen finds."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.float16)
    F.linear(a, a, a[0])
    torch.cuda.synchronize()
    with open("/proc/self/maps") as fh:
        paths = sorted({line.split()[-1] for line in fh if "libcublasLt" in line})
    for path in paths + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("no libcublasLt found")


class Lt:
    """The few cuBLASLt calls this needs, with their status checked."""

    def __init__(self) -> None:
        self.lib = _load_cublaslt()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cublasStatus {status}")

    def _set(self, fn: Any, obj: ctypes.c_void_p, attr: int, value: Any) -> None:
        self._check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), fn.__name__)

    def build(self, m: int, k: int, n: int, dtype: torch.dtype, epilogue: str, bias: torch.Tensor) -> dict:
        """Descriptors for ``out[m, n] = x[m, k] · w[n, k]ᵀ + bias`` as torch builds them."""
        lib, cdt = self.lib, (_CUDA_R_16F if dtype == torch.float16 else _CUDA_R_16BF)
        desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F), "DescCreate")
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE[epilogue]))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(cdt))
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # A = w (op T), B = x, C = D = out
            lay = ctypes.c_void_p()
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), cdt, ctypes.c_uint64(rows),
                                                       ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
            layouts.append(lay)
        return {"desc": desc, "a": layouts[0], "b": layouts[1], "c": layouts[2]}

    def heuristics(self, d: dict, count: int, workspace: int) -> list[_Heuristic]:
        lib = self.lib
        pref = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
                  ctypes.c_uint64(workspace))
        results = (_Heuristic * count)()
        returned = ctypes.c_int(0)
        self._check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, d["desc"], d["a"], d["b"], d["c"], d["c"],
                                                       pref, count, results, ctypes.byref(returned)),
                    "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: _Algo) -> dict[str, int]:
        out = {}
        for name, (attr, ctype) in _ALGO_CONFIG.items():
            val, written = ctype(0), ctypes.c_size_t(0)
            st = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(val),
                                                               ctypes.c_size_t(ctypes.sizeof(val)),
                                                               ctypes.byref(written))
            if st == 0:
                out[name] = int(val.value)
        return out

    def _cap(self, algo: _Algo, attr: int, ctype: Any = ctypes.c_int32) -> int:
        val, written = ctype(0), ctypes.c_size_t(0)
        st = self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(val),
                                                        ctypes.c_size_t(ctypes.sizeof(val)), ctypes.byref(written))
        return int(val.value) if st == 0 else 0

    def _cap_list(self, algo: _Algo, attr: int) -> list[int]:
        written = ctypes.c_size_t(0)
        self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                                   ctypes.byref(written))
        count = written.value // 4
        if count == 0:
            return [0]
        buf = (ctypes.c_uint32 * count)()
        self._check(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf,
                                                               ctypes.c_size_t(4 * count), ctypes.byref(written)),
                    "AlgoCapGetAttribute")
        return [int(v) for v in buf]

    def _set_config(self, algo: _Algo, name: str, value: int) -> bool:
        attr, ctype = _ALGO_CONFIG[name]
        val = ctype(value)
        return self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(val),
                                                             ctypes.c_size_t(ctypes.sizeof(val))) == 0

    def enumerate(self, d: dict, dtype: torch.dtype, epilogue: str, workspace: int,
                  limit: int) -> list[_Heuristic]:
        """Every configuration cuBLASLt accepts (``AlgoCheck``) for these descriptors: each algorithm id
        × tile × stages × CTA swizzle × custom option × cluster shape, no split-K (the heuristic's
        own search space for shapes this large), at most ``limit`` of them."""
        lib, cdt = self.lib, (_CUDA_R_16F if dtype == torch.float16 else _CUDA_R_16BF)
        ids = (ctypes.c_int * 256)()
        returned = ctypes.c_int(0)
        self._check(lib.cublasLtMatmulAlgoGetIds(self.handle, _COMPUTE_32F, _CUDA_R_32F, cdt, cdt, cdt, cdt,
                                                 256, ids, ctypes.byref(returned)), "AlgoGetIds")
        found: list[_Heuristic] = []
        for algo_id in list(ids)[: returned.value]:
            base = _Algo()
            if lib.cublasLtMatmulAlgoInit(self.handle, _COMPUTE_32F, _CUDA_R_32F, cdt, cdt, cdt, cdt,
                                          algo_id, ctypes.byref(base)) != 0:
                continue
            if not self._cap(base, _CAP_EPILOGUE_MASK, ctypes.c_uint32) & _EPILOGUE[epilogue]:
                continue
            swizzles = (0, 1) if self._cap(base, _CAP_SWIZZLE, ctypes.c_uint32) else (0,)
            customs = range(self._cap(base, _CAP_CUSTOM_MAX) + 1)
            for tile, stages, swz, custom, cluster in itertools.product(
                    self._cap_list(base, _CAP_TILE_IDS), self._cap_list(base, _CAP_STAGES_IDS), swizzles, customs,
                    _CLUSTERS):
                algo = _Algo()
                ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(_Algo))
                ok = (self._set_config(algo, "tile_id", tile)
                      and self._set_config(algo, "stages_id", stages)
                      and self._set_config(algo, "cta_swizzling", swz)
                      and self._set_config(algo, "custom_option", custom)
                      and self._set_config(algo, "splitk_num", 1))
                if cluster:
                    ok = ok and self._set_config(algo, "cluster_shape_id", cluster)
                if not ok:
                    continue
                h = _Heuristic()
                if lib.cublasLtMatmulAlgoCheck(self.handle, d["desc"], d["a"], d["b"], d["c"], d["c"],
                                               ctypes.byref(algo), ctypes.byref(h)) != 0:
                    continue
                if h.workspace_size > workspace:
                    continue
                h.algo = algo
                found.append(h)
                if len(found) >= limit:
                    return found
        return found

    def matmul(self, d: dict, algo: _Algo, w: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
               workspace: torch.Tensor) -> None:
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cublasLtMatmul(
            self.handle, d["desc"], ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), d["a"],
            ctypes.c_void_p(x.data_ptr()), d["b"], ctypes.byref(zero), ctypes.c_void_p(out.data_ptr()), d["c"],
            ctypes.c_void_p(out.data_ptr()), d["c"], ctypes.byref(algo), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(workspace.numel()), stream), "cublasLtMatmul")


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
    d = lt.build(m, k, n, dtype, epilogue, bias)
    ws = torch.empty(max(workspace_bytes, 1), device="cuda", dtype=torch.uint8)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    heur = lt.heuristics(d, count, workspace_bytes)
    t0 = time.perf_counter()
    extra = lt.enumerate(d, dtype, epilogue, workspace_bytes, search) if search else []
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
            lt.matmul(d, h.algo, w, x, out, ws)
            torch.cuda.synchronize()
            entry["max_diff_vs_torch"] = float((out.float() - ref.float()).abs().max())
            if entry["max_diff_vs_torch"] < tol:
                if i < len(heur):
                    entry["ms"] = _ms(lambda h=h: lt.matmul(d, h.algo, w, x, out, ws), iters)
                else:  # a quick screen: the finalists are re-timed below
                    entry["ms"] = 1000.0 * metrics.time_op(lambda h=h: lt.matmul(d, h.algo, w, x, out, ws),
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
        graphs[f"c{j}"] = metrics.capture_graph(lambda a=a: lt.matmul(d, a["_algo"], w, x, out, ws), calls)
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
    args = ap.parse_args()
    lt = Lt()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "cublaslt_version": int(lt.lib.cublasLtGetVersion()),
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
