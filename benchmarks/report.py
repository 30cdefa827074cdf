"""Benchmark JSON files -> the seeds-style Markdown metrics table (+ a speed-up chart).

    python benchmarks/report.py out/*.json --markdown out/report.md --chart out/speedup.png

One column per (GPU, model, resolution, steps, batch); rows as in the OneDiff nexfort seeds
("PyTorch iteration speed", ..., "Warmup with Cache time"), one row per compiler, percentages
against the eager (``--compiler none``) run of the same column. Then a flat summary table with
achieved TFLOP/s (and % of the device's measured matmul peak), compile counts and errors. The chart needs matplotlib; without it the chart is skipped with a
message. Only numbers present in the JSON files are printed; a missing one shows as an empty cell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

COMPILERS = ("none", "comfy", "nexfort")
LABEL = {"none": "PyTorch (eager)", "comfy": "ComfyUI TorchCompile", "nexfort": "nexfort"}


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    docs = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if isinstance(doc, list):  # a merged results file
            docs.extend(doc)
        else:
            docs.append(doc)
    return docs


def flatten(docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for doc in docs:
        env = doc.get("env", {})
        for run in doc.get("runs", []):
            rows.append({**run, "_env": env})
    return rows


def column_key(r: dict[str, Any]) -> tuple:
    env = r["_env"]
    return (env.get("gpu") or "CPU", r["model"], r["height"], r["width"], r.get("frames"), r["steps"], r["batch"])


def column_title(key: tuple) -> str:
    gpu, model, h, w, frames, steps, batch = key
    size = f"{w}*{h}" + (f"*{frames}f" if frames else "")
    extra = f", batch {batch}" if batch != 1 else ""
    return f"{gpu}, {model} {size}, {steps} steps{extra}"


def _f(v: Any, fmt: str, unit: str = "") -> str:
    return "" if v is None else f"{v:{fmt}}{unit}"


def _pct(v: float | None, base: float | None, lower_is_better: bool = False) -> str:
    if v is None or not base:
        return ""
    d = (v - base) / base * 100
    return f" ({d:+.1f}%)"


def _pick(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """column -> compiler -> run (the last one given wins)."""
    table: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        table.setdefault(column_key(r), {})[r["compiler"]] = r
    return table


def metrics_table(rows: list[dict[str, Any]]) -> str:
    table = _pick(rows)
    if not table:
        return "_no results_\n"
    cols = list(table)
    lines = ["| Metric | " + " | ".join(column_title(c) for c in cols) + " |",
             "| --- | " + " | ".join("---" for _ in cols) + " |"]

    def row(name: str, cell) -> None:
        lines.append(f"| {name} | " + " | ".join(cell(table[c]) for c in cols) + " |")

    row("Data update date (yyyy-mm-dd)", lambda t: next(iter(t.values()))["_env"].get("date", ""))
    row("Precision (weights / manual cast)", lambda t: (lambda r: f"{r['dtype']} / {r.get('manual_cast') or '-'}")(
        next(iter(t.values()))))
    for comp in COMPILERS:
        def cell(t, comp=comp):
            r = t.get(comp)
            if not r:
                return ""
            base = t.get("none", {}).get("it_s") if comp != "none" else None
            return _f(r.get("it_s"), ".2f", " it/s") + _pct(r.get("it_s"), base)
        row(f"{LABEL[comp]} iteration speed", cell)
    for comp in COMPILERS:
        def cell(t, comp=comp):
            r = t.get(comp)
            if not r:
                return ""
            base = t.get("none", {}).get("e2e_s") if comp != "none" else None
            return _f(r.get("e2e_s"), ".3f", " s") + _pct(r.get("e2e_s"), base)
        row(f"{LABEL[comp]} E2E time", cell)
    for comp in COMPILERS:
        row(f"{LABEL[comp]} Max Mem Used", lambda t, comp=comp: _f(t.get(comp, {}).get("peak_mem_gib"), ".3f", " GiB"))
    row(f"{LABEL['none']} Warmup with Run time", lambda t: _f(t.get("none", {}).get("warmup_s"), ".3f", " s"))
    for comp in ("comfy", "nexfort"):
        row(f"{LABEL[comp]} Warmup with Compilation time", lambda t, comp=comp: _f(t.get(comp, {}).get("warmup_s"), ".2f", " s"))
        row(f"{LABEL[comp]} Warmup with Cache time",
            lambda t, comp=comp: _f(t.get(comp, {}).get("warmup_warm_cache_s"), ".2f", " s"))
    return "\n".join(lines) + "\n"


def tflops_cell(r: dict[str, Any]) -> str:
    """``achieved TFLOP/s (% of the measured peak of the compute dtype)``; empty for runs without it."""
    t = r.get("achieved_tflops")
    if t is None:
        return ""
    pct = r.get("pct_of_peak")
    if pct is None:
        return f"{t:.4g}"
    dtype = r.get("peak_dtype")
    return f"{t:.4g} ({pct:.1f}%" + (f" {dtype})" if dtype else ")")


def _variant(r: dict[str, Any]) -> str:
    """The benchmark's A/B knobs a run was started with, appended to its config cell."""
    parts = []
    if r.get("attention_experiment") not in (None, "none"):
        parts.append(f"attention={r['attention_experiment']}")
    if r.get("ln_mod_quant") is False:
        parts.append("no-ln-mod-quant")
    return (" " + " ".join(parts)) if parts else ""


