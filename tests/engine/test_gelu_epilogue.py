"""A linear followed by tanh-GELU as one GEMM with a GELU epilogue (``passes/gelu_epilogue.py``).

On CPU: the pass rewrites the DiT MLP's ``gelu(linear(x, w, b), approximate="tanh")`` and nothing
else (exact GELU, no bias, a linear read twice), the rewritten graph gives eager's output (the op
is its twin there), under dynamic shape too; the option, the settings, their cache digest, the
counter, a compile through the engine, and AOTAutograd's cache accepting the graph. On a GPU
(``gpu``): the cuBLASLt epilogue against the twin and against float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import rewritten, targets

import nexfort_engine
from nexfort_engine import OptionsError, parse_options
from nexfort_engine import settings as S
from nexfort_engine.passes import gelu_epilogue
from nexfort_engine.passes.gelu_epilogue import linear_gelu, linear_gelu_reference, rewrite_gelu_epilogues

OP = torch.ops.nexfort.linear_gelu.default


class Mlp(torch.nn.Module):
    """PixArt-α / MMDiT's MLP as ComfyUI builds it: fc1, tanh-GELU, dropout 0, fc2."""

    def __init__(self, dim: int = 16, hidden: int = 64, approximate: str = "tanh", bias: bool = True):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden, bias=bias)
        self.act = torch.nn.GELU(approximate=approximate)
        self.drop = torch.nn.Dropout(0.0)
        self.fc2 = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


#: the pass matches 16-bit graphs only (the epilogue's dtypes); CPU runs bfloat16 linears
DT = torch.bfloat16


def _x(n: int = 12) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, n, 16, dtype=DT)


def _mlp(**kw) -> Mlp:
    return Mlp(**kw).to(DT).eval()


@torch.no_grad()
def test_the_mlp_is_rewritten_and_matches_eager():
    torch.manual_seed(1)
    mlp = _mlp()
    out, ref, found, graphs = rewritten(rewrite_gelu_epilogues, mlp, (_x(),), {})
    assert found == [1]
    t = targets(graphs[0])
    assert OP in t and torch._C._nn.gelu not in t
    assert sum(1 for f in t if f in (torch._C._nn.linear, F.linear)) == 1  # fc2 stays
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: _mlp(approximate="none"),  # cuBLASLt's GELU is the tanh form: exact GELU is left alone
    lambda: _mlp(bias=False),  # the op takes a bias
    lambda: Mlp().eval(),  # float32: no epilogue to gain, Inductor keeps its kernels
])
@torch.no_grad()
def test_other_forms_are_left_alone(make):
    torch.manual_seed(1)
    model = make()
    x = _x().to(next(model.parameters()).dtype)
    out, ref, found, graphs = rewritten(rewrite_gelu_epilogues, model, (x,), {})
    assert found == [0] and OP not in targets(graphs[0])
    assert torch.allclose(out, ref, atol=1e-6)


@torch.no_grad()
def test_a_linear_read_twice_is_left_alone():
    lin = torch.nn.Linear(16, 32).to(DT)

    def fn(x):
        h = lin(x)
        return F.gelu(h, approximate="tanh") + h.sum()

    out, ref, found, _ = rewritten(rewrite_gelu_epilogues, fn, (_x(),), {})
    assert found == [0] and torch.allclose(out, ref, atol=1e-6)


@torch.no_grad()
def test_dynamic_tokens_keep_one_graph():
    torch.manual_seed(1)
    mlp = _mlp()
    found, graphs = [], []

    def backend(gm, example_inputs):
        found.append(rewrite_gelu_epilogues(gm))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=backend, dynamic=True)
    for n in (12, 20, 7):
        x = _x(n)
        assert torch.allclose(compiled(x), mlp(x), atol=1e-6)
    assert found == [1] and len(graphs) == 1
    fused = next(n for n in graphs[0].graph.nodes if n.target is OP)
    assert isinstance(fused.meta["example_value"].shape[1], torch.SymInt)  # the token count stays symbolic
    torch._dynamo.reset()


