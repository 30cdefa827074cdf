"""Parts cut while Dynamo still traces (stream.py), shipped to their workers at once.

The cuts (where they fall, what each part returns, that the plan over the parts computes what the
graph does, the engine's passes run on each part), the check against the finished graph that drops
streamed parts which do not fit it, the schedule that makes early parts larger, and - with real
Inductor compiles in real child processes - a conv net and ComfyUI's UNet under its sampler compiled
from parts shipped while the trace ran, a restart that loads them, and the drop that re-cuts the
graph with fresh workers.
"""

from __future__ import annotations

import contextlib
import operator

import cut_nets
import pytest
import torch
from cut_nets import net as _net

import nexfort_engine
from nexfort_engine import split, stream
from nexfort_engine.options import parse_options
from nexfort_engine.passes import group_norm


@pytest.fixture
def forced(monkeypatch):
    """Parts cut by cost (a tiny graph traces in milliseconds, which the schedule never cuts)."""
    monkeypatch.setenv(split.ENV_MIN_PART_NODES, "4")
    monkeypatch.setenv(stream.ENV_PART_COST, "30")


def _trace(net, x, workers=2, before_finish=None, rewrite=True):
    """Trace ``net(x)`` with a :class:`stream.Streamer` watching; the parts it ships, the split the
    backend made of the finished graph, the graph and its inputs."""
    shipped: list[split.Part] = []

    def send(part):
        shipped.append(part)
        return part.fingerprint()

    def passes(gm):
        if rewrite:
            group_norm.rewrite_group_norms(gm)

    streamer = stream.Streamer(workers, sum(1 for _ in net.parameters()), send, passes)
    got = {}

    def on_graph(gm):
        if before_finish is not None:
            before_finish(gm, streamer)
        got["cut"] = streamer.finish(gm, workers - len(streamer.shipped))

    got["gm"], got["inputs"] = cut_nets.dynamo_graph(net, x, context=streamer.watching, on_graph=on_graph,
                                                     fullgraph=True)
    return streamer, shipped, got


def test_parts_cut_while_tracing_run_like_the_graph(forced, clean_dynamo):
    net = _net()
    x = torch.randn(2, 4, 8, 8)
    streamer, shipped, got = _trace(net, x)
    cut = got["cut"]
    # two workers: one part shipped during the trace, the other kept for the tail
    assert len(streamer.shipped) == 1 and [p.index for p in shipped] == [0], streamer.report()
    assert len(cut.parts) == 2 and cut.parts[0] is shipped[0]
    # the cut fell where a block returned to the net's own loop: the part returns the hidden state
    # and the skip across the net (both read later), nothing from inside a block
    (s,) = streamer.shipped
    assert [n.name for n in s.outputs] == ["h", "h_1"], [n.name for n in s.outputs]
    assert s.nodes[-1].name == "h_1" and s.nodes[-1].target is operator.add, s.nodes[-1]
    users_after = {n for n in s.nodes for u in n.users if u not in set(s.nodes)}
    assert users_after <= set(s.outputs)
    # the GroupNorm pass ran on each part (its op in both), and the plan computes what the net does
    for part in cut.parts:
        assert any(n.target is group_norm.group_norm_channels_last for n in part.module.graph.nodes)
    with torch.no_grad():
        out = cut.plan.run([p.module for p in cut.parts], got["inputs"])
        torch.testing.assert_close(out[0], net(x), rtol=1e-5, atol=1e-5)
    assert len({p.fingerprint() for p in cut.parts}) == 2


