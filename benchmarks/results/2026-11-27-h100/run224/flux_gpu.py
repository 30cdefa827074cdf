"""Tiny Flux on the GPU, compiled whole vs regional, with passes switched off one at a time: rel-L2 vs bf16 eager."""
import copy
import json
import os
import sys
import tempfile

import torch

DEV = os.environ.get("DEV", "cuda")
sys.path[:0] = ["tests", "."]
import tiny_models as tm  # noqa: E402

tm.boot()
import nexfort_engine  # noqa: E402

mp = tm.tiny_flux(seed=3, depth=2, depth_single=2)
dm = mp.model.diffusion_model.to(DEV, torch.bfloat16).eval()
def inputs(h, w, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g, device=DEV, dtype=torch.bfloat16)
    return (r(1, 16, h, w), torch.tensor([0.7], device=DEV, dtype=torch.bfloat16), r(1, 20, 48)), {"y": r(1, 32), "guidance": torch.tensor([3.5], device=DEV, dtype=torch.bfloat16)}
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
sizes = [(32, 32), (32, 48), (48, 32)]
dm32 = copy.deepcopy(dm).float()
def f32(t):
    return t.float() if t.is_floating_point() else t
with torch.inference_mode():
    refs = {s: dm(*inputs(*s, 1)[0], **inputs(*s, 1)[1]) for s in sizes}
    ref32 = {}
    for s in sizes:
        a, k = inputs(*s, 1)
        ref32[s] = dm32(*map(f32, a), **{n: f32(v) for n, v in k.items()})
print(json.dumps({"eager_bf16_vs_fp32": {f"{s[0]}x{s[1]}": round(rel(refs[s], ref32[s]), 5) for s in sizes}}), flush=True)
variants = {
    "whole": {"mode": "O2", "regional": False},
    "whole_no_rope": {"mode": "O2", "regional": False, "fused_rope": False},
    "whole_no_sf": {"mode": "O2", "regional": False, "static_first": False},
    "whole_no_cg": {"mode": "max-optimize:benchmark:cache-all", "regional": False},
    "regional": {"mode": "O2"},
    "whole_eager": {"mode": "O2", "regional": False, "backend": "eager"},
    "whole_aot_eager": {"mode": "O2", "regional": False, "backend": "aot_eager"},
}
only = sys.argv[1:] or list(variants)
res = {}
for name in only:
    cfg = variants[name]
    try:
        torch._dynamo.reset()
        c = nexfort_engine.compile(dm, cfg, cache_dir=tempfile.mkdtemp(), label=f"flux-{name}")
        errs = {}
        with torch.inference_mode():
            for rep in range(2):
                for s in sizes:
                    a, k = inputs(*s, 1)
                    out = c(*a, **k)
                    errs[f"{s[0]}x{s[1]}#{rep}"] = (round(rel(out, refs[s]), 5), round(rel(out, ref32[s]), 5))
        rec = nexfort_engine.stats()["models"].get(c.label, {}) if callable(getattr(nexfort_engine, "stats", None)) else {}
        res[name] = {"errs": errs, "compiles": rec.get("compiles"), "recompiles": rec.get("recompiles"), "precompiled": rec.get("precompiled")}
    except Exception as e:
        res[name] = repr(e)[:500]
    print(json.dumps({name: res[name]}), flush=True)
