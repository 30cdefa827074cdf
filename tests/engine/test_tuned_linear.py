"""16-bit linears with the GEMM algorithm measured per shape (``gemm_tuning.py``, ``passes/tuned_linear.py``).

On CPU: the pass rewrites 16-bit linears and ``nexfort::linear_gelu`` calls (and leaves float32 and
mixed ones), the rewritten graph gives eager's output (the op is its twin there), under dynamic
shape with one graph; the option, the settings (auto, fp8, max-autotune) and their digest; a
compile through the engine with its counter; AOTAutograd's cache accepting the graph; the table:
queue, search between calls within a budget, a failed search keeping torch's call, persistence
merged with another process's entries, a corrupt file or entry detected and rebuilt. On a GPU
(``gpu``): the search on a real shape, the op with its choice against torch's call, under CUDA-graph
capture, and a restarted table resolving the choice again.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import rewritten, targets

import nexfort_engine
from nexfort_engine import gemm_tuning, parse_options
from nexfort_engine import settings as S
from nexfort_engine.passes import tuned_linear
from nexfort_engine.passes.gelu_epilogue import rewrite_gelu_epilogues
from nexfort_engine.passes.tuned_linear import rewrite_tuned_linears

OP = torch.ops.nexfort.tuned_linear.default
DT = torch.bfloat16


class Mlp(torch.nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.act = torch.nn.GELU(approximate="tanh")
        self.fc2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _x(n: int = 12, dtype: torch.dtype = DT) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, n, 16, dtype=dtype)


def _both(gm):
    """The GELU epilogue pass, then this one: the order the engine runs them in."""
    return rewrite_gelu_epilogues(gm), rewrite_tuned_linears(gm)


@pytest.fixture
def table(tmp_path, monkeypatch):
    gemm_tuning.reset()
    nexfort_engine.reset_stats()
    gemm_tuning.use_dir(tmp_path)
    yield tmp_path / gemm_tuning.TABLE_FILE
    gemm_tuning.reset()
    nexfort_engine.reset_stats()


@torch.no_grad()
def test_linears_and_linear_gelu_are_rewritten_and_match_eager():
    torch.manual_seed(1)
    mlp = Mlp().to(DT).eval()
    out, ref, found, graphs = rewritten(_both, mlp, (_x(),), {})
    assert found == [(1, 2)]
    t = targets(graphs[0])
    assert t.count(OP) == 2 and torch.ops.nexfort.linear_gelu.default not in t
    assert not any(f in (torch._C._nn.linear, F.linear) for f in t)
    gelu_flags = sorted(n.args[3] for n in graphs[0].graph.nodes if n.target is OP)
    assert gelu_flags == [False, True]
    assert torch.allclose(out, ref, atol=1e-6)


@torch.no_grad()
def test_float32_and_mixed_linears_are_left_alone():
    mlp = Mlp().eval()
    out, ref, found, graphs = rewritten(rewrite_tuned_linears, mlp, (_x(dtype=torch.float32),), {})
    assert found == [0] and OP not in targets(graphs[0])
    lin = torch.nn.Linear(16, 8).to(DT)

    def mixed(x):
        return F.linear(x, lin.weight.float(), None)

    out, ref, found, _ = rewritten(rewrite_tuned_linears, mixed, (_x(dtype=torch.float32),), {})
    assert found == [0] and torch.allclose(out, ref)


@torch.no_grad()
def test_dynamic_tokens_keep_one_graph():
    mlp = Mlp().to(DT).eval()
    found, graphs = [], []

    def backend(gm, example_inputs):
        found.append(rewrite_tuned_linears(gm))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=backend, dynamic=True)
    for n in (12, 20, 7):
        x = _x(n)
        assert torch.allclose(compiled(x), mlp(x), atol=1e-6)
    assert found == [2] and len(graphs) == 1
    node = next(n for n in graphs[0].graph.nodes if n.target is OP)
    assert isinstance(node.meta["example_value"].shape[1], torch.SymInt)
    torch._dynamo.reset()


def test_the_op_is_its_twin_off_the_gpu():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 16), torch.randn(32, 16), torch.randn(32)
    assert torch.equal(OP(x, w, b, False), F.linear(x, w, b))
    assert torch.equal(OP(x, w, None, False), F.linear(x, w))
    assert torch.equal(OP(x, w, b, True), F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert gemm_tuning.pending() == []  # CPU calls queue nothing


def test_the_rewritten_graph_is_cacheable():
    from torch._functorch._aot_autograd import autograd_cache

    _, _, found, graphs = rewritten(_both, Mlp().to(DT).eval(), (_x(),), {})
    assert found == [(1, 2)]
    autograd_cache.check_cacheable(graphs[0])


def test_option_and_settings():
    assert parse_options({}).tuned_gemm is None
    with pytest.raises(nexfort_engine.OptionsError, match="tuned_gemm"):
        parse_options({"tuned_gemm": "sometimes"})
    auto = parse_options({"mode": "O2"})
    # auto is off everywhere: the search did not speed up a model (run305)
    assert not S.resolve(auto, cuda=True).tuned_gemm
    assert not S.resolve(auto, cuda=False).tuned_gemm
    assert not S.resolve(parse_options({"mode": "O3"}), cuda=True, fp8_capable=True, fp8_pays=False).tuned_gemm
    assert not S.resolve(parse_options({"tuned_gemm": False}), cuda=True).tuned_gemm
    assert not S.resolve(parse_options({"backend": "aot_eager"}), cuda=True).tuned_gemm
    assert not S.resolve(parse_options({"mode": "O2", "fp8": True}), cuda=True, fp8_capable=True).tuned_gemm
    assert not S.resolve(parse_options({"mode": "max-optimize:max-autotune"}), cuda=True).tuned_gemm
    # asked for, it is on wherever the graph has 16-bit linears (fp8 weights are left alone by the pass)
    assert S.resolve(parse_options({"mode": "O2", "tuned_gemm": True}), cuda=True).tuned_gemm
    forced = S.resolve(parse_options({"tuned_gemm": True}), cuda=False)
    assert forced.tuned_gemm and forced.digest(auto) != S.resolve(auto, cuda=False).digest(auto)
    assert parse_options({}).digest() == parse_options({"mode": "O2"}).digest()  # older keys stay valid
    assert tuned_linear.wanted(True) and not tuned_linear.wanted(None) and not tuned_linear.wanted(False)


@torch.no_grad()
def test_engine_compile_counts_and_matches_eager(fresh_stats, monkeypatch):
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(Mlp().to(DT), Mlp().to(DT)).eval()
    x = _x()
    ref = model(x)
    cm = nexfort_engine.compile(model, {"backend": "aot_eager", "gelu_epilogue": True, "tuned_gemm": True},
                                label="tuned-gemm")
    out = cm(x)
    rec = fresh_stats()["models"][cm.label]
    assert rec["tuned_linears"] == 4 and rec["gelu_epilogues"] == 2 and rec["fallbacks"] == 0
    assert torch.allclose(out, ref, atol=1e-6)
    torch._dynamo.reset()


def _entry(m=4096, k=1152, n=4608, config=None, **kw):
    return {"m": m, "k": k, "n": n, "dtype": "float16", "epilogue": "gelu_bias", "config": config, **kw}


def test_queued_shapes_are_searched_between_calls_and_persisted(table, monkeypatch):
    calls = []

    def fake_search(m, k, n, dtype, epilogue, index):
        calls.append((m, k, n, dtype, epilogue))
        cfg = {"id": 66, "tile_id": 20, "stages_id": 35} if n == 4608 else None
        return _entry(m, k, n, cfg, epilogue=epilogue, speedup=1.28 if cfg else 1.0)

    monkeypatch.setattr(gemm_tuning, "_can_search", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_run_search", fake_search)
    a = gemm_tuning.key("GPU|sm90|lt1", 8192, 1152, 4608, "float16", "gelu_bias")
    b = gemm_tuning.key("GPU|sm90|lt1", 8192, 1152, 1152, "float16", "bias")
    gemm_tuning.enqueue(a, (8192, 1152, 4608, "float16", "gelu_bias", 0))
    gemm_tuning.enqueue(a, (8192, 1152, 4608, "float16", "gelu_bias", 0))  # once
    gemm_tuning.enqueue(b, (8192, 1152, 1152, "float16", "bias", 0))
    assert gemm_tuning.pending() == [a, b]
    assert gemm_tuning.tune_pending() == 2 and gemm_tuning.pending() == []
    assert calls == [(8192, 1152, 4608, "float16", "gelu_bias"), (8192, 1152, 1152, "float16", "bias")]
    saved = json.loads(table.read_text())
    assert saved["format"] == gemm_tuning.FORMAT_VERSION
    assert saved["entries"][a]["config"]["tile_id"] == 20 and saved["entries"][b]["config"] is None
    st = nexfort_engine.stats()["gemm_tuning"]
    assert st["misses"] == 2 and st["searched"] == 2 and st["chosen"] == 1 and st["kept_torch"] == 1
    # a searched shape is not queued again, in this process or the next
    gemm_tuning.enqueue(a, (8192, 1152, 4608, "float16", "gelu_bias", 0))
    assert gemm_tuning.pending() == []
    gemm_tuning.reset()
    gemm_tuning.use_dir(table.parent)
    assert set(gemm_tuning.table()) == {a, b}


def test_a_failed_search_keeps_torchs_call_and_the_budget_bounds_searching(table, monkeypatch):
    def failing(*args):
        raise RuntimeError("cublasStatus 7")

    monkeypatch.setattr(gemm_tuning, "_can_search", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_run_search", failing)
    a = gemm_tuning.key("G", 8192, 1152, 4608, "float16", "gelu_bias")
    gemm_tuning.enqueue(a, (8192, 1152, 4608, "float16", "gelu_bias", 0))
    assert gemm_tuning.tune_pending() == 1
    entry = gemm_tuning.table()[a]
    assert entry["config"] is None and "cublasStatus 7" in entry["error"]
    assert nexfort_engine.stats()["gemm_tuning"]["failed_searches"] == 1
    # no budget left: the rest of the queue runs torch's call, unsearched and unsaved
    monkeypatch.setenv(gemm_tuning.ENV_BUDGET, "0")
    b = gemm_tuning.key("G", 8192, 1152, 1152, "float16", "bias")
    gemm_tuning.enqueue(b, (8192, 1152, 1152, "float16", "bias", 0))
    assert gemm_tuning.tune_pending() == 0 and gemm_tuning.pending() == []
    assert b not in gemm_tuning.table() and nexfort_engine.stats()["gemm_tuning"]["over_budget"] == 1


def test_saving_merges_another_processs_entries(table, monkeypatch):
    other = gemm_tuning.key("G", 4096, 3072, 9216, "bfloat16", "bias")
    table.write_text(json.dumps({"format": gemm_tuning.FORMAT_VERSION,
                                 "entries": {other: _entry(4096, 3072, 9216, None, dtype="bfloat16")}}))
    monkeypatch.setattr(gemm_tuning, "_can_search", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_run_search", lambda m, k, n, d, e, i: _entry(m, k, n, None, epilogue=e))
    gemm_tuning.reset()
    gemm_tuning.use_dir(table.parent)  # read before the other process wrote? it is merged at the save
    table.write_text(json.dumps({"format": gemm_tuning.FORMAT_VERSION,
                                 "entries": {other: _entry(4096, 3072, 9216, None, dtype="bfloat16")}}))
    mine = gemm_tuning.key("G", 8192, 1152, 1152, "float16", "bias")
    gemm_tuning.enqueue(mine, (8192, 1152, 1152, "float16", "bias", 0))
    gemm_tuning.tune_pending()
    assert set(json.loads(table.read_text())["entries"]) == {other, mine}


@pytest.mark.parametrize("text", ["{not json", json.dumps([1, 2]), json.dumps({"format": 99, "entries": {}})])
def test_a_corrupt_table_is_detected_and_rebuilt(table, monkeypatch, text):
    table.write_text(text)
    gemm_tuning.reset()
    gemm_tuning.use_dir(table.parent)
    assert gemm_tuning.table() == {}
    assert nexfort_engine.stats()["gemm_tuning"]["corrupt_tables"] == 1
    monkeypatch.setattr(gemm_tuning, "_can_search", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_run_search", lambda m, k, n, d, e, i: _entry(m, k, n, None, epilogue=e))
    kk = gemm_tuning.key("G", 8192, 1152, 1152, "float16", "bias")
    gemm_tuning.enqueue(kk, (8192, 1152, 1152, "float16", "bias", 0))
    gemm_tuning.tune_pending()
    assert set(json.loads(table.read_text())["entries"]) == {kk}  # rewritten whole


def test_entries_without_the_fields_the_op_reads_are_dropped(table):
    good = gemm_tuning.key("G", 8192, 1152, 1152, "float16", "bias")
    entries = {good: _entry(8192, 1152, 1152, {"id": 66, "tile_id": 20}, epilogue="bias"),
               "cut": {"m": 8192}, "bad-config": _entry(config={"tile_id": "20"}),
               "bad-dtype": _entry(dtype="float64"), "not-a-dict": [1]}
    table.write_text(json.dumps({"format": gemm_tuning.FORMAT_VERSION, "entries": entries}))
    gemm_tuning.reset()
    gemm_tuning.use_dir(table.parent)
    assert set(gemm_tuning.table()) == {good}
    assert nexfort_engine.stats()["gemm_tuning"]["corrupt_entries"] == 4


# -- on a GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,gelu", [(torch.float16, True), (torch.bfloat16, False)])
@torch.no_grad()
def test_gpu_search_op_capture_and_restart(table, dtype, gelu):
    """A shape above MIN_FLOPS: the op queues it and runs torch's call; the search picks a
    configuration (or keeps torch's) no worse than torch's against float32; the op then runs the
    choice, also inside a CUDA graph; a restarted table resolves it again."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    m, k, n = 2048, 1024, 2048
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype) * 0.1
    ref32 = gemm_tuning.linear_reference(x.float(), w.float(), b.float(), gelu)
    torch_out = gemm_tuning._torch_call(x, w, b, gelu)
    first = OP(x, w, b, gelu)
    assert torch.equal(first, torch_out)  # a miss: torch's own call
    assert len(gemm_tuning.pending()) == 1
    assert gemm_tuning.tune_pending() == 1
    (kk, entry), = gemm_tuning.table().items()
    # beyond the heuristic's answers: other tiles were screened (none were, run304)
    assert entry["tiles_screened"] > 0 and entry["screened"] > 8
    assert entry["torch_ms"] > 0 and "error" not in entry
    assert str(dtype).endswith(entry["dtype"]) and entry["epilogue"] == ("gelu_bias" if gelu else "bias")
    out = OP(x, w, b, gelu)

    def err(t):
        return float((t.float() - ref32).norm() / ref32.norm())

    assert err(out) <= err(torch_out) * 1.01 + 1e-7
    g = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(g):
        graphed = OP(static_x, w, b, gelu)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, out)
    gemm_tuning.reset()
    gemm_tuning.use_dir(table.parent)
    assert torch.equal(OP(x, w, b, gelu), out) and gemm_tuning.pending() == []
    if entry["config"] is not None:
        assert nexfort_engine.stats()["gemm_tuning"]["table_hits"] >= 1


def test_clear_deletes_the_table_and_summary_counts_it(table, monkeypatch):
    monkeypatch.setattr(gemm_tuning, "_can_search", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_run_search",
                        lambda m, k, n, d, e, i: _entry(m, k, n, {"id": 66, "tile_id": 20} if n == 4608 else None,
                                                        epilogue=e))
    for n in (4608, 1152):
        gemm_tuning.enqueue(gemm_tuning.key("G", 8192, 1152, n, "float16", "bias"), (8192, 1152, n, "float16", "bias", 0))
    gemm_tuning.tune_pending()
    assert gemm_tuning.summary(table.parent) == {"entries": 2, "chosen": 1}
    assert gemm_tuning.clear(table.parent) == 2
    assert not table.exists() and gemm_tuning.table() == {}
    assert gemm_tuning.summary(table.parent) == {"entries": 0, "chosen": 0}
