"""Fit the compile-cost model of a cut graph's parts (``nexfort_engine.split.assign``) to measured
part compile times, and predict a cut's slowest part.

Input: the nodes of one traced graph per model (``NX_PROBE_CUT`` of ``benchmarks/probe_site``:
target, output layout, weight, part) and benchmark JSONs whose ``compile_parts.*.each`` lists every
part's node count and compile time. The cut of each JSON is recomputed from the node list (node
counts must match), its parts' features counted (compute nodes, kernels new to the part), and

    compile_s = scale_run * (c + a * nodes + b * new_kernels)

fitted by least squares over the workers' parts (relative error; one scale per run: machines
differ). ``b / a`` is the kernel weight in nodes (``NEW_KERNEL_WEIGHT``).

    python benchmarks/fit_cut_cost.py \\
        --nodes sdxl=benchmarks/results/2026-11-25-h100/split-part-times/cut_nodes_sdxl.json.gz \\
        --nodes sd21=benchmarks/results/2026-11-25-h100/split-part-times/cut_nodes_sd21.json.gz \\
        benchmarks/results/2026-11-25-h100/run19[23]_*/*.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nexfort_engine import split  # noqa: E402 - the checkout's engine


def kernel(kind: str) -> bool:
    """Whether the engine counts a node of this target (the probe's ``_kind``) as making a kernel."""
    return kind.lstrip(".") not in split._NO_KERNEL


def node_cut(rows: list, n: int, share: float) -> list[int]:
    """The node-count cut (the engine before the kernel weight)."""
    total = sum(r[2] for r in rows)
    ends = [total * (share + k) / (share + n - 1) for k in range(n)]
    out, seen, part = [], 0, 0
    for r in rows:
        while part < n - 1 and seen >= ends[part]:
            part += 1
        out.append(part)
        seen += r[2]
    return out


def cost_cut(rows: list, n: int, share: float, k: int) -> list[int]:
    """The engine's cut (split.assign) at kernel weight ``k``."""
    costs = [(None, w, sig if w and kernel(kind) else None) for kind, sig, w, _p in rows]
    return split.cut_costs(costs, n, share, kernel_weight=k)


def features(rows: list, parts: list[int], n: int) -> list[tuple[int, int]]:
    """Per part: (compute nodes, kernels new to the part)."""
    nodes, sigs = [0] * n, [set() for _ in range(n)]
    for (kind, sig, w, _p), part in zip(rows, parts, strict=True):
        nodes[part] += w
        if w and kernel(kind):
            sigs[part].add(sig)
    return [(nodes[i], len(sigs[i])) for i in range(n)]


def fit(samples: list[tuple[str, int, int, float]]) -> tuple[list[float], dict[str, float], float]:
    """Least squares (relative) for c, a, b and a scale per run, by Gauss-Newton on a small system."""
    import numpy as np

    runs = sorted({s[0] for s in samples})
    x = np.array([1.0, 0.03, 0.5] + [1.0] * (len(runs) - 1))

    def resid(x: np.ndarray) -> np.ndarray:
        sc = dict(zip(runs, [1.0, *x[3:]], strict=True))
        return np.array([sc[r] * (x[0] + x[1] * nn + x[2] * kk) / t - 1 for r, nn, kk, t in samples])

    for _ in range(200):
        r = resid(x)
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            d = np.zeros_like(x)
            d[j] = 1e-6 * max(1.0, abs(x[j]))
            jac[:, j] = (resid(x + d) - r) / d[j]
        step = np.linalg.lstsq(jac, -r, rcond=None)[0]
        x = x + step
        if np.abs(step).max() < 1e-10:
            break
    rms = math.sqrt(float(np.mean(resid(x) ** 2)))
    return list(x[:3]), dict(zip(runs, [1.0, *x[3:]], strict=True)), rms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", action="append", required=True, metavar="MODEL=PATH", help="a probe's cut dump")
    p.add_argument("--parts", type=int, default=6)
    p.add_argument("jsons", nargs="+", type=Path)
    args = p.parse_args()
    dumps = {}
    for spec in args.nodes:
        model, path = spec.split("=", 1)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            dumps[model] = json.load(f)["nodes"]
    n, samples = args.parts, []
    for path in args.jsons:
        d = json.loads(path.read_text())
        each = next(iter(d["runs"][0]["counts_after_warmup"]["compile_parts"].values()), {}).get("each")
        model = next((m for m in dumps if path.name.startswith(m) or f"_{m}" in path.name), None)
        if not each or model is None:
            continue
        got = [e["nodes"] for e in each]
        rows = dumps[model]
        cuts = [node_cut(rows, n, s) for s in (0.7, 1.0)] + [cost_cut(rows, n, s, k) for k in (34, 14)
                                                             for s in (0.8, 1.0)]
        parts = next((c for c in cuts if [f[0] for f in features(rows, c, n)] == got), None)
        if parts is None:
            print(f"{path.name}: no known cut gives node counts {got}")
            continue
        for e, (nn, kk) in zip(each, features(rows, parts, n), strict=True):
            if e.get("where") == "child":
                samples.append((f"{path.parent.name}/{path.name}", nn, kk, float(e["compile_s"])))
    (c, a, b), scales, rms = fit(samples)
    print(f"{len(samples)} worker parts from {len(scales)} runs: compile_s = scale * ({c:.2f} + {a:.4f} * nodes"
          f" + {b:.3f} * new kernels); kernel weight b/a = {b / a:.1f} nodes; rms relative error {rms:.3f}")
    for model, rows in sorted(dumps.items()):
        for label, parts in [("nodes, share 0.7", node_cut(rows, n, 0.7)),
                             ("kernel weight 14, share 0.8", cost_cut(rows, n, 0.8, 14))]:
            f = features(rows, parts, n)
            pred = [round(float(c + a * nn + b * kk), 1) for nn, kk in f]
            print(f"  {model} {label}: nodes {[x[0] for x in f]}, new kernels {[x[1] for x in f]},"
                  f" predicted s (scale 1) {pred}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
