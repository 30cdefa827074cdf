"""CompileConfig -> scoped Dynamo/Inductor settings -> a compiled module that never loses a run.

:class:`CompiledModule` wraps a ``torch.nn.Module``. Nothing compiles until the first call; then

1. the cache entry for (module structure, dtypes, device, versions, options) is located, locked,
   and verified against its manifest (:mod:`nexfort_engine.cache`);
2. Dynamo traces the module under our dynamic-shape policy (:mod:`nexfort_engine.shapes`) and hands
   each graph to our backend, which counts it and compiles it with Inductor using this config's
   patches only (``compile_fx(config_patches=...)``);
3. new artifacts are hashed into the entry's manifest.

With ``"static_first"`` (auto: a UNet's forward or a VAE's decode/encode on a GPU), a cold first
call instead compiles a static-shape twin for its own size and runs it, and a child process
(:mod:`nexfort_engine.background`) compiles the dynamic graph; the twin runs the calls it fits
until the first other size loads that.

Any exception while compiling or running compiled code is caught here once: counted, logged with
its reason, and that call — and every later one of this module — runs eager. Weights stay live
parameters (unless ``freezing``), so in-place weight patches such as LoRA are seen without a
recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import pickle
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch

from . import (
    background,
    collector,
    counters,
    gemm_tuning,
    host_call,
    intraop,
    precompile,
    prewarm,
    regions,
    shapes,
    signature,
    split,
    stream,
    trace_ops,
)
from .cache import CacheEntry, CacheStore, entry_key, environment_fingerprint, structure_digest
from .cache.store import ENV_CACHE_DIR, atomic_write_bytes
from .fp8 import MIN_AUTO_WIDTH, Fp8LinearMode, ModuleWeights, fp8_supported, model_width, pays_off
from .indexing import int32_size_args
from .options import CompileConfig, env_switch, parse_options
from .passes import group_norm
from .passes.sdpa_priority import cache_marks as sdpa_cache_marks
from .passes.sdpa_priority import device_prefers_cudnn
from .reductions import persistent_rows
from .settings import Settings, fp16_accumulation_pays, resolve, runtime_overrides
from .threads import adopt_cudagraph_trees
from .weight_layout import ChannelsLastWeights

log = logging.getLogger(__name__)

#: Exceptions that must propagate (user interrupts), matched by class name so the engine needs
#: no ComfyUI import.
PASSTHROUGH = ("InterruptProcessingException", "KeyboardInterrupt")

_compile_lock = threading.RLock()

#: ``NEXFORT_PRECOMPILE=0``: compile through ``torch.compile`` only (no ahead-of-time artifacts)
ENV_PRECOMPILE = "NEXFORT_PRECOMPILE"
#: ``NEXFORT_TRACE_STAND_INS=0``: trace ``F.linear`` as itself (trace_ops.py), for A/B measurements
ENV_STAND_INS = "NEXFORT_TRACE_STAND_INS"
#: ``NEXFORT_RUN_AS_COMPILED=0``: a cold compile's first call loads the graph it saved back, as a
#: later process does, instead of running the one it holds (for A/B measurements)
ENV_RUN_AS_COMPILED = "NEXFORT_RUN_AS_COMPILED"
#: ahead-of-time graphs per compiled module (one per guard set: batch 1 and 2, another patch,
#: a size Dynamo specialised); past it the module compiles through ``torch.compile``
MAX_PRECOMPILED = 8

#: what ``"static_first"`` auto applies to on a GPU: a UNet's forward and a VAE's decode and encode
#: (measured on SDXL's VAE at 1024²: the first decode 24.5-28.6 s against 42.0-44.6 s for the
#: dynamic graph, runs 218-219; the first encode 21.3-28.3 s against 30.2-43.1 s, run222)
AUTO_STATIC_FIRST_METHODS = ("forward", "decode", "encode")

#: a static-shape graph held for ``"static_first"`` returns this for a call it does not fit,
#: instead of compiling another graph
_NO_FIT = object()


def precompile_enabled() -> bool:
    return env_switch(ENV_PRECOMPILE)


def stand_ins_enabled() -> bool:
    return env_switch(ENV_STAND_INS)


def run_as_compiled() -> bool:
    return env_switch(ENV_RUN_AS_COMPILED)


def _exception_chain(err: BaseException) -> list[BaseException]:
    """``err`` and what it wraps: Dynamo re-raises backend errors as ``BackendCompilerFailed``
    (``from None``), keeping the original only in ``inner_exception``."""
    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in chain and len(chain) < 16:
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__
    return chain


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _compile_metrics() -> dict[str, float]:
    """Seconds torch has timed so far in this process, by phase (Dynamo's compile-time metrics)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


def _phases_since(before: dict[str, float]) -> dict[str, float]:
    """Seconds per torch compile phase since ``before`` (:func:`_compile_metrics`), those of 0.05 s
    or more."""
    return {k: dt for k, v in _compile_metrics().items() if (dt := v - before.get(k, 0.0)) >= 0.05}


def _fx_counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


def register_ops() -> None:
    """Register every ``nexfort::`` op a saved graph may call. The graph passes import the modules
    that define them while they rewrite a trace; loading a saved graph runs no pass, so a restarted
    process would otherwise fail on the first such op (``torch.ops.nexfort`` has no attribute) and
    fall back to eager. Cheap: no Triton, no CUDA (the kernels load at their first GPU call)."""
    from . import absmax, fp8, fp8_attention, rope, rowwise_quant, trace_ops  # noqa: F401
    from .passes import gelu_epilogue, group_norm, tuned_linear  # noqa: F401


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _last_recompile_reason() -> str:
    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = list(get_compilation_metrics())
    except Exception:  # noqa: BLE001 - diagnostics only
        return "unknown"
    for m in reversed(metrics):
        reason = getattr(m, "recompile_reason", None)
        if reason:
            return str(reason)
    return "unknown"


#: host hook on a region block's (args, kwargs) before its compiled forward (see :func:`compile`)
BlockHook = Callable[[tuple, dict], tuple[tuple, dict]]


def _with_fp8(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with Fp8LinearMode():
            return fn(*args, **kwargs)

    return call


class CompiledModule(torch.nn.Module):
    """A module compiled lazily by nexfort, falling back to eager on any compile/run failure."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: CompileConfig,
        store: CacheStore | None,
        label: str | None = None,
        method: str = "forward",
        block_hook: BlockHook | None = None,
        child_globals: tuple[tuple[str, str, Any], ...] = (),
    ) -> None:
        super().__init__()
        self._orig_mod = module
        self._nx_block_hook = block_hook
        #: ``"background": true``: the child process compiling, and what it needs set first
        self._nx_job: background.Job | None = None
        #: ``"static_first"``: the static-shape twin that compiled the first call, run for the calls
        #: it fits until the dynamic graph is loaded; whether it ran (a later compile here is then a
        #: recompile); set in the twin: it returns :data:`_NO_FIT` instead of compiling again
        self._nx_static: CompiledModule | None = None
        self._nx_static_ran = False
        self._nx_fits_only = False
        self._nx_child_globals = child_globals
        self._nx_method = method
        self._nx_config = config
        self._nx_store = store
        self._nx_name = label or type(module).__name__
        self._nx_label = self._nx_name
        self._nx_settings: Settings | None = None
        self._nx_entry: CacheEntry | None = None
        self._nx_env: dict[str, str] | None = None
        self._nx_graphs = 0
        self._nx_regions: list[regions.Region] = []
        #: under dynamic shape, the image input's spatial sizes are traced as multiples of this
        self._nx_fold = 1
        #: F.group_norm -> passes.group_norm (decided in _setup)
        self._nx_group_norm = False
        self._nx_group_norms = 0
        #: fp8 activation quantizations fused with their producers (passes/fuse_quant.py)
        self._nx_fused_quants = 0
        self._nx_fused_ropes = 0
        #: attentions in fp8 (passes/fp8_attention.py)
        self._nx_fp8_attentions = 0
        #: fp8 GEMMs reading weights the model stores in e4m3 (passes/fp8_stored.py)
        self._nx_fp8_stored = 0
        #: callers' SDPA priority lists with cuDNN moved ahead of flash (passes/sdpa_priority.py)
        self._nx_sdpa_reordered = 0
        #: linear + tanh-GELU pairs run as one GEMM with a GELU epilogue (passes/gelu_epilogue.py)
        self._nx_gelu_epilogues = 0
        #: linears run as nexfort::tuned_linear (passes/tuned_linear.py)
        self._nx_tuned_linears = 0
        self._nx_failed: str | None = None
        self._nx_compiled: Callable[..., Any] | None = None
        #: set up, but the first compiled call (entry verification, compile or load) not made yet:
        #: a background compile ran in between
        self._nx_first_pending = False
        #: ahead-of-time graphs (precompile.py) in use instead of torch.compile's, in trace order
        self._nx_aot = False
        self._nx_aot_artifacts: list[precompile.Artifact] = []
        #: this entry's saved graphs not loaded yet (loaded one by one until one applies)
        self._nx_aot_pending: list[Any] = []
        self._nx_aot_loaded = 0
        self._nx_aot_load_s = 0.0
        self._nx_recompile_reason: str | None = None
        self._nx_aot_used = False
        #: saved graphs in use: the call structures (signature.call_signature) whose trace broke, and
        #: why (precompile.UNSUPPORTED_CALLS); such calls run ``_nx_traced``, a torch.compile'd twin
        self._nx_broken_calls: dict[str, str] = {}
        self._nx_traced: Callable[..., Any] | None = None
        #: the last call ran ``_nx_traced`` (its compiles read Inductor's cache counters as they are)
        self._nx_last_traced = False
        #: graph-break reasons already counted for this module (each once)
        self._nx_breaks: list[str] = []
        self._nx_cudagraphs = False
        #: the traced graph is cut into this many parts (split.py; set while tracing), compiled by
        #: these children (part index -> job)
        self._nx_parts = 1
        self._nx_part_jobs: dict[int, background.Job] = {}
        #: starts one more compile worker for part ``index`` of the current split (set with the workers)
        self._nx_spawn_part: Callable[[int], background.Job] | None = None
        #: parts cut while Dynamo traces (stream.py), and the workers they went to (part -> job)
        self._nx_stream: stream.Streamer | None = None
        self._nx_stream_jobs: dict[int, background.Job] = {}
        self._nx_stand_ins = 0
        #: the passes' counts before the trace (restored when streamed parts are dropped: their
        #: passes run again on the whole graph)
        self._nx_counts_before: tuple[int, ...] = ()
        #: when the workers of the last split compile started (time.time): their phases count from it
        self._nx_parts_t0 = 0.0
        #: a precompiled trace's split parts are compiled after Dynamo built its guards: the
        #: pending split (what completes it, the trace's shape environment)
        self._nx_defer_parts = False
        #: when the trace of a saved graph started (perf_counter), until its backend is entered
        self._nx_trace_t0 = 0.0
        self._nx_pending: tuple[Callable[[], None], Any] | None = None
        #: fp8: the module's cached fp8 weights, refreshed before every compiled call (fp8.py)
        self._nx_fp8: ModuleWeights | None = None
        #: channels-last conv weights (weight_layout.py), refreshed before every compiled call
        self._nx_conv_weights: ChannelsLastWeights | None = None
        self._nx_memory_format = (
            torch.channels_last if config.memory_format == "channels_last" else None
        )
        counters.set_info(self._nx_label, state="pending", config=config.describe())

    # -- attribute access falls through to the wrapped module (dtype, config attributes, ...)
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)

    @property
    def label(self) -> str:
        return self._nx_label

    @property
    def failed(self) -> str | None:
        """Why this module fell back to eager, or ``None``."""
        return self._nx_failed

    @property
    def cache_entry(self) -> CacheEntry | None:
        return self._nx_entry

    # -- compile machinery
    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Dynamo's backend: compile one graph; count it only once it compiled (Dynamo may restart
        an analysis, e.g. TensorifyScalarRestartAnalysis, by raising from inside the backend)."""
        if self._nx_trace_t0:  # Dynamo's own share of a saved graph's trace (the caller's, serial)
            counters.set_phase(self._nx_label, "dynamo_trace", time.perf_counter() - self._nx_trace_t0)
            self._nx_trace_t0 = 0.0
        streamer, self._nx_stream = self._nx_stream, None
        # host calls compile like any op (a worker never runs its part); _compile_graph decides
        # their CUDA graphs (host_call.py)
        if hosted := host_call.count(gm):
            counters.set_info(self._nx_label, host_calls=hosted)
        if streamer is not None and (streamed := self._streamed_split(streamer, gm)) is not None:
            self._nx_graphs += 1
            return streamed
        self._graph_passes(gm)
        if self._nx_parts > 1:
            try:
                compiled = self._compile_split(gm, example_inputs)
            except Exception as e:
                if type(e).__name__ in PASSTHROUGH:
                    raise
                counters.set_info(self._nx_label, compile_parts=f"off: {type(e).__name__}: {str(e)[:200]}")
                log.warning("nexfort: %s: cutting the graph failed, compiling it whole (%s: %s)", self._nx_label,
                            type(e).__name__, e)
                compiled = precompile.serializable(self._compile_graph(gm, example_inputs))
        else:
            compiled = self._compile_graph(gm, example_inputs)
            if self._nx_aot:
                compiled = precompile.serializable(compiled)
        self._nx_graphs += 1
        return compiled

    def _graph_passes(self, gm: torch.fx.GraphModule) -> None:
        """The engine's rewrites of a traced graph (or of a part of one, stream.py), counted."""
        if n := trace_ops.restore(gm):
            self._nx_stand_ins += n
            counters.set_info(self._nx_label, trace_stand_ins=self._nx_stand_ins)
        if self._nx_group_norm and (n := group_norm.rewrite_group_norms(gm)):
            self._nx_group_norms += n
            counters.set_info(self._nx_label, group_norms_rewritten=self._nx_group_norms)
        if self._nx_settings is not None and self._nx_settings.fused_quant:
            from .passes.fuse_quant import rewrite_quantizations

            if n := rewrite_quantizations(gm):
                self._nx_fused_quants += n
                counters.set_info(self._nx_label, fp8_quant_fused=self._nx_fused_quants)
        if self._nx_settings is not None and self._nx_settings.fused_rope:
            from .passes.fuse_rope import rewrite_ropes

            if n := rewrite_ropes(gm):
                self._nx_fused_ropes += n
                counters.set_info(self._nx_label, rope_fused=self._nx_fused_ropes)
        if self._nx_settings is not None and self._nx_settings.sdpa_cudnn_first:
            from .passes.sdpa_priority import rewrite_sdpa_priorities

            if n := rewrite_sdpa_priorities(gm):
                self._nx_sdpa_reordered += n
                counters.set_info(self._nx_label, sdpa_cudnn_first=self._nx_sdpa_reordered)
        if self._nx_settings is not None and self._nx_settings.gelu_epilogue:
            from .passes.gelu_epilogue import rewrite_gelu_epilogues

            if n := rewrite_gelu_epilogues(gm):
                self._nx_gelu_epilogues += n
                counters.set_info(self._nx_label, gelu_epilogues=self._nx_gelu_epilogues)
        if self._nx_settings is not None and self._nx_settings.tuned_gemm:
            from .passes.tuned_linear import rewrite_tuned_linears

            if n := rewrite_tuned_linears(gm):  # after the GELU epilogue: it takes linear_gelu's calls too
                self._nx_tuned_linears += n
                counters.set_info(self._nx_label, tuned_linears=self._nx_tuned_linears)
        if self._nx_settings is not None and self._nx_settings.fp8_attention:
            from .passes.fp8_attention import rewrite_attentions

            if n := rewrite_attentions(gm):
                self._nx_fp8_attentions += n
                counters.set_info(self._nx_label, attention_fp8=self._nx_fp8_attentions)
        if self._nx_settings is not None and self._nx_settings.fp8:
            from .passes.fp8_stored import rewrite_stored_weights

            if n := rewrite_stored_weights(gm):  # last: the passes above match fp8_mm_cached
                self._nx_fp8_stored += n
                counters.set_info(self._nx_label, fp8_stored_weights=self._nx_fp8_stored)

    # -- a graph cut into parts compiled by several processes (split.py)
    def _compile_split(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Cut the traced graph into ``self._nx_parts`` parts; ship the children theirs, compile the
        others here, collect the children's (or compile here those a child did not deliver)."""
        label, count = self._nx_label, self._nx_parts
        t_cut = time.perf_counter()
        cut = split.split(gm, count)
        t_cut = time.perf_counter() - t_cut
        if cut is None:
            counters.set_info(label, compile_parts=f"off: the graph is too small to cut in {count}")
            return precompile.serializable(self._compile_graph(gm, example_inputs))
        shape_env = split.shape_env_of([v for p in cut.parts for v in p.inputs])
        jobs = dict(self._nx_part_jobs)
        here: list[str] = []
        sent: dict[int, str] = {}  # part -> fingerprint, as shipped
        t_ship = time.perf_counter()
        for index, job in sorted(jobs.items()):
            # before this process compiles anything: the shape environment as traced
            if (fingerprint := self._ship_part(job, cut.parts[index], count, here)) is None:
                del jobs[index]
            else:
                sent[index] = fingerprint
        t_ship = time.perf_counter() - t_ship
        counters.set_phase(label, "cut", t_cut)
        counters.set_phase(label, "ship", t_ship)
        return self._run_split(cut, jobs, sent, here, shape_env)

    # -- parts cut while Dynamo traces (stream.py)
    def _stream_send(self, part: split.Part) -> str | None:
        """Ship a part cut during the trace to the next worker without one."""
        taken = {id(job) for job in self._nx_stream_jobs.values()}
        index = next((i for i, job in sorted(self._nx_part_jobs.items()) if id(job) not in taken), None)
        if index is None:
            return None
        here: list[str] = []
        fingerprint = self._ship_part(self._nx_part_jobs[index], part, self._nx_parts, here)
        if fingerprint is None:
            del self._nx_part_jobs[index]
            return None
        self._nx_stream_jobs[part.index] = self._nx_part_jobs[index]
        return fingerprint

    def _streamed_split(self, streamer: stream.Streamer, gm: torch.fx.GraphModule) -> Callable[..., Any] | None:
        """The split whose first parts were shipped during the trace: the rest of the graph cut
        among the workers left. ``None`` where nothing was streamed, or the streamed parts do not fit
        the finished graph (their workers are replaced, and the graph is cut as a whole)."""
        label = self._nx_label
        used, self._nx_stream_jobs = self._nx_stream_jobs, {}
        taken = {id(job) for job in used.values()}
        free = [job for _i, job in sorted(self._nx_part_jobs.items()) if id(job) not in taken]
        t_cut = time.perf_counter()
        try:
            cut = streamer.finish(gm, max(1, len(free)))
        except Exception as e:
            if type(e).__name__ in PASSTHROUGH:
                raise
            why = f"{type(e).__name__}: {e}" if not isinstance(e, stream.Failed) else str(e)
            counters.set_info(label, compile_parts_streamed={**streamer.report(), "dropped": why})
            log.warning("nexfort: %s: the parts cut while tracing do not fit the graph (%s); cutting it whole",
                        label, why)
            self._replace_workers(taken)
            (self._nx_stand_ins, self._nx_group_norms, self._nx_fused_quants, self._nx_fused_ropes,
             self._nx_fp8_attentions, self._nx_fp8_stored, self._nx_sdpa_reordered,
             self._nx_gelu_epilogues, self._nx_tuned_linears) = self._nx_counts_before
            return None
        counters.set_info(label, compile_parts_streamed=streamer.report())
        if cut is None:
            return None
        t_cut = time.perf_counter() - t_cut
        jobs, sent, here = dict(used), dict(streamer.sent), list[str]()
        t_ship = time.perf_counter()
        for part in cut.parts[len(streamer.shipped):]:
            if not free:
                break
            job = free.pop(0)
            if (fingerprint := self._ship_part(job, part, len(cut.parts), here)) is not None:
                jobs[part.index], sent[part.index] = job, fingerprint
        for job in free:
            job.cancel()
        counters.set_phase(label, "cut", t_cut)
        counters.set_phase(label, "ship", time.perf_counter() - t_ship)
        counters.set_phase(label, "stream_hook", streamer.hook_s)
        shape_env = split.shape_env_of([v for p in cut.parts for v in p.inputs])
        return self._run_split(cut, jobs, sent, here, shape_env)

    def _replace_workers(self, taken: set[int]) -> None:
        """Stop the workers given parts that are dropped, and start new ones in their places."""
        for index, job in list(self._nx_part_jobs.items()):
            if id(job) not in taken:
                continue
            job.cancel()
            del self._nx_part_jobs[index]
            if self._nx_spawn_part is not None:
                try:
                    self._nx_part_jobs[index] = self._nx_spawn_part(index)
                except OSError as e:
                    log.warning("nexfort: %s: no new compile worker for part %d (%s)", self._nx_label, index, e)

    def _ship_part(self, job: background.Job, part: split.Part, count: int, here: list[str]) -> str | None:
        """Hand ``part`` to its worker: the fingerprint it was sent with, or ``None`` (the worker
        is stopped, the part is noted as compiled here)."""
        from . import ship

        try:
            fingerprint = part.fingerprint()
            data = ship.dumps((part.index, fingerprint, part.single, part.module, part.inputs))
            atomic_write_bytes(job.path / background.PART_IN_FILE, data)
        except (ship.ShipError, OSError) as e:
            job.cancel()
            here.append(f"part {part.index} compiled here: it cannot be shipped ({e})")
            log.warning("nexfort: %s: part %d of %d compiled here (cannot ship it: %s)", self._nx_label, part.index,
                        count, e)
            return None
        return fingerprint

    def _run_split(self, cut: split.Split, jobs: dict[int, background.Job], sent: dict[int, str], here: list[str],
                   shape_env: Any) -> Callable[..., Any]:
        """The split's compiled function; its parts are collected now or, in a saved graph's trace,
        once Dynamo has built its guards (:meth:`_finish_pending`)."""
        compiled = split.SplitCallable(cut.plan, [])

        deferred = self._nx_defer_parts and self._nx_pending is None
        load = deferred and run_as_compiled()

        def finish() -> None:
            # loaded here only outside Dynamo's trace (deferred): the saved graph's first call
            # then runs them as they are (_aot_compile)
            compiled.parts, fns = self._finish_split(cut, jobs, sent, here, shape_env, load=load)
            if load and all(fn is not None for fn in fns):
                compiled._fns = fns

        if deferred:
            # the caller's own part and the children's are collected after Dynamo has built the
            # trace's guards (seconds of one core: SDXL's 8.9 s on an H100 host), see _aot_compile;
            # a second graph of one trace (none in a full-graph trace) would be compiled at once
            self._nx_pending = (finish, shape_env)
        else:
            finish()
        return compiled

    def _finish_split(self, cut: split.Split, jobs: dict[int, background.Job], sent: dict[int, str],
                      here: list[str], shape_env: Any, load: bool = False,
                      ) -> tuple[list[bytes], list[Callable[..., Any] | None]]:
        """Compile the parts no child was given here, then collect the children's as they finish
        (or compile here those a child did not deliver): the parts' compiled bytes in order, and
        with ``load``, their functions, each loaded as it came in (``None`` where one was not)."""
        label, count = self._nx_label, len(cut.parts)
        blobs: list[bytes | None] = [None] * count
        loaded: list[Callable[..., Any] | None] = [None] * count
        each: dict[int, dict[str, Any]] = {part.index: {} for part in cut.parts}
        patches, load_s = self._inductor_patches(), 0.0

        def load_ahead(index: int, blob: bytes) -> None:
            # while later parts still compile, so that the first call does not reload what this
            # process just compiled (_aot_compile); a part that fails here loads with the saved graph
            nonlocal load_s
            if not load:
                return
            t_load = time.perf_counter()
            try:
                loaded[index] = split.load_compiled(blob, patches)
            except Exception as e:  # noqa: BLE001 - the saved graph's own load decides what fails
                log.info("nexfort: %s: part %d not loaded ahead (%s: %s)", label, index, type(e).__name__, e)
            load_s += time.perf_counter() - t_load

        t0 = time.perf_counter()
        for part in cut.parts:
            if part.index not in jobs:
                t_part, before = time.perf_counter(), _compile_metrics()
                blobs[part.index] = split.compile_part(part, self._compile_graph)
                each[part.index].update(where="here", compile_s=round(time.perf_counter() - t_part, 3),
                                        phases_s=split.top_phases(_phases_since(before)))
        own_s = time.perf_counter() - t0
        for part in cut.parts:  # while the children compile
            if (blob := blobs[part.index]) is not None:
                load_ahead(part.index, blob)
        from_children, delivered = 0, []
        deadline = time.monotonic() + split.CHILD_TIMEOUT_S
        waiting = dict(jobs)
        while waiting:
            # the report comes before the child's exit, which tears down CUDA and its compile pool
            # (seconds); the parent stops it once it has what it needs
            ready = [i for i, job in sorted(waiting.items())
                     if (job.path / background.RESULT_FILE).exists() or job.done()]
            if not ready and time.monotonic() <= deadline:
                time.sleep(0.02)
                continue
            for index in ready or sorted(waiting):
                job = waiting.pop(index)
                part = cut.parts[index]
                if ready:
                    got, why = self._collect_part(job, part.index, sent[index], shape_env, delivered)
                else:
                    job.cancel()
                    got, why = None, f"its child took more than {split.CHILD_TIMEOUT_S:.0f}s"
                if got is None:
                    here.append(f"part {index} compiled here: {why}")
                    log.warning("nexfort: %s: part %d of %d compiled here (%s)", label, index, count, why)
                    t_part = time.perf_counter()
                    got = split.compile_part(part, self._compile_graph)
                    each[index].update(where="here", compile_s=round(time.perf_counter() - t_part, 3))
                else:
                    from_children += 1
                blobs[index] = got
                load_ahead(index, got)
        for name in ("started", "loaded", "ready", "received", "unpickled", "compiled"):  # the slowest worker's
            times = [d["times"][name] - self._nx_parts_t0 for d in delivered if name in d["times"]]
            if times:
                counters.set_phase(label, f"children_{name}", max(times))
        if load:
            counters.set_phase(label, "parts_loaded", load_s)
        if slowest := split.slowest_child(delivered):
            counters.set_info(label, compile_parts_slowest_child=slowest)
        for d in delivered:
            if d.get("index") in each and (timing := split.child_timing(d)):
                each[d["index"]].update(where="child", compile_s=timing["compile_s"], phases_s=timing["phases_s"],
                                        # when the part reached its worker, and was compiled there
                                        at_s={k: round(v - self._nx_parts_t0, 2) for k, v in d["times"].items()
                                              if k in ("received", "compiled")})
        # what each part holds, counted once every part is in (off the caller's critical path)
        counters.set_info(label, compile_parts_each=[{**split.part_profile(part), **each[part.index]}
                                                     for part in cut.parts])
        counters.set_info(label, compile_parts="; ".join([f"{count} parts, {from_children} from child processes",
                                                          *here]),
                          compile_parts_own_seconds=round(own_s, 3),
                          compile_parts_wait_seconds=round(time.perf_counter() - t0 - own_s, 3))
        return [b for b in blobs if b is not None], loaded

    def _collect_part(self, job: background.Job, index: int, fingerprint: str, shape_env: Any,
                      delivered: list[dict[str, Any]]) -> tuple[bytes | None, str]:
        """A finished child's part: its compiled bytes once it is the part shipped and its guards hold here."""
        report = job.report()
        if report.get("crashed") or report.get("error"):
            return None, str(report.get("crashed") or report.get("error"))
        try:
            got = split.load_part((job.path / background.PART_FILE).read_bytes())
        except (OSError, ValueError, pickle.UnpicklingError) as e:
            return None, f"its result is unreadable ({type(e).__name__}: {e})"
        delivered.append({"index": got["index"], "times": dict(got.get("times") or {}),
                          "phases": dict(got.get("phases") or {})})
        if got["index"] != index or got["fingerprint"] != fingerprint:
            return None, "the child compiled another part"
        if (why := split.apply_guards(shape_env, got["guards"])) is not None:
            return None, why
        return got["compiled"], ""

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        backend = self._nx_config.backend
        if backend == "eager":
            return gm.forward
        if backend == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        assert self._nx_settings is not None
        patches = dict(self._nx_settings.inductor)
        marks: dict[str, str] = {}
        if self._nx_group_norm:
            group_norm.register_lowering()
            marks.update(group_norm.cache_marks())
        if self._nx_settings.fp8_attention:
            from .passes import fp8_attention as fp8_attention_pass

            marks.update(fp8_attention_pass.cache_marks())
        # a caller's sdpa_kernel block (ComfyUI 0.29+ on CUDA) traces into calls AOTAutograd's cache
        # does not know: marked, its graphs are saved (precompiled) and warm starts load them
        marks.update(sdpa_cache_marks())
        if marks:
            from torch._inductor import config as inductor_config

            marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
            if marked is not None:  # torch versions without it bypass AOTAutograd's cache
                patches["unsafe_marked_cacheable_functions"] = {**marked, **marks}
        if host_call.in_graph(gm) and patches.get("triton.cudagraphs") and not (
                host_call.partitions_cudagraphs() and patches.get("graph_partition")):
            # a replay would skip the host code; with partition (the cudagraphs settings) the graph
            # is replayed between the calls instead
            patches["triton.cudagraphs"] = False
        if self._nx_config.fuse_qkv_projections:
            from .passes.fuse_qkv import FuseQKVPass

            patches["post_grad_custom_pre_pass"] = FuseQKVPass()
        with persistent_rows(self._nx_settings.persistent_rows), int32_size_args(self._nx_settings.int32_size_args):
            return compile_fx(gm, example_inputs, config_patches=patches)

    def _setup(self, example: torch.Tensor | None) -> None:
        device = str(example.device) if example is not None else "cpu"
        cuda = device.startswith("cuda")
        fp8_capable = example is not None and fp8_supported(example.device)
        capability = torch.cuda.get_device_capability(example.device) if cuda else None
        fp8_pays = pays_off(self._orig_mod)
        # probe cuDNN's fp8 attention only where auto could turn it on (O3's fp8 linears)
        cfg = self._nx_config
        fp8_attention_capable = (cfg.fp8_attention is None and fp8_capable and example is not None
                                 and (cfg.fp8 or (cfg.fp8 is None and fp8_pays and "low-precision" in cfg.flags)))
        if fp8_attention_capable:
            from .fp8_attention import cudnn_supported

            fp8_attention_capable = cudnn_supported(example.device)
        if self._nx_method == "forward":
            self._nx_regions = regions.select_regions(self._orig_mod, self._nx_config.regional)
        # a convolutional net compiled whole (a UNet; not its blocks under regional compilation)
        whole_conv_net = not self._nx_regions and any(
            isinstance(m, torch.nn.modules.conv._ConvNd) for m in self._orig_mod.modules())
        self._nx_settings = resolve(
            self._nx_config,
            cuda=cuda,
            fp8_capable=fp8_capable,
            fp16_accumulation=fp16_accumulation_pays(capability),
            fp8_pays=fp8_pays,
            fp8_attention_capable=bool(fp8_attention_capable),
            autotune_pays=not whole_conv_net,
            cudnn_attention_preferred=device_prefers_cudnn(capability, torch.backends.cudnn.version()),
        )
        if self._nx_settings.autotune_skipped:
            why = ("convolutional UNet compiled whole" if whole_conv_net
                   else "no fp8 linears: cuBLAS beats Inductor's GEMM templates")
            counters.set_info(self._nx_label, autotune_skipped=why)
            log.info("nexfort: %s: O3's max-autotune left out (%s: slower with it, and a much longer cold "
                     "compile); a mode string naming max-autotune keeps it", self._nx_label, why)
        # what Inductor compiles: under regional compilation only the blocks (a UNet's transformer
        # blocks have no convolutions; its convolutions then run eager, where channels-last
        # weights would only make cuDNN hand channels-last outputs to ATen's GroupNorm, which
        # copies them back: regional SDXL spent 4.1 ms per step in such copies, run61)
        compiled = regions.blocks_module(self._nx_regions) if self._nx_regions else self._orig_mod
        # no flag sets these keys: one already in the settings is the user's own "inductor.<key>"
        # option, which wins over the patch
        layout = {k: v for k, v in shapes.layout_patches(compiled, cuda).items() if k not in self._nx_settings.inductor}
        channels_last = bool(layout.get("force_layout_optimization"))
        if layout and self._nx_config.backend == "inductor":
            self._nx_settings = dataclasses.replace(
                self._nx_settings, inductor={**self._nx_settings.inductor, **layout}
            )
            if channels_last:  # converted before each compiled call (not the eager ones of a background compile)
                self._nx_conv_weights = ChannelsLastWeights(compiled)
        self._nx_group_norm = group_norm.wanted(
            self._nx_config.group_norm_rewrite,
            channels_last_forced=channels_last,
            inductor=self._nx_config.backend == "inductor",
            forward=self._nx_method == "forward",
        )
        counters.set_info(self._nx_label, fp8=self._nx_settings.fp8, regions=[r.name for r in self._nx_regions])
        if self._nx_settings.tuned_gemm and self._nx_store is not None:
            gemm_tuning.use_dir(self._nx_store.root)  # the measured GEMM algorithms persist with the graphs
        if self._nx_config.fp8 is None and fp8_capable and not fp8_pays and "low-precision" in self._nx_config.flags:
            width = model_width(self._orig_mod)
            counters.set_info(self._nx_label, fp8_skipped=f"model width {width} < {MIN_AUTO_WIDTH}")
            log.info("nexfort: %s: fp8 linears left off (model width %d < %d: quantizing the activations "
                     "would cost what fp8 GEMMs save); \"fp8\": true forces them", self._nx_label, width,
                     MIN_AUTO_WIDTH)
        if self._nx_settings.fp8:
            self._nx_fp8 = ModuleWeights(self._orig_mod)
            weakref.finalize(self, self._nx_fp8.release)  # its graphs go with it
        self._nx_cudagraphs = bool(self._nx_settings.inductor.get("triton.cudagraphs")) and (
            self._nx_config.backend == "inductor"
        )
        if not self._nx_regions:  # regional: the glue around the blocks runs eager
            self._nx_fold = shapes.spatial_multiple(
                self._orig_mod, self._nx_config.spatial_multiple, self._nx_config.dynamic
            )
            counters.set_info(self._nx_label, spatial_multiple=self._nx_fold)
        if self._nx_store is not None:
            self._nx_env = environment_fingerprint(device)
            structure = f"{structure_digest(self._orig_mod)}.{self._nx_method}"
            # what was decided, not the option: auto and true share an entry when they agree
            structure += regions.regions_key(self._nx_regions)
            if self._nx_fold > 1:
                structure += f".fold{self._nx_fold}"
            key = entry_key(structure, self._nx_settings.digest(self._nx_config), self._nx_env)
            self._nx_entry = self._nx_store.entry(key)
            old_label = self._nx_label
            self._nx_label = f"{self._nx_name}:{key[:8]}"
            counters.rename(old_label, self._nx_label)
            counters.set_info(self._nx_label, cache_key=key)
        self._nx_aot = (
            self._nx_entry is not None
            and not self._nx_regions
            and self._nx_config.backend == "inductor"
            and precompile_enabled()
            and precompile.available()
            and not (self._aot_dir() / precompile.UNSUPPORTED).exists()
        )
        counters.set_info(self._nx_label, precompiled="on" if self._nx_aot else "off")
        if self._nx_aot:
            self._nx_broken_calls = precompile.broken_calls(self._aot_dir())
            if self._nx_broken_calls:
                counters.set_info(self._nx_label, precompiled=self._precompiled_info())
            self._nx_compiled = self._call_aot
            return
        self._nx_compiled = self._torch_compiled(example)

    def _torch_compiled(self, example: torch.Tensor | None) -> Callable[..., Any]:
        target = self._orig_mod if self._nx_method == "forward" else getattr(self._orig_mod, self._nx_method)
        if self._nx_regions:
            return self._compile_regions(target)
        if self._nx_fold > 1 and example is not None:
            return self._torch_compile(shapes.unfolding(target, example.dim()))
        return self._torch_compile(target)

    # -- ahead-of-time graphs (precompile.py): a warm start loads them instead of re-tracing
    def _aot_dir(self) -> Any:
        assert self._nx_entry is not None
        return self._nx_entry.artifacts / precompile.DIRNAME

    def _aot_target(self, example: torch.Tensor | None) -> Callable[..., Any]:
        fn = getattr(type(self._orig_mod), self._nx_method)
        if self._nx_fold > 1 and example is not None:
            return shapes.unfolding_method(fn, example.dim())
        return fn

    def _aot_find(self, args: tuple, kwargs: dict, example: torch.Tensor | None) -> tuple[Any, str | None]:
        """The first graph whose guards pass for ``args`` (the module first): among those loaded,
        then loading this entry's saved ones not loaded yet, one at a time (a stale file is
        removed; the next commit drops it from the manifest). ``(None, why)`` if none applies."""
        why = None
        for artifact in self._nx_aot_artifacts:
            why = artifact.check(args, kwargs)
            if why is None:
                return artifact, None
        while self._nx_aot_pending:
            path = self._nx_aot_pending.pop(0)
            t0 = time.perf_counter()
            try:
                register_ops()
                artifact = precompile.from_bytes(path.read_bytes(), self._aot_target(example).__globals__,
                                                 self._inductor_patches())
            except (precompile.StaleArtifact, OSError) as e:
                counters.set_info(self._nx_label, precompiled_stale=f"{path.name}: {e}")
                log.info("nexfort: %s: precompiled graph %s not used: %s", self._nx_label, path.name, e)
                self._aot_forget(path)
                continue
            finally:
                self._nx_aot_load_s += time.perf_counter() - t0
            artifact.path = path
            self._nx_aot_artifacts.append(artifact)
            self._nx_aot_loaded += 1
            counters.set_info(self._nx_label, precompiled_graphs=len(self._nx_aot_artifacts))
            why = artifact.check(args, kwargs)
            if why is None:
                counters.bump(self._nx_label, "cache_hits")
                return artifact, None
        return None, why

    def _aot_forget(self, path: Any) -> None:
        """Remove a saved graph that no longer applies, and re-commit the entry's manifest (a
        listed file missing would read as corruption next time)."""
        entry = self._nx_entry
        try:
            path.unlink()
            if entry is not None:
                with entry.lock():
                    entry.commit(self._nx_env or {})
        except OSError as e:
            log.warning("nexfort: could not remove stale precompiled graph %s (%s)", path, e)

    def _inductor_patches(self) -> dict[str, Any] | None:
        return dict(self._nx_settings.inductor) if self._nx_settings is not None else None

    def _call_aot(self, *args: Any, **kwargs: Any) -> Any:
        """Run the first saved graph whose guards pass; else trace a new one (a recompile). A call
        whose structure does not trace as one graph (a patch among its inputs, usually) compiles
        through ``torch.compile`` (:meth:`_call_twin`), and so does every call like it; past
        :data:`MAX_PRECOMPILED`, or where a saved graph fails its own inputs' guards, every call does
        from then on."""
        self._nx_last_traced = False
        example = _first_tensor(args, kwargs)
        call_args = (self._orig_mod, *shapes.fold_spatial(args, self._nx_fold, mark=False))
        artifact, why = self._aot_find(call_args, kwargs, example)
        if artifact is not None:
            return artifact(*call_args, **kwargs)
        if self._nx_fits_only:
            return _NO_FIT
        sig = signature.call_signature(args, kwargs)
        if sig in self._nx_broken_calls:  # traced before and broke: not tried again
            return self._call_twin(args, kwargs, example, sig)
        if len(self._nx_aot_artifacts) < MAX_PRECOMPILED:
            if self._nx_aot_artifacts:
                self._nx_recompile_reason = f"precompiled graph guards: {why}"
                log.info("nexfort: %s: no saved graph applies (%s); tracing one", self._nx_label, why)
            artifact = self._aot_compile(args, kwargs, example, sig)
            if artifact is not None:
                if (own := artifact.check(call_args, kwargs)) is None:
                    t0 = time.perf_counter()
                    out = artifact(*call_args, **kwargs)
                    counters.set_phase(self._nx_label, "first_run", time.perf_counter() - t0)
                    return out
                self._aot_unsupported(f"its own inputs fail the saved guards: {own}")
            elif sig in self._nx_broken_calls:  # this call's structure broke the trace, not the model
                return self._call_twin(args, kwargs, example, sig)
        else:
            log.warning("nexfort: %s: %d precompiled graphs; compiling through torch.compile from now on",
                        self._nx_label, MAX_PRECOMPILED)
        self._nx_aot = False
        self._nx_compiled = self._torch_compiled(example)
        return self._call_traced(args, kwargs)

    def _call_twin(self, args: tuple, kwargs: dict, example: torch.Tensor | None, sig: str) -> Any:
        """A call whose structure does not trace as one graph, beside saved graphs that serve the
        others: through ``torch.compile`` (in pieces at the graph breaks)."""
        if self._nx_traced is None:
            self._nx_traced = self._torch_compiled(example)
            if (self._nx_graphs or self._nx_aot_artifacts) and not self._nx_recompile_reason:  # beside others
                self._nx_recompile_reason = ("a call structure that does not trace as one graph: "
                                             f"{self._nx_broken_calls[sig]}")
        self._nx_last_traced = True
        # the caller's tensors left unmarked: a saved graph's guards check that they are
        args, kwargs = shapes.detached(args, kwargs)
        return self._call_traced(args, kwargs, self._nx_traced)

    def _precompiled_info(self) -> str:
        calls = self._nx_broken_calls
        first = next(iter(calls.values()), "")
        return f"on; {len(calls)} call structure(s) through torch.compile (the trace broke: {first})"

    def _aot_compile(self, args: tuple, kwargs: dict, example: torch.Tensor | None,
                     sig: str = "") -> precompile.Artifact | None:
        """Trace ``(args, kwargs)`` into one saved graph and return it ready to call (``None``: it
        cannot be traced so; noted in the entry, and torch.compile is used: for calls of the same
        structure ``sig`` where Dynamo could not trace it whole (a graph break), for every call
        otherwise)."""
        target = self._aot_target(example)
        graphs0 = self._nx_graphs
        taken = {p.name for p in precompile.files(self._aot_dir())}
        path = next(self._aot_dir() / f"{i}.bin" for i in range(MAX_PRECOMPILED + len(taken) + 1)
                    if f"{i}.bin" not in taken)
        label = self._nx_label
        try:
            t0 = time.perf_counter()
            self._start_parts(example)
            if self._nx_parts > 1 and stream.enabled():
                params = sum(1 for _ in self._orig_mod.parameters()) + sum(1 for _ in self._orig_mod.buffers())
                self._nx_stream = stream.Streamer(len(self._nx_part_jobs), params, self._stream_send,
                                                  self._graph_passes)
                self._nx_counts_before = (self._nx_stand_ins, self._nx_group_norms, self._nx_fused_quants,
                                          self._nx_fused_ropes, self._nx_fp8_attentions, self._nx_fp8_stored,
                                          self._nx_sdpa_reordered, self._nx_gelu_epilogues,
                                          self._nx_tuned_linears)
            t1 = time.perf_counter()
            self._nx_defer_parts, self._nx_pending = True, None
            self._nx_trace_t0 = t1
            try:
                compiled, recorder = self._aot_trace(args, kwargs, example)
                t_traced = time.perf_counter()
                sizes = self._finish_pending()
            finally:
                self._nx_defer_parts, self._nx_pending, self._nx_trace_t0 = False, None, 0.0
                self._stop_parts()
            t2 = time.perf_counter()
            data = precompile.to_bytes(compiled, recorder, sizes=sizes)
            atomic_write_bytes(path, data)
            t3 = time.perf_counter()
            if run_as_compiled() and precompile.runnable(compiled):
                # this process runs what it compiled: the guards Dynamo built while tracing and the
                # parts loaded as they came in; the file is what a later process loads
                artifact = precompile.live(compiled, recorder, target.__globals__, sizes)
                counters.set_info(label, precompiled_first_call="as compiled")
            else:
                artifact = precompile.from_bytes(data, target.__globals__, self._inductor_patches())
                counters.set_info(label, precompiled_first_call="loaded back")
            t4 = time.perf_counter()
            for name, dt in (("start_workers", t1 - t0), ("trace_and_compile", t2 - t1), ("save", t3 - t2),
                             ("load", t4 - t3), ("guards_built", t_traced - t1)):
                counters.set_phase(label, name, dt)
            if sizes:
                counters.set_info(label, precompiled_late_size_guards=[g.code for g in sizes])
        except Exception as e:
            if type(e).__name__ in PASSTHROUGH:
                raise
            self._nx_graphs = graphs0  # a graph compiled before the failure is not used
            with contextlib.suppress(OSError):
                path.unlink()
            text = str(e).strip()
            # the whole message (Dynamo's names the user code that it could not trace) for debugging
            log.debug("nexfort: %s: the saved graph's trace failed:\n%s", label, text)
            reason = f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
            if sig and any(signature.dynamo_trace_failure(x) for x in _exception_chain(e)):
                self._aot_call_unsupported(sig, reason, signature.user_location(text))
            else:
                self._aot_unsupported(reason)
            return None
        artifact.path = path
        self._nx_aot_artifacts.append(artifact)
        counters.set_info(self._nx_label, precompiled_graphs=len(self._nx_aot_artifacts),
                          precompiled_guards_dropped=len(recorder.dropped))
        return artifact

    def _finish_pending(self) -> list[precompile.SizeGuard]:
        """Complete a split whose parts waited for Dynamo's guards (:meth:`_compile_split`); the
        size guards those compiles took, which torch's saved guards lack (checked by ours)."""
        pending, self._nx_pending = self._nx_pending, None
        if pending is None:
            return []
        finish, shape_env = pending
        if shape_env is None:
            finish()
            return []
        # Dynamo froze the shape environment once its guards were built: a guard taken now would be
        # ignored, so the parts compile with it open and their guards are collected
        start, frozen = len(shape_env.guards), shape_env.frozen
        shape_env.frozen = False
        try:
            finish()
        finally:
            shape_env.frozen = frozen
        late = shape_env.guards[start:]
        if late:
            log.info("nexfort: %s: %d size guard(s) taken by the parts' compile: %s", self._nx_label, len(late),
                     [str(g.expr) for g in late])
        return precompile.size_guards(shape_env, [g.expr for g in late])

    def _aot_trace(self, args: tuple, kwargs: dict, example: torch.Tensor | None) -> tuple[Any, Any]:
        """Trace ``(args, kwargs)`` with the engine's backend: ``precompile.trace``'s result."""
        trace_args, trace_kwargs = shapes.detached(args, kwargs)
        if self._nx_config.dynamic:
            shapes.mark_dynamic_dims(trace_args, trace_kwargs)
        trace_args = shapes.fold_spatial(trace_args, self._nx_fold)
        target = self._aot_target(example)
        self_name = next(iter(inspect.signature(target).parameters), None)
        # F.linear as an op that only allocates while Dynamo traces (the backend restores it) and
        # torch.linspace with a symbolic length (trace_ops.py). Only here: a saved graph's guards
        # are ours to fingerprint (torch.compile's live guard on a stand-in would fail once the
        # real function is back; _call_traced keeps linspace's in place for every call for that)
        call = (self._orig_mod, *trace_args)
        watching = self._nx_stream.watching() if self._nx_stream is not None else contextlib.nullcontext()
        # fp8 linears: Fp8LinearMode must see every F.linear call (the stand-in would hide them)
        fp8 = self._nx_settings is not None and self._nx_settings.fp8
        linear = stand_ins_enabled() and not fp8 and trace_ops.plain(self._orig_mod, call, trace_kwargs)
        with trace_ops.standing_in(linear, symbolic_linspace=True), watching:
            return precompile.trace(target, call, trace_kwargs, self._backend, self_name,
                                    originals=trace_ops.originals())

    # -- compile workers (split.py): children that compile parts of the graph traced next
    def _start_parts(self, example: torch.Tensor | None) -> None:
        """Start the compile workers for the trace about to run (they wait for their parts, which
        :meth:`_compile_split` ships once the graph is cut); the cut count is what could start."""
        self._nx_parts, self._nx_part_jobs = 1, {}
        self._nx_parts_t0 = time.time()
        wanted = split.workers(self._nx_config.compile_workers, self._nx_config.backend, example,
                               self._nx_config.flags)
        entry = self._nx_entry
        if wanted < 2 or entry is None or self._nx_store is None:
            return
        children, why = wanted - 1, ""
        if example is not None:
            fit = split.children_that_fit(example.device)
            if fit < children:
                children, why = fit, f"device and host memory for {fit} child(ren)"
        count = children + 1
        threads = split.child_threads(count)
        try:  # what a worker needs to compile a part as this process would: no model, no weights
            data = background.dumps({
                "config": dataclasses.replace(self._nx_config, background=False),
                "settings": self._nx_settings,
                "group_norm": self._nx_group_norm,
                "label": self._nx_name,
                "key": entry.key,
                "grad": torch.is_grad_enabled(),
            })
        except background.Unavailable as e:
            data, why = None, f"cannot hand the options to a child process: {e}"
        store = self._nx_store

        def spawn(index: int) -> background.Job:
            return background.start_worker(
                root=store.root, key=f"{entry.key}.part{index}", data=data, label=self._nx_name,
                part=(index, count), threads=threads, child_globals=self._nx_child_globals,
            )

        self._nx_spawn_part = spawn if data is not None else None
        for index in range(1, count if data is not None else 1):
            try:
                job = spawn(index)
            except OSError as e:
                why = f"cannot start a child process: {e}"
                break
            self._nx_part_jobs[index] = job
        if not self._nx_part_jobs:
            counters.set_info(self._nx_label, compile_parts=f"off: {why or 'no child started'}")
            log.warning("nexfort: %s: compiling the graph whole (%s)", self._nx_label, why)
            return
        # the children's parts of a ``count``-way cut: the caller compiles the others
        self._nx_parts = count
        if len(self._nx_part_jobs) + 1 < wanted:
            log.info("nexfort: %s: %d compile workers, not %d (%s)", self._nx_label, len(self._nx_part_jobs) + 1,
                     wanted, why)

    def _stop_parts(self) -> None:
        jobs, self._nx_part_jobs, self._nx_parts = self._nx_part_jobs, {}, 1
        self._nx_spawn_part, self._nx_stream, self._nx_stream_jobs = None, None, {}
        for job in jobs.values():
            job.cancel()

    @classmethod
    def part_worker(cls, payload: dict[str, Any], root: str) -> CompiledModule:
        """In a compile worker (a child process): a wrapper around no model that compiles graphs
        as the parent's would (its options, resolved settings and cache entry)."""
        register_ops()  # a shipped part may call them; this process ran no pass that defines them
        store = CacheStore(root)
        cm = cls(torch.nn.Module(), payload["config"], store, label=payload["label"])
        cm._nx_settings = payload["settings"]
        cm._nx_group_norm = bool(payload["group_norm"])
        cm._nx_entry = store.entry(payload["key"])
        return cm

    def compile_shipped_part(self, data: bytes, out: Any, times: dict[str, float]) -> None:
        """In a compile worker: compile the part the parent shipped (:mod:`nexfort_engine.ship`)
        and write it to ``out`` with the size guards its compile added."""
        from . import ship

        index, fingerprint, single, module, inputs = ship.loads(data)
        part = split.Part(index=index, module=module, inputs=list(inputs), single=single)
        shape_env = split.shape_env_of(part.inputs)
        start = len(shape_env.guards) if shape_env is not None else 0
        times["unpickled"] = time.time()
        before = _compile_metrics()
        with self._scope():
            compiled = split.compile_part(part, self._compile_graph)
        times["compiled"] = time.time()
        # where the part's compile went, as torch times it
        atomic_write_bytes(out, split.dump_part(index, fingerprint, compiled, split.guards_since(shape_env, start),
                                                times, _phases_since(before)))

    def _aot_unsupported(self, reason: str) -> None:
        counters.set_info(self._nx_label, precompiled=f"off: {reason}")
        log.warning("nexfort: %s: no precompiled graph (%s); compiling through torch.compile", self._nx_label, reason)
        with contextlib.suppress(OSError):
            atomic_write_bytes(self._aot_dir() / precompile.UNSUPPORTED, reason.encode())

    def _aot_call_unsupported(self, sig: str, reason: str, where: str | None) -> None:
        """Calls of structure ``sig`` do not trace as one graph: they compile through
        ``torch.compile`` from now on, in this process and the next (the entry lists them)."""
        if where:
            reason = f"{reason} (at {where})"
        self._nx_broken_calls[sig] = reason
        counters.set_info(self._nx_label, precompiled=self._precompiled_info())
        log.warning("nexfort: %s: this call does not trace as one graph (%s); calls like it compile through "
                    "torch.compile, in pieces, the code between them eager (often a patch another node added "
                    "to the model); other calls keep their saved graphs", self._nx_label, reason)
        with contextlib.suppress(OSError):
            precompile.add_broken_call(self._aot_dir(), sig, reason)

    def _note_graph_breaks(self, before: dict[str, int]) -> bool:
        """Count the graph breaks Dynamo reported since ``before`` (each reason once per module);
        whether there were any."""
        found = signature.graph_break_reasons(before)
        new = [r for r in found if r not in self._nx_breaks]
        if not new:
            return bool(found)
        if not self._nx_breaks:
            log.warning("nexfort: %s: the traced graph breaks (%s): it compiles in pieces, the code between "
                        "them running eager and each piece compiled again as its inputs change (often a patch "
                        "another node added to the model); the Cache Manager lists the reasons",
                        self._nx_label, new[0])
        self._nx_breaks.extend(new)
        counters.bump(self._nx_label, "graph_breaks", len(new))
        for reason in new:
            counters.add_reason(self._nx_label, "graph_break", reason)
        return True

    def _torch_compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(
            fn,
            backend=self._backend,
            dynamic=None if self._nx_config.dynamic else False,
            fullgraph=self._nx_config.fullgraph,
        )

    def _compile_regions(self, target: Callable[..., Any]) -> Callable[..., Any]:
        """Regional compilation (see :mod:`nexfort_engine.regions`): one compiled ``forward`` per
        block class, installed on the blocks while ``target`` runs eager around them."""
        by_class: dict[type, Callable[..., Any]] = {}
        fns = []
        for region in self._nx_regions:
            cls = type(region.blocks[0])
            if cls not in by_class:
                by_class[cls] = regions.compile_block_forward(region, self._torch_compile)
            fns.append(by_class[cls])
        dynamic = self._nx_config.dynamic

        hook = self._nx_block_hook
        # one model call's prepared inputs and marks, shared by its blocks (shapes.prepare_block_inputs)
        memo: shapes.Memo = {}
        marked: shapes.Memo = {}

        def before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if hook is not None:
                args, kwargs = hook(args, kwargs)
            return shapes.prepare_block_inputs(args, kwargs, dynamic, memo, marked)

        if self._nx_settings is not None and self._nx_settings.fp8:
            # fp8 inside the compiled blocks only: in the eager glue it would run unfused
            fns = [_with_fp8(fn) for fn in fns]
        installer = regions.Installer(self._nx_regions, fns, before)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                with installer.installed():
                    return target(*args, **kwargs)
            finally:
                memo.clear()
                marked.clear()

        return call

    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        assert self._nx_settings is not None
        with contextlib.ExitStack() as stack:
            if self._nx_entry is not None:
                stack.enter_context(self._nx_entry.activate())
                if self._nx_settings.fp8_attention:  # cuDNN's graphs saved with the entry
                    from .fp8_attention import plan_cache

                    stack.enter_context(plan_cache(self._nx_entry.artifacts / "cudnn"))
            stack.enter_context(collector.compiling())  # a call may (re)compile: fewer GC passes
            stack.enter_context(shapes.shape_policy(self._nx_config.dynamic, self._nx_config.size_oblivious))
            stack.enter_context(runtime_overrides(self._nx_settings.runtime))
            if self._nx_settings.fp8 and not self._nx_regions:
                # traced by Dynamo: quantize + _scaled_mm land in the graph (regional: per block)
                stack.enter_context(Fp8LinearMode())
            yield

    def _first_call(self, args: tuple, kwargs: dict) -> Any:
        """Verify the cache entry and compile, holding the entry's inter-process lock."""
        entry = self._nx_entry
        lock = entry.lock() if entry is not None else contextlib.nullcontext()
        with lock:
            if entry is not None:
                t_verify = time.perf_counter()
                state = entry.verify(self._nx_env)
                counters.set_phase(self._nx_label, "verify", time.perf_counter() - t_verify)
                if state == "corrupt":
                    counters.bump(self._nx_label, "corrupt_entries")
                log.info("nexfort: cache entry %s: %s", entry.key, state)
                if self._nx_aot and state == "hit":
                    self._nx_aot_pending = precompile.files(self._aot_dir())
            return self._call_compiled(args, kwargs)

    def _call_compiled(self, args: tuple, kwargs: dict) -> Any:
        assert self._nx_compiled is not None
        graphs0 = self._nx_graphs
        hit0, miss0 = _fx_counters()
        skips0 = _cudagraph_skips() if self._nx_cudagraphs else 0
        breaks0 = signature.graph_break_counts()
        if self._nx_cudagraphs:  # CUDA-graph trees' per-thread state, where another thread imported them
            adopt_cudagraph_trees()
        if self._nx_fp8 is not None:  # outside the graph: CUDA-graph replays skip the op's Python
            self._nx_fp8.refresh()
        if self._nx_conv_weights is not None:
            self._refresh_conv_weights()
        t0 = time.perf_counter()
        with self._scope():
            if graphs0 == 0 and not self._nx_aot_used:
                counters.set_info(self._nx_label, state="compiling")
            if self._nx_cudagraphs:
                # each call is a new inference step: its outputs are consumed before the next call
                # (ComfyUI accumulates them at once), so CUDA-graph trees may reuse their memory
                torch.compiler.cudagraph_mark_step_begin()
            out = self._nx_compiled(*args, **kwargs) if self._nx_aot else self._call_traced(args, kwargs)
        dt = time.perf_counter() - t0
        if out is _NO_FIT:
            return out
        if self._nx_cudagraphs and (skipped := _cudagraph_skips() - skips0):
            counters.bump(self._nx_label, "cudagraph_skips", skipped)
        new = self._nx_graphs - graphs0
        loaded = not new and graphs0 == 0 and bool(self._nx_aot_artifacts) and not self._nx_aot_used
        if new or loaded:  # the compile's survivors get their full collection now, not mid-sampling
            settle = collector.settle()
            counters.set_phase(self._nx_label, "settle", settle)
            dt += settle
        if new:
            broke = self._note_graph_breaks(breaks0)
            hit1, miss1 = _fx_counters()
            self._after_compile(new, dt, hit1 - hit0, miss1 - miss0, broke)
        elif loaded:
            self._after_load(dt)
        else:
            counters.add_seconds(self._nx_label, "compiled_call", dt)
        return out

    def _call_traced(self, args: tuple, kwargs: dict, fn: Callable[..., Any] | None = None) -> Any:
        fn = fn if fn is not None else self._nx_compiled
        assert fn is not None
        dynamic = self._nx_config.dynamic
        if dynamic:  # marks are read only when Dynamo (re)compiles
            shapes.mark_dynamic_dims(args, kwargs)
            args = shapes.fold_spatial(args, self._nx_fold)
        # torch.linspace with a symbolic length here too (trace_ops.linspace), in place for every
        # call, not only a trace: Dynamo's live guards name the stand-in. Without it a model that
        # builds position ids with linspace (Flux, Wan, Qwen-Image compiled whole) specialised on
        # each resolution, and torch's AOTAutograd cache then served a width x height call the
        # graph compiled for height x width (BENCHMARKS.md, thirty-fifth session, item 3)
        with trace_ops.standing_in(False, symbolic_linspace=dynamic):
            return fn(*args, **kwargs)

    def _after_load(self, seconds: float) -> None:
        """The first call ran a graph loaded from the cache: nothing was traced or compiled."""
        self._nx_aot_used = True
        label = self._nx_label  # ``seconds`` includes loading (``_nx_aot_load_s`` of them)
        counters.add_seconds(label, "compile", seconds)
        counters.set_info(label, state="compiled")
        counters.set_phase(label, "warm_load", self._nx_aot_load_s)
        counters.set_phase(label, "warm_first_run", seconds - self._nx_aot_load_s)
        for i, part_s in enumerate(split.LOAD_SECONDS):
            counters.set_phase(label, f"warm_load_part{i}", part_s)
        log.info("nexfort: %s ran %d precompiled graph(s) from the cache in %.1fs, %.1fs of it loading (nothing "
                 "traced)", label, self._nx_aot_loaded, seconds, self._nx_aot_load_s)
        entry = self._nx_entry
        if entry is not None:
            try:
                with entry.lock():
                    entry.update_meta(hits=int(entry.read_meta().get("hits", 0)) + 1)
            except OSError as e:
                log.warning("nexfort: could not update cache entry %s (%s)", entry.key, e)

    def _refresh_conv_weights(self) -> None:
        assert self._nx_conv_weights is not None
        if self._nx_conv_weights.refresh():
            counters.set_info(self._nx_label, channels_last_weights=self._nx_conv_weights.converted)

    def _after_compile(self, new: int, seconds: float, hits: int, misses: int, broke: bool = False) -> None:
        label = self._nx_label
        # (a loaded graph, or a static_first twin's, ran first)
        first = self._nx_graphs == new and not self._nx_aot_used and not self._nx_static_ran
        counters.bump(label, "compiles", new)
        # a first call makes one graph, or one per region under regional compilation, or one per
        # piece where its trace broke (graph_breaks)
        recompiles = (0 if broke else max(0, new - (len(self._nx_regions) or 1))) if first else new
        if recompiles and self._nx_static_ran and not self._nx_recompile_reason:
            self._nx_recompile_reason = "static_first: a shape the static graph does not fit, and no dynamic graph " \
                "from the background compile"
        if recompiles:
            counters.bump(label, "recompiles", recompiles)
            reason, self._nx_recompile_reason = self._nx_recompile_reason or _last_recompile_reason(), None
            counters.add_reason(label, "recompile", reason)
        if self._nx_aot and not self._nx_last_traced:
            # a precompiled graph is traced and compiled whole, bypassing Inductor's cache; the
            # parts compile workers made load through that cache, and read as its hits (SD2.1's
            # cold compile in six parts reported 5 hits and 0 misses, run185)
            hits, misses = 0, new
        counters.bump(label, "cache_hits", hits)
        counters.bump(label, "cache_misses", misses)
        counters.add_seconds(label, "compile", seconds)
        counters.set_info(label, state="compiled")
        log.info(
            "nexfort: %s compiled %d graph(s) in %.1fs (cache hits %d, misses %d)", label, new, seconds, hits, misses
        )
        entry = self._nx_entry
        if entry is not None and self._nx_store is not None:
            t_commit = time.perf_counter()
            try:
                with entry.lock():
                    meta = entry.read_meta()
                    size = entry.commit(
                        self._nx_env or {},
                        {
                            "label": self._nx_name,
                            "options": self._nx_config.describe(),
                            "hits": int(meta.get("hits", 0)) + (1 if hits and not misses else 0),
                        },
                    )
            except OSError as e:  # disk full, read-only dir: the compiled module still works
                log.warning("nexfort: could not persist cache entry %s (%s); the compile is kept in memory",
                            entry.key, e)
                return
            self._nx_store.evict(keep=entry.key)
            counters.set_phase(label, "commit", time.perf_counter() - t_commit)
            log.info("nexfort: cache entry %s committed (%d bytes) in %s", entry.key, size, entry.path)

    # -- background compile (background.py)
    def _start_background(self, args: tuple, kwargs: dict, example: torch.Tensor | None) -> bool:
        """Start compiling in a child process; ``False`` (and why, in the counters and the log)
        where this call compiles in the foreground instead: a warm entry loads faster here. The
        child compiles with compile workers as a foreground compile would (``compile_workers``,
        auto: split.workers). With one intra-op thread between calls here (intraop.py) the eager
        steps keep their speed: SD2.1's child 47.1 s instead of 93.9 s alone, eager 35.1 against
        36.9 it/s meanwhile (run220)."""
        entry = self._nx_entry
        why = None
        if entry is None or self._nx_store is None:
            why = "no cache directory (the child hands its compile over through the cache)"
        elif "freezing" in self._nx_config.flags:
            why = "the freezing flag bakes the weights into the graph (the child has zeros)"
        elif entry.committed(self._nx_env):
            counters.set_info(self._nx_label, background="off: the cache entry is warm")
            return False
        elif example is not None:
            why = background.memory_shortfall(self._orig_mod, example.device)
        if why is None:
            assert entry is not None and self._nx_store is not None
            try:
                self._nx_job = background.start(
                    root=self._nx_store.root, key=entry.key, module=self._orig_mod, args=args, kwargs=kwargs,
                    config=dataclasses.replace(self._nx_config, background=False, static_first=False),
                    label=self._nx_name,
                    method=self._nx_method, block_hook=self._nx_block_hook if self._nx_regions else None,
                    skip=(CompiledModule,), child_globals=self._nx_child_globals,
                )
            except (background.Unavailable, OSError) as e:
                why = f"cannot hand the model to a child process: {e}"
        if why is not None:
            counters.set_info(self._nx_label, background=f"off: {why}")
            log.warning("nexfort: %s: compiling in the foreground (%s)", self._nx_label, why)
            return False
        assert self._nx_job is not None
        weakref.finalize(self, self._nx_job.cancel)
        self._nx_first_pending = True
        counters.set_info(self._nx_label, state="background", background=f"running (pid {self._nx_job.proc.pid})")
        return True

    def _background_finished(self) -> None:
        """The child is done: the first compiled call comes next. It loads what the child
        committed, or compiles here if the child did not succeed."""
        job, self._nx_job = self._nx_job, None
        assert job is not None
        report = job.result()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        # a child that died or whose compile failed leaves a cold entry: the compile runs here then
        # (it fails here too if the model cannot be compiled, and runs eager as usual)
        why = report.get("crashed") or (f"its compile fell back to eager: {report['failed']}" if report.get("failed")
                                        else None)
        # a static_first twin keeps running the calls it fits: the state is its, until another shape
        state = "compiled" if self._nx_static is not None else "pending"
        if why:
            counters.set_info(self._nx_label, state=state, background=f"failed: {why}")
            log.warning("nexfort: %s: the background compile did not succeed (%s); compiling in the foreground%s",
                        self._nx_label, why, " at the first shape the static graph does not fit"
                        if self._nx_static is not None else "")
            return
        seconds = float(report.get("wall_seconds", 0.0))
        counters.add_seconds(self._nx_label, "background", seconds)
        counters.set_info(self._nx_label, background=f"done in {seconds:.1f}s")
        if self._nx_static is not None:
            counters.set_info(self._nx_label, state=state)
        log.info("nexfort: %s: background compile done in %.1fs; loading it%s", self._nx_label, seconds,
                 " at the first shape the static graph does not fit" if self._nx_static is not None else "")

    # -- static shape first (``"static_first"``): the first call's own shape, the dynamic graph behind
    def _static_first_off(self, example: torch.Tensor | None) -> str | None:
        """Why the first call compiles the dynamic graph itself (``None``: its static twin first)."""
        cfg = self._nx_config
        if cfg.static_first is False:
            return "the option is off"
        if not cfg.dynamic:
            return "static shape: the one graph is static"
        if self._nx_entry is None or self._nx_store is None:
            return "no cache directory (the dynamic graph comes back through the cache)"
        if "freezing" in cfg.flags:
            return "the freezing flag bakes the weights into the graph (the background child has zeros)"
        if not self._nx_aot:
            return ("only a whole model's saved graph with the Inductor backend (regional graphs compile through "
                    "torch.compile)")
        if self._nx_entry.committed(self._nx_env):
            return "the dynamic graph's cache entry is warm"
        if cfg.static_first is None and (example is None or not example.is_cuda):
            return "auto: CUDA devices only"
        if cfg.static_first is None and self._nx_method not in AUTO_STATIC_FIRST_METHODS:
            return (f"auto: a model's forward or a VAE's decode/encode only ({self._nx_method} compiles its "
                    "dynamic graph at once)")
        return None

    def _compile_static_first(self, args: tuple, kwargs: dict, example: torch.Tensor | None) -> Any:
        """The first call, cold: compile a static-shape twin for its shape (its own cache entry; a
        static graph costs AOTAutograd and Inductor about half the work of a dynamic one), run it,
        then hand the dynamic compile to a child process (background.py)."""
        cfg = self._nx_config
        twin = CompiledModule(
            self._orig_mod, dataclasses.replace(cfg, dynamic=False, static_first=False, background=False),
            self._nx_store, label=f"{self._nx_name} (static)", method=self._nx_method,
            block_hook=self._nx_block_hook, child_globals=self._nx_child_globals,
        )
        # the inputs as this call gets them, for the child: the call may add to its dicts
        job_args, job_kwargs = background.snapshot(args), background.snapshot(kwargs)
        t0 = time.perf_counter()
        try:
            out = twin(*args, **kwargs)
        except BaseException:  # an interrupted prompt (PASSTHROUGH): the next call starts over
            self._nx_compiled = None
            raise
        seconds = time.perf_counter() - t0
        if twin.failed is not None:  # the dynamic graph would fail the same way: eager from now on
            self._nx_failed = twin.failed
            counters.set_info(self._nx_label, state="fallback", static_first=f"failed: {twin.failed}")
            return out
        self._nx_static_ran = True
        shape = tuple(example.shape) if example is not None else ()
        if not twin._nx_aot or twin._nx_broken_calls:  # through torch.compile: its guards are not ours to check
            self._nx_first_pending = True
            why = "its trace broke (graph breaks)" if twin._nx_broken_calls else "no saved graph"
            counters.set_info(self._nx_label, static_first=f"static graph for {shape} not kept: {why} "
                              f"({twin.label}); the next call compiles the dynamic graph")
            if twin._nx_broken_calls:
                self._nx_recompile_reason = ("static_first: the static graph's trace broke; the dynamic graph "
                                             "compiles in pieces too")
            return out
        twin._nx_fits_only = True
        # not a submodule (its state dict would repeat the model's)
        object.__setattr__(self, "_nx_static", twin)
        counters.set_info(self._nx_label, static_first=f"static graph for {shape} in {seconds:.1f}s ({twin.label})")
        if self._start_background(job_args, job_kwargs, example):
            log.info("nexfort: %s: ran a static graph for %s (%.1fs); the dynamic graph compiles in the background",
                     self._nx_label, shape, seconds)
        else:
            # no child: the first call of another shape compiles the dynamic graph here (a recompile)
            self._nx_first_pending = True
            counters.set_info(self._nx_label, state="compiled")
        return out

    def _static_call(self, args: tuple, kwargs: dict) -> Any:
        """Run the static twin if its graph fits the call, else :data:`_NO_FIT`."""
        twin = self._nx_static
        assert twin is not None
        out = twin._call_compiled(args, kwargs)
        if out is not _NO_FIT:
            counters.bump(twin.label, "calls")
        return out

    def _while_background(self, args: tuple, kwargs: dict) -> Any:
        """A call while the child compiles: the static twin where it fits, else eager."""
        if self._nx_static is not None:
            if (out := self._static_call(args, kwargs)) is not _NO_FIT:
                return out
            counters.bump(self._nx_label, "static_first_eager_calls")
        return self._eager(*args, **kwargs)

    def _drop_static(self, why: str) -> None:
        """Retire the static twin; its cache entry goes too once the dynamic graph's is committed
        (a later process loads that one: the static entry would never be read again)."""
        twin, self._nx_static = self._nx_static, None
        assert twin is not None
        log.info("nexfort: %s: static graph %s retired (%s); the dynamic graph runs from now on", self._nx_label,
                 twin.label, why)
        counters.set_info(twin.label, state="retired")
        static_entry = twin.cache_entry
        if (static_entry is not None and self._nx_store is not None and self._nx_entry is not None
                and self._nx_entry.committed(self._nx_env)):
            try:
                self._nx_store.clear(static_entry.key)
            except OSError as e:
                log.warning("nexfort: could not remove the static graph's cache entry %s (%s)", static_entry.key, e)

    def _fall_back(self, err: BaseException) -> None:
        root = _exception_chain(err)[-1]  # the backend's own error, not Dynamo's wrapper
        text = str(root).strip()
        reason = f"{type(root).__name__}: {text.splitlines()[0][:300] if text else ''}"
        if root is not err:
            reason = f"{type(err).__name__}: {reason}"
        self._nx_failed = reason
        if self._nx_fp8 is not None:  # the compiled graphs will not run again
            self._nx_fp8.release()
        counters.bump(self._nx_label, "fallbacks")
        counters.add_reason(self._nx_label, "fallback", reason)
        counters.set_info(self._nx_label, state="fallback")
        log.warning("nexfort: compiling %s failed, running eager instead: %s", self._nx_label, reason, exc_info=err)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the thread's own intra-op count inside (Dynamo's guards read it); one thread after the
        # call while a background child compiles (intraop.py)
        with intraop.compiled_call():
            out = self._forward(args, kwargs)
        if gemm_tuning.pending():  # shapes the graphs' tuned linears met first: searched between calls
            gemm_tuning.tune_pending()
        return out

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        if self._nx_failed is not None:
            return self._eager(*args, **kwargs)
        if self._nx_memory_format is not None:
            args, kwargs = shapes.to_memory_format(args, kwargs, self._nx_memory_format)
        counters.bump(self._nx_label, "calls")
        try:
            if self._nx_job is not None:
                if not self._nx_job.done():
                    return self._while_background(args, kwargs)
                with _compile_lock:
                    if self._nx_job is not None:
                        self._background_finished()
            if self._nx_static is not None and (out := self._static_call(args, kwargs)) is not _NO_FIT:
                return out
            if self._nx_compiled is None or self._nx_first_pending:
                with _compile_lock:
                    if self._nx_compiled is None or self._nx_first_pending:
                        # a running prewarm imports what this compile would: not both at once; the
                        # modules this compile imports are listed for the next process's prewarm
                        prewarm.wait()
                        before = frozenset(sys.modules)
                        if self._nx_compiled is None:
                            example = _first_tensor(args, kwargs)
                            t_setup = time.perf_counter()
                            self._setup(example)
                            counters.set_phase(self._nx_label, "setup", time.perf_counter() - t_setup)
                            if self._nx_config.background and self._start_background(args, kwargs, example):
                                return self._eager(*args, **kwargs)
                            if (why := self._static_first_off(example)) is None:
                                return self._compile_static_first(args, kwargs, example)
                            if self._nx_config.static_first:
                                counters.set_info(self._nx_label, static_first=f"off: {why}")
                        if self._nx_static is not None:  # the dynamic graph replaces it from now on
                            self._drop_static("a shape it does not fit")
                        self._nx_first_pending = False
                        out = self._first_call(args, kwargs)
                        if self._nx_store is not None:
                            prewarm.record(self._nx_store.root, before)
                        return out
            return self._call_compiled(args, kwargs)
        except BaseException as err:
            if type(err).__name__ in PASSTHROUGH or not isinstance(err, Exception):
                raise
            for inner in _exception_chain(err)[1:]:  # an interrupt wrapped by Dynamo
                if type(inner).__name__ in PASSTHROUGH or not isinstance(inner, Exception):
                    raise inner from None
            self._fall_back(err)
            return self._eager(*args, **kwargs)

    def weights_changed(self) -> None:
        """The host changed weights in place (e.g. ComfyUI's ``weight_inplace_update`` patching of
        inference tensors, which have no version counter): derived copies (fp8) are rebuilt before
        the next call. Parameters that were *replaced* are noticed without this."""
        if self._nx_fp8 is not None:
            self._nx_fp8.invalidate()

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        """The module itself, counted (``eager_calls``, ``eager_call_seconds``): what a prompt ran
        uncompiled, whatever the reason."""
        t0 = time.perf_counter()
        try:
            return getattr(self._orig_mod, self._nx_method)(*args, **kwargs)
        finally:
            counters.bump(self._nx_label, "eager_calls")
            counters.add_seconds(self._nx_label, "eager_call", time.perf_counter() - t0)


def default_cache_dir() -> str | None:
    return os.environ.get(ENV_CACHE_DIR) or None


def compile(  # noqa: A001 - the seeds' name
    module: torch.nn.Module,
    options: CompileConfig | dict[str, Any] | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    label: str | None = None,
    method: str = "forward",
    block_hook: BlockHook | None = None,
    child_globals: tuple[tuple[str, str, Any], ...] = (),
) -> CompiledModule:
    """Compile ``module`` with nexfort (lazily, at its first call).

    ``method``: compile ``module.<method>`` instead of ``forward`` (a VAE's ``decode``/``encode``).
    ``options``: the seeds' dict / JSON string (see :func:`nexfort_engine.options.parse_options`).
    ``block_hook``: under regional compilation, called with each block's ``(args, kwargs)`` before
    its compiled forward and returning the ones to pass: where the host drops per-block values
    a block reads but does not need (they would otherwise make every twin its own graph).
    ``cache_dir``: where compiled artifacts persist; defaults to ``$NEXFORT_CACHE_DIR``; ``None``
    and no env var means Inductor's own default cache.
    ``child_globals``: ``(module, attribute, value)`` a background compile's child process sets
    before it loads the model (:mod:`nexfort_engine.background`).
    """
    if isinstance(module, CompiledModule):
        module = module._orig_mod
    config = parse_options(options)
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    store = CacheStore(cache_dir) if cache_dir else None
    return CompiledModule(module, config, store, label=label, method=method, block_hook=block_hook,
                          child_globals=tuple(child_globals))
