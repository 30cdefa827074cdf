"""Seconds per prompt and per working session, through a real ComfyUI server.

What a ComfyUI user waits for: from queueing a prompt (``POST /prompt``) until its image is saved
(the prompt's ``execution_success`` on the websocket; ``/history`` where there is no websocket),
text encoding and VAE decode included, ComfyUI's latent previews on (``--preview-method auto``:
TAESD where ``models/vae_approx`` has its decoder, else Latent2RGB; ComfyUI 0.3.75's own default is
``none``, ``--previews auto,none`` gives a row of each). A *session* is a fresh ComfyUI process running a realistic sequence
of API-format prompts (built here, each with its own seed and prompt text, so ComfyUI's result cache
never answers one)::

    CheckpointLoaderSimple -> [LoraLoader] -> [compile node] -> CLIPTextEncode x2 -> EmptyLatentImage
        -> KSampler -> [LatentUpscaleBy 1.5 -> KSampler denoise 0.5: the hires pass] -> VAEDecode -> SaveImage

Contenders: ``eager`` (no compile node), ``comfy`` (ComfyUI's own TorchCompileModel, backend
inductor), ``O1``/``O2``/``O3`` (*Nexfort Compile Model* with that mode) and ``nexfort:<JSON>``
(the node's ``options`` JSON, e.g. ``nexfort:{"mode": "O2", "background": true}``). Each contender
runs with a cold compile cache (empty ``NEXFORT_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` of its own) and warm (a second fresh server on the same directories); eager
has no cache and runs once.

Per prompt: wall seconds (POST to saved image), the server's execution time (its
``execution_start`` to ``execution_success``), the sampler's median step time, and nexfort's
counters after it (``GET /nexfort/stats``: compiles, recompiles, fallbacks, model calls, the model's
state): a prompt ran (partly) *uncompiled* when the model was eager during it (a background compile
without a static graph that fits, ``static_first_eager_calls``, a fallback). For ``comfy``, Dynamo's
own recompile log lines (``TORCH_LOGS=recompiles``) are counted per prompt. Per session: the
server's start, the session total (server start to the last image) and the sum of the prompts.

    python -m benchmarks.session --comfy-root $COMFY --contenders eager,comfy,O2 \\
        --sequence sdxl --output-json out/session_sdxl.json

Without ``--checkpoint``, the random-weight SDXL checkpoint and LoRA of
``scripts/random_checkpoint.py`` are used (built first, in a subprocess, where missing);
``--tiny`` uses the tiny SD1.5 checkpoint and LoRA (CPU tests).

The JSON is rewritten after every prompt (a session cut short shows ``error: "incomplete"``),
and a session that fails keeps its rows (with ``error``). Long runs split over several commands share one ``--work-dir``: ``--cold`` there, then
``--warm`` (it runs on the caches the cold run left), and ``--report a.json b.json ...`` prints the
tables of all of them together.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

if str(REPO_ROOT) not in sys.path:  # run as a script: the repo root on the path (benchmarks.*)
    sys.path.insert(0, str(REPO_ROOT))

import comfy_server  # noqa: E402

from benchmarks.per_image import NEXFORT_PRESETS, split_contenders  # noqa: E402, F401 (the tests call it here)

#: the compile node's id in the built graphs (``node_ids`` of its records in /nexfort/stats)
COMPILE_NODE = "3"
SAMPLER_NODE = "7"
HIRES_SAMPLER_NODE = "9"
#: engine states in which the model's calls run uncompiled
EAGER_STATES = ("background", "fallback", "pending")
PROMPTS = (
    "a lighthouse on a cliff at sunset, oil painting",
    "a red fox in fresh snow, telephoto photograph",
    "an old tram in a narrow street, rainy evening",
    "a bowl of ramen on a wooden table, studio light",
    "a glass greenhouse full of ferns, morning fog",
    "a sailing ship in a storm, dramatic clouds",
    "portrait of an elderly fisherman, 85mm",
    "a futuristic city skyline at night, neon",
    "a mountain lake with reflections, autumn",
    "a cat sleeping on a stack of books",
    "a desert caravan at dawn, wide angle",
    "a watercolor map of an imaginary island",
)
NEGATIVE = "blurry, low quality, watermark"


# -- the sequences ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a session."""

    width: int
    height: int
    steps: int
    batch: int = 1
    #: LoRA strength (model and clip); None: no LoRA in this prompt
    lora: float | None = None
    #: hires pass: the first pass's latent upscaled by this, sampled again at denoise 0.5
    hires: float | None = None

    def label(self) -> str:
        s = f"{self.width}x{self.height} {self.steps}st b{self.batch}"
        if self.hires:
            s += f" +hires{self.hires:g}x"
        if self.lora is not None:
            s += f" lora{self.lora:g}"
        return s

    def unet_steps(self) -> int:
        """Sampler steps the diffusion model runs (KSampler at denoise 0.5 runs its ``steps`` steps too:
        the last ``steps`` of a schedule twice as long)."""
        return self.steps * (2 if self.hires else 1)


