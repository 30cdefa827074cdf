"""fp8 linears (``nexfort_engine.fp8``): the ``_scaled_mm`` fast path against its torch twin on odd
shapes, the eligibility rules, the TorchFunctionMode, the ``fp8`` option and the compiled path.

``torch._scaled_mm`` runs on CPU with rowwise scales in recent torch (2.14; 2.11 allows only
per-tensor scales there, so the tests that run the fast path on CPU are skipped on it). The fast
path differs from the reference only in accumulation and in rounding its output through bf16.
Tolerances (relative L2 error):

* reference vs the fp32 matmul: < 6% (e4m3 has 3 mantissa bits; about 3.5% on random normals);
* fast path vs reference: < 1% (one bf16 rounding of the output, ~0.2%);
* a compiled two-layer bf16 MLP vs eager with the reference mode: < 3% (bf16 between the layers
  moves a few values across fp8 rounding boundaries in the second quantization).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters as dynamo_counters

import nexfort_engine
from nexfort_engine import OptionsError, parse_options
from nexfort_engine import compiler as compiler_mod
from nexfort_engine import settings as S
from nexfort_engine.fp8 import (
    Fp8LinearMode,
    eligible,
    fp8_linear,
    fp8_linear_reference,
    fp8_supported,
    quantize_rowwise,
)

REF_TOL = 6e-2
FAST_TOL = 1e-2
COMPILED_TOL = 3e-2

def _cpu_rowwise_scaled_mm() -> bool:
    try:
        fp8_linear(torch.randn(1, 2, 16), torch.randn(16, 16))
    except RuntimeError:
        return False
    return True


#: the fast path on CPU: torch 2.11 has only per-tensor ``_scaled_mm`` scales on CPU
needs_cpu_fast_path = pytest.mark.skipif(
    not _cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm has no rowwise scales (torch >= 2.14 has)"
)

#: (input shape, out_features): K and N multiples of 16, token counts odd, 3-D and 4-D inputs
SHAPES = [((1, 7, 32), 48), ((2, 33, 64), 16), ((3, 5, 16), 80), ((2, 3, 5, 48), 32)]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(shape, n, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.randn(n, shape[-1], generator=g) / shape[-1] ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


class TokenMLP(torch.nn.Module):
    """A transformer MLP on tokens, plus a 2-D embedding MLP (which must stay unconverted)."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)
        self.emb = torch.nn.Linear(16, dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) + self.emb(t)[:, None]


# -- quantization and the two matmuls


def test_quantize_rowwise_scales_and_roundtrip():
    t = torch.randn(7, 48) * torch.logspace(-3, 3, 7)[:, None]  # rows of very different range
    t[3] = 0  # an all-zero row: tiny scale, zeros, no NaN
    q, scale = quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
    assert scale.dtype == torch.float32 and scale.shape == (7, 1)
    back = q.float() * scale
    assert torch.isfinite(back).all() and (back[3] == 0).all()
    fmax = torch.finfo(torch.float8_e4m3fn).max
    assert torch.allclose(q.float().abs().amax(-1)[[0, 1, 2, 4, 5, 6]], torch.full((6,), fmax))
    for r in (0, 1, 2, 4, 5, 6):  # per-row error independent of the row's magnitude
        assert rel_l2(back[r], t[r]) < REF_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape, n", SHAPES, ids=[f"{s}x{n}" for s, n in SHAPES])
def test_reference_close_to_full_precision(shape, n, dtype):
    x, w, b = _inputs(shape, n, dtype)
    ref = fp8_linear_reference(x, w, b)
    exact = F.linear(x.float(), w.float(), b.float())
    assert ref.dtype == dtype and ref.shape == (*shape[:-1], n)
    assert rel_l2(ref, exact) < REF_TOL


@needs_cpu_fast_path
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape, n", SHAPES, ids=[f"{s}x{n}" for s, n in SHAPES])
def test_fast_path_matches_reference(shape, n, dtype, bias):
    x, w, b = _inputs(shape, n, dtype, bias=bias)
    fast = fp8_linear(x, w, b)
    ref = fp8_linear_reference(x, w, b)
    assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape
    assert rel_l2(fast, ref) < FAST_TOL


@needs_cpu_fast_path
def test_fast_path_takes_non_contiguous_input():
    x, w, b = _inputs((2, 9, 64), 32, torch.bfloat16)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    xs = torch.cat([x, x], -1)[..., :64]  # a strided slice
    ref = fp8_linear_reference(x, w, b)
    for view in (xt, xs):
        assert not view.is_contiguous()
        assert rel_l2(fp8_linear(view, w, b), ref) < FAST_TOL


# -- eligibility


