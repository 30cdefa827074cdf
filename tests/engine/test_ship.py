"""A cut part of a traced graph pickled for a compile worker (ship.py).

Round trips of real Dynamo graphs (dynamic sizes, the GroupNorm pass's own functions, a view
crossing a cut, a constant tensor attribute): the rebuilt part has the same code and input
metadata (fingerprint), its shape environment has the sender's symbols, what AOTAutograd reads
from Dynamo survives, and the part compiled from the copy in a fresh fake mode computes what the
original part computes. Unpicklable contents raise ShipError.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from cut_nets import dynamo_graph as _dynamo_graph
from cut_nets import net as _net

from nexfort_engine import shapes, ship, split


class Chunky(torch.nn.Module):
    """A chunk whose halves are used far apart (a view crosses the cut), a constant table, and a
    slice bounded by a traced size (a node inside a slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(6)])
        self.register_buffer("table", torch.arange(8, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, late = self.a(x).chunk(2, dim=-1)
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h)) + self.table
        return (h * late)[:, : x.shape[1] - 1]


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setenv(split.ENV_MIN_PART_NODES, "4")


def _round_trip(part: split.Part) -> tuple[split.Part, object]:
    data = ship.dumps((part.index, part.fingerprint(), part.single, part.module, part.inputs))
    index, fingerprint, single, module, inputs = ship.loads(data)
    assert (index, fingerprint, single) == (part.index, part.fingerprint(), part.single)
    copy = split.Part(index=index, module=module, inputs=list(inputs), single=single)
    return copy, split.shape_env_of(copy.inputs)


def _aot_eager(part: split.Part):
    from torch._dynamo.backends.registry import lookup_backend
    from torch._guards import TracingContext, detect_fake_mode, tracing

    with tracing(TracingContext(detect_fake_mode(part.inputs))):
        return lookup_backend("aot_eager")(part.module, list(part.inputs))


def test_parts_of_a_conv_net_round_trip(small_parts, clean_dynamo):
    net = _net()
    x = torch.randn(2, 4, 8, 8)
    gm, _inputs = _dynamo_graph(net, x, rewrite=True)  # the GroupNorm pass: functions of the engine's own
    cut = split.split(gm, 3)
    assert cut is not None
    env = split.shape_env_of([v for p in cut.parts for v in p.inputs])
    dropped = 0
    for part in cut.parts:
        copy, copy_env = _round_trip(part)
        assert copy.fingerprint() == part.fingerprint()
        assert copy.module.code == part.module.code
        assert copy_env is not None and copy_env is not env
        assert {str(s) for s in copy_env.backed_var_to_val} == {str(s) for s in env.backed_var_to_val}
        # what AOTAutograd reads to know the graph came from Dynamo, and which inputs are weights
        assert copy.module.meta.get("dynamo_compile_id") == part.module.meta.get("dynamo_compile_id")
        # the sources of the part's own parameters and buffers (all AOTAutograd reads), not the
        # whole model's that every part of a cut carries
        own = {name for name, _ in part.module.named_parameters(remove_duplicate=False)}
        own.update(name for name, _ in part.module.named_buffers(remove_duplicate=False))
        sources = part.module._param_name_to_source
        assert copy.module._param_name_to_source == {k: v for k, v in sources.items() if k in own}
        dropped += len(sources) - len(copy.module._param_name_to_source)
        old = [n for n in part.module.graph.nodes if n.op == "placeholder"]
        new = [n for n in copy.module.graph.nodes if n.op == "placeholder"]
        assert [n._dynamo_source for n in new] == [n._dynamo_source for n in old]
        assert [n.meta.get("tensor_dict") for n in new] == [n.meta.get("tensor_dict") for n in old]
    assert dropped > 0


def test_a_shipped_part_computes_what_the_original_does(small_parts, clean_dynamo):
    """Each part's copy, compiled in its own fake mode (AOTAutograd), run on real values."""
    net = _net()
    x = torch.randn(2, 4, 8, 8)
    gm, inputs = _dynamo_graph(net, x, rewrite=True)
    cut = split.split(gm, 3)
    assert cut is not None
    fns = []
    for part in cut.parts:
        copy, _env = _round_trip(part)
        fns.append(_aot_eager(copy))
    # the backend's example inputs are the call's tensors, and its sizes as symbols: their values
    real = [int(a.node.hint) if isinstance(a, torch.SymInt) else a for a in inputs]
    with torch.no_grad():
        want = gm(*real)
        got = cut.plan.run(fns, real)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[0], net(x))


