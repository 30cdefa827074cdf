"""fp8 activation quantization fused with its producer (``nexfort_engine.rowwise_quant``,
``nexfort_engine.passes.fuse_quant``).

* The Triton kernel against its torch twin on odd shapes, every prologue, with and without the
  concatenated part, both launch forms, with and without ``fast`` (approximate GELU division, one
  reciprocal per row), three input dtypes and strided inputs: run by Triton's
  interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton builds the kernel).
  The kernel stores the scaled values before the e4m3 cast there (``out_dtype=float32``): the
  interpreter's own float->fp8 conversion does not round to nearest even (it gives 64 for 124.7),
  unlike the GPU's ``cvt.rn`` and torch's cast. Tolerances: scales to 1e-6 relative (the same
  float32 amax; the producer is computed once in float32 by the kernel and by the float32 twin),
  scaled values to 1e-3 absolute on a 448 range (erf/exp implementations differ in the last bits).
* The graph rewrite on Dynamo graphs of ComfyUI's own Flux and SD1.5 blocks (tiny, CPU): which
  quantizations it finds, that the old chain is gone, and that the output is unchanged (on CPU the
  op runs the twin, which is eager's arithmetic, so the outputs are equal).
* The option, the settings, the counters, and one real Inductor compile with the op in the graph.
* On a GPU (marked ``gpu``): the kernel's fp8 bytes against the twin's.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from pass_helpers import interpreted, rewritten
from pass_helpers import targets as _targets
from torch._dynamo.utils import counters as dynamo_counters

import nexfort_engine
from nexfort_engine import OptionsError, parse_options
from nexfort_engine import settings as S
from nexfort_engine.fp8 import Fp8LinearMode, fp8_supported
from nexfort_engine.passes import fuse_quant
from nexfort_engine.rowwise_quant import (
    MAX_CHUNKS,
    ONE_PASS_MAX,
    chunk_width,
    launch_config,
    quant_rows,
    torch_quant_rows,
    torch_quant_rows_ln_mod,
    torch_scaled_ln_mod,
    torch_scaled_rows,
    triton_available,
)

REPO = Path(__file__).resolve().parents[2]
QUANT_OP = torch.ops.nexfort.quant_rows.default
needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")


# -- the kernel (Triton's interpreter, CPU)

INTERPRETER_CHECK = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from nexfort_engine.rowwise_quant import triton_quant_rows, torch_scaled_rows
    torch.manual_seed(0)
    cases = [  # prologue, a width, f(h) width, rows
        ("none", 0, 48, 5), ("gelu_tanh", 0, 300, 7), ("gelu", 0, 33, 3), ("geglu", 0, 40, 6),
        ("gelu_tanh", 24, 200, 9), ("geglu", 16, 64, 4), ("gelu", 40, 17, 1),
    ]
    rows = []
    for prologue, ka, k, m in cases:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for config, fast in ((None, False), ((False, 32, 4), False), ((True, 0, 4), False), (None, True),
                                 ((False, 32, 4), True), ((True, 16, 4), True), ((True, 4096, 4), False)):
                hk = 2 * k if prologue == "geglu" else k
                h = torch.randn(m, hk + 5, dtype=dtype)[:, 3:3 + hk] * 3  # strided rows
                h[0, :3] = 40.0  # a row whose maximum is a producer value
                a = torch.randn(m, ka, dtype=dtype) * 2 if ka else None
                q, s = triton_quant_rows(h, a, prologue, config=config, out_dtype=torch.float32, fast=fast)
                q0, s0 = torch_scaled_rows(h.float(), a.float() if a is not None else None, prologue)
                rows.append({
                    "case": [prologue, ka, k, m, str(dtype), str(config), fast],
                    "shape_ok": list(q.shape) == [m, ka + k] and list(s.shape) == [m, 1],
                    "scale_rel": float(((s - s0).abs() / s0).max()),
                    "value_abs": float((q - q0).abs().max()),
                    "max_abs": float(q.abs().max()),
                })
    print(json.dumps(rows))
    """
)


