"""Stand-ins while Dynamo traces (nexfort_engine/trace_ops.py): ``F.linear`` traced as an op that
only allocates, restored to the real op before anything compiles.

Checked here without Inductor: the swap is scoped and restored; eager callers (another thread)
get the real op; under Dynamo the stand-in is taken only where its fake output is the real one's
(sizes, strides, dtype), and the restored graph is the plain trace's (same targets, same output);
a guard the trace took on the stand-in is fingerprinted as the real function. The saved-graph
process tests (test_precompile.py) run the engine's trace with it, restart and load without a
recompile.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.nn.functional as F

from nexfort_engine import precompile, trace_ops

REAL = torch._C._nn.linear


def _trace(fn, *args, stand_in=True):
    """Dynamo's graph of ``fn(*args)`` (one graph), traced with or without the stand-in; the
    stand-ins' example values as traced; the output of the graph run after :func:`restore`."""
    got = []

    def backend(gm, example_inputs):
        got.append((gm, [n.meta["example_value"] for n in gm.graph.nodes if _is_stand_in(n.target)]))
        trace_ops.restore(gm)
        return gm.forward

    torch._dynamo.reset()
    with trace_ops.standing_in(stand_in):
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)(*args)
    torch._dynamo.reset()
    [(gm, fakes)] = got
    return gm, fakes, out


def _is_stand_in(target):
    return target in (torch.ops.nexfort.trace_linear, torch.ops.nexfort.trace_linear.default)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_the_swap_is_scoped_reentrant_and_restored_on_errors():
    assert F.linear is REAL
    with trace_ops.standing_in():
        assert F.linear is trace_ops.linear
        with trace_ops.standing_in():
            assert F.linear is trace_ops.linear
        assert F.linear is trace_ops.linear
    assert F.linear is REAL
    with pytest.raises(ValueError), trace_ops.standing_in():
        raise ValueError("trace failed")
    assert F.linear is REAL
    with trace_ops.standing_in(False):
        assert F.linear is REAL


def test_eager_callers_get_the_real_op_meanwhile():
    """Another thread calling F.linear while the engine traces: the real op, autograd included."""
    x, w, b = torch.randn(3, 5, requires_grad=True), torch.randn(4, 5), torch.randn(4)
    out: dict = {}
    with torch.enable_grad(), trace_ops.standing_in():  # (an earlier test may leave grad mode off)
        t = threading.Thread(target=lambda: out.setdefault("y", F.linear(x, w, b)))
        t.start()
        t.join()
        direct = F.linear(x, w, b)
        direct.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(out["y"], REAL(x, w, b), rtol=0, atol=0)
    torch.testing.assert_close(direct, REAL(x, w, b), rtol=0, atol=0)
    # the op's eager implementation is the real op (its reference twin)
    torch.testing.assert_close(trace_linear_eager(x.detach(), w, b), REAL(x.detach(), w, b), rtol=0, atol=0)


def trace_linear_eager(x, w, b):
    return torch.ops.nexfort.trace_linear(x, w, b)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8, bias=False)
        self.c = torch.nn.Linear(6, 8)

    def forward(self, x, y):
        h = self.a(x)  # (B, N, 8) -> (B, N, 16)
        h = self.b(torch.nn.functional.gelu(h)).transpose(1, 2)  # (B, 8, N)
        z = self.c(y.permute(0, 2, 3, 1))  # non-contiguous 4-D input
        v = F.linear(h[0, :, 0], self.b.weight.t().contiguous())  # a 1-D input
        return h.sum(-1) + z.mean((1, 2)) + v.sum()


def _hinted(seq):
    return [int(v.node.hint) if isinstance(v, torch.SymInt) else int(v) for v in seq]


