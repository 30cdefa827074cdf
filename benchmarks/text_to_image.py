"""Text-to-image/video benchmark through ComfyUI's real sampler path (``comfy.sample.sample``).

One model x one compiler per process (``--compiler none|comfy|nexfort``), random weights in the
real architecture at real size, random conditioning of the real shapes (no text encoders, no VAE):

    python benchmarks/text_to_image.py --comfy-root PATH --model sd21 --compiler nexfort \
        --compiler-config '{"mode": "O2"}' --steps 20 --output-json out/sd21_nexfort.json

Metrics (see BENCHMARKS.md): steady it/s, E2E seconds, peak CUDA memory, warm-up with compile,
warm-up with a warm cache (``--warm-cache-check``: a second process on the same cache dir),
compiles/recompiles, error of the final latent vs an eager run of the same seed and vs a float32
eager reference (``--fp32-reference``), FLOPs per step and achieved TFLOP/s against the device's
measured matmul peak. ``--run_multiple_resolutions`` sweeps resolutions x step
counts x prompt lengths and reports recompiles. ``--tiny --device cpu`` runs tiny twins for tests.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "nexfort-bench/1"


def _fix_sys_path(comfy_root: Path) -> None:
    """ComfyUI's tree first (its ``nodes.py``/``utils`` must win), this repo appended (``benchmarks``,
    ``nexfort_engine``), and this script's own folder removed (no accidental top-level modules)."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    if str(comfy_root) not in sys.path:
        sys.path.insert(0, str(comfy_root))
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))


def default_comfy_root() -> Path:
    env = os.environ.get("NEXFORT_HOST") or os.environ.get("COMFYUI_ROOT")
    return Path(env) if env else REPO / ".host" / "ComfyUI"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfy-root", type=Path, default=None, help="ComfyUI tree (default: $NEXFORT_HOST or .host/ComfyUI)")
    p.add_argument("--model", default="sd21", choices=["sd21", "sdxl", "pixart", "flux", "wan"])
    p.add_argument("--compiler", default="nexfort", choices=["none", "comfy", "nexfort"])
    p.add_argument("--compiler-config", default='{"mode": "O2"}', help="nexfort options JSON (the seeds' format)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="video models (wan): frame count")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", type=float, default=None, help="default: the model's usual cfg")
    p.add_argument("--sampler", default="euler")
    p.add_argument("--scheduler", default=None, help="default: the model's usual scheduler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="timed sampling runs after warm-up (median reported)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32", "fp8_e4m3fn"], default=None,
                   help="weight dtype (default: as ComfyUI picks); fp8_e4m3fn stores the weights in fp8 and "
                        "computes in ComfyUI's manual-cast dtype, as the UNETLoader's weight_dtype option does")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny twins of the architectures (CPU tests)")
    p.add_argument("--offload-device", choices=["load", "cpu"], default="load",
                   help="the ModelPatcher's offload device: 'load' (the GPU: the random weights are built "
                        "there and never move) or 'cpu' (ComfyUI's default without --highvram; what "
                        "\"fp8_weights\" needs to take the bf16 originals off the GPU)")
    p.add_argument("--weights-device", choices=["load", "cpu"], default="load",
                   help="where the random weights are built: 'load' (the GPU) or 'cpu' (as ComfyUI's checkpoint "
                        "loader leaves a model: the first sampling moves them to the GPU; needs --offload-device "
                        "cpu). With 'cpu', \"fp8_weights\" rounds its copies on the CPU, as in a real ComfyUI")
    p.add_argument("--run_multiple_resolutions", "--run-multiple-resolutions", dest="run_multiple_resolutions",
                   type=int, nargs="?", const=1, default=0,
                   help="sweep 4 resolutions x 2 step counts x 2 prompt lengths and report recompiles")
    p.add_argument("--fp32-reference", choices=["auto", "always", "never"], default="auto",
                   help="float32 eager reference run (auto: when it fits in GPU memory)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, profile one sampling run: GPU kernel time per step by category")
    p.add_argument("--profile-host", action="store_true",
                   help="after the timed runs, one sampling run under cProfile: host (Python) time per step by function")
    p.add_argument("--warm-cache-check", action="store_true",
                   help="re-run the compile in a second process on the same cache dir (warm-up with warm cache)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="compile caches (Inductor/Triton/nexfort); default: a fresh temp dir (cold compile)")
    p.add_argument("--quant-rows-form", choices=["exact", "fast", "hw-tanh"], default=None,
                   help="the form nexfort::quant_rows runs on the GPU (default: the engine's; A/B comparisons)")
    p.add_argument("--no-prewarm", action="store_true",
                   help="nexfort: no prewarm of the compile stack's modules (nexfort_engine.prewarm; A/B comparisons)")
    p.add_argument("--no-fp8-stored", action="store_true",
                   help="fp8 graphs: weights stored in e4m3 are cast up and quantized again at every call, as "
                        "before passes/fp8_stored.py (A/B comparisons)")
    p.add_argument("--no-ln-mod-quant", action="store_true",
                   help="fp8 graphs: leave the LayerNorm + modulation inputs to Inductor (A/B comparisons)")
    p.add_argument("--rope-config", default=None, metavar="BLOCK_RxWARPS",
                   help="nexfort::rms_norm_rope's launch configuration, e.g. 32x4 (default: the engine's; A/B comparisons)")
    p.add_argument("--vae-decode", action="store_true",
                   help="decode each sampling's latent too, with ComfyUI's AutoencoderKL (the SDXL-family "
                   "config, the model's latent channels, random weights): compiled as the Nexfort Compile VAE "
                   "node does with --compiler nexfort (decode), eager otherwise (ComfyUI's node compiles no VAE); "
                   "reports the first image's time (sampling + decode)")
    p.add_argument("--background-wait", type=float, default=900.0,
                   help='"background": true: sample eager for at most this many seconds waiting for the child')
    p.add_argument("--controlnet", type=float, default=None, metavar="END_PERCENT",
                   help="UNets: a random ControlNet (ComfyUI's cldm class) applied to both conds at strength "
                        "0.8 from 0 to END_PERCENT of the steps, on a random control image; it runs uncompiled "
                        "in ComfyUI, its residuals are the diffusion model's inputs")
    p.add_argument("--compile-controlnet", action="store_true",
                   help="with --controlnet and --compiler nexfort: compile the ControlNet too (Nexfort Compile "
                        "ControlNet's glue, the same --compiler-config)")
    p.add_argument("--attention-experiment", default=None, metavar="split-d[:BMxBNxWARPSxSTAGES[xws][xf16][xlazy][xtma]]",
                   help="experiment: ComfyUI's unmasked 16-bit attention with a head dim that is not a power "
                   "of two runs benchmarks/split_d_attention.py's Triton kernel (default config 128x64x8x3)")
    p.add_argument("--patch", choices=sorted(PATCH_NODES), default=None,
                   help="a ComfyUI model-patch node applied to the model every sampling (also the eager and "
                        "float32 references), after the compiler as a workflow places it: " + "; ".join(
                            f"{k}: {v[1]} {v[2]}" for k, v in sorted(PATCH_NODES.items())))
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--output-markdown", type=Path, default=None)
    p.add_argument("--warm-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compiler == "none" and args.warm_cache_check:
        p.error("--warm-cache-check needs --compiler comfy or nexfort")
    if args.weights_device == "cpu" and args.offload_device != "cpu":
        p.error("--weights-device cpu needs --offload-device cpu (ComfyUI offloads a model to where it loaded it)")
    return args


# -- ComfyUI in-process ---------------------------------------------------------------------------


def boot_comfy(comfy_root: Path, device: str) -> None:
    """Import ComfyUI the way main.py does (CLI args set before ``comfy.model_management``)."""
    if not (comfy_root / "comfy").is_dir():
        raise SystemExit(f"no ComfyUI tree at {comfy_root}: pass --comfy-root (or run `make host`)")
    _fix_sys_path(comfy_root)
    import comfy.cli_args

    comfy.cli_args.args.disable_api_nodes = True
    if device == "cpu":
        comfy.cli_args.args.cpu = True
        # SDPA: the default sub-quadratic attention graph-breaks under torch.compile on CPU
        comfy.cli_args.args.use_pytorch_cross_attention = True
    import torch

    torch.set_grad_enabled(False)
    import asyncio
    import importlib

    import comfy.model_management  # noqa: F401  (after the args)
    import comfy.model_patcher  # noqa: F401
    import comfy.sample  # noqa: F401
    import comfy.samplers  # noqa: F401
    import comfy.supported_models  # noqa: F401
    import utils.install_util  # noqa: F401  (before anything imports a bare `utils`)

    # ComfyUI's startup loads its node modules (comfy_extras: what a first prompt would otherwise
    # import, torch._dynamo among them) before any prompt; custom nodes are loaded by load_pack
    nodes = importlib.import_module("nodes")  # after utils.install_util, as ComfyUI's main.py
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))


