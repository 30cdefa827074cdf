"""CPU: the cut of an SDXL-topology UNet (``narrow_sdxl``; the engine's own trace) into 8 parts, and
the CPU time of pickling the 7 workers' parts (``ship.dumps``) with the whole model's parameter
sources in every part (as before the twenty-eighth session), with the part's own only (the engine
now), and without the nodes' stack traces too. Three rounds, interleaved in one process.

    .venv/bin/python benchmarks/results/2026-11-25-cpu/ship_sources.py   (PROF=<file>: cProfile of the first cut and ship)

A measurement (BENCHMARKS.md, twenty-eighth section, item 5), not engine code.
"""
import cProfile
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import narrow_sdxl  # noqa: E402

from nexfort_engine import ship, split, trace_ops  # noqa: E402

OWN_STATE, META = ship._module_state, ship.NODE_META


def whole_state(gm):
    """The part's state as shipped before: the whole model's parameter sources."""
    state = OWN_STATE(gm)
    state["param_sources"] = getattr(gm, "_param_name_to_source", None)
    return state


VARIANTS = (("whole model's sources", whole_state, META),
            ("own sources", OWN_STATE, META),
            ("own sources, no stack traces", OWN_STATE, tuple(k for k in META if k != "stack_trace")))


def dumps(part):
    return ship.dumps((part.index, part.fingerprint(), part.single, part.module, part.inputs))


def backend(gm, ex):
    trace_ops.restore(gm)
    prof = cProfile.Profile() if os.environ.get("PROF") else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    cut = split.split(gm, 8)
    t1 = time.perf_counter()
    sizes = [len(dumps(part)) for part in cut.parts[1:]]
    t2 = time.perf_counter()
    if prof:
        prof.disable()
        prof.dump_stats(os.environ["PROF"])
    print(f"cut {t1 - t0:.2f}s ship {t2 - t1:.2f}s sizes {sizes}", flush=True)
    try:
        for _ in range(3):
            for name, state, meta in VARIANTS:
                ship._module_state, ship.NODE_META = state, meta
                c0 = time.process_time()
                sizes = [len(dumps(part)) for part in cut.parts[1:]]
                c1 = time.process_time()
                ship.loads(dumps(cut.parts[1]))
                c2 = time.process_time()
                print(f"{name}: dumps cpu {c1 - c0:.2f}s total {sum(sizes) / 1e6:.1f} MB; "
                      f"part 1 dumps+loads {c2 - c1:.2f}s", flush=True)
    finally:
        ship._module_state, ship.NODE_META = OWN_STATE, META
    raise narrow_sdxl.Done()


narrow_sdxl.trace_until_done(backend)