def _sdxl_sequence(lora: bool) -> tuple[PromptSpec, ...]:
    """12 prompts: 1024² x4 seeds, 832x1216 and 1216x832, 30 steps, batch 2, a LoRA strength change,
    a 1.5x hires pass, 832x1216 at 30 steps batch 2, back to 1024²."""
    a, b = (1.0, 0.5) if lora else (None, None)
    sq = dict(width=1024, height=1024)
    return (
        PromptSpec(**sq, steps=20, lora=a),
        PromptSpec(**sq, steps=20, lora=a),
        PromptSpec(**sq, steps=20, lora=a),
        PromptSpec(**sq, steps=20, lora=a),
        PromptSpec(832, 1216, 20, lora=a),
        PromptSpec(1216, 832, 20, lora=a),
        PromptSpec(**sq, steps=30, lora=a),
        PromptSpec(**sq, steps=20, batch=2, lora=a),
        PromptSpec(**sq, steps=20, lora=b),
        PromptSpec(**sq, steps=20, lora=b, hires=1.5),
        PromptSpec(832, 1216, 30, batch=2, lora=b),
        PromptSpec(**sq, steps=20, lora=b),
    )


def _sdxl_short(lora: bool) -> tuple[PromptSpec, ...]:
    """5 prompts: 1024² x2 seeds, 832x1216, 1024² 30 steps batch 2, a LoRA strength change."""
    a, b = (1.0, 0.5) if lora else (None, None)
    return (
        PromptSpec(1024, 1024, 20, lora=a),
        PromptSpec(1024, 1024, 20, lora=a),
        PromptSpec(832, 1216, 20, lora=a),
        PromptSpec(1024, 1024, 30, batch=2, lora=a),
        PromptSpec(1024, 1024, 20, lora=b),
    )


def _scaled(seq: tuple[PromptSpec, ...], factor: int, steps: dict[int, int]) -> tuple[PromptSpec, ...]:
    """``seq`` at 1/``factor`` of its resolutions (multiples of 8) and with fewer steps."""
    def r8(v: int) -> int:
        return max(8, round(v / factor / 8) * 8)
    return tuple(PromptSpec(r8(p.width), r8(p.height), steps.get(p.steps, p.steps), p.batch, p.lora, p.hires)
                 for p in seq)


SEQUENCES: dict[str, str] = {
    "sdxl": "12 prompts: 1024² x4 seeds, 832x1216, 1216x832, 30 steps, batch 2, LoRA 1.0 -> 0.5, a 1.5x hires pass",
    "sdxl-short": "5 prompts: 1024² x2 seeds, 832x1216, 30 steps batch 2, LoRA 1.0 -> 0.5",
    "tiny": "the sdxl sequence at 1/16 of its resolutions and 4/6 steps (CPU, tiny checkpoint)",
    "test": "3 prompts: 64² x2 seeds, 96x64, 4 steps, no LoRA (the CPU test)",
}


def sequence(name: str, lora: bool = True) -> tuple[PromptSpec, ...]:
    if name == "sdxl":
        return _sdxl_sequence(lora)
    if name == "sdxl-short":
        return _sdxl_short(lora)
    if name == "tiny":
        return _scaled(_sdxl_sequence(lora), 16, {20: 4, 30: 6})
    if name == "test":
        return (PromptSpec(64, 64, 4), PromptSpec(64, 64, 4), PromptSpec(96, 64, 4))
    raise ValueError(f"unknown sequence {name!r}; choose one of {', '.join(SEQUENCES)}")


# -- the graphs ------------------------------------------------------------------------------------
def contender_slug(name: str) -> str:
    """A file-name-safe short name (``nexfort:{...}`` -> ``nexfort-<mode>-<hash>``)."""
    if name.startswith("nexfort:"):
        import hashlib

        opts = json.loads(name[len("nexfort:"):])
        return f"nexfort-{opts.get('mode', 'O2')}-{hashlib.sha1(name.encode()).hexdigest()[:6]}".replace(":", "_")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def compile_node(contender: str, model_ref: list) -> dict | None:
    """The compile node for ``contender`` (None for eager)."""
    if contender == "eager":
        return None
    if contender == "comfy":
        return {"class_type": "TorchCompileModel", "inputs": {"model": model_ref, "backend": "inductor"}}
    if contender in NEXFORT_PRESETS:
        mode, options = contender, ""
    elif contender.startswith("nexfort:"):
        opts = json.loads(contender[len("nexfort:"):])  # the node's JSON overrides its widgets
        mode, options = "O2", json.dumps(opts)
    else:
        raise ValueError(f"unknown contender {contender!r}")
    return {"class_type": "NexfortCompileModel",
            "inputs": {"model": model_ref, "mode": mode, "memory_format": "contiguous", "dynamic": True,
                       "fuse_qkv": False, "options": options}}


