import json

import torch

from nexfort_engine import trace_ops


def variant(kind):
    def lin(start, end, steps, dtype):
        compute = torch.float32
        idx = torch.arange(steps, dtype=torch.int64).to(compute)
        if kind == "sym_max":
            step = (end - start) / torch.sym_max(steps - 1, 1)
        elif kind == "pymax":
            step = (end - start) / max(steps - 1, 1)
        else:
            step = (end - start) / (steps - 1)
        out = torch.where(idx < steps // 2, start + step * idx, end - step * (steps - 1 - idx))
        return out.to(dtype)
    return lin
res = {"torch": torch.__version__}
for kind in ("sym_max", "pymax", "plain", "engine", "standin"):
    def f(x, kind=kind):
        n = x.shape[0]
        if kind == "standin":
            return torch.linspace(0, n - 1, steps=n, device=x.device, dtype=x.dtype)[:, None] + x
        if kind == "engine":
            return trace_ops.linspace_symbolic(0, n - 1, n, dtype=x.dtype)[:, None] + x
        return variant(kind)(0, n - 1, n, x.dtype)[:, None] + x
    try:
        torch._dynamo.reset()
        c = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
        errs = []
        for n in (4, 6, 9):
            x = torch.zeros(n, 3)
            with trace_ops.standing_in(False, symbolic_linspace=True):
                y = c(x)
            errs.append((y - (torch.linspace(0, n - 1, n)[:, None] + x)).abs().max().item())
        res[kind] = errs
    except Exception as e:
        res[kind] = repr(e)[:600]
print(json.dumps(res, indent=1))
