"""CPU: pickling and loading the 7 workers' parts of the narrow SDXL-topology UNet's cut
(``../2026-11-25-cpu/narrow_sdxl.py``), with the computing nodes' fake values as views ("plain",
as before the twenty-ninth session: ``ship._flat_values`` patched to flatten nothing) and as plain
tensors of the same layout ("flat", ``ship.py`` now), two rounds interleaved; the rebuilt values'
layouts are checked against the sender's.

    .venv/bin/python benchmarks/results/2026-11-26-cpu/ship_flat.py

A measurement (BENCHMARKS.md, twenty-ninth section), not engine code.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-25-cpu"))
import narrow_sdxl  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402

from nexfort_engine import ship, split, trace_ops  # noqa: E402

FLAT_VALUES = ship._flat_values


def layout(v):
    return str(v.shape), str(v.stride()), str(v.storage_offset()), v.dtype


def backend(gm, ex):
    trace_ops.restore(gm)
    cut = split.split(gm, 8)
    try:
        for rnd in range(2):
            for variant in ("plain", "flat"):
                ship._flat_values = FLAT_VALUES if variant == "flat" else (lambda gm: set())
                c0 = time.process_time()
                blobs = [ship.dumps((p.index, p.fingerprint(), p.single, p.module, p.inputs)) for p in cut.parts[1:]]
                c1 = time.process_time()
                outs = [ship.loads(b) for b in blobs]
                c2 = time.process_time()
                print(f"{variant}: dumps {c1 - c0:.2f}s loads {c2 - c1:.2f}s MB {sum(map(len, blobs)) / 1e6:.1f}",
                      flush=True)
                if rnd == 0:  # the rebuilt values: the sender's sizes, strides, offsets and dtypes
                    for p, o in zip(cut.parts[1:], outs, strict=True):
                        for a, b in zip(p.module.graph.nodes, o[3].graph.nodes, strict=True):
                            va, vb = a.meta.get("example_value"), b.meta.get("example_value")
                            if isinstance(va, FakeTensor):
                                assert layout(va) == layout(vb), a
    finally:
        ship._flat_values = FLAT_VALUES
    raise narrow_sdxl.Done()


narrow_sdxl.trace_until_done(backend)
