"""fp8 linears (``nexfort_engine.fp8``): the ``_scaled_mm`` fast path against its torch twin on odd
shapes, the eligibility rules, the TorchFunctionMode, the weight cache (quantized once per weight
version, re-quantized in place), the ``fp8`` option and the compiled path.

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
from tiny_models import rel_l2
from torch._dynamo.utils import counters as dynamo_counters

import nexfort_engine
from nexfort_engine import OptionsError, parse_options
from nexfort_engine import compiler as compiler_mod
from nexfort_engine import fp8 as fp8_mod
from nexfort_engine import settings as S
from nexfort_engine.fp8 import (
    CACHE,
    Fp8LinearMode,
    ModuleWeights,
    clear_cache,
    eligible,
    fp8_linear,
    fp8_linear_cached,
    fp8_linear_reference,
    fp8_supported,
    quantize_rowwise,
)

FP8_OP = torch.ops.nexfort.fp8_mm_cached.default
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


# -- the weight cache


def _entry(w: torch.Tensor):
    return CACHE._entries[fp8_mod._key(w)]


@needs_cpu_fast_path
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape, n", SHAPES, ids=[f"{s}x{n}" for s, n in SHAPES])
@torch.no_grad()
def test_cached_path_matches_reference(cache, shape, n, dtype, bias):
    x, w, b = _inputs(shape, n, dtype, bias=bias)
    want = fp8_linear(x, w, b)  # same numbers: the same quantization, the same GEMM
    miss = fp8_linear_cached(x, w, b)  # inline, queued
    assert len(cache) == 0 and cache.refresh() == 1 and len(cache) == 1
    hit = fp8_linear_cached(x, w, b)
    assert cache.stats["hits"] == 1 and cache.stats["inline"] == 1
    for got in (miss, hit):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert rel_l2(got, fp8_linear_reference(x, w, b)) < FAST_TOL


@needs_cpu_fast_path
@torch.no_grad()
def test_in_place_patch_requantizes_in_place(cache):
    x, w, b = _inputs((2, 9, 64), 32, torch.bfloat16)
    fp8_linear_cached(x, w, b)
    cache.refresh()
    q, scale = _entry(w).q, _entry(w).scale
    ptrs = q.data_ptr(), scale.data_ptr()
    before = fp8_linear_cached(x, w, b)
    assert cache.refresh() == 0  # nothing changed: nothing quantized

    w.add_(torch.randn_like(w))  # LoRA-like, in place: a new version
    assert cache.refresh() == 1
    want_q, want_s = quantize_rowwise(w)
    assert (q.data_ptr(), scale.data_ptr()) == ptrs  # rewritten, not reallocated
    assert torch.equal(q.float(), want_q.float()) and torch.equal(scale, want_s)
    after = fp8_linear_cached(x, w, b)
    assert rel_l2(after, before) > 0.1
    torch.testing.assert_close(after, fp8_linear(x, w, b), rtol=0, atol=0)

    w.copy_(torch.randn_like(w))  # without a refresh: the op re-quantizes (in place) itself
    torch.testing.assert_close(fp8_linear_cached(x, w, b), fp8_linear(x, w, b), rtol=0, atol=0)
    assert cache.stats["requantized"] == 2 and q.data_ptr() == ptrs[0]


@needs_cpu_fast_path
@torch.no_grad()
def test_dead_weights_are_dropped_unless_captured(cache):
    x = torch.randn(1, 3, 32)
    ws = [torch.randn(16, 32) for _ in range(3)]
    for w in ws:
        fp8_linear_cached(x, w)
    cache.refresh()
    assert len(cache) == 3 and cache.nbytes() == 3 * (16 * 32 + 16 * 4)
    _entry(ws[1]).captured = True  # as if a CUDA graph read it: it must outlive the graph
    del ws[:2]  # freed at once, without waiting for a refresh (a model unloaded between calls)
    assert len(cache) == 2 and cache.stats["dropped"] == 1
    cache.refresh()
    assert len(cache) == 2
    clear_cache()
    assert len(cache) == 0 and cache.nbytes() == 0


@needs_cpu_fast_path
@torch.no_grad()
def test_invalidate_all_requantizes_live_weights_and_never_drops_them(cache):
    """invalidate() with no keys marks every copy stale; a refresh that names no weights then
    re-quantizes each from its live weight in place (it used to take them for dead weights and
    drop the uncaptured ones, and leave captured ones stale)."""
    x = torch.randn(1, 3, 32)
    ws = [torch.randn(16, 32) for _ in range(2)]
    for w in ws:
        fp8_linear_cached(x, w)
    cache.refresh()
    _entry(ws[1]).captured = True
    ptrs = [_entry(w).q.data_ptr() for w in ws]
    for w in ws:
        w.mul_(-1)
    cache.invalidate()
    assert cache.refresh() == 2 and len(cache) == 2 and cache.stats["dropped"] == 0
    assert [_entry(w).q.data_ptr() for w in ws] == ptrs  # in place: captured graphs read the new values
    for w in ws:
        torch.testing.assert_close(fp8_linear_cached(x, w), fp8_linear(x, w), rtol=0, atol=0)
    del ws[0]  # a stale-marked weight that dies is still dropped at once
    assert len(cache) == 1 and cache.stats["dropped"] == 1


@needs_cpu_fast_path
@torch.no_grad()
def test_inference_tensors_replaced_or_invalidated(cache):
    """ComfyUI loads and patches weights under inference_mode: no version counter. A replaced
    parameter (ComfyUI's default LoRA patching) is another storage; an in-place change needs
    invalidate()."""
    lin = torch.nn.Linear(32, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        lin.weight = torch.nn.Parameter(lin.weight.clone(), requires_grad=False)
        x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
        slots = ModuleWeights(lin)
        with Fp8LinearMode():
            lin(x)
        slots.refresh()
        assert len(cache) == 1 and _entry(lin.weight).version is None

        lin.weight.mul_(2)  # in place, invisible to the cache...
        assert slots.refresh() == 0
        slots.invalidate()  # ...until the host says so
        assert slots.refresh() == 1

        # replaced: quantized by the refresh before the call (the slot is known), then a hit
        lin.weight = torch.nn.Parameter(torch.randn_like(lin.weight), requires_grad=False)
        assert slots.refresh() == 1
        hits = cache.stats["hits"]
        with Fp8LinearMode():
            out = lin(x)
        assert cache.stats["hits"] == hits + 1
        torch.testing.assert_close(out, fp8_linear(x, lin.weight, lin.bias), rtol=0, atol=0)
        _entry(lin.weight).captured = True  # shared with a module whose CUDA graph read it: kept
        slots.release()
        assert len(cache) == 1
        clear_cache()
        assert len(cache) == 0


@needs_cpu_fast_path
@torch.no_grad()
def test_refresh_fast_path_sees_every_kind_of_change(cache, monkeypatch):
    """refresh() skips the cache's full pass while nothing changed, and takes it after each kind
    of change: an in-place write (version), a replaced parameter, a move to new memory (``.data``
    swap, as ``module.to()`` does), invalidate(), and a weight the op met for the first time."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 32)).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    slots = ModuleWeights(model)
    with Fp8LinearMode():
        model(x)
    assert slots.refresh() == 2
    full = []
    orig = cache.refresh
    monkeypatch.setattr(cache, "refresh", lambda weights=(): full.append(1) or orig(weights))

    assert slots.refresh() == 0 and not full  # unchanged: no full pass
    model[0].weight.mul_(2)
    assert slots.refresh() == 1 and len(full) == 1
    assert slots.refresh() == 0 and len(full) == 1
    model[1].weight = torch.nn.Parameter(torch.randn_like(model[1].weight))
    assert slots.refresh() == 1 and len(full) == 2
    model[0].weight.data = model[0].weight.data.clone()  # new memory, same Parameter and version
    assert slots.refresh() == 1 and len(full) == 3
    slots.invalidate()
    assert slots.refresh() == 2 and len(full) == 4
    assert slots.refresh() == 0 and len(full) == 4
    with Fp8LinearMode():  # the op queues a weight it has no copy of: generation changes
        fp8_linear_cached(x, torch.randn(16, 32, dtype=torch.bfloat16))
    slots.refresh()
    assert len(full) == 5
    hits = cache.stats["hits"]
    with Fp8LinearMode():  # every copy is current: the call reads the cache
        out = model(x)
    assert cache.stats["hits"] == hits + 2
    with Fp8LinearMode(reference=True):
        ref = model(x)
    assert rel_l2(out, ref) < FAST_TOL

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


def test_resolve_fp8_when_asked_or_low_precision_on_an_fp8_gpu():
    o3, o2 = parse_options({"mode": "O3"}), parse_options({"mode": "O3", "fp8": True})
    # auto: on with low-precision (O3) where the GPU has fp8 tensor cores, off elsewhere
    assert S.resolve(o3, cuda=True, fp8_capable=True).fp8 is True
    assert S.resolve(o3, cuda=True, fp8_capable=False).fp8 is False
    assert S.resolve(o3, cuda=False).fp8 is False  # low-precision is dropped on CPU
    assert S.resolve(parse_options({"mode": "O2"}), cuda=True, fp8_capable=True).fp8 is False
    assert S.resolve(parse_options({"mode": "max-optimize:low-precision"}), cuda=True, fp8_capable=True).fp8 is True
    # forced: on with fp8 tensor cores, and on CPU (correct, for tests)
    assert S.resolve(o2, cuda=True, fp8_capable=True).fp8 is True
    assert S.resolve(o2, cuda=False).fp8 is True
    assert S.resolve(parse_options({"mode": "O1", "fp8": True}), cuda=True, fp8_capable=True).fp8 is True
    # forced on a GPU without fp8 (e.g. an A100): off, with a warning instead of a failing compile
    assert S.resolve(o2, cuda=True, fp8_capable=False).fp8 is False
    assert S.resolve(parse_options({"mode": "O3", "fp8": False}), cuda=True, fp8_capable=True).fp8 is False


def test_auto_fp8_only_for_models_wide_enough_to_repay_quantization():
    o3 = parse_options({"mode": "O3"})
    # auto: off for a narrow model (SDXL, PixArt), even on an fp8 GPU under O3
    narrow = S.resolve(o3, cuda=True, fp8_capable=True, fp8_pays=False)
    assert narrow.fp8 is False
    # "fp8": true still forces it; O3 keeps its other low-precision switches
    forced = parse_options({"mode": "O3", "fp8": True})
    assert S.resolve(forced, cuda=True, fp8_capable=True, fp8_pays=False).fp8 is True
    assert narrow.runtime.get("matmul_bf16_reduction") is True
    # one cache entry with "fp8": false (the same compile)
    never = parse_options({"mode": "O3", "fp8": False})
    assert narrow.digest(o3) == S.resolve(never, cuda=True, fp8_capable=True).digest(never)


def test_model_width_is_the_weighted_median_linear_width():
    class Net(torch.nn.Module):
        def __init__(self, wide: int, narrow: int) -> None:
            super().__init__()
            self.big = torch.nn.Linear(wide, 4 * wide)  # most of the weights
            self.up = torch.nn.Linear(narrow, narrow)
            self.conv = torch.nn.Conv2d(4, 4, 3)  # not a linear

    assert fp8_mod.model_width(Net(64, 16)) == 64
    assert fp8_mod.model_width(torch.nn.Conv2d(4, 4, 3)) == 0
    assert fp8_mod.pays_off(Net(64, 16), min_width=64)
    assert not fp8_mod.pays_off(Net(32, 16), min_width=64)


def test_compiled_module_asks_whether_fp8_pays_for_its_model(monkeypatch, fresh_stats, resolve_kwargs):
    monkeypatch.setattr(compiler_mod, "fp8_supported", lambda device: True)  # as on an fp8 GPU
    net = torch.nn.Sequential(torch.nn.Linear(16, 16))
    cm = nexfort_engine.compile(net, {"mode": "O3", "backend": "eager"}, cache_dir=None)
    cm(torch.randn(2, 3, 16))
    assert resolve_kwargs["fp8_pays"] is False  # 16 < MIN_AUTO_WIDTH
    # the reason is published for the Cache Manager's report
    assert fresh_stats()["models"][cm.label]["fp8_skipped"] == "model width 16 < 2048"


def test_digest_tracks_effective_fp8():
    off = parse_options({"mode": "O1"})
    on = parse_options({"mode": "O1", "fp8": True})
    never = parse_options({"mode": "O1", "fp8": False})
    d_off = S.resolve(off, cuda=False).digest(off)
    d_on = S.resolve(on, cuda=False).digest(on)
    assert d_on != d_off
    assert S.resolve(never, cuda=False).digest(never) == d_off  # both off: one cache entry
    # auto and forced agree where both are on (one entry); never is another entry
    o3, o3_never = parse_options({"mode": "O3"}), parse_options({"mode": "O3", "fp8": False})
    o3_on = parse_options({"mode": "O3", "fp8": True})
    auto = S.resolve(o3, cuda=True, fp8_capable=True)
    assert auto.digest(o3) == S.resolve(o3_on, cuda=True, fp8_capable=True).digest(o3_on)
    assert auto.digest(o3) != S.resolve(o3_never, cuda=True, fp8_capable=True).digest(o3_never)
    # where auto is off (no fp8 GPU), auto and never share the entry
    no_fp8 = S.resolve(o3, cuda=True, fp8_capable=False)
    assert no_fp8.digest(o3) == S.resolve(o3_never, cuda=True, fp8_capable=False).digest(o3_never)


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
    # fc1, fc2 through the cached-weight op (no weight quantization in the graph); the 2-D emb
    # stays F.linear
    assert graph_targets.count(FP8_OP) == 2 and torch._scaled_mm not in graph_targets
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


@needs_cpu_fast_path
@torch.no_grad()
def test_compiled_fp8_quantizes_weights_once_per_version(fresh_stats, cache):
    """Through nexfort_engine.compile: the first call quantizes the weights inline, the refresh
    before the second caches them; then every call is a hit until a weight changes, in place
    (re-quantized in place by the refresh) or replaced (cached by the refresh): no recompiles."""
    torch.manual_seed(0)
    model = TokenMLP().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fp8": True, "backend": "aot_eager", "mode": "O1", "dynamic": True},
                                label="fp8-cache")
    t = torch.randn(2, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    first = cm(x, t)
    assert cache.stats["inline"] == 2 and len(cache) == 0
    for tokens in (7, 11, 7):
        xi = torch.randn(2, tokens, 32, dtype=torch.bfloat16)
        assert rel_l2(cm(xi, t), _eager_reference(model, xi, t)) < COMPILED_TOL
    assert len(cache) == 2 and cache.stats["quantized"] == 2 and cache.stats["inline"] == 2
    assert cache.stats["hits"] == 6 and cache.stats["requantized"] == 0
    torch.testing.assert_close(cm(x, t), first, rtol=0, atol=0)
    q = _entry(model.fc1.weight).q

    model.fc1.weight.add_(torch.randn_like(model.fc1.weight))  # in place
    patched = cm(x, t)
    assert cache.stats["requantized"] == 1 and _entry(model.fc1.weight).q is q  # by refresh, in place
    assert rel_l2(patched, first) > 0.1 and rel_l2(patched, _eager_reference(model, x, t)) < COMPILED_TOL

    model.fc2.weight = torch.nn.Parameter(torch.randn_like(model.fc2.weight) / 8)  # replaced
    hits = cache.stats["hits"]
    replaced = cm(x, t)
    assert cache.stats["quantized"] == 3 and cache.stats["hits"] == hits + 2 and cache.stats["inline"] == 2
    assert rel_l2(replaced, _eager_reference(model, x, t)) < COMPILED_TOL

    rec = fresh_stats()["models"][cm.label]
    assert rec["fp8"] is True and rec["fallbacks"] == 0
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
    assert len(cache) == 2 and cache.stats["dropped"] == 1  # the replaced fc2 weight died: its copy too


@needs_cpu_fast_path
@torch.no_grad()
def test_fallback_releases_fp8_weights(fresh_stats, cache, monkeypatch):
    model = TokenMLP().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fp8": True, "backend": "aot_eager", "mode": "O1"}, label="fp8-fallback")
    t, x = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 7, 32, dtype=torch.bfloat16)
    cm(x, t)
    cm(x, t)
    assert len(cache) == 2

    def broken(self, args, kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(compiler_mod.CompiledModule, "_call_compiled", broken)
    torch.testing.assert_close(cm(x, t), model(x, t), rtol=0, atol=0)
    assert cm.failed and len(cache) == 0


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
def test_inductor_compiles_fp8(fresh_stats, nx_cache, graph_targets, cache):
    torch.manual_seed(0)
    model = TokenMLP().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fp8": True, "mode": "O1"}, cache_dir=nx_cache, label="fp8-inductor")
    dynamo_counters["graph_break"].clear()
    t = torch.randn(2, 16, dtype=torch.bfloat16)
    for tokens in (7, 13):
        x = torch.randn(2, tokens, 32, dtype=torch.bfloat16)
        assert rel_l2(cm(x, t), _eager_reference(model, x, t)) < COMPILED_TOL
    assert not dynamo_counters["graph_break"]
    assert graph_targets.count(FP8_OP) == 2
    assert cache.stats["inline"] == 2 and cache.stats["hits"] == 2  # the 2nd call read the cache
    rec = fresh_stats()["models"][cm.label]
    assert rec["fp8"] is True and rec["fallbacks"] == 0 and rec["compiles"] == 1 and rec["recompiles"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_supported("cuda"), reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("shape, n", SHAPES, ids=[f"{s}x{n}" for s, n in SHAPES])
def test_fast_path_matches_reference_on_gpu(shape, n):
    x, w, b = (v.cuda() for v in _inputs(shape, n, torch.bfloat16))
    assert rel_l2(fp8_linear(x, w, b), fp8_linear_reference(x, w, b)) < FAST_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_supported("cuda"), reason="needs a CUDA GPU with fp8 (sm89+)")
@pytest.mark.parametrize("scale", [None, 0.37])
def test_stored_weight_path_matches_twin_on_gpu(scale):
    """``nexfort::fp8_mm_stored`` (weights the model stores in e4m3, passes/fp8_stored.py) against
    its torch twin on the GPU's ``_scaled_mm``."""
    x, w, b = (v.cuda() for v in _inputs((2, 33, 64), 48, torch.bfloat16))
    xq, sx = quantize_rowwise(x.reshape(-1, 64))
    w8 = w.to(torch.float8_e4m3fn)
    s = None if scale is None else torch.tensor(scale, device="cuda")
    out = fp8_mod.fp8_mm_stored(xq, sx, w8, s, b)
    assert rel_l2(out, fp8_mod.fp8_mm_stored_reference(xq, sx, w8, s, b)) < FAST_TOL


@pytest.mark.parametrize(("family", "width", "pays"), [
    ("sdxl", 1280, False), ("pixart", 1152, False), ("wan", 1536, False), ("flux", 3072, True),
])
def test_auto_fp8_width_of_the_released_architectures(comfy_inproc, family, width, pays):
    """ComfyUI's own model classes at released sizes, built on the meta device (no memory): auto
    fp8 under O3 goes to Flux, the model it measured faster on, and not to SDXL or PixArt-alpha."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import comfy.supported_models

    from benchmarks import models

    spec = models.get_spec(family)
    config = getattr(comfy.supported_models, spec.config_class)(models.host_unet_config(spec))
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model(dict(spec.detect_state_dict), "", device=torch.device("meta"))
    assert fp8_mod.model_width(model.diffusion_model) == width
    assert fp8_mod.pays_off(model.diffusion_model) is pays