def summary_table(rows: list[dict[str, Any]]) -> str:
    head = ("| GPU | model | size | compiler | config | it/s | speed-up | TFLOP/s (% peak) | E2E s | peak GiB | "
            "warm-up s | warm-cache s | compiles | recompiles | fallbacks | max err vs eager | err vs fp32 (eager) | "
            "lossless |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    table = _pick(rows)
    for key, by_comp in table.items():
        base = by_comp.get("none", {}).get("it_s")
        # every run of the column (an A/B call has several per compiler), eager first
        runs = [r for comp in COMPILERS for r in rows if column_key(r) == key and r["compiler"] == comp]
        for r in runs:
            comp = r["compiler"]
            gpu, model, h, w, frames, steps, batch = key
            size = f"{w}x{h}" + (f"x{frames}f" if frames else "")
            speed = f"{r['it_s'] / base:.2f}x" if base and r.get("it_s") else ""
            e_eager = (r.get("err_vs_eager") or {}).get("max_abs")
            fp = r.get("err_vs_fp32") or {}
            efp = r.get("eager_err_vs_fp32") or {}
            fp_cell = f"{fp['max_abs']:.3g} ({efp.get('max_abs', float('nan')):.3g})" if fp else ""
            lossless = "" if "lossless" not in r else ("yes" if r["lossless"] else "NO")
            cfg = (r.get("compiler_config") or "") + _variant(r)
            lines.append(
                f"| {gpu} | {model} | {size} | {comp} | `{cfg}` | {_f(r.get('it_s'), '.2f')} | {speed} | "
                f"{tflops_cell(r)} | {_f(r.get('e2e_s'), '.3f')} | {_f(r.get('peak_mem_gib'), '.2f')} | {_f(r.get('warmup_s'), '.2f')} | "
                f"{_f(r.get('warmup_warm_cache_s'), '.2f')} | {r.get('compiles', '')} | {r.get('recompiles', '')} | "
                f"{r.get('fallbacks', '')} | {_f(e_eager, '.3g')} | {fp_cell} | {lossless} |"
            )
    return "\n".join(lines) + "\n"


def sweep_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        sw = r.get("sweep")
        if not sw:
            continue
        total = sum(s["new_compiles"] for s in sw)
        out.append(f"\n**{r['model']} / {r['compiler']}** `{r.get('compiler_config') or ''}` - multiple resolutions: "
                   f"{len(sw)} combinations, {total} new compiles after the first\n")
        out.append("| size | steps | prompt tokens | first run s | E2E s | it/s | new compiles | fallbacks |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for s in sw:
            out.append(f"| {s['width']}x{s['height']} | {s['steps']} | {s['text_len']} | {s['first_s']:.2f} | "
                       f"{s['e2e_s']:.3f} | {_f(s.get('it_s'), '.2f')} | {s['new_compiles']} | {s.get('fallbacks', 0)} |")
    return "\n".join(out) + ("\n" if out else "")


def profile_table(rows: list[dict[str, Any]]) -> str:
    """``--profile`` runs: kernel time per step by category (ms), the GPU's busy share of a step."""
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return ""
    cats = sorted({c for r in prof for c in r["profile"]["by_category_ms_per_step"]})
    out = ["| model | compiler | config | wall ms/step | busy ms/step | kernels/step | " + " | ".join(cats) + " |",
           "| --- " * (6 + len(cats)) + "|"]
    for r in prof:
        p = r["profile"]
        by = p["by_category_ms_per_step"]
        out.append(f"| {r['model']} {r['width']}x{r['height']} | {r['compiler']} | `{r.get('compiler_config') or ''}` | "
                   f"{p['wall_ms_per_step']:.2f} | {p['gpu_busy_ms_per_step']:.2f} | {p['kernels_per_step']:.0f} | "
                   + " | ".join(_f(by.get(c), ".2f") for c in cats) + " |")
    return "\n".join(out) + "\n"


def render(docs: list[dict[str, Any]]) -> str:
    rows = flatten(docs)
    parts = ["### Metric\n", metrics_table(rows), "\n### Summary\n", summary_table(rows)]
    sw = sweep_table(rows)
    if sw:
        parts += ["\n### Dynamic shape (run_multiple_resolutions)\n", sw]
    pt = profile_table(rows)
    if pt:
        parts += ["\n### Where the time goes (--profile, kernel ms per step)\n", pt]
    envs = {json.dumps({k: d.get("env", {}).get(k) for k in ("gpu", "torch", "triton", "comfyui", "cuda")},
                       sort_keys=True) for d in docs}
    parts.append("\nEnvironment: " + "; ".join(sorted(envs)) + "\n")
    return "".join(parts)


def one_line(r: dict[str, Any]) -> str:
    err = (r.get("err_vs_eager") or {}).get("max_abs")
    return (f"RESULT model={r['model']} compiler={r['compiler']} size={r['width']}x{r['height']} "
            f"it/s={_f(r.get('it_s'), '.2f')} e2e={_f(r.get('e2e_s'), '.3f')}s warmup={_f(r.get('warmup_s'), '.2f')}s "
            f"warm_cache={_f(r.get('warmup_warm_cache_s'), '.2f')}s peak={_f(r.get('peak_mem_gib'), '.2f')}GiB "
            f"tflops={_f(r.get('achieved_tflops'), '.4g')} pct_peak={_f(r.get('pct_of_peak'), '.1f')} "
            f"compiles={r.get('compiles')} recompiles={r.get('recompiles')} fallbacks={r.get('fallbacks')} "
            f"err_vs_eager={_f(err, '.3g')} lossless={r.get('lossless', '')}")


def series_label(r: dict[str, Any]) -> str:
    """``ComfyUI TorchCompile`` or ``nexfort <mode>`` plus the non-default options of the run."""
    if r["compiler"] != "nexfort":
        return LABEL.get(r["compiler"], r["compiler"])
    try:
        cfg = json.loads(r.get("compiler_config") or "{}")
    except ValueError:
        return f"nexfort {r.get('compiler_config')}"
    parts = [str(cfg.pop("mode", "O2"))]
    parts += [f"{k}={json.dumps(v)}" for k, v in sorted(cfg.items())]
    return "nexfort " + ", ".join(parts)


def chart(docs: list[dict[str, Any]], path: Path) -> str:
    """Bar chart of speed-up over eager per model column and compiler. Returns a status message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install matplotlib)"
    rows = flatten(docs)
    table = _pick(rows)
    cols = [c for c in table if table[c].get("none", {}).get("it_s")]
    if not cols:
        return "chart skipped: no eager (--compiler none) baseline with it/s"
    # one series per compiler and mode (the last run of each wins), so every mode measured shows
    series: dict[str, dict[tuple, dict[str, Any]]] = {}
    for r in rows:
        if r["compiler"] != "none" and r.get("it_s") and column_key(r) in cols:
            series.setdefault(series_label(r), {})[column_key(r)] = r
    fig, ax = plt.subplots(figsize=(max(7, 1.9 * len(cols)), 4.5))
    width = 0.84 / max(len(series), 1)
    for i, (label, runs) in enumerate(series.items()):
        ys = [runs[c]["it_s"] / table[c]["none"]["it_s"] if c in runs else 0.0 for c in cols]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cols))]
        bars = ax.bar(xs, ys, width, label=label)
        for b, y in zip(bars, ys, strict=False):
            if y:
                ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{c[1]}\n{c[3]}x{c[2]}" for c in cols], fontsize=8)
    ax.set_ylabel("speed-up over eager (it/s)")
    ax.set_title(f"{cols[0][0]}: ComfyUI sampling, steady it/s")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Benchmark JSON -> Markdown table and speed-up chart")
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown here (always printed)")
    p.add_argument("--chart", type=Path, default=None, help="PNG speed-up chart (needs matplotlib)")
    p.add_argument("--merged-json", type=Path, default=None, help="write all input documents as one JSON list")
    args = p.parse_args(argv)
    docs = load(args.json)
    md = render(docs)
    print(md)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md)
    if args.merged_json:
        args.merged_json.parent.mkdir(parents=True, exist_ok=True)
        args.merged_json.write_text(json.dumps(docs, indent=1, default=str))
    if args.chart:
        print(chart(docs, args.chart), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
