"""Query/key RMSNorm + rotary embedding fused (``nexfort_engine.rope``,
``nexfort_engine.passes.fuse_rope``).

* The Triton kernel against its torch twin, run by Triton's interpreter in a subprocess
  (``TRITON_INTERPRET=1`` must be set before Triton builds the kernel): odd sequence lengths, one
  and two parts (Flux's double blocks concatenate text and image), row blocks that cut through a
  position's heads, strided inputs (views of a fused QKV output), rotation matrices shared by the
  batch or per batch entry and not contiguous; float16 and bfloat16. Tolerances: float16 equal
  but for values on a rounding boundary (one step); bfloat16 within two steps, because the
  interpreter converts float32 to bfloat16 by truncation, not round-to-nearest-even as the GPU
  and torch do (the GPU test checks bfloat16 properly).
* The twin against ComfyUI's own ``QKNorm`` + ``flux.math.apply_rope`` (equal on CPU).
* The graph rewrite on Dynamo graphs of ComfyUI's own Flux blocks (tiny, CPU): two rotations per
  block found and replaced, the old ops gone, the output unchanged; the older ``mul + mul + add``
  form; what must not be rewritten.
* The option, the settings, the counter, and one real Inductor compile with the op in the graph.
* On a GPU (marked ``gpu``): bfloat16 at Flux's sizes against the twin.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
import tiny_models
import torch
from pass_helpers import interpreted, rewritten
from pass_helpers import targets as _targets
from torch._dynamo.utils import counters as dynamo_counters

import nexfort_engine
from nexfort_engine import OptionsError, parse_options
from nexfort_engine import settings as S
from nexfort_engine.passes import fuse_rope
from nexfort_engine.rope import rms_norm_rope, torch_apply_rope, torch_rms_norm_rope, triton_available

REPO = Path(__file__).resolve().parents[2]
ROPE_OP = torch.ops.nexfort.rms_norm_rope.default
needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
rotations = tiny_models.rotations


# -- the kernel (Triton's interpreter, CPU)

INTERPRETER_CHECK = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from tiny_models import rotations
    from nexfort_engine.rope import triton_rms_norm_rope, torch_rms_norm_rope
    torch.manual_seed(0)
    cases = [  # batch, heads, head size, part lengths, freqs batch
        (1, 3, 16, [5], 1), (2, 3, 16, [3, 7], 1), (2, 5, 8, [9], 2), (1, 2, 32, [1, 4], 1), (2, 4, 16, [6, 0], 2),
    ]
    rows = []
    for b, h, d, lens, fb in cases:
        for dtype in (torch.float16, torch.bfloat16):
            for config in (None, (4, 1), (1, 2), (64, 4)):
                qkvs = [torch.randn(b, n, 3, h, d, dtype=dtype) * 2 for n in lens]
                xs = [t.permute(2, 0, 3, 1, 4)[1] for t in qkvs]  # the keys: a strided view
                ws = [(torch.randn(d) * 0.5 + 1).to(dtype) for _ in lens]
                freqs = rotations(fb, sum(lens), d).transpose(0, 1).contiguous().transpose(0, 1)
                out = triton_rms_norm_rope(xs, ws, freqs, 1e-6, config=config)
                ref = torch_rms_norm_rope(xs, ws, freqs, 1e-6)
                err = (out.float() - ref.float()).abs()
                # one rounding step of the dtype (the interpreter truncates to bfloat16: two)
                # relative to the row's largest value too: the rotation mixes two rounded values
                ulp = 2 ** -10 if dtype == torch.float16 else 2 ** -7
                row_max = ref.float().abs().amax(dim=-1, keepdim=True) if ref.numel() else ref.float()
                step = (ref.float().abs() + row_max) * ulp + 1e-3 * ulp
                rows.append({
                    "case": [b, h, d, lens, fb, str(dtype), str(config)],
                    # [B, H, L, D] views of [B, L, H, D] memory, the kernel's and the twin's alike
                    "shape_ok": list(out.shape) == list(ref.shape) and out.stride() == ref.stride()
                    and out.permute(0, 2, 1, 3).is_contiguous() and out.dtype == dtype,
                    "within_step": bool((err <= 2 * step).all()),
                    "differ": float((err > 0).float().mean()) if err.numel() else 0.0,
                })
    print(json.dumps(rows))
    """
)