def test_the_op_is_its_twin_off_the_gpu():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 16), torch.randn(32, 16), torch.randn(32)
    assert torch.equal(linear_gelu(x, w, b), linear_gelu_reference(x, w, b))
    # the twin is the tanh form (CPU's torch._addmm_activation would be exact GELU)
    assert torch.allclose(linear_gelu_reference(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert not torch.allclose(linear_gelu_reference(x, w, b), F.gelu(F.linear(x, w, b)), atol=1e-6)


def test_option_and_settings():
    assert parse_options({}).gelu_epilogue is None
    assert parse_options({"gelu_epilogue": False}).gelu_epilogue is False
    with pytest.raises(OptionsError, match="gelu_epilogue"):
        parse_options({"gelu_epilogue": "yes please"})
    auto = parse_options({"mode": "O2"})
    assert S.resolve(auto, cuda=True).gelu_epilogue
    assert not S.resolve(auto, cuda=False).gelu_epilogue  # CPU: the twin, nothing to gain
    assert not S.resolve(parse_options({"backend": "aot_eager"}), cuda=True).gelu_epilogue
    assert not S.resolve(parse_options({"gelu_epilogue": False}), cuda=True).gelu_epilogue
    forced = S.resolve(parse_options({"gelu_epilogue": True}), cuda=False)
    assert forced.gelu_epilogue
    # the graph changes with it, so the digest does; the option unset keeps older keys
    assert forced.digest(auto) != S.resolve(auto, cuda=False).digest(auto)
    assert parse_options({}).digest() == parse_options({"mode": "O2"}).digest()
    assert "gelu_epilogue" not in parse_options({}).to_dict() or parse_options({}).to_dict()["gelu_epilogue"] is None
    assert gelu_epilogue.wanted(None, cuda=True, inductor=True)
    assert not gelu_epilogue.wanted(None, cuda=True, inductor=False)
    assert gelu_epilogue.wanted(True, cuda=False, inductor=False)


@torch.no_grad()
def test_engine_compile_counts_and_matches_eager(fresh_stats, monkeypatch):
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_mlp(), _mlp())
    x = _x()
    ref = model(x)
    cm = nexfort_engine.compile(model, {"backend": "aot_eager", "gelu_epilogue": True}, label="gelu-epilogue")
    out = cm(x)
    rec = fresh_stats()["models"][cm.label]
    assert rec["gelu_epilogues"] == 2 and rec["fallbacks"] == 0
    assert torch.allclose(out, ref, atol=1e-6)
    off = nexfort_engine.compile(torch.nn.Sequential(_mlp()), {"backend": "aot_eager"}, label="gelu-off")
    off(x)
    assert fresh_stats()["models"][off.label]["gelu_epilogues"] == 0  # CPU: auto is off
    torch._dynamo.reset()


def test_the_rewritten_graph_is_cacheable():
    """AOTAutograd's cache takes a graph calling the op (a registered custom op): a warm start
    does not re-trace the model."""
    from torch._functorch._aot_autograd import autograd_cache

    _, _, found, graphs = rewritten(rewrite_gelu_epilogues, _mlp(), (_x(),), {})
    assert found == [1]
    autograd_cache.check_cacheable(graphs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.no_grad()
def test_cublaslt_epilogue_against_the_twin_and_float32(dtype):
    """PixArt-α's fc1 shape (scaled down in tokens): the epilogue's error against float32 is no
    larger than the two kernels' (one rounding instead of two), and its output is the twin's within
    that rounding; a strided input (a view) takes the same path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    x = torch.randn(2, 1024, 1152, device="cuda", dtype=dtype)
    w = torch.randn(4608, 1152, device="cuda", dtype=dtype) / 1152**0.5
    b = torch.randn(4608, device="cuda", dtype=dtype) * 0.1
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
    out, twin = linear_gelu(x, w, b), linear_gelu_reference(x, w, b)
    assert out.shape == twin.shape and out.dtype == dtype and out.is_contiguous()

    def err(t):
        return float((t.float() - ref).norm() / ref.norm())

    assert err(out) <= err(twin) * 1.05, (err(out), err(twin))
    assert err(out) < (2e-3 if dtype == torch.float16 else 1e-2)
    strided = torch.randn(2, 1152, 1024, device="cuda", dtype=dtype).transpose(1, 2)
    assert torch.allclose(linear_gelu(strided, w, b).float(), linear_gelu_reference(strided, w, b).float(),
                          atol=2e-2, rtol=2e-2)
