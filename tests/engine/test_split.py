"""``"compile_workers"``: one traced graph cut into parts compiled by child processes (split.py).

The cut itself (balanced parts, the plan that runs them equals the graph, values between parts),
the refresh of example values the GroupNorm pass left stale (without it a cut fails Inductor's
stride check: the GPU's first try, run176), size guards carried from a child, the option, and -
with real Inductor compiles in real child processes - a conv net cut in three parts: two come
from children, the output matches eager, a restart loads the saved split graph without compiling,
and a part whose child delivers nothing is compiled by the parent.
"""

from __future__ import annotations

import types

import pytest
import torch
from cut_nets import dynamo_graph as _dynamo_graph
from cut_nets import net as _net

import nexfort_engine
from nexfort_engine import split, stream
from nexfort_engine.options import OptionsError, parse_options
from nexfort_engine.passes import group_norm


@pytest.fixture
def small_parts(monkeypatch):
    """Tiny graphs are cut too (children read the variable as well), once Dynamo's trace has ended
    (the cut this file tests; parts cut while tracing: test_stream.py, whose schedule could stream a
    tiny UNet whose trace is slow on a busy CPU box)."""
    monkeypatch.setenv(split.ENV_MIN_PART_NODES, "4")
    monkeypatch.setenv(stream.ENV_STREAM, "0")


def test_parts_are_balanced_consecutive_and_run_like_the_graph(small_parts, clean_dynamo):
    net = _net()
    x = torch.randn(2, 4, 8, 8)
    gm, inputs = _dynamo_graph(net, x)
    cut = split.split(gm, 3)
    assert cut is not None and len(cut.parts) == 3
    # the workers' parts cost alike, the caller's (part 0) less: what the cut weighed, recomputed
    # below on the parts' own graphs
    costs = split.part_costs(gm, split.assign(gm, 3))
    assert costs[0] < min(costs[1:]) and abs(costs[1] - costs[2]) <= 1 + split.NEW_KERNEL_WEIGHT, costs
    for part, cost in zip(cut.parts, costs, strict=True):
        assert split.part_costs(part.module, {n: 0 for n in part.module.graph.nodes
                                              if n.op not in ("placeholder", "output")}) == [cost]
    # each part reads the call's arguments or what parts before it returned
    for k, (ins, start, _n, _free) in enumerate(cut.plan.steps):
        assert all(i < start for i in ins), (k, ins, start)
    # the skip across the net crosses every cut and is freed only after its last reader
    freed = [s for _ins, _start, _n, free in cut.plan.steps for s in free]
    assert len(freed) == len(set(freed))
    # the plan over the parts' own (uncompiled) graphs computes what the graph does
    with torch.no_grad():
        want = gm(*inputs)
        got = cut.plan.run([p.module for p in cut.parts], inputs)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[0], net(x))
    assert len({p.fingerprint() for p in cut.parts}) == 3


def test_the_callers_part_can_be_smaller(small_parts, clean_dynamo, monkeypatch):
    gm, _inputs = _dynamo_graph(_net(), torch.randn(2, 4, 8, 8))

    def costs() -> list[int]:
        mapping = split.assign(gm, 3)
        assert mapping is not None
        return split.part_costs(gm, mapping)

    grain = 1 + split.NEW_KERNEL_WEIGHT  # the most one node adds to a part
    monkeypatch.setenv(split.ENV_OWN_PART_SHARE, "1")
    even = costs()
    assert max(even) - min(even) <= grain, even
    monkeypatch.setenv(split.ENV_OWN_PART_SHARE, "0.5")
    half = costs()
    assert abs(half[0] - 0.5 * max(half[1:])) <= grain and half[0] < min(half[1:]), half
    assert abs(half[1] - half[2]) <= grain, half
    monkeypatch.setenv(split.ENV_OWN_PART_SHARE, "0")
    with pytest.raises(ValueError, match="0.05 to 4"):
        split.assign(gm, 3)