@torch.no_grad()
def test_the_stand_ins_graph_is_the_plain_trace_once_restored():
    net = Net().eval()
    x, y = torch.randn(2, 5, 8), torch.randn(2, 6, 3, 4)
    plain, none, plain_out = _trace(net, x, y, stand_in=False)
    stood, fakes, out = _trace(net, x, y)
    assert none == [] and len(fakes) == 4
    # each stand-in's fake output has the real op's sizes and strides (symbolic sizes compared
    # through their hints) and dtype
    reals = [n.meta["example_value"] for n in plain.graph.nodes if n.target is REAL]
    assert len(reals) == 4
    for r, f in zip(reals, fakes):
        assert (_hinted(r.shape), _hinted(r.stride()), r.dtype) == (_hinted(f.shape), _hinted(f.stride()), f.dtype)
    # restored: the plain trace's ops, and its output, bit for bit
    assert _targets(stood) == _targets(plain)
    assert trace_ops.restore(stood) == 0
    torch.testing.assert_close(out, net(x, y), rtol=0, atol=0)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)


@torch.no_grad()
def test_where_the_fake_would_differ_the_real_op_is_traced():
    w16, w, b = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(4, 5), torch.randn(4)
    x = torch.randn(3, 5)

    def autocast(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, w, b)

    _, fakes, out = _trace(autocast, x, w, b)
    assert fakes == [] and out.dtype == torch.bfloat16

    def vector_weight(x, w):  # a 1-D weight gives a 1-D output shape rule of its own
        return F.linear(x, w[0])

    _, fakes, _ = _trace(vector_weight, x, w)
    assert fakes == []

    def mixed(x, w):  # eager raises: so does the real op in the trace
        return F.linear(x, w)

    with pytest.raises(Exception, match="dtype|same"):
        _trace(mixed, x, w16)

    def plain(x, w, b):
        return F.linear(x, w, b)

    _, fakes, out = _trace(plain, x, w, b)
    assert len(fakes) == 1
    torch.testing.assert_close(out, REAL(x, w, b), rtol=0, atol=0)


def test_a_guard_on_the_stand_in_is_the_real_functions():
    """The recorder fingerprints what a stand-in stands for, so the restored F.linear passes."""
    rec = precompile.GuardRecorder("self", trace_ops.originals())

    entry = types.SimpleNamespace(guard_type="CLOSURE_MATCH", name="G['torch'].nn.functional.linear",
                                  is_global=True, has_value=True, value=trace_ops.linear, derived_guard_types=())
    assert rec([entry]) == [False]
    [d] = rec.dropped
    assert d.fingerprint == precompile.fingerprint(F.linear) == precompile.fingerprint(REAL)
    assert d.fingerprint != precompile.fingerprint(trace_ops.linear)


class Wrapped(torch.Tensor):
    """A tensor subclass standing for ComfyUI's quantized/GGUF weights."""


def test_only_plain_tensors_are_traced_through_the_stand_in():
    net = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert trace_ops.plain(net, (x,), {"opts": {"scale": torch.ones(1), "name": "a"}})
    assert not trace_ops.plain(net, (x.as_subclass(Wrapped),), {})
    assert not trace_ops.plain(net, (x,), {"opts": [x.as_subclass(Wrapped)]})
    net.weight = torch.nn.Parameter(net.weight.detach().as_subclass(Wrapped))
    assert not trace_ops.plain(net, (x,), {})


# -- torch.linspace with a symbolic length ---------------------------------------------------------


