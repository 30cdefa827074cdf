"""Parts of a graph cut off while Dynamo still traces it, each shipped to its compile worker at once.

What: with compile workers (split.py), the caller used to trace the whole model, cut the finished
graph, and only then ship the workers their parts: the workers sat idle through the trace (SDXL:
about 20 s on an H200 host), and then every part took about 20 s. A :class:`Streamer` watches the
trace instead (a hook on Dynamo's ``InliningInstructionTranslator.inline_call``). Each time an
inlined call returns, it may cut the nodes Dynamo added since its last cut into a part and hand it
to ``send`` (the caller's shipping): that worker compiles while the trace goes on. When the trace
ends, :meth:`Streamer.finish` checks the parts against the finished graph, cuts what is left (the
tail) among the workers kept for it, and returns the :class:`~nexfort_engine.split.Split` whose
plan runs them all. SDXL's cold compile on one H200 host: 42.0 s against 53.5 s cut at the end.

When to cut (:func:`equal_finish`): a part shipped at trace time ``t`` with cost ``c`` (split.py's
measure: compute nodes plus a weight per distinct kernel) is back at about
``t + FIXED_S + PER_COST_S * c``, scaled by how much slower than the reference host this one
traces. Parts cut early are made larger, later ones smaller, so that all are back together with
the tail, which is spread over the workers kept for it. How much of the model is still to come is
estimated from the share of its parameters the graph has read (it follows the compute nodes
traced). No part exceeds 1.5 times an even share. Traces expected to be short are not streamed.

Where to cut: where every traced frame is inside a call (in the middle of another instruction,
such as unpacking a ``map``, Dynamo's own Python holds values the frames do not), and once a cut
is due, at a return as shallow as the part's shallowest (a block's return to the model's loop),
deeper ones allowed as the part grows. A part returns the values of its nodes the traced Python
still holds: each frame's locals and stack, and the objects the trace tracks (read without
realizing lazy variables, which would add graph inputs and guards). A held size or tuple is not
returned (AOTAutograd would flatten it): later parts make it again from what it was made of
(:func:`expose`). Each part takes the graph inputs that bind the symbolic sizes of its inputs, as
``split_module`` does (:func:`bindings`). Dynamo's last pass over the graph (runtime asserts, with a
CSE of size arithmetic that rewrites nodes already shipped) is off while streaming: every size is
backed by an input's, which the guards check.

Safety: nothing is assumed. :meth:`Streamer.finish` checks each shipped part against the graph
Dynamo hands the backend: its nodes unchanged, every later reader of its values reading one it
returns (or makes again), its inputs still the graph's. If anything differs (or the hook met an
error, or Dynamo restarted its trace), the streamed parts are dropped (:class:`Failed`), their
workers are replaced, and the caller cuts the finished graph as before. The graph passes the
backend runs on a whole graph run on each part (``passes``); the example values of a part's
outputs are the ones its passes left (GroupNorm's channels-last layout), which the next part's
inputs take.

Twin: the finished graph cut at once (``NEXFORT_STREAM_PARTS=0``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx

from . import split

log = logging.getLogger(__name__)

#: ``NEXFORT_STREAM_PARTS=0``: cut the finished graph only (the twin, for A/B measurements)
ENV_STREAM = "NEXFORT_STREAM_PARTS"
#: tests: cut a part as soon as its cost reaches this, whatever the time (tiny graphs trace in
#: milliseconds, which the schedule would never cut)
ENV_PART_COST = "NEXFORT_STREAM_PART_COST"
#: a worker's part takes about FIXED_S + PER_COST_S * cost from being shipped to being back
#: (H200 hosts, 8 processes compiling at once: SD2.1's parts of cost 394-406 took 11.3-13.5 s,
#: SDXL's of 637 took 16.2-19.7 s in their cold compiles of run195; plus the worker's receiving
#: and unpickling, about 1 s)
FIXED_S = 4.3
PER_COST_S = 0.023
#: from the trace's end to the tail shipped (Dynamo's own end of trace, the check, the tail's cut)
END_S = 1.5
#: no cut before the graph has read this share of the model's parameters (the estimate is noise)
MIN_PROGRESS = 0.04
#: once a cut is due, it waits for a return as shallow as the part's shallowest (a block's return to
#: the model's loop); each time the part grows by this share of its cost when due (at least by
#: DEPTH_STEP_MIN), one frame deeper. SDXL's transformer blocks return two frames deeper than its
#: blocks; waiting for a block's return made parts 20 % larger than due at 0.1 (run196, run196b)
DEPTH_STEP = 0.03
DEPTH_STEP_MIN = 20
#: the instructions a frame may be in at a cut: a call (in the middle of any other, such as
#: unpacking a ``map``, Dynamo's own Python holds values the frames do not)
_CALLS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_METHOD",
                    "PRECALL"})
#: a trace expected to take less than this is not streamed: the parts' compiles (about 12 s each)
#: outlast it, and shipping them early gains less than the tail loses. SD2.1 (a 10-11 s trace) took
#: 33.4 s streamed against 30.7 s cut at the trace's end on one H200 host, SDXL (19-21 s) 42.0 s
#: against 53.5 s (run196d); tiny models are cut as before, whatever the machine's speed
MIN_TRACE_S = 14.0
#: the schedule's finish time is recomputed at most this often (seconds of trace)
RESCHEDULE_S = 0.1
#: a typical part's cost per compute node, its kernels weighed in (SDXL's parts cut at the trace's
#: end, run195: 1.35-1.6; the first 300 nodes of its trace: 2.6)
RATIO = 1.4
#: workers kept for the tail (what is left when the trace ends; its nodes' many kernels made it
#: the slowest part with one, run196b; three or four of eight or nine workers did not measure
#: faster, runs 198-199); ``NEXFORT_STREAM_TAIL_WORKERS`` overrides it (measurements)
TAIL_WORKERS = 2
ENV_TAIL_WORKERS = "NEXFORT_STREAM_TAIL_WORKERS"
#: the trace's speed on the host FIXED_S and PER_COST_S were measured on (SDXL: about 3600 compute
#: nodes in 19 s); a slower trace scales the model's compile times by as much, up to MAX_SCALE (a
#: host whose SDXL trace took 27 s compiled its parts 1.4 times slower, run196c)
REF_NODES_PER_S = 190.0
MAX_SCALE = 2.0
#: no part costs more than this many times an even share of the whole
MAX_SHARE = 1.5
#: a part below this cost is not worth a worker (its fixed cost dominates)
MIN_PART_COST = 40


def enabled() -> bool:
    return os.environ.get(ENV_STREAM, "1") != "0"


class Failed(RuntimeError):
    """The streamed parts do not fit the finished graph; the message says why."""


@dataclass
class Shipped:
    """A part cut off during the trace: its nodes (in the graph Dynamo is building), the nodes it
    reads and returns, and what its nodes were when it was cut."""

    index: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    as_cut: list[tuple[Any, Any, Any, Any]]
    at_s: float
    cost: int
    #: its cost when the cut came due (it waited for a shallow enough return)
    due_cost: int


def equal_finish(t: float, start: float, traced: float, progress: float, workers: int,
                 fixed: float = FIXED_S, per_cost: float = PER_COST_S, end: float = END_S, tail: int = 1) -> float:
    """The earliest time (seconds into the trace) by which every part can be back, when the
    current part started at cost ``start``, ``traced`` cost has been traced in ``t`` s, that is the
    share ``progress`` of the whole, and ``workers`` workers are free (the current part's included).
    Parts are cut when they would finish then; the tail is split among the workers left (at least
    ``tail`` of them)."""
    total, span = traced / progress, t / progress
    rate = traced / max(t, 1e-6)

    def feasible(finish: float) -> bool:
        s, used = start, 0
        while True:
            left = workers - used
            if span + end + fixed + per_cost * (total - s) / left <= finish:
                return True
            if left <= tail:
                return False
            x = (finish - fixed + per_cost * s) / (1.0 / rate + per_cost)
            if x <= s or x >= total:
                return False
            s, used = x, used + 1

    lo, hi = t, t + span + end + fixed + per_cost * total + 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _node_cost(node: fx.Node, seen: set[Any]) -> int:
    """What ``node`` adds to the segment whose kernel signatures are ``seen`` (updated)."""
    ((_node, weight, sig),) = split.node_costs([node])
    cost = split.added_cost(weight, sig, seen)
    if sig is not None:
        seen.add(sig)
    return cost


def _held_nodes(tx: Any, extra: Any) -> set[fx.Node]:
    """The graph nodes whose values the traced Python still holds: in each frame's locals and stack
    (the inlined frames up to the traced function), in ``extra`` (the value just returned), and in
    the objects the trace has mutated or created."""
    from torch._dynamo.variables.base import VariableTracker

    found: set[fx.Node] = set()

    def visit(vt: Any) -> None:
        # read off the instance: an attribute a variable lacks would realize a lazy one (a new graph
        # input, a guard), which only its use in the traced code may do
        node = getattr(vars(vt).get("proxy"), "node", None)
        if isinstance(node, fx.Node):
            found.add(node)

    roots: list[Any] = [extra]
    frame = tx
    while frame is not None:
        roots.append(dict(frame.symbolic_locals))
        roots.append(list(frame.stack))
        frame = getattr(frame, "parent", None)
    effects = tx.output.side_effects
    roots.append(list(effects.store_attr_mutations.values()))
    # the objects the trace tracks (lists, dicts, objects; every tensor too, which holds nothing
    # itself: its attributes set during the trace are in store_attr_mutations)
    roots.append([vt for vt in effects.id_to_variable.values() if vars(vt).get("proxy") is None])
    VariableTracker.visit(visit, roots)
    return found


def _as_cut(node: fx.Node) -> tuple[Any, Any, Any, Any]:
    return (node.op, node.target, node.args, dict(node.kwargs))


def _same(a: Any, b: Any) -> bool:
    """Whether two node arguments are the same: nodes and symbolic values by identity (comparing
    a symbolic value would take a guard), containers item by item."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if a is b:
        return True
    if isinstance(a, (fx.Node, torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - what cannot be compared is not the same
        return False


def _example(node: fx.Node, examples: dict[fx.Node, Any]) -> Any:
    if node in examples:
        return examples[node]
    return split._example(node)


def returnable(node: fx.Node) -> bool:
    """Whether a part can return the node's value: a tensor or a number (AOTAutograd flattens a
    returned ``torch.Size`` or tuple into its items, and no longer matches the graph's outputs)."""
    try:
        value = split._example(node)
    except KeyError:
        return False
    return isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def expose(wanted: Sequence[fx.Node], inside: set[fx.Node], remade: set[fx.Node]) -> set[fx.Node]:
    """What a part of the nodes ``inside`` returns so that later parts can read ``wanted``: those
    it can return, and for the others (a tensor's size, a tuple: added to ``remade``, made again by
    each part that reads them), the nodes they are made from, likewise."""
    out: set[fx.Node] = set()
    todo = list(wanted)
    while todo:
        node = todo.pop()
        if node in out or node in remade:
            continue
        if returnable(node):
            out.add(node)
            continue
        remade.add(node)
        todo.extend(a for a in node.all_input_nodes if a in inside)
    return out


def _plain(values: Sequence[Any]) -> dict[Any, int]:
    """The symbols that are a size of one of ``values`` (or one of them), by the value's index."""
    out: dict[Any, int] = {}
    for i, value in enumerate(values):
        sizes = value.shape if isinstance(value, torch.Tensor) else [value]
        for d in sizes:
            if isinstance(d, (torch.SymInt, torch.SymFloat)) and d.node.expr.is_Symbol:
                out.setdefault(d.node.expr, i)
    return out


def bindings(graph: fx.Graph) -> dict[Any, fx.Node]:
    """Symbol -> the size input Dynamo lifted for it (Inductor's passes bind a symbol from such an
    input only, not from a tensor's size: ``KeyError: s53`` in its tensorify pass, run196)."""
    nodes = list(graph.find_nodes(op="placeholder"))
    values = [n.meta.get("example_value") for n in nodes]
    sizes = _plain([v if isinstance(v, (torch.SymInt, torch.SymFloat)) else None for v in values])
    return {sym: nodes[i] for sym, i in sizes.items()}


def build_part(index: int, nodes: Sequence[fx.Node], outputs: Sequence[fx.Node], examples: dict[fx.Node, Any],
               attr: Callable[[str], Any], meta: dict[str, Any], passes: Callable[[fx.GraphModule], None],
               remade: set[fx.Node] = frozenset(),  # type: ignore[assignment]
               symbols: dict[Any, fx.Node] | None = None) -> tuple[split.Part, list[fx.Node]]:
    """A part of ``nodes`` (consecutive in their graph) returning ``outputs`` as a tuple: its graph
    module, its inputs' example values (``examples`` where an earlier part's passes changed them),
    the engine's ``passes`` run on it and its stale example values refreshed. Also returns the nodes
    it reads (placeholders and earlier parts' values; ``get_attr`` nodes are copied in, their
    values from ``attr``, and so are the earlier parts' nodes in ``remade``, see :func:`expose`).
    Each symbolic size of an input comes in too, from the node that binds it (``symbols``, see
    :func:`bindings`), as ``split_module`` does. The example values of the part's outputs after its
    passes are written to ``examples``."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    attrs: list[fx.Node] = []
    copies: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def need(a: fx.Node) -> None:
        if a in inside or a in seen:
            return
        seen.add(a)
        if a.op == "get_attr":
            attrs.append(a)
        elif a in remade:
            for b in a.all_input_nodes:
                need(b)
            copies.append(a)  # after what it reads
        else:
            inputs.append(a)

    for node in nodes:
        for a in node.all_input_nodes:
            need(a)
    if symbols is not None:
        from torch.fx.experimental.symbolic_shapes import free_symbols

        have = set(inputs)
        bound = set(_plain([_example(a, examples) for a in inputs]))
        for a in list(inputs):
            for sym in sorted(free_symbols(_example(a, examples)), key=str):
                if sym in bound:
                    continue
                if sym not in symbols:
                    raise Failed(f"no graph input binds the size {sym} of {a.name}")
                if (b := symbols[sym]) not in have and b not in inside:
                    have.add(b)
                    inputs.append(b)
                    bound.update(_plain([_example(b, examples)]))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    values = []
    for a in inputs:
        p = graph.placeholder(a.name)
        value = _example(a, examples)
        p.meta["example_value"] = value
        if "tensor_dict" in a.meta:
            p.meta["tensor_dict"] = a.meta["tensor_dict"]
        source = getattr(a, "_dynamo_source", None)
        if source is None and a.op == "placeholder" and "grapharg" in a.meta:
            source = getattr(a.meta["grapharg"], "source", None)
        p._dynamo_source = source  # type: ignore[attr-defined]
        env[a] = p
        values.append(value)
    for a in attrs:
        env[a] = graph.node_copy(a)
    for a in copies:
        env[a] = graph.node_copy(a, lambda b: env[b])
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    # ship imports torch's graph pickler, and Inductor: only where parts are cut
    from .ship import _set_attr

    root = torch.nn.Module()
    for a in attrs:
        _set_attr(root, str(a.target), attr(str(a.target)))
    gm = fx.GraphModule(root, graph)
    gm._param_name_to_source = {}  # type: ignore[assignment] # its parameters are inputs
    gm.meta.update(meta)
    passes(gm)
    if os.environ.get("NEXFORT_SPLIT_NO_REFRESH") != "1":
        split.refresh_examples(gm)
    gm.recompile()
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for o, new in zip(outputs, out_node.args[0], strict=True):
        if isinstance(new, fx.Node):
            examples[o] = split._example(new)
    return split.Part(index=index, module=gm, inputs=values, single=False), inputs


class Streamer:
    """Cuts parts off the graph Dynamo is tracing (see the module's docstring).

    ``workers``: how many workers may take parts (one of them is kept for the tail);
    ``params``: the traced module's parameter and buffer count (the progress estimate);
    ``send``: ships a part to its worker, returning its fingerprint as shipped, or ``None`` (then
    streaming stops); ``passes``: the engine's graph passes, run on each part."""

    def __init__(self, workers: int, params: int, send: Callable[[split.Part], str | None],
                 passes: Callable[[fx.GraphModule], None]) -> None:
        self.workers = workers
        self.params = params
        self.send = send
        self.passes = passes
        self.shipped: list[Shipped] = []
        self.sent: dict[int, str] = {}
        self.parts: list[split.Part] = []
        self.failed: str | None = None
        #: workers kept for the tail: TAIL_WORKERS, where there are two more than that
        self.tail = max(1, min(int(os.environ.get(ENV_TAIL_WORKERS) or TAIL_WORKERS), workers - 2))
        self.stopped = workers < 2
        self.examples: dict[fx.Node, Any] = {}
        self.returned: set[fx.Node] = set()
        #: values no part returns (sizes, tuples) but each part that reads them makes again
        self.remade: set[fx.Node] = set()
        self.hook_s = 0.0
        self._forced = int(os.environ.get(ENV_PART_COST) or 0)
        self._t0 = time.perf_counter()
        self._output: Any = None
        self._graph: fx.Graph | None = None
        self._cursor: fx.Node | None = None
        self._segment: list[fx.Node] = []
        self._seg_cost = 0
        self._seg_seen: set[Any] = set()
        self._traced = 0  # compute nodes traced (split._weight), the trace's progress
        self._seg_nodes = 0
        self._due_at: int | None = None
        self._min_depth = 1 << 30
        self._first_inputs = 0
        self._finish_at = (-1.0, 0.0)  # (trace time it was computed at, the equal finish time)
        self._scale, self._cap = 1.0, float("inf")

    # -- during the trace
    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watch the trace run inside: each inlined call's return may cut a part."""
        from torch._dynamo.symbolic_convert import InliningInstructionTranslator

        original = InliningInstructionTranslator.__dict__["inline_call"]
        inline = original.__func__
        streamer = self

        def inline_call(cls: Any, parent: Any, *args: Any, **kwargs: Any) -> Any:
            result = inline(cls, parent, *args, **kwargs)
            if not streamer.stopped:
                t0 = time.perf_counter()
                try:
                    streamer._returned(parent, result)
                except Exception as e:  # noqa: BLE001 - the trace goes on; finish() reports it
                    streamer._fail(f"{type(e).__name__}: {e}")
                streamer.hook_s += time.perf_counter() - t0
            return result

        InliningInstructionTranslator.inline_call = classmethod(inline_call)  # type: ignore[assignment]
        self._t0 = time.perf_counter()
        try:
            # Dynamo's last pass over the graph inserts runtime asserts and CSEs its size arithmetic
            # (a size read off an intermediate tensor becomes arithmetic on the inputs' sizes), which
            # rewrites nodes already shipped; there are no asserts to insert where every size is
            # backed by an input's (the guards check those), and each part's AOTAutograd trace does
            # the size arithmetic on symbols anyway
            with torch._dynamo.config.patch(do_not_emit_runtime_asserts=True):
                yield
        finally:
            InliningInstructionTranslator.inline_call = original  # type: ignore[assignment]

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.info("nexfort: parts cut while tracing: stopped (%s)", why)
        self.stopped = True

    def _scan(self) -> None:
        assert self._graph is not None
        node = self._cursor.next if self._cursor is not None else next(iter(self._graph.nodes), None)
        while node is not None and node.op != "root":
            if node.op not in ("placeholder", "output", "get_attr"):
                self._segment.append(node)
                self._seg_cost += _node_cost(node, self._seg_seen)
                weight = split._weight(node)
                self._seg_nodes += weight
                self._traced += weight
            self._cursor = node
            node = node.next

    def _inputs(self) -> int:
        assert self._output is not None
        tracer = self._output.root_tracer
        names = getattr(tracer, "input_name_to_proxy", None)
        return len(names) if names is not None else len(tracer.graph.find_nodes(op="placeholder"))

    def _progress(self) -> float:
        """The share of the model traced: of its parameters, those the graph reads (each one a graph
        input when first read), not counting the inputs it had at the first return (the call's)."""
        return min(0.999, max(0, self._inputs() - self._first_inputs) / max(1, self.params))

    def _due(self) -> bool:
        if self._forced:
            return self._seg_cost >= self._forced
        if self._seg_cost < MIN_PART_COST:
            return False
        t = time.perf_counter() - self._t0
        if t - self._finish_at[0] >= RESCHEDULE_S:  # (the bisection costs ~1 ms; returns come every ~0.1 ms)
            progress = self._progress()
            if progress < MIN_PROGRESS or t / progress < MIN_TRACE_S:
                return False
            left = self.workers - len(self.shipped)
            # a host that traces slower than the one the model was measured on compiles slower too
            self._scale = min(MAX_SCALE, max(1 / MAX_SCALE, REF_NODES_PER_S * t / max(1, self._traced)))
            # in compute nodes, which the trace's time follows, at a typical part's cost per node
            # (not this part's: its first nodes are mostly new kernels, which made it twice as
            # large as it should have been, run196)
            per_node = PER_COST_S * RATIO * self._scale
            self._finish_at = (t, equal_finish(t, self._traced - self._seg_nodes, self._traced, progress, left,
                                               fixed=FIXED_S * self._scale, per_cost=per_node, tail=self.tail))
            # and no part much larger than an even share of the whole (what the model gets wrong
            # costs most in the largest part)
            self._cap = MAX_SHARE * RATIO * (self._traced / progress) / max(1, self.workers)
        return (self._seg_cost >= self._cap
                or t + (FIXED_S + PER_COST_S * self._seg_cost) * self._scale >= self._finish_at[1])

    def _returned(self, tx: Any, result: Any) -> None:
        output = tx.output
        if self._output is None:
            self._output, self._graph = output, output.root_tracer.graph
            self._first_inputs = self._inputs()
        elif output is not self._output:
            self._fail("Dynamo restarted its trace")
            return
        if output.current_tracer is not output.root_tracer:
            return  # inside a higher-order op's subgraph
        self._scan()
        if len(self.shipped) >= self.workers - self.tail or not self._segment:
            return
        # a point where every frame is inside a call: what the traced Python holds is in its frames
        # (in the middle of unpacking a ``map``, Dynamo's own loop holds the values not yet mapped)
        depth, frame = 0, tx
        while frame is not None:
            if getattr(getattr(frame, "current_instruction", None), "opname", None) not in _CALLS:
                return
            depth, frame = depth + 1, getattr(frame, "parent", None)
        self._min_depth = min(self._min_depth, depth)
        if self._due_at is None:
            if not self._due():
                return
            self._due_at = self._seg_cost
        # the shallowest return seen in this part is a block's return to the model's own loop;
        # deeper ones (inside a block: more of its values held) are taken as the part grows past due
        step = max(DEPTH_STEP * self._due_at, DEPTH_STEP_MIN)
        if depth > self._min_depth + int((self._seg_cost - self._due_at) / step):
            return
        held = _held_nodes(tx, result)
        inside = set(self._segment)
        returned = expose([n for n in self._segment if n in held], inside, self.remade)
        outputs = [n for n in self._segment if n in returned]
        log.debug("nexfort: part %d cut at cost %d, %d frames deep (shallowest %d), returning %d values",
                  len(self.shipped), self._seg_cost, depth, self._min_depth, len(outputs))
        self._cut(outputs)

    def _cut(self, outputs: list[fx.Node]) -> None:
        assert self._output is not None
        output, index = self._output, len(self.shipped)
        meta = {"dynamo_compile_id": getattr(output, "dynamo_compile_id", None),
                "dynamo_flat_name_to_original_fqn": dict(getattr(output, "dynamo_flat_name_to_original_fqn", {}))}
        nodes = self._segment
        part, inputs = build_part(index, nodes, outputs, self.examples, lambda t: output.nn_modules[t], meta,
                                  self.passes, self.remade, bindings(output.root_tracer.graph))
        for a in inputs:
            if a.op != "placeholder" and a not in self.returned:
                raise Failed(f"part {index} reads {a.name}, which no earlier part returns")
        fingerprint = self.send(part)
        if fingerprint is None:
            self._fail(f"part {index} could not be shipped")
            return
        self.shipped.append(Shipped(index=index, nodes=list(nodes), inputs=inputs, outputs=list(outputs),
                                    as_cut=[_as_cut(n) for n in nodes], at_s=round(time.perf_counter() - self._t0, 3),
                                    cost=self._seg_cost, due_cost=self._due_at or self._seg_cost))
        self.sent[index] = fingerprint
        self.parts.append(part)
        self.returned.update(outputs)
        self._segment, self._seg_cost, self._seg_seen, self._due_at, self._seg_nodes = [], 0, set(), None, 0
        self._min_depth, self._finish_at = 1 << 30, (-1.0, 0.0)

    # -- when the trace has ended
    def finish(self, gm: fx.GraphModule, tail_parts: int) -> split.Split | None:
        """The split of Dynamo's finished graph ``gm``: the streamed parts (checked against it),
        then its remaining nodes cut into ``tail_parts`` parts (fewer where they are few), built as
        the streamed ones were. ``None`` if nothing was streamed; :class:`Failed` if the streamed
        parts do not fit ``gm``."""
        self.stopped = True
        if self.failed is not None:
            raise Failed(self.failed)
        if not self.shipped:
            return None
        if gm.graph is not self._graph:
            raise Failed("the backend got another graph than the one traced")
        done: dict[fx.Node, int] = {}
        for s in self.shipped:
            for node, was in zip(s.nodes, s.as_cut, strict=True):
                if node.graph is not gm.graph or getattr(node, "_erased", False):
                    if node in s.outputs and any(True for _ in node.users):
                        raise Failed(f"part {s.index}: {node.name} is gone from the graph")
                    continue
                if not _same(_as_cut(node), was):
                    raise Failed(f"part {s.index}: {node.name} changed after the cut ({was[2]} -> {node.args})")
                done[node] = s.index
        returned = {o: s.index for s in self.shipped for o in s.outputs}
        for node, k in done.items():
            if node in returned or node in self.remade:
                continue
            for user in node.users:
                if done.get(user) != k:
                    raise Failed(f"part {k}: {node.name} is read by {user.name} after the cut, and not returned")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        ph = set(placeholders)
        for s in self.shipped:
            for a in s.inputs:
                if a.op == "placeholder" and a not in ph:
                    raise Failed(f"part {s.index}: its input {a.name} is no longer the graph's")
        tail = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr") and n not in done]
        for node in tail:
            for a in node.all_input_nodes:
                if a.op in ("placeholder", "get_attr") or a in returned or a in self.remade or a not in done:
                    continue
                raise Failed(f"{node.name} reads {a.name} of a streamed part, which it does not return")
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        from .ship import _get_attr

        symbols = bindings(gm.graph)
        pieces = _tail_pieces(tail, tail_parts)
        parts = list(self.parts)
        layout: list[tuple[list[fx.Node], list[fx.Node]]] = [(s.inputs, s.outputs) for s in self.shipped]
        meta = {k: gm.meta[k] for k in ("dynamo_compile_id", "dynamo_flat_name_to_original_fqn") if k in gm.meta}
        for nodes in pieces:
            inside = set(nodes)
            wanted = expose([n for n in nodes if any(u not in inside for u in n.users)], inside, self.remade)
            outs = [n for n in nodes if n in wanted]
            part, inputs = build_part(len(parts), nodes, outs, self.examples,
                                      lambda t: _get_attr(gm, t), meta, self.passes, self.remade, symbols)
            parts.append(part)
            layout.append((inputs, outs))
        return split.Split(parts=parts, plan=plan(placeholders, layout, out_node))

    def report(self) -> dict[str, Any]:
        """What was streamed, for the counters."""
        return {"streamed": len(self.shipped), "at_s": [s.at_s for s in self.shipped],
                "costs": [s.cost for s in self.shipped], "due_costs": [s.due_cost for s in self.shipped],
                "returned": [len(s.outputs) for s in self.shipped],
                "hook_s": round(self.hook_s, 3), **({"failed": self.failed} if self.failed else {})}


def _tail_pieces(tail: list[fx.Node], n: int) -> list[list[fx.Node]]:
    """The tail's nodes in at most ``n`` consecutive pieces of about equal cost."""
    if not tail:
        return []
    costs = split.node_costs(tail)
    total = sum(w for _n, w, _s in costs)
    n = max(1, min(n, total // max(1, split.min_part_nodes())))
    if n == 1:
        return [list(tail)]
    assigned = split.cut_costs(costs, n, 1.0)
    pieces: list[list[fx.Node]] = [[] for _ in range(max(assigned) + 1)]
    for node, k in zip(tail, assigned, strict=True):
        pieces[k].append(node)
    return [p for p in pieces if p]


def plan(placeholders: Sequence[fx.Node], layout: Sequence[tuple[Sequence[fx.Node], Sequence[fx.Node]]],
         out_node: fx.Node) -> split.Plan:
    """The plan that runs parts reading and returning the given nodes (``layout``: per part, its
    inputs and outputs) on the graph's arguments (``placeholders``), returning ``out_node``'s values;
    each value freed after its last reader (one nobody reads, right after its part)."""
    slot: dict[fx.Node, int] = {node: i for i, node in enumerate(placeholders)}
    next_slot = len(placeholders)
    steps: list[tuple[tuple[int, ...], int, int]] = []
    for inputs, outputs in layout:
        ins = tuple(slot[a] for a in inputs)
        start = next_slot
        for i, o in enumerate(outputs):
            slot[o] = start + i
        next_slot += len(outputs)
        steps.append((ins, start, len(outputs)))
    out_args = out_node.args[0]
    if not isinstance(out_args, (tuple, list)):
        out_args = (out_args,)
    outputs = tuple(("slot", slot[a]) if isinstance(a, fx.Node) else ("const", a) for a in out_args)
    kept = {v for kind, v in outputs if kind == "slot"}
    last: dict[int, int] = {}
    for k, (ins, start, n) in enumerate(steps):
        for s in range(start, start + n):
            last.setdefault(s, k)  # read by nobody: freed after its own part
        for s in ins:
            if s >= len(placeholders):
                last[s] = k
    freed = [tuple(sorted(s for s, k2 in last.items() if k2 == k and s not in kept)) for k in range(len(steps))]
    return split.Plan(n_args=len(placeholders), steps=tuple((ins, start, n, free) for (ins, start, n), free
                                                           in zip(steps, freed, strict=True)),
                      outputs=outputs)
