"""CPU: the engine's own trace (``precompile.trace``, ahead-of-time, full graph) of an SDXL-topology
UNet (narrow, real depth) with and without ``trace_ops.standing_in`` (F.linear as an op that only
allocates), timed from the call to the moment the backend receives the graph (Dynamo's serial
share: the backend then raises, nothing compiles).

    .venv/bin/python benchmarks/results/2026-11-25-cpu/trace_stand_ins.py   (MODES=off,on,off,on)

``GUARDS=1``: let Dynamo finish (the graph returned as is, not compiled) and time its guards too.

A measurement (BENCHMARKS.md, twenty-eighth section), not engine code.
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import narrow_sdxl  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: E402

from nexfort_engine import precompile, trace_ops  # noqa: E402

dm = narrow_sdxl.unet()


class Got(Exception):
    pass


class Plain(SerializableCallable):
    """The graph run as is: enough for Dynamo to finish (its guards) without compiling."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *a):
        return self.fn(*a)

    @classmethod
    def serialize_compile_artifacts(cls, fn):
        return b""

    @classmethod
    def deserialize_compile_artifacts(cls, data):
        raise NotImplementedError


seen = {}


def backend(gm, ex):
    t = time.perf_counter()
    seen.update(t=t, nodes=len(gm.graph.nodes), linears=sum(1 for n in gm.graph.nodes if "trace_linear" in str(n.target)))
    if os.environ.get("GUARDS") != "1":
        raise Got(t, seen["nodes"], seen["linears"])
    return Plain(gm.forward)


for mode in os.environ.get("MODES", "off,on,off,on").split(","):
    torch._dynamo.reset()
    args, kwargs = narrow_sdxl.call(dm)
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), trace_ops.standing_in(mode == "on"):
            _, rec = precompile.trace(type(dm).forward, args, kwargs, backend, "self", trace_ops.originals())
        t2 = time.perf_counter()
        print(f"{mode}: trace to backend {seen['t'] - t0:.1f} s, guards {t2 - seen['t']:.1f} s "
              f"({rec.kept} kept, {len(rec.dropped)} dropped), {seen['nodes']} nodes, {seen['linears']} stand-ins",
              flush=True)
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's exception
        got = e
        while got is not None and not isinstance(got, Got):
            got = getattr(got, "inner_exception", None) or got.__cause__
        if got is None:
            raise
        t1, nodes, linears = got.args
        print(f"{mode}: trace to backend {t1 - t0:.1f} s, {nodes} nodes, {linears} linear nodes", flush=True)
