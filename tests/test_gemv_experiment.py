"""The weight-only fp8 products of ``benchmarks/fp8_gemv.py`` (single-token linears; measured on an
H200 and not shipped: BENCHMARKS.md, thirteenth and fourteenth sessions): its two Triton kernels
against their torch twin, so the benchmark's numbers stay about correct kernels.

Run by Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton
builds the kernel), where the kernel multiplies in float32 (the interpreter's bfloat16 ``tl.dot``
returns garbage) and the output's cast to bfloat16 truncates: bfloat16 within two of its steps at
the largest magnitude, float16 to 1e-5 relative. On a GPU (marked ``gpu``): the 16-bit tensor-core
products at Flux's modulation sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pass_helpers import interpreted

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from benchmarks.fp8_gemv import torch_gemv, triton_gemv
from nexfort_engine.fp8 import quantize_rowwise
torch.manual_seed(0)
rows = []
for dtype in (torch.bfloat16, torch.float16):
    for m, n, k, bias in [(1, 96, 64, True), (3, 80, 300, False), (17, 48, 256, True)]:
        wq, ws = quantize_rowwise(torch.randn(n, k, dtype=dtype))
        x = torch.randn(m, k + 7, dtype=dtype)[:, 2:2 + k]  # strided rows
        b = torch.randn(n, dtype=dtype) if bias else None
        out = triton_gemv(x, wq, ws, b, config=(32, 64, 4, 1))
        ref = torch_gemv(x, wq, ws, b)
        rows.append({"case": [str(dtype), m, n, k, bias], "shape_ok": list(out.shape) == [m, n] and out.dtype == dtype,
                     "err": float((out.float() - ref.float()).abs().max()), "max": float(ref.float().abs().max())})
print(json.dumps(rows))
"""


def _interpreted(script: str) -> list[dict]:
    """The rows ``script`` prints, run by Triton's interpreter in a subprocess."""
    pytest.importorskip("triton")
    return interpreted(script, str(REPO))


def test_gemv_kernel_matches_twin_interpreted():
    rows = _interpreted(CHECK)
    assert len(rows) == 6
    for r in rows:
        assert r["shape_ok"], r
        assert r["err"] <= (2 * 2**-7 if "bfloat16" in r["case"][0] else 1e-5) * r["max"], r


ROWS_CHECK = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from benchmarks.fp8_gemv import torch_gemv, triton_gemv_rows
from nexfort_engine.fp8 import quantize_rowwise
torch.manual_seed(0)
rows = []
for dtype in (torch.bfloat16, torch.float16):
    for m, n, k, bias, prologue in [(1, 96, 64, True, "none"), (3, 80, 300, False, "silu"), (4, 48, 256, True, "silu")]:
        wq, ws = quantize_rowwise(torch.randn(n, k, dtype=dtype))
        x = torch.randn(m, k + 7, dtype=dtype)[:, 2:2 + k]  # strided rows
        b = torch.randn(n, dtype=dtype) if bias else None
        out = triton_gemv_rows(x, wq, ws, b, prologue, config=(16, 64, 4))
        ref = torch_gemv(x, wq, ws, b, prologue)
        rows.append({"case": [str(dtype), m, n, k, bias, prologue],
                     "shape_ok": list(out.shape) == [m, n] and out.dtype == dtype,
                     "err": float((out.float() - ref.float()).abs().max()), "max": float(ref.float().abs().max())})
print(json.dumps(rows))
"""


def test_register_form_matches_twin_interpreted():
    """The register-only kernel: masks on features and K, one to four rows, strided rows, with and
    without bias and the silu prologue. The sums' order differs and the output's cast rounds:
    bfloat16 within two of its steps at the largest magnitude, float16 to 1e-3 relative."""
    rows = _interpreted(ROWS_CHECK)
    assert len(rows) == 6
    for r in rows:
        assert r["shape_ok"], r
        assert r["err"] <= (2 * 2**-7 if "bfloat16" in r["case"][0] else 1e-3) * r["max"], r


def test_register_form_rejects_bad_arguments():
    from benchmarks.fp8_gemv import torch_gemv, triton_gemv_rows
    from nexfort_engine.fp8 import quantize_rowwise

    wq, ws = quantize_rowwise(torch.randn(32, 16))
    with pytest.raises(ValueError, match="'none' or 'silu'"):
        torch_gemv(torch.randn(2, 16), wq, ws, None, "gelu")
    with pytest.raises(ValueError, match="at most 4 rows"):
        triton_gemv_rows(torch.randn(5, 16, dtype=torch.bfloat16), wq, ws, None)


def test_twin_is_more_accurate_than_the_quantized_product():
    from benchmarks.fp8_gemv import torch_gemv
    from nexfort_engine.fp8 import fp8_linear_reference, quantize_rowwise

    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(2, 64)
    wq, ws = quantize_rowwise(w)
    exact = torch.nn.functional.linear(x, w, b)
    err = (torch_gemv(x, wq, ws, b) - exact).norm() / exact.norm()
    assert err < (fp8_linear_reference(x[:, None], w, b)[:, 0] - exact).norm() / exact.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m, n, k", [(1, 9216, 3072), (2, 18432, 3072), (3, 1152, 1152)])
def test_gemv_kernel_on_gpu(m, n, k):
    """16-bit tensor-core products of exact e4m3 weights, float32 sums: the twin's values to the
    output's rounding (the sums' order differs)."""
    from benchmarks.fp8_gemv import triton_gemv

    _check_on_gpu(lambda x, wq, ws, b: triton_gemv(x, wq, ws, b), m, n, k, "none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m, n, k, prologue", [(1, 9216, 3072, "silu"), (2, 18432, 3072, "none"), (3, 1152, 1152, "silu")])
def test_register_form_on_gpu(m, n, k, prologue):
    from benchmarks.fp8_gemv import triton_gemv_rows

    _check_on_gpu(lambda x, wq, ws, b: triton_gemv_rows(x, wq, ws, b, prologue), m, n, k, prologue)


def _check_on_gpu(product, m: int, n: int, k: int, prologue: str) -> None:
    """``product(x, wq, ws, b)`` against the twin on random bf16 inputs: either kernel's products of
    exact e4m3 weights are exact and summed in float32, so the twin's values to the output's
    rounding (two bfloat16 steps; the sums' order differs)."""
    from benchmarks.fp8_gemv import torch_gemv
    from nexfort_engine.fp8 import quantize_rowwise

    gen = torch.Generator(device="cuda").manual_seed(0)
    wq, ws = quantize_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, ref = product(x, wq, ws, b), torch_gemv(x, wq, ws, b, prologue)
    err = (out.float() - ref.float()).abs()
    assert bool((err <= ref.float().abs() * 2**-7 + 1e-2).all()), float(err.max())