def build_graph(spec: PromptSpec, index: int, seed: int, contender: str, checkpoint: str,
                lora: str | None, cfg: float, prefix: str) -> dict:
    """The API-format graph of one prompt of a session."""
    g: dict[str, dict] = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint}}}
    model, clip = ["1", 0], ["1", 1]
    if spec.lora is not None:
        if lora is None:
            raise ValueError(f"prompt {index + 1} ({spec.label()}) needs a LoRA: pass --lora or --no-lora")
        g["2"] = {"class_type": "LoraLoader", "inputs": {"model": model, "clip": clip, "lora_name": lora,
                                                         "strength_model": spec.lora, "strength_clip": spec.lora}}
        model, clip = ["2", 0], ["2", 1]
    node = compile_node(contender, model)
    if node is not None:
        g[COMPILE_NODE] = node
        model = [COMPILE_NODE, 0]
    text = f"{PROMPTS[index % len(PROMPTS)]}, variation {index + 1}"
    g["4"] = {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": clip}}
    g["5"] = {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE, "clip": clip}}
    g["6"] = {"class_type": "EmptyLatentImage",
              "inputs": {"width": spec.width, "height": spec.height, "batch_size": spec.batch}}
    sampler = {"model": model, "positive": ["4", 0], "negative": ["5", 0], "seed": seed, "steps": spec.steps,
               "cfg": cfg, "sampler_name": "euler", "scheduler": "normal"}
    g[SAMPLER_NODE] = {"class_type": "KSampler", "inputs": {**sampler, "latent_image": ["6", 0], "denoise": 1.0}}
    samples = [SAMPLER_NODE, 0]
    if spec.hires:
        g["8"] = {"class_type": "LatentUpscaleBy",
                  "inputs": {"samples": samples, "upscale_method": "nearest-exact", "scale_by": spec.hires}}
        g[HIRES_SAMPLER_NODE] = {"class_type": "KSampler",
                                 "inputs": {**sampler, "latent_image": ["8", 0], "denoise": 0.5}}
        samples = [HIRES_SAMPLER_NODE, 0]
    g["10"] = {"class_type": "VAEDecode", "inputs": {"samples": samples, "vae": ["1", 2]}}
    g["11"] = {"class_type": "SaveImage", "inputs": {"images": ["10", 0], "filename_prefix": prefix}}
    return g


# -- engine counters -------------------------------------------------------------------------------
_DELTA_COUNTERS = ("calls", "compiles", "recompiles", "fallbacks", "cache_hits", "cache_misses",
                   "static_first_eager_calls", "eager_calls", "graph_breaks")
_DELTA_SECONDS = ("compile_seconds", "compiled_call_seconds", "eager_call_seconds", "background_seconds")


def _records(stats: dict | None, node_id: str) -> tuple[list[dict], list[dict]]:
    """(the compile node's model records, their static-shape twins') in ``/nexfort/stats``."""
    models = ((stats or {}).get("engine") or {}).get("models") or {}
    main = [dict(rec, label=label) for label, rec in models.items() if node_id in (rec.get("node_ids") or [])]
    names = [re.sub(r":[0-9a-f]{8}$", "", r["label"]) for r in main]  # "<name>:<cache key>"
    twins = [dict(rec, label=label) for label, rec in models.items()
             if " (static)" in label and any(label.startswith(f"{n} (static)") for n in names)]
    return main, twins


def engine_delta(before: dict | None, after: dict | None, node_id: str = COMPILE_NODE) -> dict[str, Any]:
    """What the compile node's models did between two ``/nexfort/stats`` answers."""
    main_b, twins_b = _records(before, node_id)
    main_a, twins_a = _records(after, node_id)

    def total(recs: list[dict], key: str) -> float:
        return sum(float(r.get(key) or 0) for r in recs)

    d: dict[str, Any] = {k: int(total(main_a, k) - total(main_b, k)) for k in _DELTA_COUNTERS}
    d.update({k: round(total(main_a, k) - total(main_b, k), 3) for k in _DELTA_SECONDS})
    d["static_calls"] = int(total(twins_a, "calls") - total(twins_b, "calls"))
    d["compiles"] += int(total(twins_a, "compiles") - total(twins_b, "compiles"))
    d["compile_seconds"] = round(d["compile_seconds"] + total(twins_a, "compile_seconds")
                                 - total(twins_b, "compile_seconds"), 3)
    last_b = max(main_b, key=lambda r: r.get("updated") or 0, default={})
    last_a = max(main_a, key=lambda r: r.get("updated") or 0, default={})
    d["state_before"] = last_b.get("state", "")
    d["state"] = last_a.get("state", "")
    d["background"] = last_a.get("background", "")
    d["static_first"] = last_a.get("static_first", "")
    d["has_static_twin"] = any(r.get("state") != "retired" for r in twins_a)
    d["fallback_reasons"] = list(last_a.get("fallback_reasons") or [])[-3:] if d["fallbacks"] else []
    d["recompile_reasons"] = list(last_a.get("recompile_reasons") or [])[-3:] if d["recompiles"] else []
    d["models"] = [r["label"] for r in main_a]
    return d