@needs_triton
def test_triton_kernel_matches_twin_interpreted():
    rows = interpreted(INTERPRETER_CHECK, str(REPO), str(REPO / "tests"))
    assert len(rows) == 5 * 2 * 4
    for r in rows:
        assert r["shape_ok"], r
        assert r["within_step"], r
        if r["case"][5] == "torch.float16":
            assert r["differ"] < 0.02, r  # rounding-boundary values only


def test_twin_is_comfyui_qknorm_and_rope(comfy_inproc):
    from comfy.ldm.flux.layers import QKNorm
    from comfy.ldm.flux.math import apply_rope

    torch.manual_seed(0)
    b, h, d = 2, 3, 16
    import inspect

    import comfy.ops

    # newer ComfyUI builds the norms from its ops (and rotates through comfy-kitchen's op)
    ops = {"operations": comfy.ops.disable_weight_init} if "operations" in inspect.signature(QKNorm).parameters else {}
    norm = QKNorm(d, dtype=torch.bfloat16, **ops)
    for p in norm.parameters():
        p.data.copy_(torch.randn(d) * 0.3 + 1)
    txt = torch.randn(b, 5, 3, h, d, dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
    img = torch.randn(b, 7, 3, h, d, dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
    freqs = rotations(1, 12, d)
    tq, tk = norm(txt[0], txt[1], txt[2])
    iq, ik = norm(img[0], img[1], img[2])
    q, k = apply_rope(torch.cat([tq, iq], 2), torch.cat([tk, ik], 2), freqs)
    w_q, w_k = (n.scale if hasattr(n, "scale") else n.weight for n in (norm.query_norm, norm.key_norm))
    assert torch.equal(torch_rms_norm_rope([txt[0], img[0]], [w_q, w_q], freqs, 1e-6), q)
    assert torch.equal(torch_rms_norm_rope([txt[1], img[1]], [w_k, w_k], freqs, 1e-6), k)
    assert torch.equal(rms_norm_rope([txt[1], img[1]], [w_k, w_k], freqs, 1e-6), k)  # CPU: the twin
    assert torch.equal(torch_apply_rope(tq, freqs[:, :, :5]), apply_rope(tq, tq, freqs[:, :, :5])[0])


def test_bad_arguments_name_the_valid_values():
    x = torch.randn(1, 2, 4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="one weight per part"):
        torch_rms_norm_rope([x, x], [w], rotations(1, 8, 8), 1e-6)
    with pytest.raises(ValueError, match=r"must be \[D\] = \[8\]"):
        torch_rms_norm_rope([x], [torch.ones(4)], rotations(1, 4, 8), 1e-6)
    with pytest.raises(ValueError, match="same B, H, D"):
        torch_rms_norm_rope([x, torch.randn(1, 3, 4, 8)], [w, w], rotations(1, 8, 8), 1e-6)
    with pytest.raises(ValueError, match=r"freqs must be float32 \[1 or B, 1, L, D/2, 2, 2\]"):
        torch_rms_norm_rope([x], [w], rotations(1, 5, 8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        torch_rms_norm_rope([torch.randn(1, 2, 4, 7)], [torch.ones(7)], rotations(1, 4, 8), 1e-6)


# -- the graph rewrite (Dynamo graphs of ComfyUI's blocks, CPU)


def _count_then_rewrite(gm):
    found = len(fuse_rope.find_matches(gm))
    fuse_rope.rewrite_ropes(gm)
    return found


def _rewritten(fn, args, kwargs):
    """(output, eager output, [match count per graph], [rewritten graph modules])."""
    return rewritten(_count_then_rewrite, fn, args, kwargs, dynamic=True)


def test_rewrite_flux_blocks(comfy_inproc, cache):
    mp = tiny_models.tiny_flux(depth=2, depth_single=2)
    dm = mp.model.diffusion_model.to(torch.bfloat16)
    spec = mp.model.nexfort_tiny
    gen = torch.Generator().manual_seed(0)
    x, t, ctx = torch.randn(1, 16, 8, 12, generator=gen), torch.rand(1, generator=gen), torch.randn(1, 7, 48, generator=gen)
    extra = {k: v.to(torch.bfloat16) for k, v in spec.call_extra(1, 8, 12).items()}
    out, ref, found, graphs = _rewritten(dm, (x.bfloat16(), t, ctx.bfloat16()), {"transformer_options": {}, **extra})
    # queries and keys of 2 double and 2 single blocks (Dynamo may restart its analysis once, from
    # inside the backend, to turn float inputs into tensors: then the backend sees the graph twice)
    assert found and set(found) == {8}
    targets = _targets(graphs[-1])
    assert targets.count(ROPE_OP) == 8
    assert torch.rms_norm not in targets and "addcmul_" not in targets and "type_as" not in targets
    assert torch.equal(out, ref)  # CPU: the op runs the twin, eager's arithmetic


class _Rotations(torch.nn.Module):
    """The rotation in ComfyUI's older form, and variants the rewrite must leave alone."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d) * 0.2 + 1)

    @staticmethod
    def rotate(y, pe):  # ComfyUI before 0.3.x's apply_rope1: mul + mul + add
        y_ = y.float().reshape(*y.shape[:-1], -1, 1, 2)
        return (pe[..., 0] * y_[..., 0] + pe[..., 1] * y_[..., 1]).reshape(*y.shape).type_as(y)

    def forward(self, qkv, pe, pe_heads, x_full):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = self.rotate(torch.rms_norm(q, (q.shape[-1],), self.w, 1e-6), pe)  # taken
        kn = torch.rms_norm(k, (k.shape[-1],), self.w, 1e-6)
        b = self.rotate(kn, pe) + kn  # taken: the norm has another user, which keeps it
        c = self.rotate(torch.rms_norm(v, (v.shape[-1],), self.w, 1e-6), pe_heads)  # per-head pe: left
        full = torch.rms_norm(x_full, (x_full.shape[-1],), None, 1e-6)  # over the whole width (Wan): left
        d = self.rotate(full.reshape(q.shape), pe)
        e = self.rotate(q, pe)  # no norm: left
        return a + b + c + d + e


def test_rewrite_older_form_and_leaves_others(cache):
    torch.manual_seed(0)
    model = _Rotations().to(torch.bfloat16)
    qkv = torch.randn(2, 6, 3, 2, 16, dtype=torch.bfloat16)
    pe, pe_heads = rotations(1, 6, 16), rotations(1, 6, 16).expand(1, 2, 6, 8, 2, 2).contiguous()
    out, ref, found, graphs = _rewritten(model, (qkv, pe, pe_heads, torch.randn(2, 2, 6, 16, dtype=torch.bfloat16)), {})
    assert found and set(found) == {2}
    targets = _targets(graphs[-1])
    assert targets.count(ROPE_OP) == 2 and targets.count(torch.rms_norm) == 3  # kept: kn, v's, the full one
    # the op rotates with addcmul (0.3.75's form), this model with mul + add: float32 rounding
    # apart, then rounded to bfloat16
    assert tiny_models.rel_l2(out, ref) < 1e-3
    # float32 models keep their ops (the op would run its eager twin where Inductor compiles them)
    _, _, found32, _ = _rewritten(_Rotations(), (qkv.float(), pe, pe_heads, torch.randn(2, 2, 6, 16)), {})
    assert set(found32) == {0}


def _kitchen_ropes() -> tuple:
    """comfy-kitchen's rotation ops (newer ComfyUI's Flux calls them); where the package is not
    installed (CI's ComfyUI 0.3.75), stand-ins under the same names with its eager backend's
    arithmetic, which is 0.3.75's ``apply_rope1``."""
    try:
        import comfy_kitchen  # noqa: F401 - registers its ops
    except ImportError:
        pass
    try:
        return torch.ops.comfy_kitchen.apply_rope, torch.ops.comfy_kitchen.apply_rope1
    except (AttributeError, RuntimeError):
        pass

    def rope1(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
        out = freqs_cis[..., 0] * x_[..., 0]
        out.addcmul_(freqs_cis[..., 1], x_[..., 1])
        return out.reshape(*x.shape).type_as(x)

    @torch.library.custom_op("comfy_kitchen::apply_rope1", mutates_args=())
    def apply_rope1(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        return rope1(x, freqs_cis)

    @torch.library.custom_op("comfy_kitchen::apply_rope", mutates_args=())
    def apply_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope1(xq, freqs_cis), rope1(xk, freqs_cis)

    apply_rope1.register_fake(lambda x, f: torch.empty_like(x))
    apply_rope.register_fake(lambda q, k, f: (torch.empty_like(q), torch.empty_like(k)))
    return torch.ops.comfy_kitchen.apply_rope, torch.ops.comfy_kitchen.apply_rope1


class _KitchenRotations(torch.nn.Module):
    """Newer ComfyUI's Flux attention: ``torch.nn.RMSNorm`` (``eps=None``) per head, ``.to(v)``,
    text and image streams concatenated, then comfy-kitchen's op on queries and keys; and its
    one-tensor op on a norm, and on a tensor without one (left)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.qn, self.kn = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        for n in (self.qn, self.kn):
            torch.nn.init.normal_(n.weight, 1.0, 0.2)
        self.ropes = _kitchen_ropes()

    def forward(self, txt, img, pe):
        apply_rope, apply_rope1 = self.ropes
        tq, tk, tv = txt.permute(2, 0, 3, 1, 4)
        iq, ik, iv = img.permute(2, 0, 3, 1, 4)
        q = torch.cat([self.qn(tq).to(tv), self.qn(iq).to(iv)], dim=2)
        k = torch.cat([self.kn(tk).to(tv), self.kn(ik).to(iv)], dim=2)
        q, k = apply_rope(q, k, pe)
        v = torch.cat([tv, iv], dim=2)
        return q + k + apply_rope1(self.qn(v), pe) + apply_rope1(v, pe)


def test_rewrite_kitchen_form(cache):
    """comfy-kitchen's ``apply_rope(q, k, pe)`` after per-head norms with ``eps=None`` (newer
    ComfyUI; the real op where comfy-kitchen is installed, a stand-in elsewhere): queries, keys and
    the one-tensor call on a norm become the fused op, the call without a norm stays, and on CPU
    the op's twin gives eager's bits (torch's ``eps=None`` is float32's epsilon)."""
    torch.manual_seed(0)
    model = _KitchenRotations().to(torch.bfloat16)
    txt, img = torch.randn(2, 5, 3, 2, 16, dtype=torch.bfloat16), torch.randn(2, 7, 3, 2, 16, dtype=torch.bfloat16)
    out, ref, found, graphs = _rewritten(model, (txt, img, rotations(1, 12, 16)), {})
    assert found and set(found) == {3}
    targets = _targets(graphs[-1])
    assert targets.count(ROPE_OP) == 3 and torch.rms_norm not in targets
    assert sum("apply_rope1" in str(t) for t in targets) == 1  # the call without a norm
    assert torch.equal(out, ref)


def test_regional_fp8_flux_blocks_are_rewritten(comfy_inproc, cache, fresh_stats, monkeypatch):
    """What O3 runs on Flux: regional compilation with fp8 linears, whose TorchFunctionMode makes
    Dynamo record ``a * b`` as the method ``mul`` (the first GPU run matched nothing there)."""
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    mp = tiny_models.tiny_flux(depth=4, depth_single=4)
    dm = mp.model.diffusion_model.to(torch.bfloat16)  # the op takes 16-bit models
    cm = nexfort_engine.compile(dm, {"backend": "aot_eager", "mode": "O1", "fp8": True, "fused_rope": True},
                                label="rope-regional-fp8")
    with torch.no_grad():
        tiny_models.call_diffusion(mp, 64, 64, ctx_len=7, diffusion_model=cm, dtype=torch.bfloat16)
    rec = fresh_stats()["models"][cm.label]
    assert rec["regions"] == ["double_blocks[DoubleStreamBlockx4]", "single_blocks[SingleStreamBlockx4]"]
    assert rec["rope_fused"] == 4 and rec["fallbacks"] == 0  # queries and keys of each block class
    torch._dynamo.reset()


def test_sweep_with_the_fused_op_never_recompiles(comfy_inproc, cache, fresh_stats, monkeypatch):
    """The op's fake checks relate symbolic sizes (the rotation table's length to the parts'):
    resolutions and prompt lengths must still share one graph per block class (issue 6's sweep)."""
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    mp = tiny_models.tiny_flux(depth=4, depth_single=4)
    dm = mp.model.diffusion_model.to(torch.bfloat16)
    dm.dtype = torch.bfloat16  # ComfyUI casts the sampler's inputs to this
    cm = nexfort_engine.compile(dm, {"backend": "aot_eager", "mode": "O1", "fused_rope": True}, label="rope-sweep")
    compiled = tiny_models.with_diffusion_model(mp, cm)
    with torch.no_grad():
        for (h, w), ctx in itertools.product(tiny_models.RESOLUTIONS["flux"], (77, 154)):
            assert torch.isfinite(tiny_models.sample(compiled, h, w, 1, 2, 1.0, ctx)).all()
    rec = fresh_stats()["models"][cm.label]
    assert rec["recompiles"] == 0, rec["recompile_reasons"]
    assert rec["rope_fused"] == 4 and rec["compiles"] == 2 and rec["recompiles"] == 0, rec["recompile_reasons"]
    torch._dynamo.reset()


# -- options, settings, the compiled path


def test_option_parsing():
    assert parse_options({}).fused_rope is None
    assert parse_options({"fused_rope": False}).fused_rope is False
    with pytest.raises(OptionsError, match="fused_rope"):
        parse_options({"fused_rope": "yes"})


def test_resolve_fused_rope():
    o2 = parse_options({"mode": "O2"})
    assert S.resolve(o2, cuda=True).fused_rope is triton_available()
    assert S.resolve(parse_options({"mode": "O3"}), cuda=True, fp8_capable=True).fused_rope is triton_available()
    assert not S.resolve(o2, cuda=False).fused_rope  # CPU: only when asked
    assert not S.resolve(parse_options({"fused_rope": False}), cuda=True).fused_rope
    assert not S.resolve(parse_options({"backend": "aot_eager"}), cuda=True).fused_rope
    forced = S.resolve(parse_options({"fused_rope": True}), cuda=False)
    assert forced.fused_rope
    plain = S.resolve(parse_options({}), cuda=False)
    assert forced.digest(parse_options({})) != plain.digest(parse_options({}))


class _QKRope(torch.nn.Module):
    """Flux's attention input path on a fused QKV projection."""

    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.q_scale = torch.nn.Parameter(torch.randn(dim // heads) * 0.2 + 1)
        self.k_scale = torch.nn.Parameter(torch.randn(dim // heads) * 0.2 + 1)

    def forward(self, x, pe):
        qkv = self.qkv(x)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q = torch.rms_norm(q, (q.shape[-1],), self.q_scale, 1e-6)
        k = torch.rms_norm(k, (k.shape[-1],), self.k_scale, 1e-6)
        q, k = torch_apply_rope(q, pe), torch_apply_rope(k, pe)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.inductor
@torch.no_grad()
def test_inductor_compiles_the_fused_op(fresh_stats, nx_cache, cache):
    """A real Inductor compile (CPU) of a graph holding ``nexfort::rms_norm_rope``: the op survives
    Inductor's passes, dynamic token counts reuse the graph, and the counter reaches the Cache
    Manager's report."""
    torch.manual_seed(0)
    model = _QKRope().to(torch.bfloat16)
    cm = nexfort_engine.compile(model, {"fused_rope": True, "mode": "max-optimize:cache-all"},
                                cache_dir=nx_cache, label="fused-rope")
    dynamo_counters["graph_break"].clear()
    for tokens in (7, 13):
        x = torch.randn(2, tokens, 32, dtype=torch.bfloat16)
        pe = rotations(1, tokens, 16)
        assert tiny_models.rel_l2(cm(x, pe), model(x, pe)) < 2e-2  # bf16 roundings of two paths
    assert not dynamo_counters["graph_break"]
    rec = fresh_stats()["models"][cm.label]
    assert rec["fallbacks"] == 0 and rec["compiles"] == 1 and rec["recompiles"] == 0
    assert rec["rope_fused"] == 2


# -- the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("lens, fb", [([4608], 1), ([512, 4096], 1), ([77, 1000], 2)])
def test_kernel_matches_twin_on_gpu(lens, fb):
    from nexfort_engine.rope import triton_rms_norm_rope

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, d = 2, 24, 128
    qkvs = [torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for n in lens]
    xs = [t.permute(2, 0, 3, 1, 4)[0] for t in qkvs]
    ws = [torch.rand(d, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5 for _ in lens]
    freqs = rotations(fb, sum(lens), d).cuda()
    out = triton_rms_norm_rope(xs, ws, freqs, 1e-6)
    ref = torch_rms_norm_rope(xs, ws, freqs, 1e-6)
    # eager rounds the norm to bfloat16 before the weight (torch's CUDA rms_norm may not): values
    # may differ by a step of bfloat16 at the norm's magnitude, carried through the rotation
    err = (out.float() - ref.float()).abs()
    assert float(err.max()) <= 2 ** -7 * float(ref.float().abs().max()) + 1e-3
    assert float((err > 0).float().mean()) < 0.2
    assert tiny_models.rel_l2(out, ref) < 4e-3