def _position_ids(x, start, extra):
    """ComfyUI's Flux/Wan/Qwen-Image pattern: ids over the patches of a latent side."""
    n = (x.shape[1] + 1) // 2
    return torch.linspace(start, n - 1 + extra, steps=n, device=x.device, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_linspace_keeps_its_length_symbolic(dtype):
    """Under the stand-in one dynamic graph serves every length (the real op's ``steps`` is a plain
    int: Dynamo specialises it). Its values: integer ids in float32/64 exactly the real op's; any
    span at most as far from the exact (float64) values as the real op's, or within an ulp of the
    largest (16-bit dtypes are computed in float32 and rounded once; ATen rounds more often)."""
    for start, extra in ((0, 0), (0.5, 2.25), (-3, 7)):
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        with trace_ops.standing_in(False, symbolic_linspace=True):
            fn = torch.compile(_position_ids, backend=backend, dynamic=True, fullgraph=True)
            for n in (8, 12, 16, 40, 600):
                out = fn(torch.zeros(1, n, 2, dtype=dtype), start, extra)
                steps = (n + 1) // 2
                ref = torch.linspace(start, steps - 1 + extra, steps=steps, dtype=dtype)
                exact = torch.linspace(start, steps - 1 + extra, steps=steps, dtype=torch.float64)
                assert out.shape == ref.shape and out.dtype == dtype
                if (start, extra) == (0, 0) and dtype in (torch.float32, torch.float64):
                    assert torch.equal(out, ref)
                ours = (out.double() - exact).abs().max().item()
                theirs = (ref.double() - exact).abs().max().item()
                assert ours <= max(theirs, torch.finfo(dtype).eps * exact.abs().max().item()), (n, start, extra)
        torch._dynamo.reset()
        assert len(graphs) == 1, (start, extra, len(graphs))
        targets = _targets(graphs[0])
        assert torch.linspace not in targets and trace_ops._LINSPACE not in targets


def test_linspace_with_a_constant_length_stays_in_one_graph():
    """A plain-int length, as in Flux's rotary frequencies (``steps=dim // 2``, float64), next to a
    symbolic one: one graph with no break (fullgraph), and a 1-long span is its start. On torch 2.11
    ``torch.sym_max`` on two ints broke the trace ("torch.* op returned non-Tensor"), and Flux, Wan
    and Qwen-Image compiled whole lost their saved graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x):
        n = x.shape[0]
        scale = torch.linspace(0, (16 - 2) / 16, steps=16 // 2, dtype=torch.float64)
        one = torch.linspace(2.5, 7.0, steps=1)
        return torch.linspace(0, n - 1, steps=n)[:, None] + x, scale, one

    torch._dynamo.reset()
    with trace_ops.standing_in(False, symbolic_linspace=True):
        compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
        for n in (4, 6, 9):
            out = compiled(torch.zeros(n, 3))
            refs = (trace_ops._LINSPACE(0, n - 1, steps=n)[:, None].expand(n, 3),
                    trace_ops._LINSPACE(0, (16 - 2) / 16, steps=8, dtype=torch.float64),
                    trace_ops._LINSPACE(2.5, 7.0, steps=1))
            for got, ref in zip(out, refs, strict=True):
                torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch._dynamo.reset()
    assert len(graphs) == 1


def test_linspace_stand_in_is_the_real_op_elsewhere():
    """Scoped and restored; outside a trace, and inside one where the symbolic form does not apply
    (a tensor end, an integer dtype), it is the real op with every argument it was given."""
    real = trace_ops._LINSPACE
    assert torch.linspace is real
    with trace_ops.standing_in(False, symbolic_linspace=True):
        assert torch.linspace is trace_ops.linspace
        with trace_ops.standing_in(symbolic_linspace=True):
            assert torch.linspace is trace_ops.linspace and F.linear is trace_ops.linear
        assert torch.linspace is trace_ops.linspace and F.linear is REAL
        out = torch.empty(5)
        torch.linspace(0.0, 1.0, 5, out=out)
        torch.testing.assert_close(out, real(0.0, 1.0, 5), rtol=0, atol=0)
        y = torch.linspace(start=-1, end=1, steps=4, dtype=torch.float64, requires_grad=True)
        assert y.requires_grad and y.dtype == torch.float64
        torch.testing.assert_close(y.detach(), real(-1, 1, 4, dtype=torch.float64), rtol=0, atol=0)

        def fallbacks(x):
            n = x.shape[0]
            return torch.linspace(0, x[0], steps=4) + torch.linspace(0, n, steps=n, dtype=torch.int64).sum()

        x = torch.full((6,), 3.0)
        torch.testing.assert_close(torch.compile(fallbacks, backend="eager", dynamic=True)(x),
                                   real(0, 3.0, 4) + real(0, 6, 6, dtype=torch.int64).sum())
    assert torch.linspace is real
    with pytest.raises(ValueError), trace_ops.standing_in(False, symbolic_linspace=True):
        raise ValueError("trace failed")
    assert torch.linspace is real
    assert trace_ops.originals()[id(trace_ops.linspace)] is real
    torch._dynamo.reset()
