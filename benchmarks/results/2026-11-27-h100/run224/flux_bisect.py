"""Which part of ComfyUI's Flux glue makes bf16 eager far from fp32 (tiny random-weight Flux, CPU)."""
import copy
import os
import sys

import torch

sys.path[:0] = ["tests", "."]
import tiny_models as tm  # noqa: E402

tm.boot()
DEV = os.environ.get("DEV", "cpu")
mp = tm.tiny_flux(seed=3, depth=2, depth_single=2)
dm = mp.model.diffusion_model.to(DEV, torch.bfloat16).eval()
dm32 = copy.deepcopy(dm).float()
g = torch.Generator(device=DEV).manual_seed(1)
def r(*s):
    return torch.randn(*s, generator=g, device=DEV, dtype=torch.bfloat16)
a = (r(1, 16, 32, 32), torch.tensor([0.7], device=DEV, dtype=torch.bfloat16), r(1, 20, 48))
k = {"y": r(1, 32), "guidance": torch.tensor([3.5], device=DEV, dtype=torch.bfloat16)}
def f32(t):
    return t.float() if torch.is_tensor(t) and t.is_floating_point() else t
def rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()
with torch.inference_mode():
    ref = dm32(*map(f32, a), **{n: f32(v) for n, v in k.items()})
    print("eager bf16 vs fp32", round(rel(dm(*a, **k), ref), 5))
    names = [n for n, _ in dm.named_children()]
    print("children", names)
    for name in names + ["ALL_GLUE"]:
        patched = []
        for n in (names if name == "ALL_GLUE" else [name]):
            if n in ("double_blocks", "single_blocks"):
                continue
            m, m32 = getattr(dm, n), getattr(dm32, n)
            orig = m.forward
            def fwd(*x, _m32=m32, _n=n, **kw):
                out = _m32(*map(f32, x), **{q: f32(v) for q, v in kw.items()})
                return out.to(torch.bfloat16) if out.dtype == torch.float32 and _n != "pe_embedder" else out
            m.forward = fwd
            patched.append((m, orig))
        try:
            print(f"{name} in fp32:", round(rel(dm(*a, **k), ref), 5))
        except Exception as e:
            print(name, "failed", repr(e)[:200])
        for m, orig in patched:
            m.forward = orig
with torch.inference_mode():
    k2 = dict(k, guidance=k["guidance"].float())
    print("guidance passed as float32:", round(rel(dm(*a, **k2), ref), 5))
    a2 = (a[0], a[1].float(), a[2])
    print("guidance and timestep float32:", round(rel(dm(*a2, **k2), ref), 5))
