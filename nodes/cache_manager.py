"""Nexfort Cache Manager: report the compile cache and counters; clear, export, import bundles.

Bundle paths are file names inside ComfyUI's directories only: exports go to the output
directory, imports come from the input directory (or output). Absolute paths, ``..`` and
symbolic links are refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from comfy_api.latest import io, ui

import nexfort_engine
from nexfort_engine import gemm_tuning, prewarm
from nexfort_engine.cache import CacheError, CacheStore, export_bundle, import_bundle

from .common import DOCS_URL
from .patcher import cache_root

ACTIONS = ["refresh", "clear_all", "clear_model", "export_bundle", "import_bundle"]


def confined_path(name: str, *, for_write: bool) -> Path:
    """Resolve a bundle file name inside ComfyUI's output (export) or input/output (import) dir."""
    import folder_paths

    name = (name or "").strip()
    if not name:
        raise CacheError("bundle_path is empty: give a file name such as 'nexfort-cache.tar.gz'")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise CacheError(f"bundle_path {name!r} refused: use a relative file name inside ComfyUI's directories")
    bases = [folder_paths.get_output_directory()] if for_write else [
        folder_paths.get_input_directory(),
        folder_paths.get_output_directory(),
    ]
    for base in bases:
        base_real = Path(base).resolve()
        cand = base_real / p
        # refuse links anywhere on the way (a link could point outside)
        cur = base_real
        for part in p.parts:
            cur = cur / part
            if cur.is_symlink():
                raise CacheError(f"bundle_path {name!r} refused: {part!r} is a symbolic link")
        real = cand.resolve()
        if os.path.commonpath([real, base_real]) != str(base_real):
            raise CacheError(f"bundle_path {name!r} refused: it leaves {base_real}")
        if for_write or real.exists():
            return real
    raise CacheError(f"bundle {name!r} not found in ComfyUI's input or output directory")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


#: the first call's phases the report shows (engine counters' ``compile_phases``), in call order
_PHASES = (("setup", "setup"), ("verify", "cache check"), ("dynamo_trace", "trace"),
           ("children_received", "parts with the workers at"), ("guards_built", "guards built at"),
           ("children_compiled", "workers done at"), ("parts_loaded", "parts loaded while waiting"),
           ("trace_and_compile", "trace and compile"),
           ("load", "load"), ("first_run", "first run"), ("warm_load", "load"), ("warm_first_run", "first run"),
           ("settle", "garbage collection"), ("commit", "cache commit"))


