"""CPU: Dynamo's trace of an SDXL-topology UNet (narrow, real depth) with F.linear as is, against
F.linear replaced during the trace by a custom op whose fake implementation only allocates.

    .venv/bin/python benchmarks/results/2026-11-25-cpu/trace_linear_op.py   (MODES=aten,op,aten,op)

``MODES``: ``aten`` (as is), ``op`` (F.linear as the custom op), ``gn`` (F.group_norm as one), ``op+gn``.

A measurement for a lead (BENCHMARKS.md, twenty-seventh session), not engine code.
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


@torch.library.custom_op("nxprobe::linear", mutates_args=())
def nx_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch._C._nn.linear(x, w, b)

@nx_linear.register_fake
def _(x, w, b=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]))

@torch.library.custom_op("nxprobe::group_norm", mutates_args=())
def nx_group_norm(x: torch.Tensor, groups: int, w: torch.Tensor | None = None, b: torch.Tensor | None = None,
                  eps: float = 1e-5) -> torch.Tensor:
    return torch.group_norm(x, groups, w, b, eps)


@nx_group_norm.register_fake
def _(x, groups, w=None, b=None, eps=1e-5):
    return torch.empty_like(x)


cfg = dict(M._SDXL, model_channels=64, context_dim=64, adm_in_channels=2816)
mc = comfy.supported_models.SDXL(dict(cfg))
mc.set_inference_dtype(torch.float32, None)
dm = mc.get_model({}, "", device=torch.device("cpu")).eval().diffusion_model


def inputs():
    x, t, ctx, y = torch.randn(2, 4, 16, 16), torch.rand(2) * 999, torch.randn(2, 77, 64), torch.randn(2, 2816)
    for a, dims in ((x, (0, 2, 3)), (t, (0,)), (ctx, (0, 1)), (y, (0,))):
        torch._dynamo.maybe_mark_dynamic(a, list(dims))
    return x, t, ctx, y


got = {}


def backend(gm, ex):
    got['gm'] = gm
    return gm.forward


orig, orig_gn = torch.nn.functional.linear, torch.nn.functional.group_norm
for mode in os.environ.get("MODES", "aten,op,aten,op").split(","):
    torch._dynamo.reset()
    if "op" in mode:
        torch.nn.functional.linear = nx_linear
    if "gn" in mode:
        torch.nn.functional.group_norm = nx_group_norm
    x, t, ctx, y = inputs()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = torch.compile(dm, backend=backend, dynamic=None)(x, t, ctx, y=y, transformer_options={})
    dt = time.perf_counter() - t0
    torch.nn.functional.linear, torch.nn.functional.group_norm = orig, orig_gn
    n = sum(1 for nd in got['gm'].graph.nodes if 'linear' in str(nd.target))
    print(f"{mode}: trace {dt:.1f} s, {len(got['gm'].graph.nodes)} nodes, {n} linear nodes", flush=True)