def test_eligibility_rules():
    w = torch.randn(48, 32)
    assert eligible(torch.randn(2, 7, 32), w)
    assert eligible(torch.randn(2, 3, 7, 32), w)
    assert not eligible(torch.randn(7, 32), w)  # 2-D: timestep / adaLN / pooled MLPs
    assert not eligible(torch.randn(2, 7, 20), torch.randn(48, 20))  # K = 20
    assert not eligible(torch.randn(2, 7, 32), torch.randn(40, 32))  # N = 40
    assert not eligible(torch.randn(2, 7, 32, dtype=torch.float64), w.double())
    assert not eligible(torch.randn(2, 7, 32, dtype=torch.bfloat16), w)  # mixed dtypes: F.linear's error
    assert not eligible(torch.randn(2, 7, 32), torch.randn(32))
    with torch.enable_grad():  # _scaled_mm has no backward
        assert not eligible(torch.randn(2, 7, 32), w.requires_grad_())
    with torch.no_grad():
        assert eligible(torch.randn(2, 7, 32), w)


def test_fp8_supported_is_false_on_cpu():
    assert fp8_supported(torch.device("cpu")) is False
    assert fp8_supported("cpu") is False


# -- the mode


@needs_cpu_fast_path
@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_mode_routes_functional_and_module_linears(reference):
    twin = fp8_linear_reference if reference else fp8_linear
    x, w, b = _inputs((2, 7, 32), 48, torch.bfloat16)
    lin = torch.nn.Linear(32, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
        want = twin(x, w, b)
        assert not torch.equal(want, F.linear(x, w, b))  # so the checks below can tell them apart
        with Fp8LinearMode(reference=reference):
            got = [F.linear(x, w, b), F.linear(x, w, bias=b), F.linear(input=x, weight=w, bias=b),
                   torch.nn.functional.linear(x, w, b), lin(x)]
            nobias = F.linear(x, w)
            flat = F.linear(x[0], w, b)  # 2-D: passes through
            other = torch.mm(x[0], w.t())  # not a linear: passes through
    for g in got:
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    torch.testing.assert_close(nobias, twin(x, w), rtol=0, atol=0)
    torch.testing.assert_close(flat, F.linear(x[0], w, b), rtol=0, atol=0)
    torch.testing.assert_close(other, torch.mm(x[0], w.t()), rtol=0, atol=0)


def test_mode_leaves_training_alone():
    lin = torch.nn.Linear(32, 48)
    x = torch.randn(2, 7, 32)
    with torch.enable_grad():  # the ComfyUI host (booted by other tests) turns grad off
        with Fp8LinearMode():
            out = lin(x)
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
        out.sum().backward()
    assert lin.weight.grad is not None


# -- options and settings


def test_fp8_option_values():
    assert parse_options({}).fp8 is None
    assert parse_options({"fp8": None}).fp8 is None
    assert parse_options({"fp8": True}).fp8 is True
    assert parse_options('{"fp8": false}').fp8 is False
    with pytest.raises(OptionsError, match="true, false or null"):
        parse_options({"fp8": "yes"})
    with pytest.raises(OptionsError, match="true, false or null"):
        parse_options({"fp8": 1})


def test_low_precision_flag_mentions_fp8():
    assert "fp8" in nexfort_engine.FLAGS["low-precision"]


def test_resolve_fp8_only_when_asked():
    o3, o2 = parse_options({"mode": "O3"}), parse_options({"mode": "O3", "fp8": True})
    # auto is off everywhere (measured slower than fp16 on SDXL/PixArt; BENCHMARKS.md run8)
    assert S.resolve(o3, cuda=False).fp8 is False
    assert S.resolve(o3, cuda=True, fp8_capable=True).fp8 is False
    # forced: on with fp8 tensor cores, and on CPU (correct, for tests)
    assert S.resolve(o2, cuda=True, fp8_capable=True).fp8 is True
    assert S.resolve(o2, cuda=False).fp8 is True
    assert S.resolve(parse_options({"mode": "O1", "fp8": True}), cuda=True, fp8_capable=True).fp8 is True
    # forced on a GPU without fp8 (e.g. an A100): off, with a warning instead of a failing compile
    assert S.resolve(o2, cuda=True, fp8_capable=False).fp8 is False
    assert S.resolve(parse_options({"mode": "O3", "fp8": False}), cuda=True, fp8_capable=True).fp8 is False


def test_digest_tracks_effective_fp8():
    off = parse_options({"mode": "O1"})
    on = parse_options({"mode": "O1", "fp8": True})
    never = parse_options({"mode": "O1", "fp8": False})
    d_off = S.resolve(off, cuda=False).digest(off)
    d_on = S.resolve(on, cuda=False).digest(on)
    assert d_on != d_off
    assert S.resolve(never, cuda=False).digest(never) == d_off  # both off: one cache entry
    # auto (off) and never: one entry
    o3, o3_never = parse_options({"mode": "O3"}), parse_options({"mode": "O3", "fp8": False})
    auto = S.resolve(o3, cuda=True, fp8_capable=True)
    assert auto.digest(o3) == S.resolve(o3_never, cuda=True, fp8_capable=True).digest(o3_never)


# -- the compiled path


@pytest.fixture
def graph_targets(monkeypatch):
    """Every call_function target of every graph the engine's backend receives."""
    targets: list[object] = []
    orig = compiler_mod.CompiledModule._compile_graph

    def spy(self, gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return orig(self, gm, example_inputs)

    monkeypatch.setattr(compiler_mod.CompiledModule, "_compile_graph", spy)
    return targets


def _eager_reference(model, x, t):
    with Fp8LinearMode(reference=True):
        return model(x, t)


@needs_cpu_fast_path
@torch.no_grad()
def test_compiled_fp8_matches_reference_and_sees_weight_patches(fresh_stats, graph_targets):
    torch.manual_seed(0)
    model = TokenMLP().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fp8": True, "backend": "aot_eager", "mode": "O1", "dynamic": True},
                                label="fp8-mlp")
    dynamo_counters["graph_break"].clear()
    t = torch.randn(2, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    out = cm(x, t)
    assert rel_l2(out, _eager_reference(model, x, t)) < COMPILED_TOL
    assert rel_l2(out, model(x, t)) < REF_TOL  # and close to the model itself
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])
    assert graph_targets.count(torch._scaled_mm) == 2  # fc1, fc2; the 2-D emb stays F.linear
    assert F.linear in graph_targets

    # another token count: same graph
    x2 = torch.randn(2, 11, 32, dtype=torch.bfloat16)
    assert rel_l2(cm(x2, t), _eager_reference(model, x2, t)) < COMPILED_TOL

    # a LoRA-like in-place weight patch is seen without a recompile
    before = cm(x, t)
    delta = torch.randn_like(model.fc2.weight) * 0.5
    model.fc2.weight.add_(delta)
    after = cm(x, t)
    assert rel_l2(after, before) > 0.1
    assert rel_l2(after, _eager_reference(model, x, t)) < COMPILED_TOL
    model.fc2.weight.sub_(delta)

    rec = fresh_stats()["models"][cm.label]
    assert rec["fp8"] is True and rec["fallbacks"] == 0
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
    # the eager model is untouched: outside the compiled call there is no fp8
    torch.testing.assert_close(model(x, t), F.linear(F.gelu(F.linear(x, model.fc1.weight, model.fc1.bias)),
                                                     model.fc2.weight, model.fc2.bias)
                               + model.emb(t)[:, None], rtol=0, atol=0)