def load_pack() -> Any:
    """This repo as a custom-node package (as ComfyUI loads it) -> its ``nodes`` subpackage."""
    import importlib
    import importlib.util

    name = "nexfort_pack"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{name}.nodes")


class Decoder:
    """``--vae-decode``: a VAE's decode after each sampling, timed (wall time with syncs)."""

    def __init__(self, args: argparse.Namespace, mp: Any, device: Any) -> None:
        import torch
        from comfy.ldm.models.autoencoder import AutoencoderKL

        from benchmarks.models import init_weights
        from benchmarks.vae_decode import DDCONFIG

        channels = int(mp.model.latent_format.latent_channels)
        ddconfig = {**DDCONFIG, "z_channels": channels}
        if args.tiny:
            ddconfig.update(ch=32, ch_mult=[1, 2], num_res_blocks=1)
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        torch.manual_seed(args.seed)
        vae = init_weights(AutoencoderKL(ddconfig=ddconfig, embed_dim=channels).eval()).to(device, self.dtype)
        self.fn = vae.decode
        if args.compiler == "nexfort":  # as the Nexfort Compile VAE node compiles it
            import nexfort_engine

            config = json.loads(args.compiler_config or "{}")
            self.fn = nexfort_engine.compile(vae, config, cache_dir=os.environ.get("NEXFORT_CACHE_DIR"),
                                             method="decode")

    def __call__(self, latent: Any) -> float:
        from benchmarks import metrics

        z = latent.to(self.device, self.dtype)
        metrics.sync(self.device)
        t0 = time.perf_counter()
        self.fn(z)
        metrics.sync(self.device)
        return time.perf_counter() - t0