def test_watching_the_trace_changes_nothing_dynamo_traces(forced, clean_dynamo):
    """The cuts only read the traced Python's variables (never realising a lazy one, which would
    add a graph input and guards): the finished graph has the inputs and computing nodes of a trace
    nobody watched, and an argument the model holds but never reads is not guarded on (another
    size of it does not recompile)."""

    class Holding(torch.nn.Module):  # holds an argument it never reads (a lazy variable in Dynamo)
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x: torch.Tensor, unused: torch.Tensor | None = None) -> torch.Tensor:
            return self.net(x)

    net = Holding()
    x = torch.randn(2, 4, 8, 8)
    for d in (0, 2, 3):
        torch._dynamo.mark_dynamic(x, d)

    def compiled_graphs(streamer):
        graphs = []

        def backend(gm, _example_inputs):
            graphs.append(gm)
            if streamer is not None:
                streamer.finish(gm, 1)
            return gm.forward

        torch._dynamo.reset()
        fn = torch.compile(net, backend=backend, dynamic=None, fullgraph=True)
        with torch.no_grad():
            with streamer.watching() if streamer is not None else contextlib.nullcontext():
                fn(x, torch.randn(3))
            fn(x, torch.randn(5))  # another size of the unread argument
        return graphs

    (plain,) = compiled_graphs(None)
    streamer = stream.Streamer(2, sum(1 for _ in net.parameters()), lambda part: part.fingerprint(), lambda gm: None)
    watched = compiled_graphs(streamer)
    assert streamer.shipped and len(watched) == 1, (streamer.report(), len(watched))

    def inputs(gm):
        return [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def computing(gm):
        return [(n.op, str(n.target)) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]

    assert inputs(watched[0]) == inputs(plain)
    assert computing(watched[0]) == computing(plain)


def test_more_workers_more_parts_and_unread_values_are_freed(forced, clean_dynamo, monkeypatch):
    net = _net()
    x = torch.randn(1, 4, 8, 8)
    monkeypatch.setenv(stream.ENV_TAIL_WORKERS, "1")
    streamer, _shipped, got = _trace(net, x, workers=4)
    assert streamer.tail == 1 and len(streamer.shipped) == 3 and len(got["cut"].parts) == 4, streamer.report()
    monkeypatch.delenv(stream.ENV_TAIL_WORKERS)
    streamer, shipped, got = _trace(net, x, workers=4)
    cut = got["cut"]
    # two workers kept for the tail (stream.TAIL_WORKERS), which is cut in two where it is long enough
    assert streamer.tail == 2 and len(streamer.shipped) == 2 and len(cut.parts) in (3, 4), streamer.report()
    # each part ends where a block returned (the net's own loop): it returns one or two values
    assert all(len(s.outputs) <= 2 for s in streamer.shipped), streamer.report()
    # every value a part returns is freed after its last reader, or right after its part when nobody
    # reads it; the graph's output is kept
    steps = cut.plan.steps
    produced = {s for _ins, start, n, _free in steps for s in range(start, start + n)}
    freed = [s for _ins, _start, _n, free in steps for s in free]
    kept = {v for kind, v in cut.plan.outputs if kind == "slot"}
    assert sorted(freed) == sorted(produced - kept)
    with torch.no_grad():
        out = cut.plan.run([p.module for p in cut.parts], got["inputs"])
        torch.testing.assert_close(out[0], net(x), rtol=1e-5, atol=1e-5)


def test_streamed_parts_that_do_not_fit_the_finished_graph_are_dropped(forced, clean_dynamo):
    """A node of a shipped part changed after its cut, or a value read after the cut that the part
    does not return (here: taken off its outputs): the check refuses the streamed parts."""
    net = _net()
    x = torch.randn(1, 4, 8, 8)

    def change_a_node(gm, streamer):
        node = next(n for n in streamer.shipped[0].nodes if n.op == "call_function" and len(n.args) > 1)
        node.args = (*node.args[:-1], node.args[-1])  # the same values, a new tuple: still fits
        assert streamer.finish.__self__ is streamer
        node.args = tuple(reversed(node.args))

    with pytest.raises(Exception) as info:
        _trace(net, x, before_finish=change_a_node)
    assert "changed after the cut" in str(info.value), info.value

    def forget_an_output(gm, streamer):
        streamer.shipped[0].outputs.pop()

    with pytest.raises(Exception) as info:
        _trace(net, x, before_finish=forget_an_output)
    assert "after the cut, and not returned" in str(info.value), info.value


def test_nothing_is_streamed_from_a_graph_traced_in_no_time(clean_dynamo, monkeypatch):
    """The schedule's own timing (no forced cost): a tiny net's trace ends long before a part cut
    from it could come back, so nothing is streamed and the finished graph is cut as before."""
    monkeypatch.delenv(stream.ENV_PART_COST, raising=False)
    streamer, shipped, got = _trace(_net(), torch.randn(1, 4, 8, 8))
    assert shipped == [] and got["cut"] is None and streamer.report()["streamed"] == 0


def test_the_schedule_makes_early_parts_larger():
    """Parts shipped while the trace goes on finish together: the earlier one is larger, and more
    workers finish sooner; SDXL's trace as measured (4961 cost traced in 19 s) with 7 workers."""

    def run(workers, total=4961.0, span=19.0):
        start, t, parts = 0.0, 0.0, []
        while t < span and len(parts) < workers - 1:
            t += 0.05
            traced = total * t / span
            seg = traced - start
            if traced / total < stream.MIN_PROGRESS or seg < stream.MIN_PART_COST:
                continue
            finish = stream.equal_finish(t, start, traced, traced / total, workers - len(parts))
            if t + stream.FIXED_S + stream.PER_COST_S * seg >= finish:
                parts.append((t, seg, t + stream.FIXED_S + stream.PER_COST_S * seg))
                start = traced
        tail = total - start
        return parts, span + stream.END_S + stream.FIXED_S + stream.PER_COST_S * tail / (workers - len(parts))

    parts, tail_done = run(7)
    sizes = [seg for _t, seg, _f in parts]
    assert len(parts) == 6 and sizes == sorted(sizes, reverse=True), sizes
    done = [f for _t, _s, f in parts] + [tail_done]
    assert max(done) - min(done) < 1.0, done
    # the whole graph cut at the trace's end, 8 parts of 637 (run195): about 40 s
    assert max(done) < 19 + stream.END_S + stream.FIXED_S + stream.PER_COST_S * 637 - 5
    assert run(9)[1] < tail_done


# -- real Inductor compiles in real child processes --------------------------------------------


def _compile(cache_dir):
    config = {"mode": "O2", "regional": False, "group_norm_rewrite": True, "memory_format": "channels_last",
              "compile_workers": 3}
    return nexfort_engine.compile(_net(), config, cache_dir=str(cache_dir))


def _record(stats) -> dict:
    (rec,) = stats()["models"].values()
    return rec


@pytest.mark.inductor
def test_parts_shipped_while_tracing_compile_in_children_and_a_restart_loads_them(forced, tmp_path, fresh_stats,
                                                                                 clean_dynamo):
    x = torch.randn(2, 4, 16, 16)
    cm = _compile(tmp_path)
    with torch.inference_mode():
        out = cm(x)
        want = _net()(x)
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    streamed = rec["compile_parts_streamed"]
    assert streamed["streamed"] == 1 and "failed" not in streamed and "dropped" not in streamed, streamed
    # both parts from children: the one shipped during the trace and the tail
    assert rec["compile_parts"].startswith("2 parts, 2 from child processes"), rec["compile_parts"]
    assert [d["where"] for d in rec["compile_parts_each"]] == ["child", "child"], rec["compile_parts_each"]
    assert rec["precompiled_first_call"] == "as compiled" and rec["compiles"] == 1
    assert "stream_hook" in rec["compile_phases"], rec["compile_phases"]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    nexfort_engine.reset_stats()
    torch._dynamo.reset()
    cm2 = _compile(tmp_path)  # (its weights made outside inference mode, as the first's)
    with torch.inference_mode():
        out2 = cm2(x)
    rec2 = _record(fresh_stats)
    assert rec2["compiles"] == 0 and rec2["cache_hits"] == 1 and rec2["fallbacks"] == 0, rec2
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


@pytest.mark.inductor
def test_streamed_parts_dropped_at_the_end_are_cut_again_by_fresh_workers(forced, tmp_path, fresh_stats,
                                                                          clean_dynamo, monkeypatch):
    finish = stream.Streamer.finish

    def finish_refusing(self, gm, tail_parts):
        if self.shipped:
            raise stream.Failed("refused by the test")
        return finish(self, gm, tail_parts)

    monkeypatch.setattr(stream.Streamer, "finish", finish_refusing)
    x = torch.randn(1, 4, 16, 16)
    with torch.inference_mode():
        out = _compile(tmp_path)(x)
        want = _net()(x)
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["compile_parts_streamed"]["dropped"] == "refused by the test", rec["compile_parts_streamed"]
    # the streamed part's GroupNorms were rewritten, and then the whole graph's: counted once
    assert rec["group_norms_rewritten"] == 12, rec["group_norms_rewritten"]
    # the finished graph cut in three as without streaming, the worker of the dropped part replaced
    assert rec["compile_parts"].startswith("3 parts, 2 from child processes"), rec["compile_parts"]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.inductor
def test_comfyuis_unet_compiles_from_parts_shipped_while_tracing(forced, patcher, tmp_path, monkeypatch, fresh_stats,
                                                                 clean_dynamo):
    """ComfyUI's SD1.5 UNet class through the node layer and ComfyUI's sampler (its attention
    unpacks a ``map``, its blocks hold skip connections in a list): parts cut while tracing, the
    check against the finished graph passes, and the image is eager's."""
    import tiny_models

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(stream.ENV_PART_COST, "150")
    err = tiny_models.sd15_compiled_error(patcher.compile_model_patcher,
                                          parse_options({"mode": "O1", "compile_workers": 3}))
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    streamed = rec["compile_parts_streamed"]
    assert streamed["streamed"] == 1 and "dropped" not in streamed and "failed" not in streamed, streamed
    assert rec["compile_parts"].startswith("2 parts, 2 from child processes"), rec["compile_parts"]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec
    assert err <= 1e-3
