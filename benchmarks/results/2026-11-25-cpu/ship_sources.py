"""CPU: the cut of an SDXL-topology UNet (narrow, real depth; the engine's own trace) into 8 parts, and
the CPU time of pickling the 7 workers' parts (ship.dumps) with the whole model's parameter sources
in every part ("as is"), with the part's own only, and without the nodes' stack traces too.

    .venv/bin/python benchmarks/results/2026-11-25-cpu/ship_sources.py

Needs ``ship.FILTER`` (a switch the measurement added to ship.py for the run; the engine now
always keeps the part's own sources). A measurement (BENCHMARKS.md, twenty-eighth section, item 5),
not engine code.
"""
import cProfile
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import tiny_models  # noqa: E402
import torch  # noqa: E402

tiny_models.boot()
import comfy.supported_models  # noqa: E402

from benchmarks import models as M  # noqa: E402
from nexfort_engine import precompile, shapes, ship, split, trace_ops  # noqa: E402

cfg = dict(M._SDXL, model_channels=64, context_dim=64, adm_in_channels=2816)
mc = comfy.supported_models.SDXL(dict(cfg))
mc.set_inference_dtype(torch.float32, None)
dm = mc.get_model({}, "", device=torch.device("cpu")).eval().diffusion_model

class Got(Exception):
    pass

def backend(gm, ex):
    trace_ops.restore(gm)
    prof = cProfile.Profile() if os.environ.get("PROF") else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    cut = split.split(gm, 8)
    t1 = time.perf_counter()
    for _ in range(3):
        for name, filt, meta in (("as is", False, ("example_value", "val", "tensor_dict", "stack_trace")),
                                 ("own sources", True, ("example_value", "val", "tensor_dict", "stack_trace")),
                                 ("own sources, no stack", True, ("example_value", "val", "tensor_dict"))):
            ship.FILTER, ship.NODE_META = filt, meta
            c0 = time.process_time()
            sizes = [len(ship.dumps((part.index, part.fingerprint(), part.single, part.module, part.inputs)))
                     for part in cut.parts[1:]]
            c1 = time.process_time()
            c2 = time.process_time()
            for part in cut.parts[1:2]:
                ship.loads(ship.dumps((part.index, part.fingerprint(), part.single, part.module, part.inputs)))
            c3 = time.process_time()
            print(f"{name}: dumps cpu {c1-c0:.2f}s total {sum(sizes)/1e6:.1f} MB; part 1 dumps+loads {c3-c2:.2f}s", flush=True)
    t2 = time.perf_counter()
    if prof:
        prof.disable()
        prof.dump_stats("/tmp/p/cutship.prof")
    print(f"cut {t1-t0:.2f}s ship {t2-t1:.2f}s sizes {sizes}", flush=True)
    raise Got()

args = (dm, torch.randn(2, 4, 16, 16), torch.rand(2) * 999, torch.randn(2, 77, 64))
kwargs = {"y": torch.randn(2, 2816), "transformer_options": {}}
shapes.mark_dynamic_dims(args[1:], kwargs)
try:
    with torch.no_grad(), trace_ops.standing_in():
        precompile.trace(type(dm).forward, args, kwargs, backend, "self", trace_ops.originals())
except Exception:
    pass
