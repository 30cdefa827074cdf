"""CPU: the engine's own trace (``precompile.trace``, ahead-of-time, full graph) of an SDXL-topology
UNet (narrow, real depth) with and without ``trace_ops.standing_in`` (F.linear as an op that only
allocates), timed from the call to the moment the backend receives the graph (Dynamo's serial
share: the backend then raises, nothing compiles).

    .venv/bin/python benchmarks/results/2026-11-25-cpu/trace_stand_ins.py   (MODES=off,on,off,on)

A measurement (BENCHMARKS.md, twenty-eighth section), not engine code.
"""
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
from nexfort_engine import precompile, shapes, trace_ops  # noqa: E402

cfg = dict(M._SDXL, model_channels=64, context_dim=64, adm_in_channels=2816)
mc = comfy.supported_models.SDXL(dict(cfg))
mc.set_inference_dtype(torch.float32, None)
dm = mc.get_model({}, "", device=torch.device("cpu")).eval().diffusion_model


class Got(Exception):
    pass


def backend(gm, ex):
    raise Got(time.perf_counter(), len(gm.graph.nodes), sum(1 for n in gm.graph.nodes if "trace_linear" in str(n.target)))


for mode in os.environ.get("MODES", "off,on,off,on").split(","):
    torch._dynamo.reset()
    args = (dm, torch.randn(2, 4, 16, 16), torch.rand(2) * 999, torch.randn(2, 77, 64))
    kwargs = {"y": torch.randn(2, 2816), "transformer_options": {}}
    shapes.mark_dynamic_dims(args[1:], kwargs)
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), trace_ops.standing_in(mode == "on"):
            precompile.trace(type(dm).forward, args, kwargs, backend, "self", trace_ops.originals())
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's exception
        got = e
        while got is not None and not isinstance(got, Got):
            got = getattr(got, "inner_exception", None) or got.__cause__
        if got is None:
            raise
        t1, nodes, linears = got.args
        print(f"{mode}: trace to backend {t1 - t0:.1f} s, {nodes} nodes, {linears} linear nodes", flush=True)
