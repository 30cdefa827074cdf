"""The 8-bit attention experiment of ``benchmarks/fp8_attention.py`` (measured on an H200 and not
shipped: BENCHMARKS.md, eleventh session): its Triton kernel against its torch twin, so the
benchmark's numbers stay about a correct kernel.

Run by Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton
builds the kernel), in fp16: the interpreter mishandles bf16 ``tl.dot`` and rounds float->fp8 its
own way (not to nearest even), so with e4m3 probabilities the kernel is held to the error bound of
the twin rather than to the twin's values. Tolerances: int8 q/k with P·V in fp16, 2e-3 absolute
(the same integer products; fp16 rounding of P); e4m3 P·V, a relative error against float32 SDPA
within 2x the twin's own.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from pass_helpers import interpreted

REPO = Path(__file__).resolve().parent.parent

CHECK = textwrap.dedent(
    """
    import json, sys, torch
    import torch.nn.functional as F
    sys.path.insert(0, sys.argv[1])
    from benchmarks import fp8_attention as fa
    torch.manual_seed(0)
    rows = []
    for b, h, n, d, n_kv in [(1, 2, 136, 64, 136), (2, 1, 70, 32, 128), (1, 1, 64, 128, 200)]:
        q = torch.randn(b, h, n, d, dtype=torch.float16)
        k, v = (torch.randn(b, h, n_kv, d, dtype=torch.float16) for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for qk in (torch.int8, fa.FP8_DTYPE):
            q8, qs = fa.quantize_tokens(q, qk)
            k8, ks = fa.quantize_tokens(k, qk)
            for pv in (False, True):
                v8, vs = fa.quantize_channels(v) if pv else (v, qs)
                args = (q8, qs, k8, ks, v8, vs, d ** -0.5, pv, torch.float16)
                out = fa.triton_fp8_attention(*args, config=(32, 64, 4, 2))
                twin = fa.torch_fp8_attention(*args)
                err = lambda t: float((t.float() - ref).norm() / ref.norm())
                rows.append({"case": [b, h, n, d, n_kv, str(qk), pv], "stride": list(out.stride()),
                             "shape": list(out.shape), "diff": float((out.float() - twin.float()).abs().max()),
                             "err": err(out), "twin_err": err(twin)})
    print(json.dumps(rows))
    """
)


def test_kernel_matches_twin_interpreted():
    pytest.importorskip("triton")
    rows = interpreted(CHECK, str(REPO))
    assert len(rows) == 12
    for r in rows:
        b, h, n, d, n_kv, qk, pv = r["case"]
        assert r["shape"] == [b, h, n, d]
        assert r["stride"] == [n * h * d, d, h * d, 1], r  # [B, N, H, D] storage
        if not pv:
            assert r["diff"] < 2e-3, r
        else:
            assert r["err"] < 2 * r["twin_err"], r
        # what the experiment measured: 8-bit q/k cost accuracy (int8 much less than e4m3)
        assert r["twin_err"] < (0.03 if qk == "torch.int8" and not pv else 0.2), r


def test_quantizers_and_bad_arguments():
    from benchmarks import fp8_attention as fa

    x = torch.randn(2, 3, 5, 32)
    q8, s = fa.quantize_tokens(x, torch.int8)
    assert q8.dtype == torch.int8 and s.shape == (2, 3, 5)
    assert torch.allclose(q8.float() * s.unsqueeze(-1), x, atol=float(s.max()) / 2 + 1e-6)
    v8, vs = fa.quantize_channels(x)
    assert v8.shape == (2, 3, 32, 5) and vs.shape == (2, 3, 32)
    assert float(v8.float().abs().amax()) == fa.FP8_MAX
    with pytest.raises(ValueError, match="float8_e4m3fn, torch.int8"):
        fa.quantize_tokens(x, torch.float16)
    with pytest.raises(ValueError, match="head dim 24 not supported; valid: 32, 64, 128, 256"):
        q8, qs = fa.quantize_tokens(torch.randn(1, 1, 4, 24))
        fa.torch_fp8_attention(q8, qs, q8, qs, torch.randn(1, 1, 4, 24), qs, 1.0, False, torch.float32)