def test_views_and_constants_cross_intact(small_parts, clean_dynamo):
    torch.manual_seed(0)
    net = Chunky().eval().requires_grad_(False)
    x = torch.randn(3, 5, 8)
    gm, _inputs = _dynamo_graph_3d(net, x)
    cut = split.split(gm, 3)
    assert cut is not None
    viewed = [v for p in cut.parts for v in p.inputs if isinstance(v, torch.Tensor) and v._is_view()]
    assert viewed, "the chunk's second half should cross a cut as a view"
    views = 0
    for part in cut.parts:
        copy, _env = _round_trip(part)
        assert copy.fingerprint() == part.fingerprint()
        for a, b in zip(part.inputs, copy.inputs):
            if isinstance(a, torch.Tensor):
                assert b._is_view() == a._is_view()
                assert str(b.storage_offset()) == str(a.storage_offset())
        # the computing nodes' fake values travel as plain tensors of the same layout (cheaper to
        # rebuild than views; the inputs above keep their bases)
        for a, b in zip(part.module.graph.nodes, copy.module.graph.nodes):
            va, vb = a.meta.get("example_value"), b.meta.get("example_value")
            if a.op == "placeholder" or not isinstance(va, torch.Tensor):
                continue
            views += va._is_view()
            assert not vb._is_view(), b
            assert (str(vb.shape), str(vb.stride()), str(vb.storage_offset()), vb.dtype) == \
                (str(va.shape), str(va.stride()), str(va.storage_offset()), va.dtype), b
    assert views, "the chunk's halves are views in the nodes' metadata"
    bounds = [b for n in gm.graph.nodes for a in _flat(n.args) if isinstance(a, slice)
              for b in (a.start, a.stop, a.step) if isinstance(b, torch.fx.Node)]
    assert bounds, "the last slice's bound should be a node of the graph"


def _flat(args: object) -> list:
    """Every value inside nested tuples and lists (slices kept whole)."""
    if isinstance(args, (tuple, list)):
        return [v for a in args for v in _flat(a)]
    return [args]


def _dynamo_graph_3d(net: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    got: dict[str, object] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    x = x.clone()
    for d in (0, 1):
        torch._dynamo.mark_dynamic(x, d)
    with torch.no_grad():
        torch.compile(net, backend=backend, dynamic=None)(x)
    return got["gm"], got["inputs"]  # type: ignore[return-value]


def test_what_cannot_be_pickled_raises_ship_error():
    with pytest.raises(ship.ShipError, match="pickle"):
        ship.dumps((1, lambda: 0))
    with pytest.raises(pickle.UnpicklingError):
        ship.loads(b"not a pickle")


def test_parts_of_comfyuis_unet_ship_and_compute_the_same(small_parts, clean_dynamo):
    """ComfyUI's own SD1.5 UNet class (tiny widths): timestep embedding, attention, skip
    concatenations, the GroupNorm pass. Cut in four, every part shipped and compiled from its copy,
    the plan's output equals the graph's own."""
    import tiny_models

    from nexfort_engine.passes import group_norm

    mp = tiny_models.tiny_sd15(depth=1)
    dm = mp.model.diffusion_model
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    t = torch.rand(2, generator=gen) * 999
    ctx = torch.randn(2, 77, 64, generator=gen)
    got: dict[str, object] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        group_norm.rewrite_group_norms(gm)
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    args, kwargs = shapes.detached((x, t, ctx), {"transformer_options": {}})
    shapes.mark_dynamic_dims(args, kwargs)  # as the engine traces: batch, sizes, text length
    with torch.no_grad():
        torch.compile(dm, backend=backend, dynamic=None)(*args, **kwargs)
        want = dm(x, t, ctx, transformer_options={})
    gm, inputs = got["gm"], got["inputs"]
    cut = split.split(gm, 4)
    assert cut is not None and len(cut.parts) == 4
    fns = []
    for part in cut.parts:
        copy, _env = _round_trip(part)
        assert copy.fingerprint() == part.fingerprint()
        fns.append(_aot_eager(copy))
    real = [int(a.node.hint) if isinstance(a, torch.SymInt) else a for a in inputs]
    with torch.no_grad():
        out = cut.plan.run(fns, real)
        whole = gm(*real)
    torch.testing.assert_close(out[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-4)