def report(store: CacheStore, message: str = "") -> str:
    s = nexfort_engine.stats()
    entries = store.list()
    lines = [f"nexfort cache: {store.root}"]
    if message:
        lines.append(message)
    lines.append(f"{len(entries)} entries, {_human(sum(e['size_bytes'] for e in entries))}")
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])) if e["last_used"] else "-"
        lines.append(f"  {e['key'][:12]}  {_human(e['size_bytes']):>9}  hits={e['hits']}  used={used}  {e['label']} [{e['options']}]")
    lines.append(
        f"this session: compiles={s['compiles']} recompiles={s['recompiles']} cache hits={s['cache_hits']} "
        f"misses={s['cache_misses']} fallbacks={s['fallbacks']} cudagraph skips={s.get('cudagraph_skips', 0)} "
        f"compile time={s['compile_seconds']:.1f}s"
    )
    tuning = gemm_tuning.summary(store.root)
    if tuning["entries"] or s.get("gemm_tuning"):
        here = s.get("gemm_tuning", {})
        lines.append(f"GEMM tuning: {tuning['entries']} shapes measured, {tuning['chosen']} with a faster algorithm "
                     f"than torch's; this session searched {here.get('searched', 0)} in "
                     f"{here.get('search_seconds', 0.0):.1f}s, read {here.get('table_hits', 0)} from the table")
    pw = prewarm.status()
    if pw["state"] != "idle":
        lines.append(f"prewarm: {pw['state']}, {pw['imported'] + pw['present']} of {pw['listed']} modules loaded"
                     + (f" in {pw['seconds']:.1f}s" if pw["state"] == "done" else "")
                     + (f", {pw['failed']} failed" if pw["failed"] else ""))
    for label, m in s["models"].items():
        how = ("regional: " + ", ".join(m["regions"])) if m.get("regions") else "whole model"
        if m.get("fp8"):
            how += ", fp8 linears"
        if m.get("spatial_multiple", 1) > 1:
            how += f", latent sizes traced as multiples of {m['spatial_multiple']}"
        if m.get("group_norms_rewritten"):
            how += f", {m['group_norms_rewritten']} GroupNorms in channels-last order"
        if m.get("channels_last_weights"):
            how += f", {m['channels_last_weights']} conv weights made channels-last"
        if m.get("fp8_quant_fused"):
            how += f", {m['fp8_quant_fused']} fp8 quantizations fused with their producers"
        if m.get("rope_fused"):
            how += f", {m['rope_fused']} query/key norm + rotary embeddings fused"
        if m.get("attention_fp8"):
            how += f", {m['attention_fp8']} attentions in fp8 (cuDNN)"
        if m.get("sdpa_cudnn_first"):
            how += f", cuDNN attention ahead of flash in {m['sdpa_cudnn_first']} priority list(s)"
        if m.get("gelu_epilogues"):
            how += f", {m['gelu_epilogues']} linear + GELU pairs as one GEMM (GELU in its epilogue)"
        if m.get("tuned_linears"):
            how += f", {m['tuned_linears']} linears with the GEMM algorithm measured per shape"
        if m.get("fp8_weight_layers"):
            how += f", {m['fp8_weight_layers']} linear weights stored in fp8"
        if m.get("host_patches"):
            how += (f", {m['host_patches']} host-reading attention patch(es) run as {m.get('host_calls', 0)} "
                    "host call(s) in the graph (CUDA graphs, where on, between them)")
        if m.get("fp8_stored_weights"):
            how += f", {m['fp8_stored_weights']} fp8 GEMMs on the weights as stored (e4m3)"
        if m.get("trace_stand_ins"):
            how += f", {m['trace_stand_ins']} F.linear traced through a stand-in"
        if m.get("fp8_skipped") and not m.get("fp8"):
            how += f", fp8 linears left off ({m['fp8_skipped']})"
        if m.get("autotune_skipped"):
            how += f", max-autotune left off ({m['autotune_skipped']})"
        lines.append(f"  {label}: {m['state']}, compiles={m['compiles']}, recompiles={m['recompiles']}, "
                     f"hits={m['cache_hits']}"
                     + (f", graph breaks={m['graph_breaks']}" if m.get("graph_breaks") else "") + f" ({how})")
        if phases := [f"{name} {m['compile_phases'][key]:.1f}s" for key, name in _PHASES
                      if key in (m.get("compile_phases") or {})]:  # where the first call's time went
            lines.append("    first call: " + ", ".join(phases))
        if m.get("static_first"):  # "static_first": the first call's static graph, the dynamic one behind
            lines.append(f"    static first: {m['static_first']}")
        if m.get("background"):  # "background": true - the child process compiling it, or why not
            lines.append(f"    background compile: {m['background']}")
        if m.get("compile_parts"):  # "compile_workers": the graph cut into parts compiled by children
            lines.append(f"    compile workers: {m['compile_parts']}")
            if slow := m.get("compile_parts_slowest_child"):  # where the wait for the last part went
                phases = ", ".join(f"{k} {v:.1f}s" for k, v in list(slow.get("phases_s", {}).items())[:3])
                lines.append(f"    slowest worker: part {slow.get('part')}, {slow.get('compile_s', 0.0):.1f}s"
                             + (f" ({phases})" if phases else ""))
            if (streamed := m.get("compile_parts_streamed") or {}).get("streamed"):  # cut while tracing
                why = streamed.get("dropped") or streamed.get("failed")
                lines.append(f"    parts shipped while tracing: {streamed['streamed']}, at "
                             + ", ".join(f"{t:.1f}" for t in streamed.get("at_s", [])) + "s"
                             + (f" (dropped: {why}; the traced graph was cut whole)" if why else ""))
            if each := [d for d in m.get("compile_parts_each") or [] if "compile_s" in d]:  # the cut's balance
                lines.append("    parts' compile: " + ", ".join(
                    f"{d['part']}{' (here)' if d.get('where') == 'here' else ''} {d['compile_s']:.1f}s"
                    f" ({d['nodes']} nodes, {d.get('kernels', '?')} kernels)" for d in each))
            if late := m.get("precompiled_late_size_guards"):  # taken after Dynamo's guards: ours check them
                lines.append(f"    size guards from the parts' compile: {len(late)}, checked on every call"
                             f" (e.g. {late[0]})")
        for r in m["recompile_reasons"][-3:]:
            lines.append(f"    recompile: {r}")
        for r in m["fallback_reasons"][-3:]:
            lines.append(f"    fallback: {r}")
        for r in m.get("graph_break_reasons", [])[-3:]:  # the graph compiled in pieces (a patch, usually)
            lines.append(f"    graph break: {r}")
        if m.get("precompiled", "").startswith("on; "):  # some calls' structure did not trace whole
            lines.append(f"    saved graphs: {m['precompiled']}")
    return "\n".join(lines)


