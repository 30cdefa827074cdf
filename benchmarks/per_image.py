"""Seconds per image, side by side in one process: eager, ComfyUI's compile and nexfort presets.

What a user waits for is the whole sampling: ``comfy.sample.sample`` from its call until the
latent is ready on the device (a synchronise at the end). This benchmark builds one random-weight
model at real size, puts each contender on a clone of the same ModelPatcher (ComfyUI's
``TorchCompileModel`` helper, nexfort's node glue), warms each up (compile, and one more sampling
so CUDA graphs are recorded), then times the contenders in interleaved rounds (A B C, A B C, ...)
so a machine's drift hits them alike, and reports the median of the rounds:

    python -m benchmarks.per_image --model sdxl --contenders eager,comfy,O2 --steps 20 \\
        --repeat 5 --output-json out/sdxl_per_image.json

Per contender: seconds per image and it/s (steps / that), the cold first sampling (compile
included), and diagnostics beside them: the device's step time (CUDA events at the sampler's
callbacks), the host's time between callbacks, and the fixed cost of a sampling (seconds per image
minus the steps at the device's step time). ``--syncs`` runs one more sampling per contender with
torch's CUDA sync debug mode and lists where the host waited for the device (Python stack of each
synchronising call); ``--api`` one more under ``torch.profiler``: the CUDA runtime calls the host
made per step, with their time (a ``cudaMemcpyAsync`` from pageable memory or a
``cudaStreamSynchronize`` that takes milliseconds is the host waiting for the device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import text_to_image as t2i  # noqa: E402

#: contenders: "eager", "comfy" (ComfyUI's TorchCompileModel, inductor) and nexfort's presets
NEXFORT_PRESETS = ("O1", "O2", "O3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy-root", type=Path, default=None)
    p.add_argument("--model", default="sdxl", choices=["sd21", "sdxl", "pixart", "flux", "wan"])
    p.add_argument("--contenders", default="eager,comfy,O2",
                   help="comma list of: eager, comfy, " + ", ".join(NEXFORT_PRESETS) +
                   ", or nexfort:<options JSON> (e.g. nexfort:{\"mode\":\"O2\"})")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", type=float, default=None)
    p.add_argument("--repeat", type=int, default=5, help="timed rounds (median reported; at least 3 for a claim)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny twins of the architectures (CPU tests)")
    p.add_argument("--syncs", action="store_true", help="one more sampling per contender under CUDA sync debug mode")
    p.add_argument("--api", action="store_true", help="one more sampling per contender under torch.profiler")
    p.add_argument("--cache-dir", type=Path, default=None, help="compile caches (default: a fresh temp dir: cold)")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)
    names = split_contenders(args.contenders)
    for c in names:
        if c not in ("eager", "comfy", *NEXFORT_PRESETS) and not c.startswith("nexfort:"):
            p.error(f"--contenders: {c!r} is not one of eager, comfy, {', '.join(NEXFORT_PRESETS)}, nexfort:<JSON>")
    args.contender_list = names
    return args


def split_contenders(text: str) -> list[str]:
    """``a,b,nexfort:{"x":1,"y":2}`` -> its names: commas inside braces belong to the JSON."""
    names, depth, cur = [], 0, ""
    for ch in text:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(cur.strip())
            cur = ""
        else:
            cur += ch
    names.append(cur.strip())
    return [n for n in names if n]


def _compiler_of(name: str) -> tuple[str, str]:
    """(text_to_image's --compiler, --compiler-config) for a contender name."""
    if name == "eager":
        return "none", "{}"
    if name == "comfy":
        return "comfy", "{}"
    if name.startswith("nexfort:"):
        return "nexfort", name.split(":", 1)[1]
    return "nexfort", json.dumps({"mode": name})


def _t2i_args(args: argparse.Namespace) -> argparse.Namespace:
    """text_to_image's namespace for its Runner (sampler, scheduler, seed, batch, frames)."""
    argv = ["--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch), "--device", args.device]
    for flag, value in (("--height", args.height), ("--width", args.width), ("--frames", args.frames),
                        ("--cfg", args.cfg)):
        if value is not None:
            argv += [flag, str(value)]
    if args.tiny:
        argv.append("--tiny")
    return t2i.parse_args(argv)


class SyncLog:
    """Where the host waited for the device: torch's CUDA sync debug mode ("warn") reports each
    synchronising call (``.item()``, a blocking copy, ``synchronize``); each report's Python stack
    (this file's and torch's own frames left out) is counted."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()

    def _show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings.py" not in f.filename and f.filename != __file__]
        self.sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-6:]))] += 1

    def __enter__(self) -> SyncLog:
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


def runtime_calls(prof: Any, steps: int, top: int = 12) -> dict[str, Any]:
    """The CUDA runtime/driver calls the host made in a profiled sampling, per step: count, total
    and longest time per call name, and the longest single calls with their Python stacks."""
    per: dict[str, list[float]] = {}
    longest: list[tuple[float, str, list[str]]] = []
    for evt in prof.events():
        name = str(evt.name)
        if not name.startswith(("cuda", "cu")) or "CUDA" in str(getattr(evt, "device_type", "")):
            continue
        us = float(evt.cpu_time_total)
        rec = per.setdefault(name, [0, 0.0, 0.0])
        rec[0] += 1
        rec[1] += us
        rec[2] = max(rec[2], us)
        if us >= 200.0:
            stack = [s for s in (getattr(evt, "stack", None) or []) if "/torch/" not in s][:6]
            longest.append((us, name, stack))
    longest.sort(key=lambda r: -r[0])
    steps = max(steps, 1)
    return {
        "per_step": {k: {"calls": round(v[0] / steps, 2), "ms": round(v[1] / 1000.0 / steps, 3),
                         "max_ms": round(v[2] / 1000.0, 3)}
                     for k, v in sorted(per.items(), key=lambda kv: -kv[1][1])},
        "longest": [{"ms": round(us / 1000.0, 3), "call": n, "stack": st} for us, n, st in longest[:top]],
    }


def fixed_cost_s(run: dict[str, Any], steps: int) -> float | None:
    """A sampling's time beyond its steps at the device's median step time."""
    step_ms = run.get("step_ms") or []
    if not step_ms:
        return None
    return run["e2e_s"] - steps * statistics.median(step_ms) / 1000.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targs = _t2i_args(args)
    targs.cache_dir = args.cache_dir
    cache_dir, was_empty = t2i._setup_cache_env(targs)
    t2i.boot_comfy((args.comfy_root or t2i.default_comfy_root()).resolve(), args.device)
    import torch

    from benchmarks import metrics, models

    device = torch.device(args.device)
    spec = models.get_spec(args.model, tiny=args.tiny)
    height, width = args.height or spec.height, args.width or spec.width
    if spec.frames is None:
        targs.frames = None
    elif targs.frames is None:
        targs.frames = spec.frames
    dtype, manual_cast = models.pick_dtypes(spec, device, None)
    runner = t2i.Runner(targs, spec, device)
    if any(c != "eager" and c != "comfy" for c in args.contender_list):
        t2i.load_pack()
        from nexfort_engine import prewarm

        prewarm.start(os.environ["NEXFORT_CACHE_DIR"])
    mp = models.build(spec, device, dtype, manual_cast, seed=targs.seed)
    metrics.sync(device)
    doc: dict[str, Any] = {
        "schema": "nexfort-per-image/1", "env": t2i.environment(device), "argv": sys.argv[1:] if argv is None else argv,
        "model": args.model, "title": spec.title, "tiny": args.tiny, "height": height, "width": width,
        "frames": targs.frames, "batch": args.batch, "steps": args.steps, "cfg": runner.cfg,
        "sampler": targs.sampler, "scheduler": runner.scheduler, "dtype": str(dtype).replace("torch.", ""),
        "cache_dir_was_empty": was_empty, "contenders": {},
    }
    rows: dict[str, dict[str, Any]] = doc["contenders"]
    targets: dict[str, Any] = {}
    eager_latent = None
    for name in args.contender_list:
        compiler, config = _compiler_of(name)
        target = t2i.apply_compiler(mp, compiler, config)
        targets[name] = target
        first, m1 = runner.run(target, height, width, args.steps)
        second, m2 = runner.run(target, height, width, args.steps)  # CUDA graphs record on a later call
        rows[name] = {"compiler": compiler, "config": config, "first_sampling_s": round(m1["e2e_s"], 4),
                      "second_sampling_s": round(m2["e2e_s"], 4)}
        if name == "eager":
            eager_latent = second
        elif eager_latent is not None:
            rows[name]["err_vs_eager"] = metrics.latent_error(second, eager_latent)
        print(f"[per_image] {name}: first sampling {m1['e2e_s']:.2f} s, second {m2['e2e_s']:.3f} s", flush=True)

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in targets}
    for _ in range(max(args.repeat, 1)):
        for name, target in targets.items():
            _, m = runner.run(target, height, width, args.steps)
            runs[name].append(m)
    for name, rs in runs.items():
        e2e = statistics.median(r["e2e_s"] for r in rs)
        step = [statistics.median(r["step_ms"]) for r in rs if r.get("step_ms")]
        host = [r["host_ms_per_step"] for r in rs if r.get("host_ms_per_step") is not None]
        fixed = [f for f in (fixed_cost_s(r, args.steps) for r in rs) if f is not None]
        rows[name].update({
            "s_per_image": round(e2e, 4), "it_s": round(args.steps / e2e, 3),
            "s_per_image_all": [round(r["e2e_s"], 4) for r in rs],
            "device_step_ms": round(statistics.median(step), 3) if step else None,
            "host_step_ms": round(statistics.median(host), 3) if host else None,
            "fixed_ms": round(1000.0 * statistics.median(fixed), 2) if fixed else None,
            "gc_ms": statistics.median(r.get("gc_ms", 0.0) for r in rs),
            "cudagraph_replays": rs[-1].get("cudagraph_replays"),
        })
    base = rows.get("comfy", {}).get("s_per_image")
    eager = rows.get("eager", {}).get("s_per_image")
    for row in rows.values():
        if base:
            row["x_vs_comfy"] = round(base / row["s_per_image"], 3)
        if eager:
            row["x_vs_eager"] = round(eager / row["s_per_image"], 3)

    if args.device == "cuda" and (args.syncs or args.api):
        for name, target in targets.items():
            if args.syncs:
                with SyncLog() as log:
                    runner.run(target, height, width, args.steps)
                rows[name]["syncs"] = dict(log.sites.most_common(12))
                rows[name]["syncs_total"] = sum(log.sites.values())
            if args.api:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA],
                                            with_stack=True) as prof:
                    runner.run(target, height, width, args.steps)
                rows[name]["runtime_calls"] = runtime_calls(prof, args.steps)

    text = json.dumps(doc, indent=2, default=str)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text)
    for name, row in rows.items():
        print(f"RESULT {args.model} {name}: {row['s_per_image']:.4f} s/image ({row['it_s']:.2f} it/s)"
              f" x_vs_comfy={row.get('x_vs_comfy')} x_vs_eager={row.get('x_vs_eager')}"
              f" device_step={row['device_step_ms']} ms host_step={row['host_step_ms']} ms"
              f" fixed={row['fixed_ms']} ms first={row['first_sampling_s']} s", flush=True)
        if row.get("syncs"):
            print(f"  syncs ({row['syncs_total']}):", flush=True)
            for site, n in row["syncs"].items():
                print(f"    {n:4d}  {site}", flush=True)
        if row.get("runtime_calls"):
            for k, v in list(row["runtime_calls"]["per_step"].items())[:8]:
                print(f"  api {k}: {v}", flush=True)
            for r in row["runtime_calls"]["longest"][:6]:
                print(f"  long {r['ms']} ms {r['call']} {' <- '.join(r['stack'][:4])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