def uncompiled(delta: dict[str, Any]) -> tuple[str, int]:
    """(why the model ran uncompiled during a prompt, or "", and how many of its calls did).

    ``eager_calls`` counts exactly the calls the engine ran uncompiled, for any reason; the rest
    reads engines without that counter: ``static_first_eager_calls`` (the calls a static graph did
    not fit while the background compile ran), and a background compile without a static twin, whose
    calls are then all counted (an upper bound where the compile finished during the prompt).
    """
    calls = delta["calls"]
    eager = delta.get("eager_calls", 0)  # every call the engine ran uncompiled, exactly
    if delta["fallbacks"] or delta["state"] == "fallback":
        return "fallback", eager or calls
    if eager:
        why = "background compile" if "background" in (delta["state_before"], delta["state"]) else "ran uncompiled"
        return why, eager
    if delta["static_first_eager_calls"]:
        return "background compile (no static graph for this shape)", delta["static_first_eager_calls"]
    during = "background" in (delta["state_before"], delta["state"])
    if during and not delta["static_calls"] and not delta["has_static_twin"]:
        why = "background compile" if delta["state"] == "background" else "background compile (finished during it)"
        return why, calls
    if calls and delta["state"] == "pending":
        return "not compiled (state pending)", calls
    return "", 0


# -- one session -----------------------------------------------------------------------------------
@dataclass
class PromptRecord:
    index: int
    label: str
    seed: int
    wall_s: float
    server_s: float | None
    step_s: float | None
    images: list[str]
    engine: dict[str, Any] = field(default_factory=dict)
    uncompiled: str = ""
    uncompiled_calls: int = 0
    #: Dynamo's recompiles in this prompt from the server log (``comfy``: TORCH_LOGS=recompiles)
    torch_recompiles: int | None = None