def test_a_part_of_new_kernels_costs_more_than_one_that_repeats_them(clean_dynamo, monkeypatch):
    """The cut weighs kernels, not nodes: a run of repeated blocks (a UNet's deep transformer
    stack: one kernel per op kind) holds more nodes than a stretch of blocks that each make new
    kernels (its ResBlocks at several widths), which is what made SDXL's last part 50 % slower."""

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.same = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(12)])
            self.grow = torch.nn.ModuleList([torch.nn.Linear(32 + 8 * i, 40 + 8 * i) for i in range(6)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for m in self.same:  # the same kernels over and over
                x = torch.nn.functional.gelu(m(x)) + x
            for m in self.grow:  # each width its own kernels
                x = torch.nn.functional.gelu(m(x)) * 2
            return x

    monkeypatch.setenv(split.ENV_MIN_PART_NODES, "4")
    monkeypatch.setenv(split.ENV_OWN_PART_SHARE, "1")
    torch.manual_seed(0)
    got = {}

    def backend(gm, _example_inputs):
        got["gm"] = gm
        return gm.forward

    x = torch.randn(2, 3, 32)
    torch._dynamo.mark_dynamic(x, 1)
    with torch.no_grad():
        torch.compile(Mixed().eval(), backend=backend)(x)
    gm = got["gm"]
    mapping = split.assign(gm, 2)
    assert mapping is not None
    nodes = [sum(split._weight(n) for n, p in mapping.items() if p == k) for k in range(2)]
    assert nodes[0] > 2 * nodes[1], nodes  # the repeated stretch takes more than twice the nodes
    costs = split.part_costs(gm, mapping)
    assert max(costs) - min(costs) <= 1 + split.NEW_KERNEL_WEIGHT, costs
    # by node count alone, the cut would have fallen in the middle of the repeated stretch
    assert all(p == 0 for n, p in mapping.items() if "same" in str(n.meta.get("nn_module_stack", "")))


def test_too_small_a_graph_is_not_cut(clean_dynamo):
    gm, _inputs = _dynamo_graph(_net(), torch.randn(2, 4, 8, 8))
    assert split.split(gm, 3) is None  # 64 compute nodes per part at least
    assert split.assign(gm, 1) is None


def test_stale_group_norm_layouts_are_refreshed(small_parts, clean_dynamo):
    """The pass keeps ATen GroupNorm's example value; the op it puts there returns channels-last,
    and so do the SiLUs after it. Refreshed, the graph's example values match a real run's."""
    x = torch.randn(2, 4, 8, 8)
    net = _net()
    gm, inputs = _dynamo_graph(net, x, rewrite=True)
    norms = [n for n in gm.graph.nodes if n.target is group_norm.group_norm_channels_last]
    assert len(norms) == 12
    stale = [split._layout(n.meta["example_value"]) for n in norms]
    assert split.refresh_examples(gm) >= len(norms)
    # the real values of every node, by running the graph node by node
    real = {}
    interp = torch.fx.Interpreter(gm)
    orig_run_node = interp.run_node

    def run_node(n):
        real[n] = orig_run_node(n)
        return real[n]

    interp.run_node = run_node
    with torch.no_grad():
        interp.run(*inputs)
    checked = 0
    for n in gm.graph.nodes:
        value = real.get(n)
        if n.op in ("call_function", "call_method") and isinstance(value, torch.Tensor) and value.dim() == 4:
            fake = n.meta["example_value"]
            # the fake strides at the traced sizes (torch 2.11 answers is_contiguous(channels_last)
            # on symbolic strides conservatively: compare the strides themselves)
            strides = tuple(int(st.node.hint) if isinstance(st, torch.SymInt) else st for st in fake.stride())
            assert strides == value.stride(), (n, strides, value.stride())
            checked += 1
    assert checked > 3 * len(norms)
    fresh = [split._layout(n.meta["example_value"]) for n in norms]
    assert fresh != stale  # what the cut would have got wrong


def test_the_group_norm_twin_has_the_ops_layout():
    for shape in [(2, 8, 5, 6), (1, 8, 1, 6), (2, 8, 7), (2, 8, 3, 4, 5)]:
        for channels_last in (False, True):
            x = torch.randn(*shape, dtype=torch.float16)
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            w, b = torch.randn(8, dtype=torch.float16), torch.randn(8, dtype=torch.float16)
            real = group_norm.group_norm_channels_last(x, 4, w, b, 1e-5)
            twin = group_norm._example_output(x, 4, w, b, 1e-5)
            assert (twin.shape, twin.stride(), twin.dtype) == (real.shape, real.stride(), real.dtype), shape


def test_a_childs_guards_are_added_here():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    sym = env.create_symbol(12, ConstantSource("x_size_0"))
    n0 = len(env.guards)
    assert split.apply_guards(env, [f"Eq(Mod({sym}, 4), 0)"]) is None
    assert len(env.guards) == n0 + 1
    assert "does not hold" in (split.apply_guards(env, [f"Eq({sym}, 5)"]) or "")
    assert split.apply_guards(None, []) is None
    assert "no shape environment" in (split.apply_guards(None, ["Eq(s0, 1)"]) or "")


def test_size_guards_taken_after_dynamos_are_checked_from_the_inputs(monkeypatch):
    """A guard a part's compile takes once Dynamo has built its own (the parts compile then) is
    printed as Python over the input sizes it reads; one without an input source, or one that does
    not hold at the traced sizes, is refused."""
    import sympy
    from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.functions import Mod

    from nexfort_engine import precompile

    env = ShapeEnv()
    h = env.create_symbol(16, TensorPropertySource(LocalSource("x"), TensorProperty.SIZE, 2))
    (g,) = precompile.size_guards(env, [sympy.Eq(Mod(h, 4), 0)])
    assert g.sources == {str(h): "L['x'].size()[2]"}, g
    assert eval(g.code, {}, {str(h): 20}) and not eval(g.code, {}, {str(h): 18})  # noqa: S307
    with pytest.raises(ValueError, match="does not hold"):
        precompile.size_guards(env, [sympy.Eq(h, 8)])
    # Inductor's int32 index bound as run191 met it on SD2.1: a floor of a rational, exact here
    b = env.create_symbol(2, TensorPropertySource(LocalSource("x"), TensorProperty.SIZE, 0))
    bound = sympy.Le(192 * b * sympy.floor(sympy.Rational(160, 3) * h * h + sympy.Rational(5, 6)), 2**31 - 1)
    (g,) = precompile.size_guards(env, [bound])
    assert "Fraction(160, 3)" in g.code and "math.floor" in g.code, g.code

    def holds(guard, **sizes) -> bool:
        return eval(guard.code, precompile._SIZE_GUARD_GLOBALS, {str(k): v for k, v in sizes.items()})  # noqa: S307

    for hb, bb in ((16, 2), (96, 2), (200, 2), (200, 1), (128, 16)):
        assert holds(g, **{str(h): hb, str(b): bb}) == bool(bound.subs({h: hb, b: bb})), (hb, bb)
    # a printed form Python cannot evaluate is evaluated by sympy instead
    monkeypatch.setattr(precompile, "_size_printer", lambda: types.SimpleNamespace(doprint=lambda e: "no_such(1)"))
    (g,) = precompile.size_guards(env, [bound])
    assert g.code.startswith("_sympy_guard(") and holds(g, **{str(h): 96, str(b): 2})
    assert not holds(g, **{str(h): 200, str(b): 16})
    with pytest.raises(ValueError, match="no input size"):
        precompile.size_guards(env, [sympy.Eq(sympy.Symbol("u0", integer=True), 1)])


def test_option_is_validated_and_auto_follows_the_device():
    assert parse_options({"compile_workers": 4}).compile_workers == 4
    assert parse_options({}).compile_workers is None
    for bad in (0, 33, 2.5, True, "4"):
        with pytest.raises(OptionsError, match="compile_workers.*1 to 32"):
            parse_options({"compile_workers": bad})
    cpu = torch.zeros(1)
    gpu = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    assert split.workers(None, "inductor", cpu) == 1
    assert split.workers(None, "inductor", gpu) == max(1, min(split.AUTO_WORKERS, split._cores() // 2))
    assert split.workers(3, "inductor", cpu) == 3
    assert split.workers(3, "eager", cpu) == 1
    assert split.workers(3, "inductor", gpu, ("max-optimize", "freezing")) == 1  # zeros would be baked in
    # the option does not change the cache entry: any worker count fills and loads the same one
    from nexfort_engine.settings import resolve

    a, b = parse_options({"compile_workers": 1}), parse_options({"compile_workers": 6})
    assert resolve(a, cuda=False).digest(a) == resolve(b, cuda=False).digest(b)


def test_children_that_fit_in_device_memory():
    """A worker holds no weights (it compiles a shipped part): its CUDA context is what it needs."""
    per_child = split.CHILD_OVERHEAD_BYTES
    cuda = torch.device("cuda", 0)
    plenty = lambda: 1 << 50  # noqa: E731
    assert split.children_that_fit(cuda, lambda d: (3 * per_child + 1, 0), plenty) == 3
    assert split.children_that_fit(cuda, lambda d: (per_child - 1, 0), plenty) == 0
    # the host's memory limits them too
    assert split.children_that_fit(cuda, lambda d: (9 * per_child, 0), lambda: 2 * split.CHILD_HOST_BYTES) == 2
    assert split.children_that_fit(torch.device("cpu"), host_fn=lambda: None) > 1000
    assert split.host_available_bytes() is None or split.host_available_bytes() > 0


# -- real Inductor compiles in real child processes --------------------------------------------


def _compile(cache_dir, **options):
    net = _net()
    config = {"mode": "O2", "regional": False, "group_norm_rewrite": True, "memory_format": "channels_last",
              "compile_workers": 3, **options}
    return net, nexfort_engine.compile(net, config, cache_dir=str(cache_dir))


def _record(stats) -> dict:
    models = stats()["models"]
    assert len(models) == 1, models
    return next(iter(models.values()))


def _compiled_run(cache_dir, stats, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The conv net compiled with three workers and called on ``x``: (compiled output, eager output,
    the model's counters), after checking that nothing fell back to eager."""
    net, cm = _compile(cache_dir)
    with torch.inference_mode():
        out = cm(x)
        want = net(x)
    rec = _record(stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    return out, want, rec


@pytest.mark.inductor
def test_parts_compile_in_children_and_a_restart_loads_them(small_parts, tmp_path, fresh_stats, clean_dynamo,
                                                           monkeypatch):
    """Also: the parts compile after Dynamo has built the trace's guards (it froze its shape
    environment then), and a size guard the caller's own part takes (here one added on purpose:
    the height a multiple of 16) is saved with the graph and checked on later calls."""
    compile_part, seen = split.compile_part, []

    def compile_part_taking_a_guard(part, compile_fn):
        env = split.shape_env_of(part.inputs)
        seen.append(bool(env.frozen))  # Dynamo freezes it once its guards are built
        if part.index == 0:
            height = next(d for t in part.inputs if isinstance(t, torch.Tensor) for d in t.shape[2:3]
                          if isinstance(d, torch.SymInt))
            assert height % 2 == 0  # a guard: Eq(Mod(s, 2), 0) (s: the height / 8, folded)
        return compile_part(part, compile_fn)

    monkeypatch.setattr(split, "compile_part", compile_part_taking_a_guard)
    x = torch.randn(2, 4, 16, 16)
    out, want, rec = _compiled_run(tmp_path, fresh_stats, x)
    assert seen == [False], seen  # the caller's own part, compiled with the environment reopened
    (late,) = rec["precompiled_late_size_guards"]
    assert "% 2" in late, late
    assert rec["compile_parts"].startswith("3 parts, 2 from child processes"), rec["compile_parts"]
    assert rec["precompiled"] == "on" and rec["compiles"] == 1
    # a cold compile: one miss, whatever the workers' parts count in Inductor's own cache
    assert rec["cache_misses"] == 1 and rec["cache_hits"] == 0, rec
    slowest = rec["compile_parts_slowest_child"]
    assert slowest["part"] in (1, 2) and slowest["compile_s"] > 0, slowest
    assert "compile_fx_inner" in slowest["phases_s"], slowest
    # every part's size, node kinds and compile time (the cut's balance, for the benchmark JSON)
    each = rec["compile_parts_each"]
    assert [d["part"] for d in each] == [0, 1, 2] and [d["where"] for d in each] == ["here", "child", "child"], each
    assert all(d["nodes"] > 0 and d["compile_s"] > 0 and sum(d["kinds"].values()) == d["nodes"] for d in each), each
    assert "compile_fx_inner" in each[0]["phases_s"] and each[slowest["part"]]["compile_s"] == slowest["compile_s"]
    assert all(0 < d["kernels"] <= d["distinct"] and d["cost"] == d["nodes"] + split.NEW_KERNEL_WEIGHT * d["kernels"]
               for d in each), each
    phases = rec["compile_phases"]
    assert {"trace_and_compile", "cut", "ship", "children_received", "children_compiled", "load",
            "first_run", "parts_loaded"} <= set(phases), phases
    # each part was loaded as it came in, and the first call ran them (no reload of the saved graph)
    assert rec["precompiled_first_call"] == "as compiled"
    # Inductor's CPU kernels against eager, both float32, one process
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    # a restart (a new wrapper, Dynamo reset): the saved split graph loads, nothing compiles
    nexfort_engine.reset_stats()
    torch._dynamo.reset()
    net2, cm2 = _compile(tmp_path)
    with torch.inference_mode():
        out2 = cm2(x)
    rec2 = _record(fresh_stats)
    assert rec2["compiles"] == 0 and rec2["cache_hits"] == 1 and rec2["fallbacks"] == 0, rec2
    assert "warm_load_part2" in rec2["compile_phases"], rec2["compile_phases"]
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # the late guard came back with the saved graph: a height of 32 passes it, 24 does not
    from nexfort_engine import shapes

    (artifact,) = cm2._nx_aot_artifacts
    assert [g.sources for g in artifact.size_guards] and "% 2" in artifact.size_guards[0].code
    for height, passes in ((32, True), (24, False)):
        with torch.inference_mode():
            x2 = torch.randn(2, 4, height, 16).contiguous(memory_format=torch.channels_last)
            y = shapes.fold_spatial((x2,), cm2._nx_fold, mark=False)
            why = artifact.check((net2, *y), {})
        assert (why is None) == passes, (height, why)
        if not passes:
            assert why.startswith("size guard ") and "fails" in why, why


@pytest.mark.inductor
def test_parts_that_cannot_ship_or_are_not_delivered_are_compiled_here(small_parts, tmp_path, fresh_stats,
                                                                         clean_dynamo, monkeypatch):
    """Part 1 cannot be pickled (its worker is stopped), part 2's worker crashes on what it
    receives: the parent compiles both itself, and the output is still the model's."""
    from nexfort_engine import ship

    dumps = ship.dumps

    def dumps_failing_part_1(obj):
        if obj[0] == 1:
            raise ship.ShipError("TypeError: cannot pickle this (a test)")
        if obj[0] == 2:
            return b"not a pickle"
        return dumps(obj)

    monkeypatch.setattr(ship, "dumps", dumps_failing_part_1)
    out, want, rec = _compiled_run(tmp_path, fresh_stats, torch.randn(1, 4, 16, 16))
    parts = rec["compile_parts"]
    assert parts.startswith("3 parts, 0 from child processes"), parts
    assert "part 1 compiled here: it cannot be shipped (TypeError: cannot pickle this" in parts, parts
    assert "part 2 compiled here: exit code" in parts, parts
    assert [d.get("where") for d in rec["compile_parts_each"]] == ["here"] * 3, rec["compile_parts_each"]
    assert rec["precompiled_first_call"] == "as compiled"
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.inductor
@torch.no_grad()
def test_a_worker_compiles_a_part_with_nexfort_ops(small_parts, tmp_path, fresh_stats, clean_dynamo):
    """A part holding ``nexfort::rms_norm_rope`` (the fused RoPE op, on by default on a GPU) compiles
    in its worker, a new process that ran no pass defining the op. Before the worker registered the
    engine's ops, it exited on ``AttributeError: ... no attribute 'rms_norm_rope'`` and the parent
    compiled that part itself (Flux compiled whole lost its compile workers)."""
    from tiny_models import FluxAttentionBlock, rel_l2, rotations

    torch.manual_seed(0)
    block = FluxAttentionBlock().to(torch.bfloat16)
    cm = nexfort_engine.compile(block, {"mode": "max-optimize:cache-all", "fused_rope": True, "compile_workers": 2},
                                cache_dir=str(tmp_path), label="rope-parts")
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    pe = rotations(1, 12, 32)
    out = cm(x, pe)
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0 and rec["rope_fused"] == 2, rec["fallback_reasons"]
    assert rec["compile_parts"] == "2 parts, 1 from child processes", rec["compile_parts"]
    child = next(d for d in rec["compile_parts_each"] if d["where"] == "child")
    assert child["kinds"].get("rms_norm_rope.default") == 2, rec["compile_parts_each"]
    assert rel_l2(out, block(x, pe)) < 1e-2  # the fused op keeps eager's roundings


@pytest.mark.inductor
@torch.no_grad()
def test_a_graph_with_host_calls_compiles_in_parts_and_its_host_code_runs_here(small_parts, tmp_path, fresh_stats,
                                                                                clean_dynamo):
    """Host calls (``nexfort::host_call``, an IPAdapter-like patch's ``.item()`` read) are opaque ops
    to a compile worker: the graph is cut and compiled in three processes like any other (it was
    compiled whole in the caller before: 146 s for SDXL with 70 of them, run276), and the host code
    runs in this process at every call, both branches of its sigma test, in one graph; a restart
    loads the saved split graph."""
    from cut_nets import host_net

    net = host_net()
    config = {"mode": "O2", "regional": False, "compile_workers": 3}
    cm = nexfort_engine.compile(net, config, cache_dir=str(tmp_path), label="host-parts")
    x = torch.randn(2, 4, 16, 16)
    outs = {}
    for sigma in (10.0, 1.0, 10.0):
        sigmas = torch.tensor([sigma])
        outs[sigma] = cm(x, sigmas)
        torch.testing.assert_close(outs[sigma], net(x, sigmas), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs[10.0], outs[1.0])  # the branch the host took shows
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec
    assert rec["host_calls"] == 3, rec
    assert rec["compile_parts"].startswith("3 parts, 2 from child processes"), rec["compile_parts"]
    kinds = [d["kinds"].get("host_call.default", 0) for d in rec["compile_parts_each"]]
    assert sum(kinds) == 3, rec["compile_parts_each"]
    nexfort_engine.reset_stats()
    torch._dynamo.reset()
    cm2 = nexfort_engine.compile(host_net(), config, cache_dir=str(tmp_path), label="host-parts")
    for sigma in (1.0, 10.0):
        torch.testing.assert_close(cm2(x, torch.tensor([sigma])), outs[sigma], rtol=0, atol=0)
    rec2 = _record(fresh_stats)
    assert rec2["compiles"] == 0 and rec2["cache_hits"] == 1 and rec2["fallbacks"] == 0, rec2


def test_a_graph_with_host_calls_keeps_cuda_graphs_between_them_where_inductor_partitions(monkeypatch):
    """A graph holding host calls compiles with the CUDA-graph settings as they are: graph partition
    on, so Inductor replays the pieces between the calls. Its saved graph is loaded under the same
    patches (``_inductor_patches``): run276 compiled such a graph with CUDA graphs off, its warm
    start loaded it with them on, torch refused it (AssertionError) and the model was traced again
    (48 s). Only where torch could not partition are CUDA graphs turned off."""
    import torch._inductor.compile_fx as compile_fx_module
    from cut_nets import host_net

    from nexfort_engine import host_call
    from nexfort_engine.compiler import CompiledModule
    from nexfort_engine.settings import resolve

    seen: list[dict] = []
    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, inputs, config_patches: seen.append(config_patches))
    cm = CompiledModule(torch.nn.Identity(), parse_options({"mode": "O2"}), None)
    cm._nx_settings = resolve(cm._nx_config, cuda=True)
    load = cm._inductor_patches()
    assert load["triton.cudagraphs"] is True and load["graph_partition"] is True
    host_net()  # its resolver
    gm = torch.fx.symbolic_trace(lambda h, s: host_call.call([h, s], "test.cut_nets.gate", [1], "0.25") + 1)
    plain = torch.fx.symbolic_trace(lambda h, s: h + s)
    assert host_call.in_graph(gm) and not host_call.in_graph(plain)
    assert host_call.partitions_cudagraphs()  # torch 2.11+ (the floor)
    cm._compile_graph(gm, [])
    cm._compile_graph(plain, [])
    for patches in seen:
        assert {k: patches[k] for k in ("triton.cudagraphs", "graph_partition")} == {
            "triton.cudagraphs": True, "graph_partition": True}, patches
    monkeypatch.setattr(host_call, "partitions_cudagraphs", lambda: False)
    cm._compile_graph(gm, [])
    assert seen[2]["triton.cudagraphs"] is False
    # on the CPU the settings have no CUDA graphs: nothing to turn off
    cm._nx_settings = resolve(cm._nx_config, cuda=False)
    cm._compile_graph(gm, [])
    assert "triton.cudagraphs" not in seen[3], seen[3]


@pytest.mark.inductor
def test_comfyuis_unet_compiles_in_shipped_parts_under_its_sampler(small_parts, patcher, tmp_path, monkeypatch,
                                                                    fresh_stats, clean_dynamo):
    """ComfyUI's SD1.5 UNet class through the node layer and ComfyUI's sampler: three parts, two
    compiled by workers from what the caller shipped; the image is eager's."""
    import tiny_models

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    err = tiny_models.sd15_compiled_error(patcher.compile_model_patcher,
                                          parse_options({"mode": "O1", "compile_workers": 3}))
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["compile_parts"].startswith("3 parts, 2 from child processes"), rec["compile_parts"]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec
    assert err <= 1e-3


def test_a_worker_waits_for_its_part_and_stops_when_cancelled(tmp_path):
    """A worker holds no model: its job is the options, settings and cache key. Started, it readies
    itself and waits for the part the parent would ship; the parent cancels it (the trace failed,
    or the graph was compiled whole) and it is gone, having written no part."""
    import time

    from nexfort_engine import background
    from nexfort_engine.settings import resolve

    config = parse_options({"mode": "O1", "compile_workers": 2})
    data = background.dumps({"config": config, "settings": resolve(config, cuda=False), "group_norm": False,
                             "label": "Net", "key": "ab" * 32, "grad": False})
    assert len(data) < 64 * 1024  # no weights travel
    job = background.start_worker(root=tmp_path, key="ab" * 32 + ".part1", data=data, label="Net", part=(1, 2))
    deadline = time.monotonic() + 120
    while (job.path / background.JOB_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the job file is consumed once the worker has loaded it
    assert not (job.path / background.JOB_FILE).exists(), background._tail(job.path / background.LOG_FILE)
    time.sleep(1.0)
    assert not job.done(), background._tail(job.path / background.LOG_FILE)  # waiting for its part
    job.cancel()
    assert job.done() and job.proc.returncode != 0
    assert not (job.path / background.PART_FILE).exists()


def test_the_cut_of_sdxls_traced_graph_is_the_measured_one():
    """The engine's cut over the nodes of SDXL's real traced graph (dumped on the GPU host by the
    probe, run192) gives the parts whose compile times run193 measured, with the last part no
    longer holding three times the new kernels of the transformer parts."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("fit_cut_cost", root / "benchmarks" / "fit_cut_cost.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    import gzip
    import json

    with gzip.open(root / "benchmarks/results/2026-11-25-h100/split-part-times/cut_nodes_sdxl.json.gz", "rt") as f:
        rows = json.load(f)["nodes"]
    parts = fit.cost_cut(rows, 6, split.OWN_PART_SHARE, split.NEW_KERNEL_WEIGHT)
    feats = fit.features(rows, parts, 6)
    assert [n for n, _k in feats] == [262, 667, 625, 625, 625, 365], feats  # sdxl_k14*.json, run193
    assert [k for _n, k in feats] == [26, 9, 12, 12, 12, 30], feats
    old = fit.features(rows, fit.node_cut(rows, 6, 0.7), 6)  # the node-count cut of before
    assert [n for n, _k in old] == [390, 556, 556, 556, 556, 555] and old[5][1] == 34, old
