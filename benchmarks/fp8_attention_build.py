"""Diagnostics for the engine's fp8 attention on a GPU: how long cuDNN takes to build its fp8
attention graph for Flux's shape (a first call's cost, paid again at every warm start), whether
the cudnn frontend can serialize that graph and how fast it comes back, and where the fused
query/key kernel's e4m3 output differs from its torch twin.

    python3 benchmarks/fp8_attention_build.py --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nexfort_engine import fp8_attention as fa  # noqa: E402
from nexfort_engine.rope import fp8_scales, torch_rms_norm_rope, torch_rms_norm_rope_fp8, triton_rms_norm_rope  # noqa: E402


def build_times(shape: tuple[int, int, int, int]) -> dict[str, Any]:
    """Seconds to build the graph (cold, then a second shape-identical graph), and the frontend's
    serialization round trip where it has one."""
    q = torch.zeros(shape, device="cuda", dtype=torch.float8_e4m3fn).transpose(1, 2).contiguous().transpose(1, 2)
    out = fa._output(q)
    row: dict[str, Any] = {"shape": list(shape)}
    handle = fa._handle(q.device)
    for name in ("first build s", "second build s"):
        t0 = time.perf_counter()
        g = fa._Graph(handle, q, q, q, out)
        torch.cuda.synchronize()
        row[name] = round(time.perf_counter() - t0, 3)
    try:
        t0 = time.perf_counter()
        data = g.serialize()
        row["serialize s"] = round(time.perf_counter() - t0, 3)
        row["serialized bytes"] = len(data)
        t0 = time.perf_counter()
        g2 = fa._Graph(handle, q, q, q, out, serialized=data)
        row["deserialize s"] = round(time.perf_counter() - t0, 3)
        one = torch.ones(1, device="cuda")
        qr = (torch.randn(shape, device="cuda") * 50).to(torch.float8_e4m3fn).transpose(1, 2).contiguous().transpose(1, 2)
        outs = []
        for graph in (g, g2):
            o = fa._output(qr)
            graph(qr, qr, qr, fa.pack_scales(one, one, one), o)
            outs.append(o.float())
        row["deserialized graph gives the same output"] = bool(torch.equal(outs[0], outs[1]))
        # a new process: import, handle, load the saved graph, first execution
        path = Path(tempfile.mkdtemp()) / "plan.cudnn"
        path.write_bytes(data)
        child = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(Path(__file__).resolve().parent.parent),
                                str(path), json.dumps(list(shape))], capture_output=True, text=True, timeout=120)
        row["fresh process"] = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else child.stderr[-800:]
    except Exception as exc:  # say why
        row["serialization"] = f"{type(exc).__name__}: {exc}"[:400]
    return row


FRESH_PROCESS = """
import json, sys, time
t = {}
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda")
t["torch + CUDA context s"] = time.perf_counter() - t0
sys.path.insert(0, sys.argv[1])
t0 = time.perf_counter()
import cudnn
t["import cudnn s"] = time.perf_counter() - t0
from nexfort_engine import fp8_attention as fa
shape = json.loads(sys.argv[3])
q = torch.zeros(shape, device="cuda", dtype=torch.float8_e4m3fn).transpose(1, 2).contiguous().transpose(1, 2)
out = fa._output(q)
t0 = time.perf_counter()
handle = fa._handle(q.device)
t["handle s"] = time.perf_counter() - t0
t0 = time.perf_counter()
g = fa._Graph(handle, q, q, q, out, serialized=open(sys.argv[2], "rb").read())
t["load s"] = time.perf_counter() - t0
one = torch.ones(1, device="cuda")
t0 = time.perf_counter()
g(q, q, q, fa.pack_scales(one, one, one), out)
torch.cuda.synchronize()
t["first execution s"] = time.perf_counter() - t0
t0 = time.perf_counter()
g2 = fa._Graph(handle, q, q, q, out)
t["build after load s"] = time.perf_counter() - t0
print(json.dumps({k: round(v, 3) for k, v in t.items()}))
"""


def rope_differences(lens: list[int], fb: int) -> dict[str, Any]:
    """Where the kernel's e4m3 output and its twin's differ (bfloat16, Flux's head size)."""
    import tiny_models

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, d = 2, 24, 128
    qkvs = [torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 for n in lens]
    xs = [t.permute(2, 0, 3, 1, 4)[0] for t in qkvs]
    ws = [(torch.randn(d, generator=gen, device="cuda") * 0.5 + 1).to(torch.bfloat16) for _ in lens]
    freqs = tiny_models.rotations(fb, sum(lens), d).cuda()
    scale, descale = fp8_scales(ws, 128)
    ref = torch_rms_norm_rope_fp8(xs, ws, freqs, 1e-6, scale)
    out = triton_rms_norm_rope(xs, ws, freqs, 1e-6, fp8_scale=scale)
    bf16 = triton_rms_norm_rope(xs, ws, freqs, 1e-6)
    exact = torch_rms_norm_rope([x.float() for x in xs], [w.float() for w in ws], freqs, 1e-6)
    o, r = out.float(), ref.float()
    bad = (o - r).abs() > (r.abs() * 0.2 + 0.5)
    idx = bad.nonzero()[:8].tolist()
    rows_bad = bad.any(dim=-1)
    return {
        "lens": lens, "fb": fb, "descale": float(descale),
        "rel_l2 kernel fp8 vs twin": tiny_models.rel_l2(o, r),
        "rel_l2 kernel fp8 vs exact": tiny_models.rel_l2(o * descale.reshape(1), exact),
        "rel_l2 twin fp8 vs exact": tiny_models.rel_l2(r * descale.reshape(1), exact),
        "rel_l2 kernel bf16 vs exact": tiny_models.rel_l2(bf16.float(), exact),
        "elements far apart": int(bad.sum()), "rows with one": int(rows_bad.sum()), "rows": int(rows_bad.numel()),
        "bad (b, h, l) by count": {k: int(rows_bad.sum(dim=k).count_nonzero()) for k in (0, 1, 2)},
        "first": [[i, float(o[tuple(i)]), float(r[tuple(i)]), float(exact[tuple(i)] / descale.reshape(()))]
                  for i in idx],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-json", type=Path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("fp8_attention_build needs a CUDA device\n")
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in (("build", lambda: build_times((1, 24, 4608, 128))),
                     ("rope", lambda: [rope_differences([4608], 1), rope_differences([512, 4096], 1)])):
        try:
            result[name] = fn()
        except Exception as exc:
            result[name] = f"{type(exc).__name__}: {exc}"[:600]
        print(json.dumps({name: result[name]}), flush=True)
    if a.output_json:
        a.output_json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
