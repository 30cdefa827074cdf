"""Counters: compiles, recompiles (with Dynamo's reasons), cache hits/misses, fallbacks.

One process-wide registry. The nodes, the web route, the Cache Manager, the benchmark and the
tests all read the same numbers through :func:`snapshot` (exported as ``nexfort_engine.stats()``).
Counters are bumped under a lock; reading returns a deep copy.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MAX_REASONS = 50
COUNTERS = (
    "compiles",
    "recompiles",
    "cache_hits",
    "cache_misses",
    "fallbacks",
    "calls",
    "corrupt_entries",
    # CUDA-graph skips Inductor reported during our calls: a graph (or a call of it) that ran
    # kernel by kernel instead of being replayed; the reason is logged under TORCH_LOGS=cudagraphs
    "cudagraph_skips",
    # "static_first": calls of a shape the static graph does not fit, run eager while the dynamic
    # graph compiled in the background
    "static_first_eager_calls",
    # calls that ran the module uncompiled for any reason (a fallback, the first calls while a
    # background compile runs, a shape the static graph does not fit): what a prompt ran uncompiled
    "eager_calls",
    # graph breaks Dynamo reported while tracing this model (each distinct reason once): the model
    # then compiles in pieces, the code between them running eager (usually a model patch another
    # node added that Dynamo cannot trace: ``Tensor.item()`` on the sigma, random tile sizes)
    "graph_breaks",
)

_lock = threading.Lock()


@dataclass
class _Record:
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    recompile_reasons: list[str] = field(default_factory=list)
    fallback_reasons: list[str] = field(default_factory=list)
    graph_break_reasons: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    compiled_call_seconds: float = 0.0
    #: host seconds in the calls counted by ``eager_calls``
    eager_call_seconds: float = 0.0
    state: str = "pending"
    cache_key: str = ""
    config: str = ""
    node_ids: list[str] = field(default_factory=list)
    #: token-wise linears run in fp8 (fp8.py)
    fp8: bool = False
    #: why auto fp8 (O3) left the linears in fp16/bf16 (fp8.pays_off), or ""
    fp8_skipped: str = ""
    #: why the O3 preset's max-autotune was left out (settings.resolve), or ""
    autotune_skipped: str = ""
    #: regional compilation: the block groups compiled once each (empty: the whole model)
    regions: list[str] = field(default_factory=list)
    #: dynamic shape: the image input's spatial sizes traced as multiples of this (shapes.fold_spatial)
    spatial_multiple: int = 1
    #: F.group_norm calls compiled in channels-last order (passes/group_norm.py), all graphs
    group_norms_rewritten: int = 0
    #: fp8 activation quantizations fused with their GELU/GEGLU/concat producers (passes/fuse_quant.py)
    fp8_quant_fused: int = 0
    #: query/key RMSNorm + rotary embeddings fused into one op (passes/fuse_rope.py)
    rope_fused: int = 0
    #: attentions run in fp8 through cuDNN (passes/fp8_attention.py)
    attention_fp8: int = 0
    #: callers' SDPA priority lists with cuDNN moved ahead of flash (passes/sdpa_priority.py)
    sdpa_cudnn_first: int = 0
    #: linear + tanh-GELU pairs run as one GEMM with a GELU epilogue (passes/gelu_epilogue.py)
    gelu_epilogues: int = 0
    #: linears run with the GEMM algorithm measured per shape (passes/tuned_linear.py, gemm_tuning.py)
    tuned_linears: int = 0
    #: fp8 GEMMs reading the weights a model stores in e4m3, no copy or cast (passes/fp8_stored.py)
    fp8_stored_weights: int = 0
    #: linears the host swapped for layers storing their weight in e4m3 (``"fp8_weights"``, fp8_weights.py)
    fp8_weight_layers: int = 0
    #: host calls in the last graph compiled (host_call.py), and the attention patches the host
    #: swapped for them in the last call (the node layer's host_patches.py)
    host_calls: int = 0
    host_patches: int = 0
    #: conv weights converted to channels-last outside the graph so far (weight_layout.py)
    channels_last_weights: int = 0
    #: ahead-of-time graphs (precompile.py): "on", "off" or "off: <why>"; graphs traced or loaded
    #: in this process; the last saved graph found stale (and why); guards kept out of torch's set
    precompiled: str = ""
    precompiled_graphs: int = 0
    precompiled_stale: str = ""
    precompiled_guards_dropped: int = 0
    #: what ran the last cold compile's first call: "as compiled" (the graph and guards this
    #: process had just made; its parts loaded as they came in) or "loaded back" (the saved file)
    precompiled_first_call: str = ""
    #: size guards a split graph's parts took after Dynamo built the trace's guards (checked by
    #: the engine, as Python expressions over the input sizes)
    precompiled_late_size_guards: list[str] = field(default_factory=list)
    #: F.linear calls traced through their stand-in (trace_ops.py), last graph
    trace_stand_ins: int = 0
    #: ``"background": true`` (background.py): "running (pid N)", "done in Xs", "failed after Xs",
    #: "crashed: <why>" or "off: <why>"; the child's wall time until it was done
    background: str = ""
    #: ``"static_first"`` (compiler.py): the static graph the first call compiled, or why it did not
    static_first: str = ""
    background_seconds: float = 0.0
    #: ``"compile_workers"`` (split.py): "N parts, M from child processes[; part i compiled here: why]"
    #: or "off: <why>"; the seconds the caller spent compiling its own parts, then waiting for the rest
    compile_parts: str = ""
    compile_parts_own_seconds: float = 0.0
    compile_parts_wait_seconds: float = 0.0
    #: the worker whose part compiled longest: {"part", "compile_s", "phases_s": torch's longest
    #: compile phases in it} (split.slowest_child)
    compile_parts_slowest_child: dict[str, Any] = field(default_factory=dict)
    #: the parts cut while Dynamo traced (stream.py): {"streamed": how many, "at_s": when each was
    #: shipped (seconds into the trace), "costs", "returned": values each returns, "hook_s": the
    #: trace's time in the cutting; "failed"/"dropped": why the streamed parts were not used}
    compile_parts_streamed: dict[str, Any] = field(default_factory=dict)
    #: every part of the last cut: {"part", "nodes", "distinct" (node layouts), "kernels" and
    #: "cost" (as the cut weighed it), "inputs", "kinds": its most frequent node targets, "where":
    #: "here" or "child", "compile_s", "phases_s"} (split.part_profile)
    compile_parts_each: list[dict[str, Any]] = field(default_factory=list)
    #: seconds per step of the first call (setup: options resolved and the cache entry located;
    #: verify: the entry checked against its manifest; settle: the full garbage collection after a
    #: compile or load; commit: the entry's manifest written and old entries evicted) and of the
    #: last cold compile of a precompiled graph (start_workers, dynamo_trace (until the backend has
    #: the graph), trace_and_compile, cut, ship, save, load, first_run, parts_loaded (a split
    #: compile's parts loaded by the caller as they came in, during its wait); a split compile's slowest
    #: worker per step, from the trace's start: children_started, children_loaded, children_ready,
    #: children_received, children_unpickled, children_compiled)
    compile_phases: dict[str, float] = field(default_factory=dict)
    updated: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.counters)
        d.update(
            recompile_reasons=list(self.recompile_reasons),
            fallback_reasons=list(self.fallback_reasons),
            graph_break_reasons=list(self.graph_break_reasons),
            compile_seconds=round(self.compile_seconds, 3),
            compiled_call_seconds=round(self.compiled_call_seconds, 4),
            eager_call_seconds=round(self.eager_call_seconds, 4),
            state=self.state,
            cache_key=self.cache_key,
            config=self.config,
            node_ids=list(self.node_ids),
            fp8=self.fp8,
            fp8_skipped=self.fp8_skipped,
            autotune_skipped=self.autotune_skipped,
            regions=list(self.regions),
            spatial_multiple=self.spatial_multiple,
            group_norms_rewritten=self.group_norms_rewritten,
            fp8_quant_fused=self.fp8_quant_fused,
            rope_fused=self.rope_fused,
            attention_fp8=self.attention_fp8,
            sdpa_cudnn_first=self.sdpa_cudnn_first,
            gelu_epilogues=self.gelu_epilogues,
            tuned_linears=self.tuned_linears,
            fp8_stored_weights=self.fp8_stored_weights,
            fp8_weight_layers=self.fp8_weight_layers,
            host_calls=self.host_calls,
            host_patches=self.host_patches,
            channels_last_weights=self.channels_last_weights,
            precompiled=self.precompiled,
            precompiled_graphs=self.precompiled_graphs,
            precompiled_stale=self.precompiled_stale,
            precompiled_guards_dropped=self.precompiled_guards_dropped,
            precompiled_first_call=self.precompiled_first_call,
            precompiled_late_size_guards=list(self.precompiled_late_size_guards),
            trace_stand_ins=self.trace_stand_ins,
            background=self.background,
            static_first=self.static_first,
            background_seconds=round(self.background_seconds, 3),
            compile_parts=self.compile_parts,
            compile_parts_own_seconds=round(self.compile_parts_own_seconds, 3),
            compile_parts_wait_seconds=round(self.compile_parts_wait_seconds, 3),
            compile_parts_slowest_child=dict(self.compile_parts_slowest_child),
            compile_parts_streamed=dict(self.compile_parts_streamed),
            compile_parts_each=[dict(d) for d in self.compile_parts_each],
            compile_phases=dict(self.compile_phases),
            updated=self.updated,
        )
        return d


_total = _Record(state="")
_models: dict[str, _Record] = {}
#: process-wide counters of one engine part that belongs to no single model (``gemm_tuning``:
#: the GEMM algorithm table shared by every compiled model), shown under their section's name
_sections: dict[str, dict[str, Any]] = {}


def _append(lst: list[str], item: str) -> None:
    lst.append(item)
    del lst[:-MAX_REASONS]


def model(label: str) -> _Record:
    with _lock:
        return _models.setdefault(label, _Record())


def bump(label: str, counter: str, n: int = 1) -> None:
    with _lock:
        rec = _models.setdefault(label, _Record())
        rec.counters[counter] += n
        _total.counters[counter] += n
        rec.updated = time.time()


def add_reason(label: str, kind: str, reason: str) -> None:
    """kind: 'recompile', 'fallback' or 'graph_break'."""
    with _lock:
        rec = _models.setdefault(label, _Record())
        _append(getattr(rec, f"{kind}_reasons"), reason)
        _append(getattr(_total, f"{kind}_reasons"), f"{label}: {reason}")


def add_seconds(label: str, what: str, seconds: float) -> None:
    """what: 'compile', 'compiled_call', 'eager_call' or 'background'."""
    with _lock:
        rec = _models.setdefault(label, _Record())
        attr = f"{what}_seconds"
        setattr(rec, attr, getattr(rec, attr) + seconds)
        setattr(_total, attr, getattr(_total, attr) + seconds)


def set_info(label: str, **info: Any) -> None:
    with _lock:
        rec = _models.setdefault(label, _Record())
        for k, v in info.items():
            if k == "node_id":
                if v is not None and str(v) not in rec.node_ids:
                    rec.node_ids.append(str(v))
            else:
                setattr(rec, k, v)
        rec.updated = time.time()


def set_phase(label: str, name: str, seconds: float) -> None:
    """Record how long one step of a model's compile took (``compile_phases``)."""
    with _lock:
        rec = _models.setdefault(label, _Record())
        rec.compile_phases[name] = round(float(seconds), 3)
        rec.updated = time.time()


