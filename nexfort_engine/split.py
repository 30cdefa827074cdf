"""One traced graph compiled as consecutive parts, the parts compiled in parallel processes.

What: with ``"compile_workers": N`` (N > 1), the graph Dynamo traces from a whole model is cut into N
consecutive parts of about equal compile cost (:func:`split`, torch.fx's ``split_module``; the cost
is a part's node count plus a weight per distinct kernel, :func:`assign`). Each part
is compiled by AOTAutograd and Inductor on its own: N - 1 of them by compile workers, child
processes started when the trace starts (:func:`nexfort_engine.background.start_worker`), one in
the caller's process. A worker holds no model: it gets the engine's options and resolved settings,
readies itself (Inductor imported, its compile pool and CUDA context started) while the caller
traces, and then receives its part, pickled by :mod:`nexfort_engine.ship` (the part's graph, the
fake values of its inputs, the shape environment). The caller collects the compiled parts as
bytes, adds the size guards each part's compile made to its own shape environment
(:func:`apply_guards`), and returns a :class:`SplitCallable`: a fixed plan that calls the parts in
order and passes values between them. It saves and loads as the whole graph's compiled function
would (a warm start loads one module per part: SDXL's took 2-4 s longer on an H200, BENCHMARKS.md
twenty-third session).

Why: AOTAutograd's and Inductor's work on one graph runs on a single Python thread. A dynamic-shape
UNet's cold compile is mostly that work (SDXL: 128 of 175 s on an H200, BENCHMARKS.md twenty-first
session), and it grows with the node count, so N processes divide it by about N. What is not
divided: the trace, the cut, and loading the parts. Measured with 6 processes when every worker
still traced the model itself (with its own zero-filled copy of the weights on the GPU): SD2.1
84-128 s -> 55-64 s, SDXL 170-175 s -> 87-99 s, the same speed (runs 180-183). Shipping the part
instead takes the workers' traces (six at once: SDXL 27 s) and their copies of the weights away.

What a cut costs at run time: kernels do not fuse across a cut (cuts fall between nodes, N - 1 of
them), and under CUDA graphs each part is its own recorded graph, replayed one after another.

Safety: a part that cannot be shipped, whose worker failed, or whose guards do not hold here, is
compiled in the caller's process instead. Cutting needs every value crossing a cut to carry a true
example value (its fake tensor): those the engine's graph passes left stale are recomputed first
(:func:`refresh_examples`); a graph without them is compiled whole (:func:`split` returns ``None``).

Auto (``"compile_workers": null``, the default): :func:`workers` processes on a CUDA device, as many
as device memory (a CUDA context each) and host memory hold (:func:`children_that_fit`); one on the
CPU.

Twin: the whole graph compiled at once (``"compile_workers": 1``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import operator
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
from torch import fx

log = logging.getLogger(__name__)

#: a graph with fewer compute nodes than this per part is not cut (each part costs a worker);
#: ``NEXFORT_MIN_PART_NODES`` overrides it (tests cut tiny graphs)
MIN_NODES_PER_PART = 64
ENV_MIN_PART_NODES = "NEXFORT_MIN_PART_NODES"
#: the first part's cost against each other part's (the caller compiles it, after Dynamo's guards)
OWN_PART_SHARE = 0.8
ENV_OWN_PART_SHARE = "NEXFORT_OWN_PART_SHARE"
#: op codes that are bookkeeping, not compute: not counted when balancing the parts
_FREE_OPS = ("placeholder", "output", "get_attr")
#: what a node that makes a kernel unlike any before it in its part costs, in compute nodes. A
#: worker's part compiled in about 0.042 s per node + 0.58 s per such kernel + 3.4 s (fit over 49
#: parts of SDXL and SD2.1 compiled by workers in nine cold compiles, runs 192-193, on each
#: machine's own scale; 8 % rms error): 14 nodes. Counting nodes alone left SDXL's last part (its
#: output blocks: ResBlocks at three widths) 50 % slower than the others, while its repeated
#: transformer blocks reuse their few kernels. A first fit without cuts of unequal node counts
#: (34 nodes) overloaded the transformer stretch (run193).
NEW_KERNEL_WEIGHT = 14
#: node targets (functions, and methods without their dot) that make no kernel of their own
_NO_KERNEL = frozenset({
    "view", "reshape", "transpose", "permute", "movedim", "flatten", "unflatten", "chunk", "split", "unbind",
    "contiguous", "type", "float", "half", "bfloat16", "to", "expand", "unsqueeze", "squeeze", "size", "dim",
    "dropout", "linear", "conv1d", "conv2d", "conv3d", "scaled_dot_product_attention", "matmul", "bmm", "mm",
    "addmm", "baddbmm", "einsum",
})


#: a child that has not delivered its part by then is stopped, and the part compiled here
CHILD_TIMEOUT_S = 1800.0
#: what a compile worker needs on the device: its CUDA context (it compiles; it never runs the
#: model, and holds no weights)
CHILD_OVERHEAD_BYTES = 1 << 30


#: auto: at most this many processes (the caller included), one per two cores. With shipped parts
#: (no worker traces the model), SDXL's cold O2 compile on a 16-core H100 host took 60.8-61.1 s
#: with 6, 50.6-52.3 s with 8 and 55.3 s with 12 (one process per core: the parts' compile
#: threads compete); BENCHMARKS.md, twenty-eighth session. Before the parts were shipped, when
#: every worker traced the model, 8 had been slower than 6 (SD2.1 88.3 s against 56.3 s).
AUTO_WORKERS = 8


def workers(option: int | None, backend: str, example: torch.Tensor | None, flags: Sequence[str] = ()) -> int:
    """How many processes (the caller included) compile a traced graph: the option, else (auto)
    up to :data:`AUTO_WORKERS` on a CUDA device, one per two cores; one on the CPU (its Inductor
    compiles C++ with all cores already). Always one under ``freezing``: that flag bakes the
    weights' values into the graph, and a worker has none."""
    if backend != "inductor" or "freezing" in flags:
        return 1
    if option is not None:
        return option
    if example is None or example.device.type != "cuda":
        return 1
    return max(1, min(AUTO_WORKERS, _cores() // 2))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: host memory a compile worker is assumed to need (an estimate, not measured: a Python process
#: with torch, Inductor, its compile pool and one part's graph)
CHILD_HOST_BYTES = 4 << 30


def host_available_bytes() -> int | None:
    """The host's available memory (Linux ``MemAvailable``), or ``None`` where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def children_that_fit(device: torch.device,
                      free_fn: Callable[[torch.device], tuple[int, int]] | None = None,
                      host_fn: Callable[[], int | None] = host_available_bytes) -> int:
    """How many compile workers fit now: their CUDA contexts in ``device``'s free memory, and their
    processes in the host's available memory."""
    host = host_fn()
    fit = (1 << 16) if host is None else int(host // CHILD_HOST_BYTES)
    if device.type != "cuda":
        return fit
    free, _total = (free_fn or torch.cuda.mem_get_info)(device)
    return min(fit, int(free // CHILD_OVERHEAD_BYTES))


def child_threads(count: int) -> int:
    """Inductor compile threads per child: the machine's cores shared among ``count`` processes."""
    return max(1, _cores() // count)


#: seconds each part of the split graph loaded last took to deserialize (diagnostics)
LOAD_SECONDS: list[float] = []


@dataclass
class Part:
    """One part of a split graph: its graph module and the fake values of its inputs."""

    index: int
    module: fx.GraphModule
    inputs: list[Any]
    #: whether the part returned one value before its output was made a tuple
    single: bool

    def fingerprint(self) -> str:
        """Equal in two processes exactly when the part's code and input metadata are."""
        h = hashlib.sha256(self.module.code.encode())
        for v in self.inputs:
            h.update(_describe(v).encode())
        return h.hexdigest()[:24]


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"T({v.dtype},{v.device},{tuple(map(str, v.shape))},{tuple(map(str, v.stride()))})"
    return f"{type(v).__name__}({v})"


@dataclass
class Split:
    """A graph cut into parts, and the plan that runs them."""

    parts: list[Part]
    plan: Plan


@dataclass(frozen=True)
class Plan:
    """How the parts run: slots ``[0, n_args)`` are the call's arguments, then each part's outputs.

    ``steps``: per part, ``(input slots, first output slot, output count, slots freed after it)``;
    ``outputs``: per returned value, ``("slot", i)`` or ``("const", value)``."""

    n_args: int
    steps: tuple[tuple[tuple[int, ...], int, int, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, Any], ...]

    @property
    def n_slots(self) -> int:
        return self.n_args + sum(n for _ins, _start, n, _free in self.steps)

    def run(self, fns: Sequence[Callable[..., Any]], args: Sequence[Any]) -> tuple[Any, ...]:
        slots: list[Any] = [*args, *([None] * (self.n_slots - self.n_args))]
        for fn, (ins, start, n, free) in zip(fns, self.steps, strict=True):
            outs = fn(*[slots[i] for i in ins])
            slots[start:start + n] = list(outs)[:n]
            for i in free:
                slots[i] = None
        return tuple(slots[v] if kind == "slot" else v for kind, v in self.outputs)


def _weight(node: fx.Node) -> int:
    if node.op in _FREE_OPS or (node.op == "call_function" and node.target is operator.getitem):
        return 0
    return 1


def _makes_kernel(node: fx.Node) -> bool:
    """Whether Inductor generates a kernel of its own for the node (not a view or layout change it
    folds into the kernels around it, an identity, or a call into a library's matmul, convolution
    or attention)."""
    return bool(_weight(node)) and _kind(node).lstrip(".") not in _NO_KERNEL


def node_costs(nodes: Iterable[fx.Node]) -> list[tuple[fx.Node, int, Hashable | None]]:
    """Per node, in the order given: its weight, and its kernel signature if it makes a kernel."""
    return [(node, _weight(node), _signature(node) if _makes_kernel(node) else None) for node in nodes]


def _costs(gm: fx.GraphModule) -> list[tuple[fx.Node, int, Hashable | None]]:
    """:func:`node_costs` of the graph's compute nodes, in graph order."""
    return node_costs(node for node in gm.graph.nodes if node.op not in ("placeholder", "output"))


def added_cost(weight: int, sig: Hashable | None, seen: set[Hashable], kernel_weight: int = NEW_KERNEL_WEIGHT) -> int:
    """What a node of ``weight`` and kernel signature ``sig`` adds to a part whose kernel signatures
    are ``seen`` (left unchanged): its weight, and ``kernel_weight`` if its kernel is a new one."""
    return weight + kernel_weight * (sig is not None and sig not in seen)


def min_part_nodes() -> int:
    """The fewest compute nodes a part is cut to (``NEXFORT_MIN_PART_NODES``)."""
    return int(os.environ.get(ENV_MIN_PART_NODES) or MIN_NODES_PER_PART)


def _fill(costs: Sequence[tuple[Any, int, Hashable | None]], n: int, cap: float, share: float,
          kernel_weight: int) -> tuple[list[int], bool]:
    """Greedy consecutive parts of at most ``cap`` (the first: ``share * cap``); whether they fit."""
    out: list[int] = []
    part, cost, seen, ok = 0, 0.0, set[Hashable](), True
    for _node, weight, sig in costs:
        if (weight and cost > 0 and part < n - 1
                and cost + added_cost(weight, sig, seen, kernel_weight) > _budget(part, cap, share)):
            part, cost, seen = part + 1, 0.0, set()
        cost += added_cost(weight, sig, seen, kernel_weight)
        if sig is not None:
            seen.add(sig)
        ok = ok and cost <= _budget(part, cap, share)
        out.append(part)
    return out, ok


def _budget(part: int, cap: float, share: float) -> float:
    return cap * share if part == 0 else cap


def _cost(nodes: int, kernels: int) -> int:
    """A part's compile cost as the cut weighs it (:data:`NEW_KERNEL_WEIGHT`)."""
    return nodes + NEW_KERNEL_WEIGHT * kernels


def cut_costs(costs: Sequence[tuple[Any, int, Hashable | None]], n: int, share: float,
              kernel_weight: int | None = None) -> list[int]:
    """Each node's part in the cut of ``n`` parts whose costliest part is least (the first part's
    budget ``share`` times the others'): bisection over the budget with :func:`_fill`. ``costs``:
    per node, (anything, weight, kernel signature or ``None``), as :func:`_costs` gives them;
    ``kernel_weight``: :data:`NEW_KERNEL_WEIGHT` unless given (the fit weighs other values)."""
    kw = NEW_KERNEL_WEIGHT if kernel_weight is None else kernel_weight
    total = sum(weight for _node, weight, _sig in costs)
    lo, hi = 0, int(total * (1 + kw) * max(1.0, 1 / share)) + 1  # hi fits all in part 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fill(costs, n, mid, share, kw)[1]:
            hi = mid
        else:
            lo = mid
    return _fill(costs, n, hi, share, kw)[0]


def part_costs(gm: fx.GraphModule, mapping: dict[fx.Node, int]) -> list[int]:
    """What :func:`assign` weighs each part at: its compute nodes, plus :data:`NEW_KERNEL_WEIGHT`
    per kernel signature the part holds."""
    n = max(mapping.values()) + 1
    weights, sigs = [0] * n, [set[Hashable]() for _ in range(n)]
    for node, weight, sig in _costs(gm):
        weights[mapping[node]] += weight
        if sig is not None:
            sigs[mapping[node]].add(sig)
    return [_cost(w, len(s)) for w, s in zip(weights, sigs, strict=True)]


def assign(gm: fx.GraphModule, n: int) -> dict[fx.Node, int] | None:
    """Node -> part for ``n`` consecutive parts of about equal compile cost (graph order is
    topological, so every value flows forward), or ``None`` if the graph is too small to cut.

    A part's cost is its compute-node count plus :data:`NEW_KERNEL_WEIGHT` per kernel unlike the
    others in it (:func:`part_costs`): the cut that minimises the most costly part, found by
    bisection over that maximum with a greedy fill. The first part (the caller's) gets
    ``NEXFORT_OWN_PART_SHARE`` (default :data:`OWN_PART_SHARE`) times the others' budget."""
    costs = _costs(gm)
    total = sum(weight for _node, weight, _sig in costs)
    if n < 2 or total < n * min_part_nodes():
        return None
    share = float(os.environ.get(ENV_OWN_PART_SHARE) or OWN_PART_SHARE)
    if not 0.05 <= share <= 4.0:
        raise ValueError(f"{ENV_OWN_PART_SHARE}={share}: a share from 0.05 to 4")
    out = {node: part for (node, _w, _s), part in zip(costs, cut_costs(costs, n, share), strict=True)}
    # a get_attr goes with its first user (split_module copies the attribute into that part)
    for node, _w, _s in costs:
        if node.op == "get_attr" and node.users:
            out[node] = min(out[u] for u in node.users if u in out) if any(u in out for u in node.users) else out[node]
    if len(set(out.values())) < n:
        return None
    return out


def _example(node: fx.Node) -> Any:
    """Dynamo's fake value for a node (a tensor, a SymInt or a plain value); KeyError if none."""
    for key in ("example_value", "val"):
        if key in node.meta:
            return node.meta[key]
    raise KeyError(node.name)


def _layout(v: Any) -> Any:
    """What of an example value a cut depends on, comparable without guarding on symbols."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, tuple(map(_size_key, v.shape)), tuple(map(_size_key, v.stride())))
    if isinstance(v, (tuple, list)):
        return tuple(_layout(x) for x in v)
    return type(v).__name__


def _ours(target: Any) -> bool:
    """A function or op the engine's graph passes put into graphs."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target).startswith("nexfort.")  # a packet has no ``namespace``
    return str(getattr(target, "__module__", "")).startswith("nexfort_engine")


def refresh_examples(gm: fx.GraphModule) -> int:
    """Recompute the example values the engine's graph passes left stale; how many changed.

    The passes retarget nodes and keep Dynamo's example values, which describe the replaced op:
    the channels-last GroupNorm returns a channels-last tensor where ATen's returned a contiguous
    one, and so do the elementwise ops after it. Inside one compiled graph that is harmless; at a
    cut, the value's layout is what the next part is compiled to receive, and it must be what the
    part before returns (the GPU's first try, run176, failed Inductor's stride assertion on it).
    The nodes the passes made are run again on fake values, and after them every node reading a
    value whose layout changed (a convolution's output keeps its layout, which ends the chain). A
    whole-graph fake propagation did the same in 8.2 s on SD2.1's UNet (run178)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensor

    mode = next((v.fake_mode for node in gm.graph.nodes if node.op == "placeholder"
                 for v in [node.meta.get("example_value")] if isinstance(v, FakeTensor)), None)
    if mode is None:
        return 0
    dirty: set[fx.Node] = set()
    changed = 0

    def value(a: Any) -> Any:
        return _example(a) if isinstance(a, fx.Node) else a

    with mode, enable_python_dispatcher():
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            if not (node.op == "call_function" and _ours(node.target)) and not any(
                a in dirty for a in node.all_input_nodes
            ):
                continue
            args = fx.node.map_aggregate(node.args, value)
            kwargs = fx.node.map_aggregate(node.kwargs, value)
            if node.op == "call_method":
                new = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                new = getattr(node.target, "_nexfort_example", node.target)(*args, **kwargs)
            old = node.meta.get("example_value")
            node.meta["example_value"] = new
            if _layout(new) != _layout(old):
                dirty.add(node)
                changed += 1
    return changed


def split(gm: fx.GraphModule, n: int) -> Split | None:
    """Cut ``gm`` into ``n`` parts (see :func:`assign`), each returning a tuple, with the fake
    values of their inputs; ``None`` where the graph is too small or lacks example values."""
    mapping = assign(gm, n)
    if mapping is None:
        return None
    try:
        if os.environ.get("NEXFORT_SPLIT_NO_REFRESH") != "1":  # tests: without it, a cut fails
            refresh_examples(gm)
    except KeyError as e:
        log.info("nexfort: not cutting the graph: input %s has no example value", e)
        return None
    from torch._dynamo.backends.distributed import propagate_dynamo_source, propagate_metadata
    from torch.fx.passes.split_module import split_module

    outer = split_module(gm, None, lambda node: mapping[node], keep_original_order=True)
    if hasattr(gm, "_param_name_to_source"):
        propagate_dynamo_source(gm, outer)
        propagate_metadata(gm, outer)
    calls = [node for node in outer.graph.nodes if node.op == "call_module"]
    if len(calls) != n:
        return None
    placeholders = [node for node in outer.graph.nodes if node.op == "placeholder"]
    slot: dict[fx.Node, int] = {node: i for i, node in enumerate(placeholders)}
    next_slot = len(placeholders)
    parts: list[Part] = []
    steps: list[tuple[tuple[int, ...], int, int, tuple[int, ...]]] = []
    for index, call in enumerate(calls):
        module = getattr(outer, str(call.target))
        out_node = next(node for node in module.graph.nodes if node.op == "output")
        single = not isinstance(out_node.args[0], (tuple, list))
        if single:
            out_node.args = ((out_node.args[0],),)
            module.recompile()
        n_out = len(out_node.args[0])
        try:
            inputs = [_example(node) for node in module.graph.nodes if node.op == "placeholder"]
        except KeyError as e:
            log.info("nexfort: not cutting the graph: value %s has no example value", e)
            return None
        if any(not isinstance(a, fx.Node) for a in call.args) or call.kwargs:
            return None
        ins = tuple(slot[a] for a in call.args)
        start = next_slot
        next_slot += n_out
        if single:
            slot[call] = start
        else:
            for user in call.users:
                if user.op != "call_function" or user.target is not operator.getitem:
                    return None
                slot[user] = start + int(user.args[1])
        parts.append(Part(index=index, module=module, inputs=inputs, single=single))
        steps.append((ins, start, n_out, ()))
    out_args = next(node for node in outer.graph.nodes if node.op == "output").args[0]
    if not isinstance(out_args, (tuple, list)):
        out_args = (out_args,)
    outputs = tuple(("slot", slot[a]) if isinstance(a, fx.Node) else ("const", a) for a in out_args)
    # free each intermediate value after its last reader (a returned one is kept)
    last: dict[int, int] = {}
    for i, (ins, _s, _n, _f) in enumerate(steps):
        for s in ins:
            if s >= len(placeholders):
                last[s] = i
    kept = {v for kind, v in outputs if kind == "slot"}
    steps = [(ins, start, n_out, tuple(sorted(s for s, i in last.items() if i == k and s not in kept)))
             for k, (ins, start, n_out, _f) in enumerate(steps)]
    return Split(parts=parts, plan=Plan(n_args=len(placeholders), steps=tuple(steps), outputs=outputs))


# -- compiling a part, and what travels from a child -------------------------------------------


def compile_part(part: Part, compile_fn: Callable[[fx.GraphModule, list[Any]], Any]) -> bytes:
    """Compile one part with ``compile_fn`` (Inductor's ``compile_fx`` with the engine's patches)
    in a tracing context of its own, and return its compiled function serialised."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    from torch._guards import TracingContext, detect_fake_mode, tracing

    fake_mode = detect_fake_mode(part.inputs)
    with tracing(TracingContext(fake_mode)):
        compiled = compile_fn(part.module, list(part.inputs))
    if not hasattr(compiled, "serialize"):
        raise RuntimeError(f"part {part.index}: the compiled function cannot be serialised ({type(compiled).__name__})")
    wrapped = BundledAOTAutogradSerializableCallable(compiled)
    return BundledAOTAutogradSerializableCallable.serialize_compile_artifacts(wrapped)


def shape_env_of(values: Sequence[Any]) -> Any:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(values))
    return None if mode is None else mode.shape_env


def guards_since(shape_env: Any, start: int) -> list[str]:
    """The size guards added to ``shape_env`` after its first ``start`` ones, as text."""
    if shape_env is None:
        return []
    return [str(g.expr) for g in shape_env.guards[start:]]


def apply_guards(shape_env: Any, guards: Sequence[str]) -> str | None:
    """Add a child's guards to this process's shape environment (the same symbols: the same trace);
    the reason if one does not hold here, else ``None``."""
    if not guards:
        return None
    if shape_env is None:
        return "no shape environment here"
    import sympy

    from .shapes import traced_sizes

    symbols = {str(s): s for s in traced_sizes(shape_env)}
    for text in guards:
        try:
            expr = sympy.sympify(text, locals=symbols)
            value = shape_env.evaluate_expr(expr)
        except Exception as e:  # noqa: BLE001 - sympy/torch raise many types: "compile it here"
            return f"guard {text!r}: {type(e).__name__}: {e}"
        if not bool(value):
            return f"guard {text!r} does not hold here"
    return None


def _kind(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"module:{node.target}"
    return str(getattr(node.target, "__name__", node.target))


def part_profile(part: Part, top: int = 40) -> dict[str, Any]:
    """What a part holds (diagnostics for the cut's balance): its compute-node count, its distinct
    node layouts, its kernels as :func:`assign` counts them and its cost there, and its ``top``
    most frequent node targets with their counts."""
    kinds: dict[str, int] = {}
    signatures: set[Hashable] = set()
    kernels: set[Hashable] = set()
    weight = 0
    for node, w, sig in _costs(part.module):
        weight += w
        if w:
            kinds[_kind(node)] = kinds.get(_kind(node), 0) + 1
            signatures.add(_signature(node) if sig is None else sig)
            if sig is not None:
                kernels.add(sig)
    ranked = dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))[:top])
    return {"part": part.index, "nodes": weight, "distinct": len(signatures), "kernels": len(kernels),
            "cost": _cost(weight, len(kernels)), "inputs": len(part.inputs), "kinds": ranked}


def _signature(node: fx.Node) -> Hashable:
    """A node's target with its output's layout (dtype, device, sizes and strides, symbolic ones as
    their sympy expressions: printing them would cost a cut of SDXL 0.4 s): nodes alike in it
    compile to alike kernels."""
    try:
        value = _example(node)
    except KeyError:
        value = None
    if not isinstance(value, torch.Tensor):
        return (_kind(node), type(value).__name__)
    return (_kind(node), value.dtype, value.device.type, tuple(map(_size_key, value.shape)),
            tuple(map(_size_key, value.stride())))


def _size_key(v: Any) -> Hashable:
    return v.node.expr if isinstance(v, torch.SymInt) else v


def top_phases(phases: dict[str, float], top: int = 8) -> dict[str, float]:
    """The ``top`` longest of torch's compile phases, in seconds to 0.01 s."""
    return {k: round(v, 2) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])[:top]}


def _child_seconds(d: dict[str, Any]) -> float | None:
    times = d.get("times") or {}
    return times["compiled"] - times["unpickled"] if {"unpickled", "compiled"} <= set(times) else None


def child_timing(d: dict[str, Any], top: int = 8) -> dict[str, Any] | None:
    """A delivered part's (:func:`load_part`'s dict) index, seconds from its arrival to its
    compiled bytes and the ``top`` longest of torch's compile phases in it; ``None`` if untimed."""
    seconds = _child_seconds(d)
    if seconds is None:
        return None
    return {"part": d["index"], "compile_s": round(seconds, 3), "phases_s": top_phases(d.get("phases") or {}, top)}


def slowest_child(delivered: Sequence[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Of the parts workers delivered, the one that took longest to compile after it arrived
    (:func:`child_timing`; diagnostics: where a cut compile's wait goes)."""
    timed = [d for d in delivered if _child_seconds(d) is not None]
    if not timed:
        return {}
    return child_timing(max(timed, key=lambda d: _child_seconds(d) or 0.0), top) or {}


def dump_part(index: int, fingerprint: str, data: bytes, guards: list[str],
              times: dict[str, float] | None = None, phases: dict[str, float] | None = None) -> bytes:
    """What a child writes: its part's compiled bytes, fingerprint, guards, step times (wall clock)
    and the seconds torch timed per compile phase."""
    return pickle.dumps({"index": index, "fingerprint": fingerprint, "compiled": data, "guards": guards,
                         "times": dict(times or {}), "phases": dict(phases or {})},
                        protocol=pickle.HIGHEST_PROTOCOL)


def load_part(blob: bytes) -> dict[str, Any]:
    obj = pickle.load(io.BytesIO(blob))  # noqa: S301 - written by our own child process
    if not isinstance(obj, dict) or not {"index", "fingerprint", "compiled", "guards"} <= set(obj):
        raise ValueError("not a compiled part")
    return obj


# -- the compiled function of a split graph ----------------------------------------------------


def load_compiled(blob: bytes, inductor_config: dict[str, Any] | None = None) -> Callable[..., Any]:
    """One part's compiled function from its bytes (:func:`compile_part`'s output), loaded as
    torch loads a saved graph's compiled function (``AOTCompiledFunction.deserialize``).
    ``inductor_config``: the patches the part was compiled with, where the caller loads outside
    them (CUDA graphs are decided at load)."""
    import torch._inductor.async_compile  # noqa: F401 - the loaded code reads it (a caller that compiled nothing)
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    from torch._inductor import config as inductor_config_module

    with contextlib.ExitStack() as stack:
        if hasattr(inductor_config_module, "enable_autograd_for_aot"):
            stack.enter_context(inductor_config_module.patch(enable_autograd_for_aot=True))
        if inductor_config:
            stack.enter_context(inductor_config_module.patch(inductor_config))
        return BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(blob)


def _make_split_callable() -> type:
    """The :class:`SplitCallable` class. It subclasses torch's ``SerializableCallable``, whose module
    imports Dynamo, Inductor and Triton: made at first use (``split.SplitCallable``, by this
    module's ``__getattr__``), not when the engine is imported (tests/test_lean_import.py)."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    class SplitCallable(SerializableCallable):  # type: ignore[misc,valid-type]
        """The parts' compiled functions run by a :class:`Plan`; saved as the plan plus each part's
        bytes. The compiling process loads each part as it comes in (the compiler's wait for the
        workers) and runs them as they are; another process loads them from the saved bytes."""

        def __init__(self, plan: Plan, parts: list[bytes], fns: list[Callable[..., Any]] | None = None) -> None:
            self.plan = plan
            self.parts = parts
            self._fns = fns

        @classmethod
        def serialize_compile_artifacts(cls, fn: Any) -> bytes:
            return pickle.dumps({"plan": fn.plan, "parts": fn.parts}, protocol=pickle.HIGHEST_PROTOCOL)

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> Any:
            state = pickle.loads(data)  # noqa: S301 - our own artifact (precompile checks its envelope)
            fns = []
            LOAD_SECONDS.clear()
            for blob in state["parts"]:
                t0 = time.perf_counter()
                fns.append(load_compiled(blob))
                LOAD_SECONDS.append(round(time.perf_counter() - t0, 3))
            return cls(state["plan"], state["parts"], fns)

        @property
        def runnable(self) -> bool:
            """Whether every part is loaded: by :meth:`deserialize_compile_artifacts`, or in the
            compiling process as each part came in (:func:`load_compiled`, the compiler's wait)."""
            return self._fns is not None

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if self._fns is None:
                raise RuntimeError("a split graph runs once its parts are loaded")
            return self.plan.run(self._fns, args)

    SplitCallable.__module__, SplitCallable.__qualname__ = __name__, "SplitCallable"
    return SplitCallable


def __getattr__(name: str) -> Any:
    if name == "SplitCallable":  # pickled saved graphs name it: nexfort_engine.split.SplitCallable
        cls = _make_split_callable()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
