"""CPU: where AOTAutograd's trace of a Dynamo graph goes, per Dynamo node target. The narrow
SDXL-topology UNet (``../2026-11-25-cpu/narrow_sdxl.py``) traced by Dynamo with the engine's dynamic
dims, then ``aot_module_simplified`` with Inductor's decompositions and a forward compiler that
stops the clock (no Inductor). ``LINEAR=1``: ``aten.linear`` through a hand-written decomposition
(view + addmm + view) instead of ``matmul``'s.

    .venv/bin/python benchmarks/results/2026-11-26-cpu/aot_node_costs.py

A measurement (BENCHMARKS.md, twenty-ninth section), not engine code.
"""
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-25-cpu"))
import narrow_sdxl  # noqa: E402
import torch  # noqa: E402
import torch.fx  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch._inductor.decomposition import select_decomp_table  # noqa: E402

dm = narrow_sdxl.unet()
res = {}
acc = collections.defaultdict(lambda: [0, 0.0])
orig = torch.fx.Interpreter.run_node
depth = [0]


def run_node(self, n):
    """Time each top-level node of the Dynamo graph as AOTAutograd interprets it (both passes)."""
    if depth[0]:
        return orig(self, n)
    depth[0] += 1
    t = time.perf_counter()
    try:
        return orig(self, n)
    finally:
        depth[0] -= 1
        k = n.op + ":" + (n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)))
        a = acc[k]
        a[0] += 1
        a[1] += time.perf_counter() - t


torch.fx.Interpreter.run_node = run_node


def linear(x, w, b=None):
    aten = torch.ops.aten
    if x.dim() == 2:
        return aten.mm(x, aten.t(w)) if b is None else aten.addmm(b, x, aten.t(w))
    x2 = aten.view(x, [-1, x.shape[-1]]) if x.is_contiguous() else aten.reshape(x, [-1, x.shape[-1]])
    y = aten.mm(x2, aten.t(w)) if b is None else aten.addmm(b, x2, aten.t(w))
    return aten.view(y, [*x.shape[:-1], w.shape[0]])


def backend(gm, ex):
    res["dynamo_nodes"] = len(gm.graph.nodes)
    t0 = time.perf_counter()

    def fw(g, i):
        res["aot_s"] = round(time.perf_counter() - t0, 2)
        res["aten_nodes"] = len(g.graph.nodes)
        return g.forward

    table = dict(select_decomp_table())
    if os.environ.get("LINEAR"):
        table[torch.ops.aten.linear.default] = linear
    return aot_module_simplified(gm, ex, fw_compiler=fw, decompositions=table)


args, kwargs = narrow_sdxl.call(dm)
with torch.no_grad():
    torch.compile(type(dm).forward, backend=backend, fullgraph=True)(*args, **kwargs)
print(res)
for k, (c, t) in sorted(acc.items(), key=lambda kv: -kv[1][1])[:12]:
    print("%-45s %6d calls %7.2f s %6.2f ms each" % (k, c, t, 1000 * t / c))