#: ``--patch``: name -> (comfy_extras module, node class, inputs); SDXL-style settings
PATCH_NODES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "freeu_v2": ("nodes_freelunch", "FreeU_V2", {"b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2}),
    "pag": ("nodes_pag", "PerturbedAttentionGuidance", {"scale": 3.0}),
    "sag": ("nodes_sag", "SelfAttentionGuidance", {"scale": 0.5, "blur_sigma": 2.0}),
    "deepshrink": ("nodes_model_downscale", "PatchModelAddDownscale", {
        "block_number": 3, "downscale_factor": 2.0, "start_percent": 0.0, "end_percent": 0.35,
        "downscale_after_skip": True, "downscale_method": "bicubic", "upscale_method": "bicubic"}),
    "hypertile": ("nodes_hypertile", "HyperTile", {"tile_size": 256, "swap_size": 2, "max_depth": 0,
                                                   "scale_depth": False}),
    # not a ComfyUI node: custom nodes' pattern (ComfyUI_IPAdapter_plus's CrossAttentionPatch), see HostSigmaAttn2
    "ipadapter_like": ("", "HostSigmaAttn2", {"weight": 0.7, "tokens": 16}),
}


class HostSigmaAttn2:
    """An attn2 replacement like IPAdapter's (a custom node, not installable here): cross-attention
    as usual, plus ``weight`` × attention to ``tokens`` extra keys and values (here taken from the
    prompt's, at half scale, in place of projected image embeddings), only while the sigma, read on
    the host with ``.item()`` in every call, is inside the patch's window. The host read breaks
    Dynamo's graph in every cross-attention layer."""

    def __init__(self, weight: float, tokens: int, sigma_start: float = 1e9, sigma_end: float = 0.0) -> None:
        self.weight, self.tokens, self.sigma_start, self.sigma_end = weight, tokens, sigma_start, sigma_end

    def __call__(self, q: Any, k: Any, v: Any, extra_options: dict) -> Any:
        from comfy.ldm.modules.attention import optimized_attention

        out = optimized_attention(q, k, v, extra_options["n_heads"])
        sigma = extra_options["sigmas"].detach().cpu()[0].item() if "sigmas" in extra_options else 1e9
        if self.sigma_end <= sigma <= self.sigma_start:
            ip_k, ip_v = k[:, : self.tokens] * 0.5, v[:, : self.tokens] * 0.5
            out = out + self.weight * optimized_attention(q, ip_k, ip_v, extra_options["n_heads"])
        return out.to(dtype=q.dtype)


def _attn2_positions(mp: Any) -> list[tuple[str, int, int]]:
    """(block, number, transformer index) of every cross-attention in ``mp``'s UNet, in ComfyUI's
    ``set_model_attn2_replace`` terms."""
    out = []
    unet = mp.model.diffusion_model
    for kind, blocks in (("input", unet.input_blocks), ("middle", [unet.middle_block]), ("output", unet.output_blocks)):
        for n, block in enumerate(blocks):
            for layer in block:
                for i, _ in enumerate(getattr(layer, "transformer_blocks", [])):
                    out.append((kind, 0 if kind == "middle" else n, i))
    return out


def apply_patch(mp: Any, name: str) -> Any:
    """``--patch``: ``mp`` through ComfyUI's node (classic or V3 schema), as a workflow runs it."""
    import importlib

    module, cls_name, inputs = PATCH_NODES[name]
    if cls_name == "HostSigmaAttn2":
        m = mp.clone()
        patch = HostSigmaAttn2(**inputs)
        for kind, n, i in _attn2_positions(m):
            m.set_model_attn2_replace(patch, kind, n, i)
        return m
    cls = getattr(importlib.import_module(f"comfy_extras.{module}"), cls_name)
    if hasattr(cls, "FUNCTION"):
        return getattr(cls(), cls.FUNCTION)(model=mp, **inputs)[0]
    return cls.execute(model=mp, **inputs).args[0]


def apply_compiler(mp: Any, compiler: str, config_json: str) -> Any:
    """A clone of ``mp`` compiled the way each node does it (the original stays eager)."""
    if compiler == "none":
        return mp
    if compiler == "comfy":
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        m = mp.clone()
        set_torch_compile_wrapper(model=m, backend="inductor")
        return m
    load_pack()
    import importlib

    common = importlib.import_module("nexfort_pack.nodes.common")
    patcher = importlib.import_module("nexfort_pack.nodes.patcher")
    config = common.build_config("O2", "contiguous", True, config_json)
    return patcher.compile_model_patcher(mp, config, node_id="benchmark")


def compile_controlnet(controlnet: Any, config_json: str) -> Any:
    """``--compile-controlnet``: ComfyUI's copy of ``controlnet`` with its model compiled, as the
    *Nexfort Compile ControlNet* node makes it."""
    load_pack()
    import importlib

    common = importlib.import_module("nexfort_pack.nodes.common")
    patcher = importlib.import_module("nexfort_pack.nodes.patcher")
    config = common.build_config("O2", "contiguous", True, config_json)
    return patcher.compile_controlnet(controlnet, config, node_id="benchmark-controlnet")


# -- sampling ---------------------------------------------------------------------------------------


class HostWaits:
    """Where a sampling's host thread stood still or took another path: Python's garbage
    collections (their time and count); for models with host calls, the waits of ``HostCopied``
    reads for their host copy (``nexfort_engine.host_call``); and how CUDA-graph trees ran each
    piece (``CUDAGraphNode.run``: a replay, ``run_first_inputs``: the run that recorded it,
    ``CUDAWarmupNode.run``: its kernels one by one). To tell a host-bound step that waits for the
    GPU, or launches every kernel, from one that computes."""

    def __init__(self) -> None:
        self.gc_s, self.gc_n, self.wait_s, self.wait_n = 0.0, 0, 0.0, 0
        self.counts: dict[str, int] = {"cudagraph_replays": 0, "cudagraph_records": 0, "cudagraph_warmups": 0}
        self._gc_t0 = 0.0
        self._restore: list[tuple[Any, str, Any]] = []

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.gc_n += 1

    def _wrap(self, cls: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        orig = cls.__dict__.get(name)
        if orig is not None:
            self._restore.append((cls, name, orig))
            setattr(cls, name, wrapper(orig))

    def _counting(self, key: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.counts[key] += 1
                return orig(*args, **kwargs)
            return counted
        return wrapper

    def _timing(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """``HostCopied._host`` timed where it waits for the copy (its first read)."""
        def timed(me: Any) -> Any:
            if me._nx_ready[0] is None:
                return orig(me)
            t = time.perf_counter()
            try:
                return orig(me)
            finally:
                self.wait_s += time.perf_counter() - t
                self.wait_n += 1
        return timed

    def __enter__(self) -> HostWaits:
        import gc

        gc.callbacks.append(self._on_gc)
        host_call = sys.modules.get("nexfort_engine.host_call")
        if host_call is not None:
            self._wrap(host_call.HostCopied, "_host", self._timing)
        trees = sys.modules.get("torch._inductor.cudagraph_trees")
        if trees is not None:
            node, warmup = getattr(trees, "CUDAGraphNode", object), getattr(trees, "CUDAWarmupNode", object)
            self._wrap(node, "run", self._counting("cudagraph_replays"))
            # a node's first run right after its recording (a re-recording shows up here too)
            self._wrap(node, "run_first_inputs", self._counting("cudagraph_records"))
            self._wrap(warmup, "run", self._counting("cudagraph_warmups"))
        return self

    def __exit__(self, *exc: Any) -> None:
        import gc

        gc.callbacks.remove(self._on_gc)
        for cls, name, orig in reversed(self._restore):
            setattr(cls, name, orig)
        self._restore.clear()

    def summary(self) -> dict[str, Any]:
        return {"gc_ms": round(1000.0 * self.gc_s, 3), "gc_collections": self.gc_n,
                "host_copy_wait_ms": round(1000.0 * self.wait_s, 3), "host_copy_waits": self.wait_n,
                **self.counts}


class Runner:
    """Everything one sampling run needs; :meth:`run` returns (latent, metrics)."""

    def __init__(self, args: argparse.Namespace, spec: Any, device: Any) -> None:
        self.args = args
        self.spec = spec
        self.device = device
        #: ``--controlnet``: built with the benchmarked model's dtype (benchmark()), or at first use
        self.controlnet: Any = None

    def run(self, mp: Any, height: int, width: int, steps: int, text_len: int | None = None) -> tuple[Any, dict]:
        import comfy.sample

        from benchmarks import metrics

        args = self.args
        if args.patch:
            mp = apply_patch(mp, args.patch)
        latent, noise, pos, neg = self.inputs(mp, height, width, text_len)
        timer = metrics.StepTimer(self.device)
        metrics.sync(self.device)
        t0 = time.perf_counter()
        with HostWaits() as waits:
            out = comfy.sample.sample(
                mp, noise, steps, self.cfg, args.sampler, self.scheduler, pos, neg, latent,
                callback=timer, disable_pbar=True, seed=args.seed,
            )
            metrics.sync(self.device)
        e2e = time.perf_counter() - t0
        return out, {"e2e_s": e2e, "it_s": timer.it_per_s(), "host_ms_per_step": timer.host_ms_per_step(),
                     **waits.summary(),
                     "steps_seen": len(timer.marks), "t0_perf_s": round(t0, 4),
                     # per step (2..N): the device's time and the host's, to place a slow sampling
                     "step_ms": [round(1000.0 * d, 3) for d in timer.seconds_between()],
                     "host_step_ms": [round(1000.0 * d, 3) for d in timer.host_seconds_between()]}

    def profile(self, mp: Any, height: int, width: int, steps: int) -> dict[str, Any]:
        """One sampling run under ``torch.profiler``: GPU kernel time per step by category."""
        import torch

        from benchmarks import metrics

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            _, m = self.run(mp, height, width, steps)
        return metrics.kernel_breakdown(prof, steps, m["e2e_s"], cuda=self.device.type == "cuda")

    def profile_host(self, mp: Any, height: int, width: int, steps: int) -> dict[str, Any]:
        """One sampling run under ``cProfile``: where the host's time goes, per step."""
        import cProfile

        from benchmarks import metrics

        prof = cProfile.Profile()
        prof.enable()
        try:
            _, m = self.run(mp, height, width, steps)
        finally:
            prof.disable()
        return metrics.host_breakdown(prof, steps, m["e2e_s"])

    def inputs(self, mp: Any, height: int, width: int, text_len: int | None = None) -> tuple[Any, Any, list, list]:
        """(empty latent, noise, positive, negative) exactly as :meth:`run` samples them."""
        import comfy.sample
        import torch

        from benchmarks import models

        latent = torch.zeros(self.spec.latent_shape(self.args.batch, height, width, self.args.frames))
        latent = comfy.sample.fix_empty_latent_channels(mp, latent)
        noise = comfy.sample.prepare_noise(latent, self.args.seed)
        pos, neg = models.conditioning(self.spec, height, width, text_len)
        if self.args.controlnet is not None:
            self._apply_controlnet(mp, pos, neg, height, width)
        return latent, noise, pos, neg

    def _apply_controlnet(self, mp: Any, pos: list, neg: list, height: int, width: int) -> None:
        """``--controlnet``: as ControlNetApplyAdvanced does (a copy with the hint per conditioning)."""
        import torch

        from benchmarks import models

        if self.controlnet is None:
            self.controlnet = models.build_controlnet(self.spec, self.device, mp.model.get_dtype(),
                                                      mp.model.manual_cast_dtype)
        hint = torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(self.args.seed + 7))
        applied = self.controlnet.copy().set_cond_hint(hint, 0.8, (0.0, self.args.controlnet))
        for cond in (pos, neg):
            cond[0][1]["control"] = applied
            cond[0][1]["control_apply_to_uncond"] = False

    def count_flops(self, mp: Any, height: int, width: int) -> dict[str, Any]:
        """FLOPs of one sampling step: a 1-step ``comfy.sample.sample`` on a clone of the *eager*
        ``mp`` whose ``model_function_wrapper`` runs each diffusion-model call under
        ``FlopCounterMode`` - the batch (cond + uncond when cfg > 1), latent shape and context are
        the ones the sampler builds. The clone only adds the wrapper; ``mp`` itself is untouched."""
        import comfy.ldm.modules.attention as attention
        import comfy.sample

        from benchmarks import metrics

        seen: dict[str, Any] = {"calls": 0, "flops": 0, "by_op": {}, "batch": []}

        def wrapper(apply_model: Any, a: dict[str, Any]) -> Any:
            with metrics.flop_counter() as counter:
                out = apply_model(a["input"], a["timestep"], **a["c"])
            seen["calls"] += 1
            seen["flops"] += counter.get_total_flops()
            seen["batch"].append(int(a["input"].shape[0]))
            for op, n in metrics.flops_by_op(counter).items():
                seen["by_op"][op] = seen["by_op"].get(op, 0) + n
            return out

        m = mp.clone()
        m.set_model_unet_function_wrapper(wrapper)
        latent, noise, pos, neg = self.inputs(m, height, width)
        comfy.sample.sample(m, noise, 1, self.cfg, self.args.sampler, self.scheduler, pos, neg, latent,
                            disable_pbar=True, seed=self.args.seed)
        del m
        attn = sum(n for op, n in seen["by_op"].items() if "attention" in op)
        return {
            "flops_per_step": int(seen["flops"]),
            "flops_model_calls": seen["calls"],
            "flops_model_batch": seen["batch"],
            "flops_by_op": dict(sorted(seen["by_op"].items(), key=lambda kv: -kv[1])),
            "flops_attention_counted": attn > 0,
            "attention_function": getattr(attention.optimized_attention, "__name__", None),
        }

    @property
    def cfg(self) -> float:
        return self.args.cfg if self.args.cfg is not None else self.spec.cfg

    @property
    def scheduler(self) -> str:
        return self.args.scheduler or self.spec.scheduler


def environment(device: Any) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    try:
        import comfyui_version

        env["comfyui"] = comfyui_version.__version__
    except Exception:  # noqa: BLE001
        env["comfyui"] = None
    try:
        import nexfort_engine

        env["nexfort"] = nexfort_engine.__version__
    except Exception:  # noqa: BLE001
        env["nexfort"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_mem_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = None
    return env


def _fp32_affordable(spec: Any, device: Any, dtype: Any, mode: str, compiler: str) -> bool:
    import torch

    if mode == "never":
        return False
    if mode == "auto" and compiler == "none":
        return False  # the compiled runs measure eager's error vs float32 as well
    if mode == "always" or device.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    lowp = torch.tensor([], dtype=dtype).element_size()
    # fp32 twin + the low-precision model + activations headroom
    return spec.params * (4 + lowp) * 1.25 < 0.85 * total


def _setup_cache_env(args: argparse.Namespace) -> tuple[Path, bool]:
    if args.cache_dir is None:
        args.cache_dir = Path(tempfile.mkdtemp(prefix="nexfort_bench_cache_"))
    cache = args.cache_dir.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    was_empty = not any(cache.iterdir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    os.environ["NEXFORT_CACHE_DIR"] = str(cache / "nexfort")
    return cache, was_empty


def _child_argv(args: argparse.Namespace, out_json: Path) -> list[str]:
    """Same benchmark, second process, same cache dir: measure warm-up with a warm cache only."""
    argv = [a for a in sys.argv[1:]]
    drop_with_value = {"--output-json", "--output-markdown", "--cache-dir", "--repeat", "--fp32-reference"}
    drop_flags = {"--warm-cache-check", "--run_multiple_resolutions", "--run-multiple-resolutions"}
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop_with_value:
            skip = "=" not in a
            continue
        if key in drop_flags:
            # --run_multiple_resolutions takes an optional value
            if "=" not in a and i + 1 < len(argv) and argv[i + 1].isdigit():
                skip = True
            continue
        out.append(a)
    return [sys.executable, str(Path(__file__).resolve()), *out, "--warm-child", "--repeat", "0",
            "--fp32-reference", "never", "--cache-dir", str(args.cache_dir), "--output-json", str(out_json)]


def _ran_fp8() -> bool:
    """Whether a model nexfort compiled in this process runs fp8 linears (its counters' info)."""
    from nexfort_engine import counters

    return any(rec.get("fp8") for rec in counters.snapshot().get("models", {}).values())


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    cache_dir, cache_was_empty = _setup_cache_env(args)
    comfy_root = (args.comfy_root or default_comfy_root()).resolve()
    boot_comfy(comfy_root, args.device)
    import torch

    from benchmarks import metrics, models

    if args.quant_rows_form:
        from nexfort_engine import rowwise_quant

        rowwise_quant.gpu_form = args.quant_rows_form
    if args.rope_config:
        from nexfort_engine import rope

        rope.DEFAULT_CONFIG = tuple(int(v) for v in args.rope_config.split("x"))
    if args.no_ln_mod_quant:
        from nexfort_engine.passes import fuse_quant

        fuse_quant.take_ln_mod = False
    if args.no_fp8_stored:
        from nexfort_engine.passes import fp8_stored

        fp8_stored.enabled = False
    attention_experiment = None
    if args.attention_experiment:
        from benchmarks import split_d_attention

        name, _, cfg = args.attention_experiment.partition(":")
        if name != "split-d":
            raise SystemExit(f"--attention-experiment {name!r}: valid: split-d[:BMxBNxWARPSxSTAGES[xws][xf16][xlazy][xtma]]")
        try:
            config = split_d_attention.parse_config(cfg) if cfg else split_d_attention.DEFAULT_VARIANT
        except ValueError as exc:
            raise SystemExit(f"--attention-experiment: {exc}") from None
        modules = split_d_attention.install_in_comfy(config)
        attention_experiment = f"{name}:{split_d_attention.format_config(config)}"
        print(f"[bench] attention experiment {attention_experiment} in {', '.join(modules)}", flush=True)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (use --device cpu --tiny on CPU)")
    spec = models.get_spec(args.model, tiny=args.tiny)
    height = args.height or spec.height
    width = args.width or spec.width
    if spec.frames is None:
        args.frames = None
    elif args.frames is None:
        args.frames = spec.frames
    dtype, manual_cast = models.pick_dtypes(spec, device, args.dtype)
    runner = Runner(args, spec, device)

    result: dict[str, Any] = {
        "model": args.model,
        "title": spec.title,
        "tiny": args.tiny,
        "compiler": args.compiler,
        "compiler_config": args.compiler_config if args.compiler == "nexfort" else (
            '{"backend": "inductor"}' if args.compiler == "comfy" else None),
        "height": height,
        "width": width,
        "frames": args.frames,
        "batch": args.batch,
        "steps": args.steps,
        "controlnet_end_percent": args.controlnet,
        "controlnet_compiled": bool(args.compile_controlnet),
        "patch": args.patch,
        "attention_experiment": attention_experiment,
        "cfg": runner.cfg,
        "sampler": args.sampler,
        "scheduler": runner.scheduler,
        "dtype": str(dtype).replace("torch.", ""),
        "manual_cast": str(manual_cast).replace("torch.", "") if manual_cast is not None else None,
        "offload_device": args.offload_device,
        "weights_device": args.weights_device,
        "detected_as": None if args.tiny else models.check_detection(spec),
        "cache_dir": str(cache_dir),
        "cache_dir_was_empty": cache_was_empty,
    }
    if args.compiler == "nexfort":
        from nexfort_engine import parse_options, rope, rowwise_quant

        result["compiler_config_resolved"] = parse_options(args.compiler_config).to_dict()
        result["quant_rows_form"] = rowwise_quant.gpu_form
        result["ln_mod_quant"] = not args.no_ln_mod_quant
        result["fp8_stored"] = not args.no_fp8_stored
        result["rope_config"] = list(rope.DEFAULT_CONFIG)

    if args.compiler == "nexfort":
        # as in ComfyUI: the pack loads at startup, and its prewarm starts when the prompt arrives,
        # before the checkpoint loads (nodes/prewarm.py)
        load_pack()
        from nexfort_engine import prewarm

        if args.no_prewarm:
            os.environ[prewarm.ENV_PREWARM] = "0"
        prewarm.start(os.environ["NEXFORT_CACHE_DIR"])

    t0 = time.perf_counter()
    weights_device = torch.device("cpu") if args.weights_device == "cpu" else device
    mp = models.build(spec, device, dtype, manual_cast, seed=args.seed, weights_device=weights_device)
    if args.offload_device == "cpu":
        mp.offload_device = torch.device("cpu")
    metrics.sync(device)
    result["build_s"] = time.perf_counter() - t0
    print(f"built {args.model} (weights on {weights_device}) in {result['build_s']:.1f} s", file=sys.stderr, flush=True)
    result["params"] = sum(p.numel() for p in mp.model.diffusion_model.parameters())
    if args.controlnet is not None:  # before the float32 twin runs: the ControlNet in the model's dtype
        runner.controlnet = models.build_controlnet(spec, device, dtype, manual_cast)
        result["controlnet_params"] = sum(p.numel() for p in runner.controlnet.control_model.parameters())

    # float32 eager reference (same weights, upcast), freed before anything is measured
    ref32 = None
    if not args.warm_child and _fp32_affordable(spec, device, dtype, args.fp32_reference, args.compiler):
        if dtype == torch.float32:
            result["fp32_reference"] = "model already runs in float32"
        else:
            twin = models.build_fp32_twin(spec, device, mp)
            ref32, _ = runner.run(twin, height, width, args.steps)
            del twin
            import gc

            import comfy.model_management as mm

            mm.unload_all_models()
            gc.collect()
            mm.soft_empty_cache()
            result["fp32_reference"] = "eager float32, same weights"
    elif not args.warm_child:
        result["fp32_reference"] = "skipped" if args.fp32_reference == "never" or args.compiler == "none" else (
            "skipped (does not fit)")

    # eager at the model's dtype: the baseline (compiler none) or the same-seed reference
    eager_latent = None
    if not args.warm_child:
        metrics.reset_peak(device)
        eager_latent, m = runner.run(mp, height, width, args.steps)
        result["eager_warmup_s"] = m["e2e_s"]
        print(f"eager first sampling (with the load) {m['e2e_s']:.1f} s", file=sys.stderr, flush=True)
        if args.compiler == "none":
            result["warmup_s"] = m["e2e_s"]

    # FLOPs of one step, counted on the eager model before anything is compiled (outside all timing)
    if not args.warm_child:
        result.update(runner.count_flops(mp, height, width))

    # the compile node's own run (with "fp8_weights": rounding the e4m3 copies), before any sampling
    t_node = time.perf_counter()
    target = apply_compiler(mp, args.compiler, args.compiler_config)
    if args.compile_controlnet:
        if args.compiler != "nexfort" or runner.controlnet is None:
            raise SystemExit("--compile-controlnet needs --controlnet and --compiler nexfort")
        runner.controlnet = compile_controlnet(runner.controlnet, args.compiler_config)
    metrics.sync(device)
    result["compile_node_s"] = round(time.perf_counter() - t_node, 4)
    decoder = Decoder(args, mp, device) if args.vae_decode else None
    graphs0 = metrics.dynamo_unique_graphs()
    if args.compiler == "nexfort":
        import nexfort_engine

        nexfort_engine.reset_stats()

    if args.compiler != "none":
        if args.compiler == "nexfort":  # where the prewarm was when the first sampling started
            result["prewarm_at_first_call"] = prewarm.status()
        # first sampling through the compiled model: warm-up with compilation
        latent, m = runner.run(target, height, width, args.steps)
        result["warmup_s"] = m["e2e_s"]
        # where the warm-up went, read before the first decode (a compiled VAE compiles there)
        result["compile_phases_s"] = metrics.compile_phases()
        if decoder is not None:  # the first image: the first sampling, then its decode
            result["vae_first_decode_s"] = decoder(latent)
            result["first_image_s"] = m["e2e_s"] + result["vae_first_decode_s"]
        result["counts_after_warmup"] = metrics.compile_counts(args.compiler, graphs0)
        if args.compiler == "nexfort" and compiling_in_background():
            # "background": the warm-up ran eager while a child compiles; "static_first": it ran a
            # static graph compiled for its shape while a child compiles the dynamic one. Sample on
            # until the child is done (its graphs loaded, or ready in the cache for the next shape)
            rows = result["background_runs"] = background_samplings(runner, target, height, width, args, m, decoder)
            if "background" not in rows[-1]["states"].values():  # from the warm-up's start
                result["background_until_compiled_s"] = round(rows[-1]["start_s"] + rows[-1]["e2e_s"], 3)
    else:
        latent = eager_latent

    metrics.reset_peak(device)
    runs = []
    for _ in range(max(args.repeat, 0)):
        latent, m = runner.run(target, height, width, args.steps)
        runs.append(m)
    result["runs"] = runs
    result["it_s"] = metrics.median([r["it_s"] for r in runs])
    result["e2e_s"] = metrics.median([r["e2e_s"] for r in runs])
    result["host_ms_per_step"] = metrics.median([r.get("host_ms_per_step") for r in runs])
    result["peak_mem_gib"] = metrics.peak_gib(device) if runs else None
    if decoder is not None and latent is not None:  # the decode's own speed, after everything above
        result["vae_decode_ms"] = round(metrics.median([decoder(latent) for _ in range(3)]) * 1000, 2)
    result.update(metrics.compile_counts(args.compiler, graphs0))
    if args.compiler != "none":
        result["cudagraphs"] = metrics.cudagraph_state()
    if args.compiler == "nexfort":  # the GEMM algorithms measured per shape (gemm_tuning.py)
        st = nexfort_engine.stats()  # imported above, where the stats were reset
        result["gemm_tuning"] = st.get("gemm_tuning", {})
        result["tuned_linears"] = {k: m.get("tuned_linears", 0) for k, m in st.get("models", {}).items()}
    if not args.warm_child:
        # the device's measured matmul peak (after the timed runs: not in their peak memory)
        peak = metrics.device_peak(device)
        result["device_peak_tflops"] = peak["tflops"]
        result["device_peak_best_tflops"] = peak["best_tflops"]
        result["device_peak_method"] = {"op": "torch.mm n x n x n (fp8: torch._scaled_mm)", "n": peak["n"],
                                        "fp8_scaling": peak["fp8_scaling"], "statistic": "median block",
                                        **peak["timing"], "spread_tflops": peak["spread"]}
        result["peak_dtype"] = metrics.DTYPE_KEY.get(manual_cast or dtype)
        if args.compiler == "nexfort" and _ran_fp8():  # the GEMMs ran in fp8: their peak is the bound
            result["peak_dtype"] = "fp8"
        result.update(metrics.achieved(result.get("flops_per_step"), result["it_s"], peak["tflops"],
                                       result["peak_dtype"]))

    if latent is not None:
        result["latent_finite"] = bool(torch.isfinite(latent).all())
        result["latent_std"] = float(latent.float().std())
    if args.compiler != "none" and eager_latent is not None:
        result["err_vs_eager"] = metrics.latent_error(latent, eager_latent)
    if ref32 is not None and eager_latent is not None:
        result["eager_err_vs_fp32"] = metrics.latent_error(eager_latent, ref32)
        result["err_vs_fp32"] = metrics.latent_error(latent, ref32)
        e_eager = result["eager_err_vs_fp32"]["max_abs"]
        e_comp = result["err_vs_fp32"]["max_abs"]
        # the lossless claim: compiled error vs fp32 within 1.5x the eager-at-dtype error vs fp32
        result["lossless"] = bool(e_comp <= 1.5 * e_eager + 1e-6)

    # the optional stages below may be cut off by a time budget (SIGINT): keep what was measured
    try:
        if args.profile:
            result["profile"] = runner.profile(target, height, width, args.steps)
        if args.profile_host:
            result["profile_host"] = runner.profile_host(target, height, width, args.steps)
        if args.warm_cache_check:
            result["warmup_warm_cache_s"], result["warm_child"] = warm_cache_check(args)
        if args.run_multiple_resolutions:
            result["sweep"] = []
            sweep(args, spec, runner, target, graphs0, result["sweep"])
    except KeyboardInterrupt:
        result["interrupted"] = True
        print("interrupted: writing the results measured so far", file=sys.stderr, flush=True)
    return result


def compiling_in_background() -> bool:
    """Whether a model's compile runs in a child process ("background", "static_first")."""
    import nexfort_engine

    return any(m.get("state") == "background" for m in nexfort_engine.stats().get("models", {}).values())


def background_samplings(runner: Runner, target: Any, height: int, width: int, args: argparse.Namespace,
                         first: dict, decoder: Decoder | None = None) -> list[dict]:
    """``"background": true``: samplings after the warm-up until no model compiles in a child any
    more, each with its start time after the warm-up's start, wall time, it/s and the states (with
    ``--vae-decode``, each sampling's latent decoded after it, as a workflow would)."""
    import nexfort_engine
    from benchmarks import metrics

    def states() -> dict[str, str]:
        return {k: m.get("state", "") for k, m in nexfort_engine.stats().get("models", {}).items()}

    import torch

    t0 = time.perf_counter() - first["e2e_s"]
    device = torch.device(args.device)
    rows = [{"start_s": 0.0, "e2e_s": first["e2e_s"], "it_s": first.get("it_s"), "states": states(),
             "peak_gib": metrics.peak_gib(device), "device_used_gib": metrics.device_used_gib(device)}]
    while "background" in rows[-1]["states"].values() and time.perf_counter() - t0 < args.background_wait:
        start = time.perf_counter() - t0
        metrics.reset_peak(device)
        lat, m = runner.run(target, height, width, args.steps)
        decode_s = decoder(lat) if decoder is not None else None
        rows.append({"start_s": round(start, 3), "e2e_s": m["e2e_s"], "it_s": m.get("it_s"), "states": states(),
                     "decode_s": decode_s,
                     # the device's and the host's median step: which of the two a compile beside it slows
                     "step_ms_median": metrics.median(m.get("step_ms") or []),
                     "host_step_ms_median": metrics.median(m.get("host_step_ms") or []),
                     "gc_ms": m.get("gc_ms"), "host_copy_wait_ms": m.get("host_copy_wait_ms"),
                     "cudagraph_replays": m.get("cudagraph_replays"), "cudagraph_records": m.get("cudagraph_records"),
                     "cudagraph_warmups": m.get("cudagraph_warmups"),
                     # this process's peak over the sampling, and the device's use with the child on it
                     "peak_gib": metrics.peak_gib(device), "device_used_gib": metrics.device_used_gib(device)})
        print(f"background: sampling at {start:.1f}s took {m['e2e_s']:.2f}s ({m.get('it_s') or 0:.2f} it/s), "
              f"states {rows[-1]['states']}", flush=True)
    return rows


def sweep(args: argparse.Namespace, spec: Any, runner: Runner, target: Any, graphs0: int, rows: list[dict]) -> None:
    """4 resolutions x 2 step counts x 2 prompt lengths; recompiles counted per combination."""
    import torch

    from benchmarks import metrics

    step_counts = (args.steps, max(args.steps // 2, 2))
    device = torch.device(args.device)
    for h, w in spec.sweep_resolutions:
        for steps in step_counts:
            for text_len in spec.sweep_text_lens:
                before = metrics.compile_counts(args.compiler, graphs0)
                metrics.reset_peak(device)
                _, first = runner.run(target, h, w, steps, text_len)
                _, again = runner.run(target, h, w, steps, text_len)
                after = metrics.compile_counts(args.compiler, graphs0)
                rows.append({
                    "height": h, "width": w, "steps": steps, "text_len": text_len,
                    "first_s": first["e2e_s"], "e2e_s": again["e2e_s"], "it_s": again["it_s"],
                    "new_compiles": after["compiles"] - before["compiles"],
                    "fallbacks": after.get("fallbacks", 0) - before.get("fallbacks", 0),
                    # peak over both samplings; what the allocator holds after (CUDA-graph pools too)
                    "peak_gib": metrics.peak_gib(device), "reserved_gib": metrics.reserved_gib(device),
                })
                new_reasons = list(after.get("recompile_reasons") or [])[len(before.get("recompile_reasons") or []):]
                if new_reasons:  # why a combination compiled again (guard failures, as counted)
                    rows[-1]["recompile_reasons"] = [str(r)[:2000] for r in new_reasons]
                print(f"sweep {w}x{h} steps={steps} text={text_len}: first {first['e2e_s']:.2f}s, "
                      f"{again['it_s'] or 0:.2f} it/s, new compiles {rows[-1]['new_compiles']}", flush=True)


def warm_cache_check(args: argparse.Namespace) -> tuple[float | None, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        argv = _child_argv(args, out)
        print("warm-cache check: " + " ".join(argv), flush=True)
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            return None, {"rc": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
        child = json.loads(out.read_text())["runs"][0]
    keep = ("warmup_s", "compile_node_s", "compile_phases_s", "compiles", "recompiles", "fallbacks", "cache_hits", "cache_misses",
            "cache_dir_was_empty", "prewarm_at_first_call", "recompile_reasons", "static_first", "background",
            "precompiled_first_call")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("nexfort:")]
    return child.get("warmup_s"), {**{k: child.get(k) for k in keep}, "nexfort_log": lines[-40:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    result = benchmark(args)
    result["wall_s"] = time.perf_counter() - t0
    import torch

    doc = {
        "schema": SCHEMA,
        "env": environment(torch.device(args.device)),
        "argv": sys.argv[1:] if argv is None else argv,
        "runs": [result],
    }
    text = json.dumps(doc, indent=2, default=str)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text)
    from benchmarks import report

    md = report.render([doc])
    if args.output_markdown:
        args.output_markdown.parent.mkdir(parents=True, exist_ok=True)
        args.output_markdown.write_text(md)
    if not args.warm_child:
        print(md)
        print(report.one_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