class NexfortCacheManager(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="NexfortCacheManager",
            display_name="Nexfort Cache Manager",
            category="nexfort/cache",
            description="Show the nexfort compile cache (entries, sizes, hits/misses, recompiles and their reasons) "
            "and manage it: refresh, clear all, clear one model, export/import a verified bundle. "
            f"Help: {DOCS_URL}/cache.md",
            inputs=[
                io.Combo.Input("action", options=ACTIONS, default="refresh",
                               tooltip="refresh: report. clear_all / clear_model: delete entries. "
                               "export_bundle / import_bundle: a verified .tar.gz."),
                io.String.Input("key", default="", tooltip="Entry key (or its first characters, as in the report) "
                                "for clear_model or a one-entry export."),
                io.String.Input("bundle_path", default="nexfort-cache.tar.gz",
                                tooltip="Bundle file in ComfyUI's output folder (export) or input/output folder "
                                "(import)."),
            ],
            outputs=[io.String.Output("report", tooltip="The cache report as text.")],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, action: str = "refresh") -> bool | str:
        # ComfyUI 0.3.75 does not check V3 Combo values at queue time: do it here (newer ComfyUI
        # leaves inputs that validate_inputs takes to it)
        if action not in ACTIONS:
            return f"nexfort: action {action!r} is not in the list; valid actions: {', '.join(ACTIONS)}"
        return True

    @classmethod
    def fingerprint_inputs(cls, **kwargs) -> float:
        return time.time()  # always re-run: the cache changes outside the graph

    @classmethod
    def execute(cls, action: str, key: str, bundle_path: str) -> io.NodeOutput:
        store = CacheStore(cache_root())
        if action == "refresh":
            msg = ""
        elif action == "clear_all":
            msg = f"cleared {len(store.clear())} entries"
            if tuned := gemm_tuning.clear(store.root):
                msg += f" and {tuned} measured GEMM shapes"
        elif action == "clear_model":
            if not key.strip():
                raise CacheError("clear_model needs a key: copy one from the report (refresh)")
            msg = f"cleared {', '.join(store.clear(key))}"
        elif action == "export_bundle":
            dest = confined_path(bundle_path, for_write=True)
            index = export_bundle(store, dest, [key] if key.strip() else None)
            msg = f"exported {len(index['entries'])} entries to {dest}"
        elif action == "import_bundle":
            keys = import_bundle(store, confined_path(bundle_path, for_write=False))
            msg = f"imported {len(keys)} verified entries: {', '.join(k[:12] for k in keys)}"
        else:
            raise ValueError(f"unknown action {action!r}; valid actions: {', '.join(ACTIONS)}")
        text = report(store, msg)
        return io.NodeOutput(text, ui=ui.PreviewText(text))