def _interpreted(script: str) -> list[dict]:
    return interpreted(script, str(REPO))


@needs_triton
def test_triton_kernel_matches_twin_interpreted():
    rows = _interpreted(INTERPRETER_CHECK)
    assert len(rows) == 7 * 3 * 7
    for r in rows:
        assert r["shape_ok"], r
        assert r["scale_rel"] < 1e-6, r
        assert r["value_abs"] < 1e-3, r
        assert r["max_abs"] == pytest.approx(448.0), r  # each row's maximum maps onto e4m3's largest


LN_INTERPRETER_CHECK = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from nexfort_engine.rowwise_quant import triton_quant_rows_ln_mod, torch_scaled_ln_mod
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        # batch, tokens, width, modulation batch (1: one row for every sample)
        for b, n, d, mb in [(1, 5, 3072, 1), (2, 3, 300, 2), (2, 4, 48, 1), (1, 2, 5000, 1)]:
            x = torch.randn(b, n, d, dtype=dtype) * 2 + 0.5
            base = torch.randn(mb, 1, 3 * d, dtype=dtype)
            # add: a strided view, as ComfyUI's chunks; mult: 1 + scale made here or by the kernel
            scale, add = base[..., :d], base[..., d:2 * d]
            offset = 1.0 if b * n % 2 else 0.0
            mult = scale if offset else 1 + scale
            q, s = triton_quant_rows_ln_mod(x, mult, add, 1e-6, offset, out_dtype=torch.float32)
            q0, s0 = torch_scaled_ln_mod(x, mult, add, 1e-6, offset)
            rows.append({
                "case": [str(dtype), b, n, d, mb, offset],
                "shape_ok": list(q.shape) == [b * n, d] and list(s.shape) == [b * n, 1],
                "scale_rel": float(((s - s0).abs() / s0).max()),
                "value_abs": float((q - q0).abs().max()),
                "max_abs": float(q.abs().max()),
            })
    print(json.dumps(rows))
    """
)


@needs_triton
def test_ln_mod_kernel_matches_twin_interpreted():
    """float32: the twin's values to 1e-3 of 448; float16: a value on a rounding boundary of the
    norm can move one float16 step (the kernel's mean and variance sum in another order), at most
    0.25 of 448 at these magnitudes; bfloat16: the
    interpreter converts float32 to bfloat16 by truncation, not round-to-nearest-even as the GPU
    and torch do, so scales within 2 %, values within 6 of 448 (test_ln_mod_kernel_on_gpu checks
    bfloat16 properly)."""
    rows = _interpreted(LN_INTERPRETER_CHECK)
    assert len(rows) == 12 and {r["case"][-1] for r in rows} == {0.0, 1.0}
    for r in rows:
        bf16 = "bfloat16" in r["case"][0]
        assert r["shape_ok"], r
        assert r["scale_rel"] < (2e-2 if bf16 else 1e-6), r
        assert r["value_abs"] < (6.0 if bf16 else 0.25 if "float16" in r["case"][0] else 1e-3), r
        assert r["max_abs"] == pytest.approx(448.0), r


def test_launch_config():
    for width, a_width in [(16, 0), (300, 0), (2560, 0), (5120, 0), (12288, 0), (12288, 3072), (16384, 16384), (40000, 0)]:
        one_pass, block, warps = launch_config(width, a_width)
        assert warps in (4, 8, 16, 32)
        assert block & (block - 1) == 0
        if one_pass:
            chunks = -(-width // block)
            assert 1 <= chunks <= MAX_CHUNKS and block * chunks <= ONE_PASS_MAX
            assert block * (chunks - 1) < width  # no chunk of padding only
        else:
            assert width > ONE_PASS_MAX // 2 or a_width
    # rows of 3 x 4096 or 5 x 1024 elements compute no padding lanes
    assert chunk_width(12288) * 3 == 12288 and chunk_width(5120) * 5 == 5120 and chunk_width(2560) == 1024
    assert chunk_width(12288, 2048) == 2048 and chunk_width(12288, 16) == 2048 and chunk_width(16) == 16
    assert chunk_width(40000) == 8192  # at most MAX_CHUNKS chunks
    assert launch_config(12288) == (True, 4096, 8) and launch_config(2560) == (True, 1024, 4)


def test_twin_is_quantize_rowwise_of_the_producer():
    from nexfort_engine.fp8 import quantize_rowwise

    torch.manual_seed(0)
    h = torch.randn(5, 64, dtype=torch.bfloat16)
    a = torch.randn(5, 16, dtype=torch.bfloat16)
    value, gate = h.chunk(2, -1)
    for prologue, x in [
        ("gelu", F.gelu(h)),
        ("gelu_tanh", torch.cat([a, F.gelu(h, approximate="tanh")], -1)),
        ("geglu", value * F.gelu(gate)),
    ]:
        q0, s0 = quantize_rowwise(x)
        q, s = torch_quant_rows(h, a if prologue == "gelu_tanh" else None, prologue)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
        q, s = quant_rows(h, a if prologue == "gelu_tanh" else None, prologue)  # CPU: the twin
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


def test_bad_arguments_name_the_valid_values():
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="valid: none, gelu_tanh, gelu, geglu"):
        torch_quant_rows(h, None, "silu")
    with pytest.raises(ValueError, match="even number"):
        torch_quant_rows(torch.randn(3, 7), None, "geglu")
    with pytest.raises(ValueError, match="same number of rows"):
        torch_quant_rows(h, torch.randn(4, 8), "none")
    with pytest.raises(ValueError, match="2-D"):
        torch_quant_rows(torch.randn(2, 3, 8), None, "none")
    x, m = torch.randn(2, 5, 8), torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match=r"\[batch, tokens, features\]"):
        torch_quant_rows_ln_mod(x[0], m, m, 1e-6)
    with pytest.raises(ValueError, match=r"mult must be \[batch or 1, 1, 8\]"):
        torch_quant_rows_ln_mod(x, torch.randn(3, 1, 8), m, 1e-6)
    with pytest.raises(ValueError, match="they must match"):
        torch_quant_rows_ln_mod(x, m, m.double(), 1e-6)


# -- the graph rewrite (Dynamo graphs of ComfyUI's blocks, CPU)


def _rewritten(fn, args, kwargs, min_width=1):
    """Trace ``fn`` under the fp8 mode; rewrite each graph; run it with aot_eager. Returns
    (output, eager output, [matches per graph], [rewritten graph modules])."""

    def rewrite(gm):
        found = [(m.prologue, m.width, m.a is not None) for m in fuse_quant.find_matches(gm, min_width)]
        fuse_quant.rewrite_quantizations(gm, min_width)
        return found

    return rewritten(rewrite, fn, args, kwargs, mode=Fp8LinearMode)


def test_rewrite_flux_blocks(comfy_inproc, cache):
    mp = tiny_models.tiny_flux()
    dm = mp.model.diffusion_model
    spec = mp.model.nexfort_tiny
    gen = torch.Generator().manual_seed(0)
    x, t, ctx = torch.randn(1, 16, 8, 8, generator=gen), torch.rand(1, generator=gen), torch.randn(1, 7, 48, generator=gen)
    out, ref, found, graphs = _rewritten(dm, (x, t, ctx), {"transformer_options": {}, **spec.call_extra(1, 8, 8)})
    # the double block's image and text MLPs (GELU-tanh), the single block's cat(attention, GELU-tanh)
    assert sorted(found[0]) == [("gelu_tanh", 128, False), ("gelu_tanh", 128, False), ("gelu_tanh", 192, True)]
    targets = _targets(graphs[0])
    assert targets.count(QUANT_OP) == 3
    # the replaced chains are gone: no GELU left, and one amax per remaining in-graph quantization
    assert torch._C._nn.gelu not in targets
    assert targets.count("amax") == targets.count(torch.ops.nexfort.fp8_mm_cached.default) - 3
    assert torch.equal(out, ref)


def test_rewrite_geglu_feed_forwards(comfy_inproc, cache):
    mp = tiny_models.tiny_sd15()
    um = mp.model.diffusion_model
    gen = torch.Generator().manual_seed(0)
    x, t, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.rand(2, generator=gen) * 999, torch.randn(2, 7, 64, generator=gen)
    out, ref, found, graphs = _rewritten(um, (x, t, ctx), {"transformer_options": {}})
    # one GEGLU feed-forward per transformer block: 2 down, 1 middle, 4 up (widths 128 / 256)
    assert [p for p, _, _ in found[0]] == ["geglu"] * 7
    assert {w for _, w, _ in found[0]} == {128, 256}
    assert _targets(graphs[0]).count(QUANT_OP) == 7
    assert torch.equal(out, ref)


def test_rewrite_flux_block_inputs(comfy_inproc, cache):
    """Blocks compiled one by one (what regional compilation does): the LayerNorm + modulation of a
    block input feeding a quantized linear becomes ``quant_rows_ln_mod`` (single block: ``linear1``;
    double block: the image and text ``qkv``); the double block's second norms, of residual sums
    made in the graph, stay with Inductor."""
    mp = tiny_models.tiny_flux()
    dm = mp.model.diffusion_model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    d = 64
    vec = torch.randn(1, d, generator=gen).bfloat16()
    img, txt = torch.randn(1, 23, d, generator=gen).bfloat16(), torch.randn(1, 7, d, generator=gen).bfloat16()
    pe = torch.randn(1, 1, 30, 16, 2, 2, generator=gen)
    ln_op = torch.ops.nexfort.quant_rows_ln_mod.default

    out, ref, found, graphs = _rewritten(dm.single_blocks[0], (torch.cat([txt, img], 1).clone(), vec, pe), {})
    assert sorted(found[0]) == [("gelu_tanh", 192, True), ("ln_mod", 64, False)]
    targets = _targets(graphs[0])
    assert targets.count(ln_op) == 1 and torch.addcmul not in targets and F.layer_norm not in targets
    # ComfyUI's ``1 + scale`` is the op's offset: no separate addition left
    (call,) = [n for n in graphs[0].graph.nodes if n.target is ln_op]
    assert call.args[-1] == 1.0 and "add" not in targets
    assert torch.equal(out, ref)

    out, ref, found, graphs = _rewritten(dm.double_blocks[0], (img.clone(), txt.clone(), vec, pe), {})
    assert sorted(found[0]) == [("gelu_tanh", 128, False)] * 2 + [("ln_mod", 64, False)] * 2
    targets = _targets(graphs[0])
    assert targets.count(ln_op) == 2 and targets.count(F.layer_norm) == 2  # the norms of the residual sums
    assert all(torch.equal(o, r) for o, r in zip(out, ref, strict=True))


def test_regional_fp8_flux_takes_block_inputs(comfy_inproc, cache, fresh_stats, monkeypatch):
    """What O3 runs on Flux: regional blocks get copies of their inputs (``x.clone()`` in the graph);
    the LayerNorm + modulation of those copies is taken (the op reads the input), and the output is
    the same as without the form."""
    from nexfort_engine.passes import fuse_quant as fq

    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    mp = tiny_models.tiny_flux(depth=4, depth_single=4)
    dm = mp.model.diffusion_model.to(torch.bfloat16)
    outs = []
    for take in (True, False):
        monkeypatch.setattr(fq, "take_ln_mod", take)
        monkeypatch.setattr(fq, "DEFAULT_MIN_WIDTH", 64)
        torch._dynamo.reset()
        cm = nexfort_engine.compile(dm, {"backend": "aot_eager", "mode": "O1", "fp8": True, "fused_quant": True},
                                    label=f"ln-mod-regional-{take}")
        with torch.no_grad():
            outs.append(tiny_models.call_diffusion(mp, 64, 64, ctx_len=7, diffusion_model=cm, dtype=torch.bfloat16))
        rec = fresh_stats()["models"][cm.label]
        # double blocks: image + text qkv inputs and MLPs; single blocks: linear1 input and linear2's cat
        assert rec["fp8_quant_fused"] == (6 if take else 3) and rec["fallbacks"] == 0, rec
    assert torch.equal(outs[0], outs[1])
    torch._dynamo.reset()


def test_ln_mod_form_refuses_inputs_written_in_place_before_the_linear():
    """The op reads the block input (behind its copy) where the linear runs: an in-place write to
    the input or its copy before that point would change what it reads, so the form is refused."""

    def f(x, y):
        c = x.clone()
        c.mul_(2)  # symbolic tracing keeps ``c`` bound to the clone: the write is a separate node
        return F.layer_norm(c, (4,)) + y

    gm = torch.fx.symbolic_trace(f)
    nodes = {n.name: n for n in gm.graph.nodes}
    clone, x, out = nodes["clone"], nodes["x"], nodes["add"]
    assert fuse_quant._mutated_before([clone, x], out)
    assert not fuse_quant._mutated_before([x], out)  # only the copy is written
    assert not fuse_quant._mutated_before([clone, x], nodes["mul_"])  # the write is at the end, not before it


class _Producers(torch.nn.Module):
    """Quantized linears behind producers the rewrite must leave alone, and one it takes."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(dim if i < 4 else 2 * dim, dim) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc[0](F.layer_norm(x, x.shape[-1:]))  # LayerNorm: Inductor's fused kernel stays
        y = self.fc[1](F.silu(y))  # not a GELU
        y = self.fc[2](torch.cat([y[:, :3], F.gelu(y[:, 3:])], dim=1))  # concatenated across tokens
        gelu = F.gelu(y)
        y = self.fc[3](gelu) + gelu.sum()  # taken: the GELU has another user, which keeps it
        return self.fc[4](torch.cat([y, F.gelu(y, approximate="tanh")], dim=-1))  # taken (a = y)


def test_rewrite_leaves_other_producers(cache):
    torch.manual_seed(0)
    model = _Producers()
    x = torch.randn(2, 9, 32)
    out, ref, found, graphs = _rewritten(model, (x,), {})
    assert sorted(found[0]) == [("gelu", 32, False), ("gelu_tanh", 64, True)]
    targets = _targets(graphs[0])
    assert targets.count(QUANT_OP) == 2 and targets.count(torch._C._nn.gelu) == 2  # cat-across-tokens + kept
    assert torch.equal(out, ref)
    # rows narrower than the threshold keep Inductor's quantization
    _, _, found, _ = _rewritten(model, (x,), {}, min_width=fuse_quant.DEFAULT_MIN_WIDTH)
    assert found == [[]]


# -- options, settings, the compiled path


def test_option_parsing():
    assert parse_options({}).fused_quant is None
    assert parse_options({"fused_quant": False}).fused_quant is False
    with pytest.raises(OptionsError, match="fused_quant"):
        parse_options({"fused_quant": "yes"})


def test_resolve_fused_quant():
    o3 = parse_options({"mode": "O3"})
    assert S.resolve(o3, cuda=True, fp8_capable=True).fused_quant is triton_available()
    assert not S.resolve(o3, cuda=True, fp8_capable=True, fp8_pays=False).fused_quant  # no fp8: nothing to fuse
    assert not S.resolve(parse_options({"mode": "O3", "fused_quant": False}), cuda=True, fp8_capable=True).fused_quant
    assert not S.resolve(parse_options({"fp8": True}), cuda=False).fused_quant  # CPU: only when asked
    forced = S.resolve(parse_options({"fp8": True, "fused_quant": True}), cuda=False)
    assert forced.fused_quant
    plain = S.resolve(parse_options({"fp8": True}), cuda=False)
    assert forced.digest(parse_options({"fp8": True})) != plain.digest(parse_options({"fp8": True}))


class GeluMLP(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


@pytest.mark.inductor
@torch.no_grad()
def test_inductor_compiles_the_fused_op(fresh_stats, nx_cache, cache, monkeypatch):
    """A real Inductor compile (CPU) of a graph holding ``nexfort::quant_rows``: the op survives
    Inductor's pre-grad passes (max-optimize's pattern matcher reads every node's example value),
    dynamic token counts reuse the graph, and the counter reaches the Cache Manager's report."""
    monkeypatch.setattr(fuse_quant, "DEFAULT_MIN_WIDTH", 1)
    torch.manual_seed(0)
    model = GeluMLP().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fp8": True, "fused_quant": True, "mode": "max-optimize:cache-all"},
                                cache_dir=nx_cache, label="fused-quant")
    dynamo_counters["graph_break"].clear()
    for tokens in (7, 13):
        x = torch.randn(2, tokens, 32, dtype=torch.bfloat16)
        with Fp8LinearMode(reference=True):
            ref = model(x)
        assert tiny_models.rel_l2(cm(x), ref) < 3e-2  # see test_fp8.py's COMPILED_TOL
    assert not dynamo_counters["graph_break"]
    rec = fresh_stats()["models"][cm.label]
    assert rec["fallbacks"] == 0 and rec["compiles"] == 1 and rec["recompiles"] == 0
    assert rec["fp8_quant_fused"] == 1


# -- the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not (fp8_supported("cuda") and triton_available()), reason="needs an fp8 GPU (sm89+) and Triton")
@pytest.mark.parametrize("prologue, ka, k, m", [("gelu_tanh", 0, 12288, 33), ("gelu_tanh", 3072, 12288, 17),
                                                ("geglu", 0, 2560, 65), ("gelu", 0, 40000, 5), ("none", 48, 80, 3)])
def test_kernel_matches_twin_on_gpu(prologue, ka, k, m):
    from nexfort_engine.rowwise_quant import triton_quant_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    hk = 2 * k if prologue == "geglu" else k
    h = torch.randn(m, hk, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    a = torch.randn(m, ka, device="cuda", dtype=torch.bfloat16, generator=gen) if ka else None
    # the exact GELU (the op's hw-tanh form is bounded by test_hw_tanh_form_on_gpu)
    q, s = triton_quant_rows(h, a, prologue, fast=True)
    # against the float32 twin (the kernel keeps the producer in float32): same scales, and the
    # same e4m3 bytes but for values on a rounding boundary
    q0, s0 = torch_scaled_rows(h.float(), a.float() if a is not None else None, prologue)
    assert float(((s - s0).abs() / s0).max()) < 1e-5
    differ = (q.view(torch.uint8) != q0.to(torch.float8_e4m3fn).view(torch.uint8)).float().mean().item()
    assert differ < 1e-3
    # against eager (the producer rounded to bf16 first, so its scale differs by up to 2^-9): one
    # e4m3 step at the larger magnitude at most (3 mantissa bits; 2^-9 among subnormals)
    q1, s1 = torch_quant_rows(h, a, prologue)
    mine = q.float() * s / s1
    step = (torch.maximum(mine.abs(), q1.float().abs()) * 2**-3).clamp_min(2**-9)
    assert bool(((mine - q1.float()).abs() <= step + mine.abs() * 2**-7).all())



@pytest.mark.gpu
@pytest.mark.skipif(not (fp8_supported("cuda") and triton_available()), reason="needs an fp8 GPU (sm89+) and Triton")
@pytest.mark.parametrize("ka, k, m", [(0, 12288, 33), (3072, 12288, 17), (0, 300, 9)])
def test_hw_tanh_form_on_gpu(ka, k, m):
    """The ``hw-tanh`` form (the GPU's ``tanh.approx.f32``, relative error about 2^-11): each
    dequantized value within one e4m3 step of the exact float32 producer's, plus what the tanh's
    error can move the GELU (0.5 |x| 2^-10); the scales within 2^-11."""
    from nexfort_engine.rowwise_quant import triton_quant_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    a = torch.randn(m, ka, device="cuda", dtype=torch.bfloat16, generator=gen) if ka else None
    q, s = triton_quant_rows(h, a, "gelu_tanh", fast=True, hw_tanh=True)
    ref, s0 = torch_scaled_rows(h.float(), a.float() if a is not None else None, "gelu_tanh")
    assert float(((s - s0).abs() / s0).max()) < 2**-11
    mine, exact = q.float() * s, ref * s0
    step = torch.maximum(exact.abs() * 2**-3, s0 * 2**-9)
    slack = torch.cat([torch.zeros(m, ka, device="cuda"), 0.5 * h.float().abs() * 2**-10], dim=1)
    assert bool(((mine - exact).abs() <= step + slack).all())
    differ = (q.view(torch.uint8) != ref.to(torch.float8_e4m3fn).view(torch.uint8)).float().mean().item()
    print(f"hw-tanh: {differ:.4%} of the e4m3 bytes differ from the exact producer's")
    assert differ < 5e-3  # measured on an H200: 0.11-0.19 % (run84)
    # the op runs this form on the GPU
    q2, s2 = quant_rows(h, a, "gelu_tanh")
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    with pytest.raises(ValueError, match="CUDA"):
        triton_quant_rows(h.cpu(), None, "gelu_tanh", hw_tanh=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (fp8_supported("cuda") and triton_available()), reason="needs an fp8 GPU (sm89+) and Triton")
@pytest.mark.parametrize("b, n, d, mb", [(1, 4608, 3072, 1), (2, 77, 3072, 2), (1, 9, 1152, 1)])
def test_ln_mod_kernel_on_gpu(b, n, d, mb):
    """bfloat16 at Flux's sizes: the twin's scales within 2^-8 and, but for values whose norm sits
    on a bfloat16 rounding boundary (the kernel sums the mean and variance in another order), its
    e4m3 bytes; every value within one e4m3 step plus what one bfloat16 step of the norm and of the
    sum moves it."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 + 0.5
    base = torch.randn(mb, 1, 3 * d, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale, add = base[..., :d], base[..., d:2 * d]
    mult = 1 + scale
    q, s = torch.ops.nexfort.quant_rows_ln_mod(x, scale, add, 1e-6, 1.0)
    ref, s0 = torch_scaled_ln_mod(x, mult, add, 1e-6)
    assert float(((s - s0).abs() / s0).max()) < 2**-8
    differ = (q.view(torch.uint8) != ref.to(torch.float8_e4m3fn).view(torch.uint8)).float().mean().item()
    print(f"ln_mod: {differ:.4%} of the e4m3 bytes differ from the twin's")
    assert differ < 1e-2
    mine, exact = q.float() * s, ref * s0
    # a norm value on a bfloat16 rounding boundary moves one step of it times the modulation,
    # the sum then one step of its own
    norm = torch.nn.functional.layer_norm(x, (d,), eps=1e-6)
    moved = ((norm * mult).abs() * 2**-8).reshape(-1, d).float() + exact.abs() * 2**-8
    step = torch.maximum(exact.abs() * 2**-3, s0 * 2**-9) + moved
    assert bool(((mine - exact).abs() <= step).all())