@dataclass
class SessionResult:
    contender: str
    cache: str
    previews: str
    server_start_s: float
    session_s: float
    prompts_s: float
    per_prompt_s: float
    prompts: list[PromptRecord]
    log_path: str
    cache_dir: str | None
    system: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    #: why the session stopped early ("" when every prompt ran)
    error: str = ""

    @property
    def uncompiled_prompts(self) -> list[PromptRecord]:
        return [p for p in self.prompts if p.uncompiled]

    def totals(self) -> dict[str, int]:
        return {k: sum(int(p.engine.get(k) or 0) for p in self.prompts)
                for k in ("compiles", "recompiles", "fallbacks")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionResult:
        """A session back from ``to_dict`` (``--report``)."""
        names = {f.name for f in fields(cls)}
        prompt_names = {f.name for f in fields(PromptRecord)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["prompts"] = [PromptRecord(**{k: v for k, v in p.items() if k in prompt_names}) for p in d["prompts"]]
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["uncompiled_prompts"] = len(self.uncompiled_prompts)
        d["uncompiled_s"] = round(sum(p.wall_s for p in self.uncompiled_prompts), 3)
        d["totals"] = self.totals()
        return d


def _wait_done(srv: comfy_server.ComfyServer, listener: comfy_server.ProgressListener | None, prompt_id: str,
               timeout: float) -> tuple[float, dict]:
    """(monotonic time the prompt finished, its /history entry). The websocket's
    ``execution_success`` (or error) marks the end where it arrives; /history is polled beside it."""
    deadline = time.monotonic() + timeout
    seen = 0
    next_poll = 0.0
    t_done: float | None = None
    while time.monotonic() < deadline:
        if listener is not None and t_done is None:
            events = listener.events
            for t, kind, data in events[seen:]:
                if kind in ("execution_success", "execution_error", "execution_interrupted") \
                        and data.get("prompt_id") == prompt_id:
                    t_done = t
                    break
            seen = len(events)
        now = time.monotonic()
        if t_done is not None or now >= next_poll:
            entry = srv.history(prompt_id)
            status = (entry or {}).get("status", {})
            if entry and status.get("completed") is not None and status.get("status_str") in ("success", "error"):
                if status["status_str"] != "success":
                    errors = [m for m in status.get("messages", []) if m[0] == "execution_error"]
                    raise comfy_server.ComfyServerError(f"prompt {prompt_id} failed: {json.dumps(errors)[:4000]}"
                                                        + srv.log_tail_text())
                return (t_done if t_done is not None else now), entry
            next_poll = now + (0.02 if t_done is not None else 0.5)
            if not srv.running:
                raise comfy_server.ComfyServerError(f"ComfyUI exited while running prompt {prompt_id}"
                                                    + srv.log_tail_text())
        time.sleep(0.01)
    raise comfy_server.ComfyServerError(f"prompt {prompt_id} did not finish within {timeout:.0f} s"
                                        + srv.log_tail_text())


def _median_step(events: list, prompt_id: str, node: str) -> float | None:
    times = [t for t, kind, data in events if kind == "progress" and data.get("prompt_id") == prompt_id
             and str(data.get("node")) == node]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return round(statistics.median(gaps), 4) if gaps else None


def _count_recompiles(log_path: Path, offset: int) -> tuple[int, int]:
    """(Dynamo 'Recompiling function' lines in the log after ``offset``, the log's new size)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return 0, offset
    return text.count(b"Recompiling function"), offset + len(text)


def run_session(*, host: Path, base: Path, contender: str, cache: str, previews: str, cache_dir: Path | None,
                seq: tuple[PromptSpec, ...], checkpoint: str, lora: str | None, cfg: float, seed: int,
                device: str, log_dir: Path, server_args: list[str], prompt_timeout: float,
                start_timeout: float = 600.0, extra_env: dict[str, str] | None = None,
                on_prompt: Callable[[SessionResult], None] | None = None) -> SessionResult:
    """Start a fresh server, run ``seq`` on it prompt after prompt, stop it. ``on_prompt`` gets the
    session so far after every prompt (marked ``error="incomplete"``)."""
    slug = contender_slug(contender)
    env: dict[str, str] = dict(extra_env or {})
    if cache_dir is not None:
        env.update(NEXFORT_CACHE_DIR=str(cache_dir / "nexfort"), TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
                   TRITON_CACHE_DIR=str(cache_dir / "triton"))
    if contender == "comfy":
        env.setdefault("TORCH_LOGS", "recompiles")
    log_path = log_dir / f"{slug}-{cache if cache != '-' else 'nocache'}-previews_{previews}.log"
    if log_path.exists():
        log_path.unlink()
    args = [*(["--preview-method", previews] if previews != "default" else []), *server_args]
    srv = comfy_server.ComfyServer(host, base_dir=base, log_path=log_path, env=env, extra_args=args,
                                   cpu=device == "cpu")
    tag = f"[{contender} {cache}{'' if previews == 'auto' else f' previews={previews}'}]"
    records: list[PromptRecord] = []
    system: dict[str, Any] = {}
    stats: dict | None = None
    error = ""
    listener: comfy_server.ProgressListener | None = None
    t0 = time.monotonic()
    t_started = t_last = t0

    def so_far(error: str) -> SessionResult:
        prompts_s = sum(r.wall_s for r in records)
        return SessionResult(contender=contender, cache=cache, previews=previews,
                             server_start_s=round(t_started - t0, 3), session_s=round(t_last - t0, 3),
                             prompts_s=round(prompts_s, 3), per_prompt_s=round(prompts_s / max(len(records), 1), 3),
                             prompts=list(records), log_path=str(log_path),
                             cache_dir=str(cache_dir) if cache_dir else None, system=system,
                             engine=_trim_engine(((stats or {}).get("engine")) or {}), error=error[:8000])

    try:
        srv.start(timeout=start_timeout)
        t_started = t_last = time.monotonic()
        print(f"{tag} server up in {t_started - t0:.1f} s (log {log_path})", flush=True)
        listener = comfy_server.ProgressListener(srv.url, srv.client_id)
        listener.start()
        try:
            system = srv.get_json("/system_stats") or {}
        except (urllib.error.URLError, OSError):
            system = {}
        stats = srv.stats()
        log_offset = 0
        for i, spec in enumerate(seq):
            graph = build_graph(spec, i, seed + i, contender, checkpoint, lora, cfg, f"session/{slug}_{cache}")
            t_post = time.monotonic()
            prompt_id = srv.submit(graph)
            t_done, entry = _wait_done(srv, listener, prompt_id, prompt_timeout)
            done = comfy_server.PromptResult(prompt_id, entry, srv.output_dir)
            images = [str(p) for p in done.images]
            missing = [p for p in done.images if not p.is_file()]
            if not images or missing:
                raise comfy_server.ComfyServerError(f"prompt {i + 1}: no saved image ({images}, missing {missing})"
                                                    + srv.log_tail_text())
            stats_after = srv.stats()
            delta = engine_delta(stats, stats_after) if contender not in ("eager", "comfy") else {}
            stats = stats_after
            why, n_eager = uncompiled(delta) if delta else ("", 0)
            if contender == "eager":
                why, n_eager = "eager", spec.unet_steps()
            recompiles = None
            if contender == "comfy":
                recompiles, log_offset = _count_recompiles(log_path, log_offset)
            rec = PromptRecord(index=i + 1, label=spec.label(), seed=seed + i, wall_s=round(t_done - t_post, 3),
                               server_s=(round(done.execution_seconds, 3) if done.execution_seconds is not None
                                         else None),
                               step_s=_median_step(listener.events, prompt_id, SAMPLER_NODE), images=images,
                               engine=delta, uncompiled=why, uncompiled_calls=n_eager, torch_recompiles=recompiles)
            records.append(rec)
            t_last = t_done
            print(f"{tag} {i + 1}/{len(seq)} {rec.label}: {rec.wall_s:.2f} s (server {rec.server_s} s, "
                  f"step {rec.step_s} s){_engine_note(rec)}", flush=True)
            if on_prompt is not None and i + 1 < len(seq):
                on_prompt(so_far("incomplete"))
    except (comfy_server.ComfyServerError, urllib.error.URLError, OSError) as e:
        # the session's rows so far are kept (time on the GPU machine is scarce); the error is reported
        error = f"{type(e).__name__}: {e}"
        print(f"{tag} FAILED after {len(records)} prompts: {error[:3000]}", flush=True)
    finally:
        if listener is not None:
            listener.stop()
        srv.stop()
    return so_far(error)


def _engine_note(rec: PromptRecord) -> str:
    e = rec.engine
    parts = []
    if e:
        static = f" (static graph {e['static_calls']})" if e["static_calls"] else ""
        parts.append(f"compiles+{e['compiles']} recompiles+{e['recompiles']} fallbacks+{e['fallbacks']} "
                     f"calls {e['calls']}{static} state {e['state_before'] or '-'}->{e['state'] or '-'}")
        if e["compile_seconds"]:
            parts.append(f"compile {e['compile_seconds']:.1f} s")
        if e["cache_hits"] or e["cache_misses"]:
            parts.append(f"cache hits {e['cache_hits']} misses {e['cache_misses']}")
    if rec.torch_recompiles:
        parts.append(f"dynamo recompiles {rec.torch_recompiles}")
    if rec.uncompiled and rec.uncompiled != "eager":
        parts.append(f"UNCOMPILED: {rec.uncompiled}, {rec.uncompiled_calls} calls")
    return (" | " + "; ".join(parts)) if parts else ""


def _trim_engine(engine: dict[str, Any]) -> dict[str, Any]:
    """The engine's final counters without the per-part compile profiles (large, in the log anyway)."""
    out = {k: v for k, v in engine.items() if k != "models"}
    out["models"] = {label: {k: v for k, v in rec.items() if k not in ("compile_parts_each",)}
                     for label, rec in (engine.get("models") or {}).items()}
    return out


# -- tables ----------------------------------------------------------------------------------------
def summary_table(sessions: list[SessionResult]) -> str:
    rows = ["| contender | cache | previews | server start s | session total s | prompts s | per prompt s "
            "| uncompiled prompts | compiles | recompiles | fallbacks |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for s in sessions:
        unc = s.uncompiled_prompts
        if s.contender == "eager":
            unc_text = "all (eager)"
        else:
            unc_text = f"{len(unc)} ({sum(p.wall_s for p in unc):.1f} s)" if unc else "0"
        t = s.totals()
        comp = "-" if s.contender in ("eager", "comfy") else t["compiles"]
        recomp: Any = "-" if s.contender == "eager" else t["recompiles"]
        if s.contender == "comfy":
            recomp = sum(p.torch_recompiles or 0 for p in s.prompts)
        fb = "-" if s.contender in ("eager", "comfy") else t["fallbacks"]
        name = s.contender
        if s.error:
            name += f" ({'incomplete' if s.error == 'incomplete' else 'FAILED'} after {len(s.prompts)} prompts)"
        rows.append(f"| {name} | {s.cache} | {s.previews} | {s.server_start_s:.1f} | {s.session_s:.1f} "
                    f"| {s.prompts_s:.1f} | {s.per_prompt_s:.2f} | {unc_text} | {comp} | {recomp} | {fb} |")
    return "\n".join(rows)


def prompt_table(sessions: list[SessionResult]) -> str:
    """Seconds of every prompt (rows) in every session (columns); ``[uncompiled: N calls]`` marks the
    prompts whose model ran (partly) eager, ``[R recompiles]`` Dynamo's recompiles under ``comfy``."""
    if not sessions:
        return ""
    heads = [f"{s.contender} {s.cache}" + ("" if s.previews == "auto" else f" ({s.previews})") for s in sessions]
    rows = ["| # | prompt | " + " | ".join(heads) + " |", "| ---: | --- |" + " ---: |" * len(sessions)]
    n = max(len(s.prompts) for s in sessions)
    for i in range(n):
        label = next((s.prompts[i].label for s in sessions if i < len(s.prompts)), "")
        cells = []
        for s in sessions:
            if i >= len(s.prompts):
                cells.append("")
                continue
            p = s.prompts[i]
            cell = f"{p.wall_s:.2f}"
            if p.uncompiled and p.uncompiled != "eager":
                cell += f" [uncompiled: {p.uncompiled_calls}/{p.engine.get('calls', '?')} calls]"
            if p.torch_recompiles:
                cell += f" [{p.torch_recompiles} recompiles]"
            cells.append(cell)
        rows.append(f"| {i + 1} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# -- the whole run ---------------------------------------------------------------------------------
def prepare_models(args: argparse.Namespace, host: Path) -> tuple[Path, Path | None]:
    """(checkpoint, LoRA or None): given, the tiny ones, or the random SDXL ones (built where missing,
    in a subprocess: ComfyUI never enters this process)."""
    import random_checkpoint

    if args.checkpoint:
        ckpt = Path(args.checkpoint).resolve()
        lora = Path(args.lora).resolve() if args.lora else None
    elif args.tiny:
        ckpt, lora = random_checkpoint.ensure_tiny(host)
        lora = Path(args.lora).resolve() if args.lora else lora
    else:
        ckpt = random_checkpoint.default_path(host)
        lora = Path(args.lora).resolve() if args.lora else random_checkpoint.default_lora_path(ckpt)
        if not random_checkpoint.is_valid(ckpt) or (not args.no_lora and not lora.is_file()):
            print(f"building the random SDXL checkpoint and LoRA in {ckpt.parent.parent} ...", flush=True)
            subprocess.run([sys.executable, str(SCRIPTS / "random_checkpoint.py"), "--host", str(host),
                            "--device", args.device, "--output", str(ckpt), "--lora", str(lora)], check=True)
    if args.no_lora:
        lora = None
    if not ckpt.is_file():
        raise SystemExit(f"no checkpoint at {ckpt}")
    if lora is not None and not lora.is_file():
        raise SystemExit(f"no LoRA at {lora} (pass --no-lora to run without)")
    return ckpt, lora


def _preread(path: Path) -> float:
    """Read ``path`` once (the page cache then holds it for every server alike); seconds taken."""
    t0 = time.monotonic()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return time.monotonic() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfy-root", type=Path,
                   default=os.environ.get("COMFY") or os.environ.get("NEXFORT_HOST") or REPO_ROOT / ".host" / "ComfyUI",
                   help="the ComfyUI tree (default: $COMFY, $NEXFORT_HOST or .host/ComfyUI)")
    p.add_argument("--contenders", default="eager,comfy,O2",
                   help="comma list of: eager, comfy, " + ", ".join(NEXFORT_PRESETS) + ", nexfort:<options JSON>")
    p.add_argument("--sequence", default="sdxl", choices=list(SEQUENCES),
                   help="; ".join(f"{k}: {v}" for k, v in SEQUENCES.items()))
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: the random SDXL one, or --tiny's)")
    p.add_argument("--lora", default=None, help="LoRA file for the sequence's LoRA prompts")
    p.add_argument("--no-lora", action="store_true", help="no LoraLoader in any prompt")
    p.add_argument("--tiny", action="store_true", help="the tiny SD1.5 checkpoint and LoRA (CPU)")
    p.add_argument("--previews", default="auto",
                   help="comma list of ComfyUI --preview-method values, a session each (auto, latent2rgb, taesd, "
                   "none; 'default': no flag, ComfyUI 0.3.75's default is none)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cold", dest="caches", action="store_const", const=("cold",), help="cold cache only")
    cache.add_argument("--warm", dest="caches", action="store_const", const=("warm",),
                       help="warm cache only (a cold session runs first to fill it, unreported)")
    cache.add_argument("--both", dest="caches", action="store_const", const=("cold", "warm"), help="(default)")
    p.set_defaults(caches=("cold", "warm"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu starts ComfyUI with --cpu; cuda without (its default device)")
    p.add_argument("--cfg", type=float, default=None, help="sampler cfg (default 7 for SDXL, 4 for --tiny)")
    p.add_argument("--seed", type=int, default=1000, help="seed of the first prompt (the next ones count up)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="ComfyUI base dir, logs and compile caches (default: a fresh temp dir, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the temp work dir (logs, images, caches)")
    p.add_argument("--server-args", default="", help="more ComfyUI command-line flags, e.g. '--highvram'")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra server environment")
    p.add_argument("--prompt-timeout", type=float, default=1800.0)
    p.add_argument("--no-preread", action="store_true", help="do not read the checkpoint once before the first server")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print the tables of earlier runs' --output-json files together (runs nothing)")
    args = p.parse_args(argv)
    args.contender_list = split_contenders(args.contenders)
    for c in args.contender_list:
        if c not in ("eager", "comfy", *NEXFORT_PRESETS) and not c.startswith("nexfort:"):
            p.error(f"--contenders: {c!r} is not one of eager, comfy, {', '.join(NEXFORT_PRESETS)}, nexfort:<JSON>")
        if c.startswith("nexfort:"):
            try:
                json.loads(c[len("nexfort:"):])
            except json.JSONDecodeError as e:
                p.error(f"--contenders: {c!r}: {e}")
    args.preview_list = [v.strip() for v in args.previews.split(",") if v.strip()]
    for env in args.env:
        if "=" not in env:
            p.error(f"--env {env!r}: KEY=VALUE")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (previews, contender, cache) session in turn; the JSON is rewritten after each one, so a
    run cut short keeps what it measured."""
    host = Path(args.comfy_root).resolve()
    if not (host / "main.py").is_file():
        raise SystemExit(f"no ComfyUI at {host} (--comfy-root)")
    tmp = None
    if args.work_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="nexfort_session_"))
        work = tmp
    else:
        work = Path(args.work_dir).resolve()
        work.mkdir(parents=True, exist_ok=True)
    sessions: list[SessionResult] = []
    meta: dict[str, Any] = {"sequence": args.sequence, "contenders": args.contender_list, "caches": list(args.caches),
                            "previews": args.preview_list, "device": args.device, "seed": args.seed,
                            "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def emit(running: SessionResult | None = None) -> dict[str, Any]:
        done = sessions + ([running] if running is not None else [])
        summary, per_prompt = summary_table(done), prompt_table(done)
        meta["system"] = next((s.system for s in done if s.system), {})
        out = {"meta": meta, "sessions": [s.to_dict() for s in done],
               "markdown": {"sessions": summary, "prompts": per_prompt}}
        if args.output_json:
            args.output_json.parent.mkdir(parents=True, exist_ok=True)
            tmp_json = args.output_json.with_name(args.output_json.name + ".tmp")
            tmp_json.write_text(json.dumps(out, indent=1, default=str))
            os.replace(tmp_json, args.output_json)
        return out

    try:
        ckpt, lora = prepare_models(args, host)
        seq = sequence(args.sequence, lora=lora is not None)
        cfg = args.cfg if args.cfg is not None else (4.0 if args.tiny else 7.0)
        server_args = args.server_args.split() if args.server_args else []
        meta.update(prompts=[asdict(s) | {"label": s.label()} for s in seq], cfg=cfg, checkpoint=str(ckpt),
                    lora=str(lora) if lora else None, server_args=server_args)
        base = comfy_server.make_base_dir(work / "base", [ckpt])
        if lora is not None:
            (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
            dst = base / "models" / "loras" / lora.name
            if not dst.exists():
                dst.symlink_to(lora)
        log_dir = work / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"sequence {args.sequence}: {len(seq)} prompts: " + "; ".join(s.label() for s in seq), flush=True)
        print(f"checkpoint {ckpt} ({ckpt.stat().st_size / 1e9:.2f} GB), LoRA {lora}, work dir {work}", flush=True)
        if not args.no_preread:
            print(f"read the checkpoint once in {_preread(ckpt):.1f} s (page cache)", flush=True)
        extra_env = dict(e.split("=", 1) for e in args.env)
        common = dict(host=host, base=base, seq=seq, checkpoint=ckpt.name, lora=lora.name if lora else None, cfg=cfg,
                      seed=args.seed, device=args.device, log_dir=log_dir, server_args=server_args,
                      prompt_timeout=args.prompt_timeout, extra_env=extra_env)
        for previews in args.preview_list:
            for contender in args.contender_list:
                phases = ("-",) if contender == "eager" else tuple(args.caches)
                cache_dir = None
                if contender != "eager":
                    # one per contender: compiled graphs do not depend on previews (a --previews none
                    # --warm run uses the caches an earlier --cold run with previews left)
                    cache_dir = work / "caches" / contender_slug(contender)
                    filled = cache_dir.is_dir() and any(cache_dir.iterdir())
                    if "cold" in phases and cache_dir.exists():
                        shutil.rmtree(cache_dir)
                    cache_dir.mkdir(parents=True, exist_ok=True)
                    if phases == ("warm",):
                        if filled:  # an earlier --cold run in this --work-dir filled it
                            print(f"[{contender} warm] on the compile caches in {cache_dir}", flush=True)
                        else:  # fill it first, unreported
                            run_session(contender=contender, cache="fill", previews=previews, cache_dir=cache_dir,
                                        **common)
                for phase in phases:
                    sessions.append(run_session(contender=contender, cache=phase, previews=previews,
                                                cache_dir=cache_dir, on_prompt=emit, **common))
                    emit()
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            print(f"work dir kept: {tmp}")
    out = emit()
    print("\n## Sessions\n\n" + out["markdown"]["sessions"] + "\n\n## Seconds per prompt\n\n"
          + out["markdown"]["prompts"], flush=True)
    if args.output_json:
        print(f"wrote {args.output_json}")
    return out


def report(paths: list[Path], output_json: Path | None = None) -> dict[str, Any]:
    """The tables of several runs' JSON files (e.g. one device call per contender) together."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    sessions = [SessionResult.from_dict(d) for r in runs for d in r["sessions"]]
    summary, per_prompt = summary_table(sessions), prompt_table(sessions)
    print("## Sessions\n\n" + summary + "\n\n## Seconds per prompt\n\n" + per_prompt, flush=True)
    out = {"meta": {"merged": [str(p) for p in paths], "runs": [r.get("meta", {}) for r in runs]},
           "sessions": [s.to_dict() for s in sessions], "markdown": {"sessions": summary, "prompts": per_prompt}}
    if output_json:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps(out, indent=1, default=str))
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    if args.report:
        report(args.report, args.output_json)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