def bump_section(section: str, counter: str, n: int = 1) -> None:
    """Add ``n`` to ``counter`` of a process-wide section (see ``_sections``)."""
    with _lock:
        sec = _sections.setdefault(section, {})
        sec[counter] = sec.get(counter, 0) + n


def set_section(section: str, **info: Any) -> None:
    with _lock:
        _sections.setdefault(section, {}).update(info)


def rename(old: str, new: str) -> None:
    """Move a model's record to a new label (the label gains its cache key once known)."""
    with _lock:
        if old != new and old in _models:
            rec = _models.pop(old)
            if new in _models:  # same module compiled again: merge node ids, keep the old counters
                for nid in rec.node_ids:
                    if nid not in _models[new].node_ids:
                        _models[new].node_ids.append(nid)
            else:
                _models[new] = rec


def snapshot() -> dict[str, Any]:
    """All counters: totals at the top level, per-model records under ``models``."""
    with _lock:
        d = _total.as_dict()
        for k in ("state", "cache_key", "config", "node_ids", "updated"):
            d.pop(k, None)
        d["models"] = {label: rec.as_dict() for label, rec in _models.items()}
        for name, sec in _sections.items():
            d[name] = dict(sec)
        return copy.deepcopy(d)


def reset() -> None:
    """Forget every counter (tests, Cache Manager 'clear all')."""
    global _total
    with _lock:
        _total = _Record(state="")
        _models.clear()
        _sections.clear()
