"""Parts cut while Dynamo traces the narrow SDXL UNet (stream.py), on the CPU box: where the
schedule cuts (its own timing, ``NEXFORT_STREAM_PART_COST`` unset) or fixed costs (set), how many
values each part returns, what the cutting costs the trace, and whether the streamed parts pass
the check against the finished graph. Each part is pickled as it would be shipped (``ship.dumps``);
the parts' plan is run eagerly on the trace's inputs against the graph itself.

    python benchmarks/results/2026-11-26-cpu/stream_sdxl.py [workers]
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-25-cpu"))
import narrow_sdxl  # noqa: E402
import torch  # noqa: E402

from nexfort_engine import ship, split, stream, trace_ops  # noqa: E402
from nexfort_engine.passes import group_norm  # noqa: E402

workers = int(sys.argv[1]) if len(sys.argv) > 1 else 7
shipped: list[tuple[int, float, int]] = []


def send(part: split.Part) -> str:
    t0 = time.perf_counter()
    data = ship.dumps((part.index, part.fingerprint(), part.single, part.module, part.inputs))
    shipped.append((part.index, round(time.perf_counter() - t0, 3), len(data)))
    return part.fingerprint()


def passes(gm: torch.fx.GraphModule) -> None:
    trace_ops.restore(gm)
    group_norm.rewrite_group_norms(gm)


dm = narrow_sdxl.unet()
with torch.no_grad():  # ComfyUI's layers skip their init: random weights for a comparable output
    for p in dm.parameters():
        p.normal_(0.0, 0.02)
params = sum(1 for _ in dm.parameters()) + sum(1 for _ in dm.buffers())
streamer = stream.Streamer(workers, params, send, passes)
profile = cProfile.Profile()
_returned = streamer._returned


def returned(tx, result) -> None:  # the hook's own work, profiled
    profile.enable()
    try:
        _returned(tx, result)
    finally:
        profile.disable()


streamer._returned = returned
t_start = time.perf_counter()
result: dict = {}


def backend(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    result["trace_s"] = time.perf_counter() - t_start
    t0 = time.perf_counter()
    cut = streamer.finish(gm, workers - len(streamer.shipped))
    result["finish_s"] = time.perf_counter() - t0
    trace_ops.restore(gm)  # the graph as it computes (the stand-ins only allocate)
    gm.recompile()
    want = gm(*example_inputs)
    got = cut.plan.run([p.module for p in cut.parts], example_inputs)
    pairs = [(a, b) for a, b in zip(got, want, strict=True) if isinstance(b, torch.Tensor)]
    assert [a for a, b in zip(got, want, strict=True) if not isinstance(b, torch.Tensor)] == [
        b for b in want if not isinstance(b, torch.Tensor)]
    result["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
    result["max_abs"] = max(float(b.abs().max()) for _a, b in pairs)
    result["tail"] = cut.parts[len(streamer.shipped):]
    result["parts"] = [(len([n for n in p.module.graph.nodes if n.op not in ("placeholder", "output")]),
                        len(p.inputs)) for p in cut.parts]
    raise narrow_sdxl.Done


args, kwargs = narrow_sdxl.call(dm)
try:
    with torch.no_grad(), trace_ops.standing_in(), streamer.watching():
        from nexfort_engine import precompile

        precompile.trace(type(dm).forward, args, kwargs, backend, "self", trace_ops.originals())
except Exception as e:  # noqa: BLE001
    while e is not None and not isinstance(e, narrow_sdxl.Done):
        e = getattr(e, "inner_exception", None) or e.__cause__
    if e is None:
        raise
print("report", streamer.report())
print("the hook's time by function (cProfile, top 14 cumulative):")
pstats.Stats(profile).sort_stats("cumulative").print_stats(14)
print("trace_s", round(result["trace_s"], 2), "finish_s", round(result["finish_s"], 3))
# when each part would be back on a GPU host, by the schedule's model (FIXED_S + PER_COST_S * cost;
# the tail, shipped at the trace's end, STREAM.END_S later)
back = [round(t + stream.FIXED_S + stream.PER_COST_S * c, 1) for t, c in zip(streamer.report()["at_s"],
                                                                            streamer.report()["costs"], strict=True)]
tail = [split.part_costs(p.module, {n: 0 for n in p.module.graph.nodes if n.op not in ("placeholder", "output")})[0]
        for p in result["tail"]]
back += [round(result["trace_s"] + stream.END_S + stream.FIXED_S + stream.PER_COST_S * c, 1) for c in tail]
print("modelled back at (s into the trace)", back, "tail costs", tail)
print("shipped (index, pickling s, bytes)", shipped)
print("parts (compute nodes, inputs)", result["parts"])
print("plan against the graph: max |diff|", result["max_abs_diff"], "of max |out|", result["max_abs"])