@torch.no_grad()
def test_fp8_off_on_cpu_by_default(fresh_stats, graph_targets):
    model = TokenMLP()
    cm = nexfort_engine.compile(model, {"backend": "aot_eager", "mode": "O3"}, label="fp8-auto")
    x, t = torch.randn(2, 7, 32), torch.randn(2, 16)
    torch.testing.assert_close(cm(x, t), model(x, t))
    assert torch._scaled_mm not in graph_targets
    assert fresh_stats()["models"][cm.label]["fp8"] is False


@needs_cpu_fast_path
@pytest.mark.inductor
@torch.no_grad()
def test_inductor_compiles_fp8(fresh_stats, nx_cache, graph_targets):
    torch.manual_seed(0)
    model = TokenMLP().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fp8": True, "mode": "O1"}, cache_dir=nx_cache, label="fp8-inductor")
    dynamo_counters["graph_break"].clear()
    t = torch.randn(2, 16, dtype=torch.bfloat16)
    for tokens in (7, 13):
        x = torch.randn(2, tokens, 32, dtype=torch.bfloat16)
        assert rel_l2(cm(x, t), _eager_reference(model, x, t)) < COMPILED_TOL
    assert not dynamo_counters["graph_break"]
    assert graph_targets.count(torch._scaled_mm) == 2
    rec = fresh_stats()["models"][cm.label]
    assert rec["fp8"] is True and rec["fallbacks"] == 0 and rec["compiles"] == 1 and rec["recompiles"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_supported("cuda"), reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("shape, n", SHAPES, ids=[f"{s}x{n}" for s, n in SHAPES])
def test_fast_path_matches_reference_on_gpu(shape, n):
    x, w, b = (v.cuda() for v in _inputs(shape, n, torch.bfloat16))
    assert rel_l2(fp8_linear(x, w, b), fp8_linear_reference(x, w, b)) < FAST_TOL
