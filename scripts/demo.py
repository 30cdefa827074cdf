"""`make demo`: the tiny default model through a real ComfyUI, eager and compiled, side by side.

1. builds the embedded tiny SD1.5 checkpoint if it is missing (no downloads),
2. starts a headless ComfyUI with the pack in custom_nodes,
3. runs the eager twin of ``tests/workflows/api/txt2img_compiled.json`` twice, then the compiled workflow
   twice (the first pays the compile, or a warm-cache load; the second runs are steady state),
4. prints image paths, seconds per step (from the websocket's per-step progress events), compile
   time, the cache directory and the engine's counters (``GET /nexfort/stats``), and stops the server.

On 2 CPU cores the first Inductor compile takes 50-100 s; a later demo run reuses the persisted cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import comfy_server  # noqa: E402
import tiny_checkpoint  # noqa: E402

REPO = comfy_server.REPO_ROOT
WORKFLOW = REPO / "tests" / "workflows" / "api" / "txt2img_compiled.json"
COMPILE_NODE = "NexfortCompileModel"


def say(msg: str = "") -> None:
    print(msg, flush=True)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _image_diff(a: Path, b: Path) -> int | None:
    """Largest per-pixel difference (0-255) between two images, or None without Pillow/numpy."""
    try:
        import numpy as np
        from PIL import Image
    except ImportError:
        return None
    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.int16)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.int16)
    return int(np.abs(x - y).max()) if x.shape == y.shape else None


def _compiled_call_seconds(before: dict | None, after: dict | None) -> float | None:
    """Mean seconds per compiled model call between two ``GET /nexfort/stats`` snapshots (the
    engine times every call that neither compiled nor loaded a graph)."""
    if not before or not after:
        return None
    b, a = before.get("engine") or {}, after.get("engine") or {}
    calls = (a.get("calls") or 0) - (b.get("calls") or 0)
    seconds = (a.get("compiled_call_seconds") or 0.0) - (b.get("compiled_call_seconds") or 0.0)
    return seconds / calls if calls > 0 and seconds > 0 else None


def _graphs(steps: int, seed: int) -> tuple[dict, dict]:
    compiled = comfy_server.set_seed(comfy_server.load_workflow(WORKFLOW), seed)
    sampler = comfy_server.find_node(compiled, "KSampler")
    compiled[sampler]["inputs"]["steps"] = steps
    eager = comfy_server.without_nodes(compiled, COMPILE_NODE)
    save = comfy_server.find_node(eager, "SaveImage")
    eager[save]["inputs"]["filename_prefix"] = "nexfort_demo_eager"
    return eager, compiled


def _progress_printer(srv: comfy_server.ComfyServer):
    def note(elapsed: float) -> None:
        state = ""
        try:
            stats = srv.stats()
            models = (stats or {}).get("engine", {}).get("models", {})
            state = ", ".join(f"{label}: {m.get('state')}" for label, m in models.items())
        except Exception:  # progress is best effort
            pass
        say(f"    ... {elapsed:5.0f} s elapsed{'  [' + state + ']' if state else ''}")

    return note


def _ensure_checkpoint(host: Path) -> Path:
    path = tiny_checkpoint.default_path(host)
    if tiny_checkpoint.is_valid(path):
        say(f"[1/4] tiny checkpoint present: {path}")
        return path
    say(f"[1/4] building the tiny random-weight SD1.5 checkpoint (~15 s): {path}")
    subprocess.run([sys.executable, str(Path(__file__).with_name("tiny_checkpoint.py")), "--host", str(host)],
                   check=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default=os.environ.get("NEXFORT_HOST", str(REPO / ".host" / "ComfyUI")),
                    help="ComfyUI tree made by `make host`")
    ap.add_argument("--steps", type=int, default=8, help="sampler steps per run (default 8)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--cache-dir", default=os.environ.get("NEXFORT_CACHE_DIR"),
                    help="compile cache root (default: $NEXFORT_CACHE_DIR, else ComfyUI's <user>/__nexfort)")
    ap.add_argument("--base-directory", default=None,
                    help="ComfyUI --base-directory (models/output/user/custom_nodes); default: the host tree")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per prompt")
    args = ap.parse_args(argv)

    host = Path(args.host).resolve()
    if not (host / "main.py").is_file():
        say(f"no ComfyUI at {host}: run `make host` first")
        return 2
    ckpt = _ensure_checkpoint(host)
    base = None
    if args.base_directory:
        base = comfy_server.make_base_dir(args.base_directory, [ckpt])
    root = base or host
    env = {"NEXFORT_CACHE_DIR": str(Path(args.cache_dir).resolve())} if args.cache_dir else {}
    cache_dir = env.get("NEXFORT_CACHE_DIR") or str(root / "user" / "__nexfort")
    log = (base / "demo-comfyui.log") if base else host.parent / "demo-comfyui.log"

    say(f"[2/4] starting ComfyUI (headless, CPU) from {host}; log: {log}")
    srv = comfy_server.ComfyServer(host, base_dir=base, port=args.port, log_path=log, env=env)
    t0 = time.perf_counter()
    try:
        srv.start()
        say(f"      up at {srv.url} in {time.perf_counter() - t0:.1f} s")
        if COMPILE_NODE not in srv.object_info():
            say(f"the nexfort pack did not load ({COMPILE_NODE} is not registered):" + srv.log_tail_text())
            return 1

        eager_g, compiled_g = _graphs(args.steps, args.seed)
        sampler = comfy_server.find_node(compiled_g, "KSampler")
        note = _progress_printer(srv)

        say(f"[3/4] eager: {args.steps} steps, 64x64, euler")
        eager = srv.run(eager_g, timeout=args.timeout, progress=note)
        say(f"      done in {eager.execution_seconds:.2f} s")
        # steady state for eager too: its first run also pays first-prompt costs (model load,
        # first calls); the step times compared are both from second runs
        eager_again_g, again_g = _graphs(args.steps, args.seed + 1)
        eager_again = srv.run(eager_again_g, timeout=args.timeout, progress=note)
        say(f"      again (steady state, seed {args.seed + 1}) done in {eager_again.execution_seconds:.2f} s")

        say("[4/4] compiled (NexfortCompileModel, mode O2): first run compiles or loads the cache;"
            " on 2 CPU cores a cold Inductor compile takes 50-100 s")
        first = srv.run(compiled_g, timeout=args.timeout, progress=note)
        say(f"      first compiled run done in {first.execution_seconds:.2f} s")
        before = srv.stats()
        again = srv.run(again_g, timeout=args.timeout, progress=note)
        say(f"      second compiled run (steady state, seed {args.seed + 1}) done in {again.execution_seconds:.2f} s")

        stats = srv.stats()
    except comfy_server.ComfyServerError as e:
        say(f"demo failed: {e}")
        return 1
    finally:
        srv.stop()

    eager_step = _median(eager_again.step_seconds(sampler))
    compiled_step = _median(again.step_seconds(sampler))
    first_steps = first.step_times(sampler)
    start = first.node_start(sampler)
    first_step = (first_steps[0] - start) if first_steps and start is not None else None
    engine = (stats or {}).get("engine", {})
    entries = (stats or {}).get("cache", [])

    say("")
    say("=" * 72)
    say("nexfort demo report (tiny random-weight SD1.5, 64x64, CPU)")
    say("=" * 72)
    say("images:")
    for label, res in (("eager", eager), ("eager #2", eager_again), ("compiled", first), ("compiled #2", again)):
        for img in res.images:
            say(f"  {label:<12} {img}")
    if eager.images and first.images:
        diff = _image_diff(eager.images[0], first.images[0])
        if diff is not None:
            say(f"  eager vs compiled (same seed): max pixel difference {diff}/255")
    say("time per sampler step (median, websocket progress events):")
    say(f"  eager (steady state)       {_fmt_s(eager_step)}")
    say(f"  compiled (steady state)    {_fmt_s(compiled_step)}")
    if eager_step and compiled_step:
        say(f"  speed-up                   {eager_step / compiled_step:.2f}x")
    say(f"  compiled first step        {_fmt_s(first_step)}  (includes compiling / loading the cache)")
    call = _compiled_call_seconds(before, stats)
    if call is not None:
        say(f"  compiled model call        {_fmt_s(call)}  (engine counter, second run: the rest of a step is"
            " ComfyUI's sampler and server)")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        say(f"  note: load average {load:.1f} on {cores} cores while measuring; per-step times are noisy")
    say("prompt wall time (execution_start -> execution_success):")
    say(f"  eager {eager.execution_seconds:.2f} s | compiled first {first.execution_seconds:.2f} s"
        f" | compiled again {again.execution_seconds:.2f} s")
    if stats is None:
        say("engine counters: GET /nexfort/stats is not available on this server")
    else:
        say(f"compile time (engine): {engine.get('compile_seconds', 0):.1f} s")
        say("engine counters: " + ", ".join(f"{k}={engine.get(k)}" for k in
                                            ("compiles", "recompiles", "cache_hits", "cache_misses", "fallbacks")))
        for label, m in sorted((engine.get("models") or {}).items()):
            if m.get("precompiled"):  # nexfort_engine/precompile.py: saved graphs loaded, not re-traced
                say(f"  {label}: precompiled graphs {m['precompiled']}, {m.get('precompiled_graphs', 0)} in use"
                    f" ({m.get('compiles', 0)} traced in this process)")
        for reason in engine.get("recompile_reasons", [])[:5]:
            say(f"  recompile: {reason}")
        for reason in engine.get("fallback_reasons", [])[:5]:
            say(f"  fallback: {reason}")
    say(f"compile cache: {cache_dir}")
    for e in entries[:10]:
        size = e.get("size_bytes")
        say(f"  {e.get('key', '')[:16]}  {e.get('label', '')}  "
            f"{(size or 0) / 1e6:.1f} MB  hits={e.get('hits')}")
    hits, misses = engine.get("cache_hits", 0), engine.get("cache_misses", 0)
    if stats is not None:
        if hits and not misses:
            say("  this run: warm start (reused the persisted cache, nothing compiled cold)")
        else:
            say("  this run: cold compile (cache now populated); run `make demo` again to see a warm start")
        pw = stats.get("prewarm") or {}
        if pw.get("listed"):
            loaded = pw.get("imported", 0) + pw.get("present", 0)
            say(f"  prewarm: {pw.get('state')}, {loaded} of {pw['listed']} listed modules loaded in the background"
                f" before the first compile ({pw.get('failed', 0)} failed)")
        elif pw.get("state") == "done":
            say("  prewarm: nothing listed yet; this run's first compile listed its imports for the next start")
    say(f"server log: {log}")
    return 0 if not engine.get("fallbacks") else 1


if __name__ == "__main__":
    sys.exit(main())
