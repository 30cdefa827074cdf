"""Microbenchmark: how fast Flux-dev's step at 1024² could be on this GPU, from its parts.

Times, one process, bf16: every GEMM shape of Flux's step (``F.linear`` with bias, as ComfyUI's
``Linear`` runs them; cuBLAS), its attention (``scaled_dot_product_attention`` on cuDNN at
1 x 24 x 4608 x 128) and the modulation GEMVs, each multiplied by its calls per step, so the sum is
a lower bound for a compiled step that keeps every product in bf16 and fuses everything else
away. Also repeats :func:`benchmarks.metrics.device_peak`'s measurement several times, to show how
much the "% of peak" column's denominator moves within one process.

    python3 benchmarks/flux_limits.py --output-json out.json [--levers]

``--levers`` also times the single block's products three ways (where its 4608 x 15360 ``cat`` of
the attention output and the GELU'd MLP half goes, 111 us a block in run307's profile): as ComfyUI
writes it (one linear1, split, GELU + cat, one linear2); with linear1 split in two (the MLP half
with cuBLASLt's GELU epilogue) and linear2 as two accumulating GEMMs (no cat), the partial sum in
float32 (``out_dtype``) or in bf16; and the attention with the model's layouts (q, k in
``[B, L, H, D]`` order, v a view of the QKV output) against contiguous ones, alone and between
GEMMs. Each variant's error against a float64 computation of the same block half is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402

IMG, TXT, HID, MLP = 4096, 512, 3072, 12288
#: name -> (M, K, N, calls per step)
GEMMS: dict[str, tuple[int, int, int, int]] = {
    "double img qkv": (IMG, HID, 3 * HID, 19),
    "double img proj": (IMG, HID, HID, 19),
    "double img mlp1": (IMG, HID, MLP, 19),
    "double img mlp2": (IMG, MLP, HID, 19),
    "double txt qkv": (TXT, HID, 3 * HID, 19),
    "double txt proj": (TXT, HID, HID, 19),
    "double txt mlp1": (TXT, HID, MLP, 19),
    "double txt mlp2": (TXT, MLP, HID, 19),
    "single linear1": (IMG + TXT, HID, 3 * HID + MLP, 38),
    "single linear2": (IMG + TXT, HID + MLP, HID, 38),
    "double mod (img+txt)": (1, HID, 6 * HID, 38),
    "single mod": (1, HID, 3 * HID, 38),
}
ATTN = (1, 24, IMG + TXT, 128, 57)


def time_s(fn: Any, device: torch.device, seconds: float = 0.4) -> float:
    """Seconds per call: warm up for ``seconds`` (:func:`metrics.block_times`, whose one block of 3
    calls after it sizes the blocks), then the best of 5 blocks of ~``seconds``/5."""
    per = metrics.block_times(fn, device, iters=3, blocks=1, warm_s=seconds)[0]
    iters = max(3, int(seconds / 5 / per))
    return metrics.time_op(fn, device, iters, blocks=5, warmup=1)


def levers(device: torch.device, g: torch.Generator) -> dict[str, Any]:
    """The single block's products and attention, timed in the variants the module names."""
    dt = torch.bfloat16
    m, heads, hd = IMG + TXT, 24, 128
    x = torch.randn(m, HID, device=device, dtype=dt, generator=g)
    w1 = torch.randn(3 * HID + MLP, HID, device=device, dtype=dt, generator=g) * HID**-0.5
    b1 = torch.randn(3 * HID + MLP, device=device, dtype=dt, generator=g) * 0.1
    w2 = torch.randn(HID, HID + MLP, device=device, dtype=dt, generator=g) * (HID + MLP) ** -0.5
    b2 = torch.randn(HID, device=device, dtype=dt, generator=g) * 0.1
    attn = torch.randn(1, m, HID, device=device, dtype=dt, generator=g)  # [B, L, H*D]
    w1q, w1m, b1q, b1m = w1[: 3 * HID], w1[3 * HID:], b1[: 3 * HID], b1[3 * HID:]
    w2a, w2b = w2[:, :HID].contiguous(), w2[:, HID:].contiguous()
    gelu_cat = torch.compile(lambda a, mlp: torch.cat((a, F.gelu(mlp, approximate="tanh")), 2))
    res: dict[str, Any] = {}

    def base() -> torch.Tensor:
        y = F.linear(x, w1, b1).unsqueeze(0)
        _, mlp = torch.split(y, [3 * HID, MLP], dim=-1)
        return F.linear(gelu_cat(attn, mlp), w2, b2)

    def split(partial32: bool) -> Any:
        def f() -> torch.Tensor:
            F.linear(x, w1q, b1q)  # the qkv half (its result goes to attention)
            gm = torch._addmm_activation(b1m, x, w1m.t(), use_gelu=True)
            a2 = attn.view(m, HID)
            if partial32:
                p_ = torch.addmm(b2.float(), a2, w2a.t(), out_dtype=torch.float32)
                return torch.addmm(p_, gm, w2b.t(), out_dtype=torch.float32)
            return torch.addmm(torch.addmm(b2, a2, w2a.t()), gm, w2b.t())
        return f

    buf = torch.empty(m, 3 * HID + HID + MLP, device=device, dtype=dt)  # [qkv | attn | gelu(mlp)]

    def into_buffer() -> torch.Tensor:
        torch.addmm(b1q, x, w1q.t(), out=buf[:, : 3 * HID])
        torch._addmm_activation(b1m, x, w1m.t(), use_gelu=True, out=buf[:, 4 * HID:])
        buf[:, 3 * HID: 4 * HID].copy_(attn.view(m, HID))  # the attention output's copy (cuDNN allocates its own)
        return F.linear(buf[:, 3 * HID:], w2, b2)

    def linear1_only() -> torch.Tensor:
        return F.linear(x, w1, b1)

    def linear1_split() -> torch.Tensor:
        torch.addmm(b1q, x, w1q.t(), out=buf[:, : 3 * HID])
        return torch._addmm_activation(b1m, x, w1m.t(), use_gelu=True, out=buf[:, 4 * HID:])

    variants = (("base", base), ("split_fp32_partial", split(True)), ("split_bf16_partial", split(False)),
                ("into_buffer", into_buffer), ("linear1_only", linear1_only), ("linear1_split", linear1_split))
    for rnd in range(2):  # two interleaved rounds: the GPU's clocks drift between calls
        for name, fn in variants:
            if "error" in res.get(name, {}):
                continue
            try:
                s = time_s(fn, device)
                res.setdefault(name, {"us_rounds": []})["us_rounds"].append(round(s * 1e6, 2))
                res[name]["us"] = min(res[name]["us_rounds"])
            except Exception as e:  # noqa: BLE001 - an op this torch lacks
                res[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(rnd, name, res[name], flush=True)
    # numerics: each variant's output against float64 of the same half block
    with torch.no_grad():
        y64 = F.linear(x.double(), w1.double(), b1.double())
        g64 = F.gelu(y64[:, 3 * HID:], approximate="tanh")
        ref = F.linear(torch.cat((attn.view(m, HID).double(), g64), 1), w2.double(), b2.double())
        for name, fn in variants[:4]:
            if "error" in res[name]:
                continue
            o = fn().reshape(m, HID).double()
            res[name]["max_abs_vs_fp64"] = float((o - ref).abs().max())
            res[name]["rel_l2_vs_fp64"] = float((o - ref).norm() / ref.norm())
            res[name]["rel_l2_bf16_rounded"] = float((o.to(dt).double() - ref).norm() / ref.norm())
            print(name, res[name], flush=True)

    # attention: contiguous against the model's layouts; alone and after linear1
    q_c, k_c, v_c = (torch.randn(1, heads, m, hd, device=device, dtype=dt, generator=g) for _ in range(3))
    qkv = torch.randn(1, m, 3, heads, hd, device=device, dtype=dt, generator=g)
    q_m = torch.randn(1, m, heads, hd, device=device, dtype=dt, generator=g).permute(0, 2, 1, 3)
    k_m = torch.randn(1, m, heads, hd, device=device, dtype=dt, generator=g).permute(0, 2, 1, 3)
    v_m = qkv[:, :, 2].permute(0, 2, 1, 3)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for name, (q, k, v) in (("contiguous", (q_c, k_c, v_c)), ("model_layout", (q_m, k_m, v_m))):
            s = time_s(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), device)
            s_lin = time_s(lambda: F.linear(x, w1, b1), device)
            s_both = time_s(lambda q=q, k=k, v=v: (F.linear(x, w1, b1), F.scaled_dot_product_attention(q, k, v)), device)
            res[f"attention_{name}"] = {"us": round(s * 1e6, 2), "after_linear1_us": round((s_both - s_lin) * 1e6, 2),
                                        "linear1_us": round(s_lin * 1e6, 2)}
            print(name, res[f"attention_{name}"], flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--peak-repeats", type=int, default=6)
    p.add_argument("--levers", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda")
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}

    rows = []
    total_ms = 0.0
    for name, (m, k, n, calls) in GEMMS.items():
        x = torch.randn(m, k, device=device, dtype=dt, generator=g)
        w = torch.randn(n, k, device=device, dtype=dt, generator=g) * k**-0.5
        b = torch.randn(n, device=device, dtype=dt, generator=g)
        s = time_s(lambda x=x, w=w, b=b: F.linear(x, w, b), device)
        ms = s * 1e3 * calls
        total_ms += ms
        rows.append({"name": name, "m": m, "k": k, "n": n, "calls": calls, "us": round(s * 1e6, 2),
                     "tflops": round(2 * m * k * n / s / 1e12, 1), "ms_per_step": round(ms, 3)})
        print(rows[-1], flush=True)
        del x, w, b
    out["gemms"] = rows
    out["gemm_ms_per_step"] = round(total_ms, 2)

    bsz, heads, seq, hd, calls = ATTN
    q, k_, v = (torch.randn(bsz, heads, seq, hd, device=device, dtype=dt, generator=g) for _ in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attn = {}
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                s = time_s(lambda: F.scaled_dot_product_attention(q, k_, v), device)
        except RuntimeError as e:
            attn[label] = {"error": str(e)[:200]}
            continue
        flops = 4 * bsz * heads * seq * seq * hd
        attn[label] = {"us": round(s * 1e6, 2), "tflops": round(flops / s / 1e12, 1),
                       "ms_per_step": round(s * 1e3 * calls, 3)}
        print(label, attn[label], flush=True)
    out["attention"] = attn
    best_attn = min(a["ms_per_step"] for a in attn.values() if "ms_per_step" in a)
    out["bound_ms_per_step"] = round(total_ms + best_attn, 2)
    out["bound_it_s"] = round(1000.0 / out["bound_ms_per_step"], 2)

    # the peak, as metrics.device_peak measures it (median block after a sustained warm-up) and as
    # it did before the fifty-ninth session (3 warm-up calls, best of 3 blocks of 10), interleaved
    peaks = []
    n = 8192
    for _ in range(args.peak_repeats):
        metrics._PEAK_CACHE.clear()
        p_ = metrics.device_peak(device)
        row: dict[str, Any] = {"median": {k: (round(v, 1) if v else v) for k, v in p_["tflops"].items()},
                               "best": {k: (round(v, 1) if v else v) for k, v in p_["best_tflops"].items()},
                               "spread": p_["spread"], "legacy": {}}
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=g) for _ in range(2))
            c = torch.empty(n, n, device=device, dtype=dtype)
            s = metrics.time_op(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), device, 10, 3, warmup=3)
            row["legacy"][name] = round(2 * n**3 / s / 1e12, 1)
        peaks.append(row)
        print("device_peak", row, flush=True)
    out["device_peak_repeats"] = peaks
    if args.levers:
        out["levers"] = levers(device, g)
    print(json.dumps({k: out[k] for k in ("gemm_ms_per_step", "bound_ms_per_step", "bound_it_s")}))
    if args.output_json:
        args.output_json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
