"""Write a random-weight SDXL base checkpoint at real size, and a random LoRA for it.

Nothing is downloaded. The checkpoint is built from ComfyUI's own modules, so its keys are the ones
ComfyUI's ``CheckpointLoaderSimple`` detects as SDXL and loads without missing keys:

* UNet: ``comfy.supported_models.SDXL`` with SDXL base 1.0's ``unet_config``
  (``benchmarks/models.py``), ``model.diffusion_model.*``, 2.6 B parameters;
* text encoders: ``comfy.sdxl_clip.SDXLClipModel`` (CLIP-L and OpenCLIP bigG), saved through
  ``SDXL.process_clip_state_dict_for_saving``: ``conditioner.embedders.0.transformer.*`` and
  ``conditioner.embedders.1.model.*`` (bigG's attention as ``in_proj_weight``);
* VAE: ``comfy.ldm.models.autoencoder.AutoencoderKL`` with SD's default ``ddconfig``,
  ``first_stage_model.*``.

``model.state_dict_for_saving`` (what ComfyUI's own *CheckpointSave* calls) assembles the prefixes.
Weights are fp16 (as released), drawn with ``benchmarks.models.init_weights`` (N(0, 1/fan_in)
matrices, unit norm scales) on the GPU where there is one: the model is built on that device and
written tensor by tensor (each copied to the host on its own), so the host never holds the whole
checkpoint; the file (6.9 GB) is written next to its final path and renamed when complete.

The LoRA is ``scripts/tiny_lora.py``'s kohya-format LoRA (``lora_unet_<ComfyUI module path>``) for
every attention and feed-forward projection of the checkpoint's transformer blocks, read from its
header; ``LoraLoader`` and ``LoraLoaderModelOnly`` apply it to the UNet.

``--tiny``: the embedded tiny SD1.5 checkpoint and LoRA (``scripts/tiny_checkpoint.py``,
``scripts/tiny_lora.py``) instead, for CPU tests; SDXL's detection needs the full depth, so there
is no smaller SDXL. CLI::

    python scripts/random_checkpoint.py --host $COMFY [--device auto|cuda|cpu] [--output FILE]
        [--lora FILE] [--lora-rank 16] [--force] [--verify] [--tiny]

Prints the two paths. ``is_valid`` reads the header only; a valid file is not rewritten.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import struct
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS.parent
for _p in (str(SCRIPTS), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import tiny_checkpoint  # noqa: E402
import tiny_lora  # noqa: E402

log = logging.getLogger("random_checkpoint")

CHECKPOINT_NAME = "nexfort-random-sdxl.safetensors"
LORA_NAME = "nexfort-random-sdxl-lora.safetensors"
FORMAT_VERSION = "1"
METADATA_KEY = "nexfort.random_checkpoint"
SEED = 20261207

#: SD's default VAE (comfy/sd.py, ``VAE.__init__``: the SD1.x/SD2.x/SDXL branch)
VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}

# Keys whose presence makes a file "ours and complete" (with the metadata key).
_REQUIRED_KEYS = (
    "model.diffusion_model.input_blocks.0.0.weight",
    "model.diffusion_model.label_emb.0.0.weight",
    "model.diffusion_model.output_blocks.2.2.conv.weight",
    "model.diffusion_model.out.2.weight",
    "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
    "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight",
    "conditioner.embedders.1.model.text_projection",
    "first_stage_model.decoder.conv_out.weight",
    "first_stage_model.post_quant_conv.weight",
)

#: safetensors dtype names
_ST_DTYPES = {
    "torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
    "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8", "torch.uint8": "U8",
    "torch.bool": "BOOL", "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2",
}


def default_path(host: str | os.PathLike) -> Path:
    return Path(host) / "models" / "checkpoints" / CHECKPOINT_NAME


def default_lora_path(checkpoint: str | os.PathLike, name: str = LORA_NAME) -> Path:
    """``<models>/loras/<name>`` next to ``<models>/checkpoints/<checkpoint>``."""
    return Path(checkpoint).resolve().parent.parent / "loras" / name


def is_valid(path: str | os.PathLike) -> bool:
    """True when ``path`` is a complete checkpoint written by this module (header check only)."""
    path = Path(path)
    header = tiny_checkpoint.read_header(path) if path.is_file() else None
    if header is None:
        return False
    meta, keys = header
    return meta.get(METADATA_KEY) == FORMAT_VERSION and all(k in keys for k in _REQUIRED_KEYS)


def write_safetensors_streaming(tensors: Mapping[str, Any], path: str | os.PathLike,
                                metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (on any device) as a safetensors file, one tensor at a time.

    ``safetensors.torch.save_file`` turns every tensor into host bytes before it writes (the whole
    checkpoint in host memory, twice at its peak); here the header is computed from the shapes and
    each tensor is copied to the host, written and dropped in turn. Larger elements first, so every
    tensor's offset is aligned to its element size (the header is padded to 8 bytes, as
    safetensors pads it). Atomic: a temp file in the same directory, renamed when complete.
    """
    import torch

    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, t in items:
        dtype = _ST_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _name, t in items:
                host = t.detach().to("cpu").contiguous().reshape(-1)
                if host.numel():
                    f.write(host.view(torch.uint8).numpy().data)
                del host
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def bootstrap_comfy(host: str | os.PathLike, cpu: bool) -> None:
    """ComfyUI's modules importable in this process (``--cpu`` only where we draw on the CPU)."""
    host = str(Path(host).resolve())
    if host not in sys.path:
        sys.path.insert(0, host)
    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    comfy.cli_args.args.use_pytorch_cross_attention = True
    import torch

    torch.set_grad_enabled(False)
    import comfy.model_management  # noqa: F401
    import utils.install_util  # noqa: F401  (before nodes: see HOST.md)


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("random_checkpoint: --device cuda but torch sees no CUDA device")
    return name


def build_state_dict(device: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``(state_dict, metadata)`` of the random SDXL checkpoint, its tensors on ``device`` (fp16).

    Needs :func:`bootstrap_comfy`. Tensors are the modules' own (no copies) except where ComfyUI's
    saving converts them (bigG's attention projections are concatenated).
    """
    import inspect

    import comfy.sdxl_clip
    import comfy.supported_models
    import torch
    from comfy.ldm.models.autoencoder import AutoencoderKL

    from benchmarks.models import FULL, init_weights

    dev = torch.device(device)
    dtype = torch.float16
    spec = FULL["sdxl"]
    model_config = comfy.supported_models.SDXL(dict(spec.unet_config))
    model_config.set_inference_dtype(dtype, None)
    t0 = time.perf_counter()
    model = model_config.get_model({}, "", device=dev)
    model = model.to(device=dev)  # a few parameters are created on the CPU
    init_weights(model.diffusion_model, SEED)
    log.info("UNet: %.2f B parameters in %.1f s", sum(p.numel() for p in model.diffusion_model.parameters()) / 1e9,
             time.perf_counter() - t0)

    t0 = time.perf_counter()
    clip = comfy.sdxl_clip.SDXLClipModel(device=dev, dtype=dtype)
    clip = clip.to(device=dev)
    init_weights(clip, SEED + 1)
    with torch.no_grad():  # CLIP's own values where ComfyUI reads them
        for name, p in clip.named_parameters():
            if name.endswith("logit_scale"):
                p.fill_(4.6055)
    log.info("CLIP-L + bigG: %.2f B parameters in %.1f s", sum(p.numel() for p in clip.parameters()) / 1e9,
             time.perf_counter() - t0)

    t0 = time.perf_counter()
    vae = AutoencoderKL(ddconfig=dict(VAE_DDCONFIG), embed_dim=4)
    vae = vae.to(device=dev, dtype=dtype)
    init_weights(vae, SEED + 2)
    log.info("VAE: %.0f M parameters in %.1f s", sum(p.numel() for p in vae.parameters()) / 1e6, time.perf_counter() - t0)

    parts: dict[str, Any] = {"clip_state_dict": clip.state_dict(), "vae_state_dict": vae.state_dict()}
    if "unet_state_dict" in inspect.signature(model.state_dict_for_saving).parameters:  # newer ComfyUI
        parts["unet_state_dict"] = model.diffusion_model.state_dict()
    sd = model.state_dict_for_saving(**parts)
    out: dict[str, Any] = {}
    for k, t in sd.items():
        if not torch.is_tensor(t):
            continue
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out[k] = t
    bad = [k for k, t in out.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise RuntimeError(f"random checkpoint: {len(bad)} tensors are not finite after init, e.g. {bad[:3]}")
    metadata = {METADATA_KEY: FORMAT_VERSION, "nexfort.seed": str(SEED), "modelspec.architecture":
                "stable-diffusion-xl-v1-base", "nexfort.note": "random weights (benchmarks only)"}
    return out, metadata


def write_checkpoint(path: str | os.PathLike, device: str) -> Path:
    sd, metadata = build_state_dict(device)
    t0 = time.perf_counter()
    out = write_safetensors_streaming(sd, path, metadata)
    log.info("wrote %s (%.2f GB) in %.1f s", out, out.stat().st_size / 1e9, time.perf_counter() - t0)
    return out


def ensure_checkpoint(host: str | os.PathLike, path: str | os.PathLike | None = None, device: str = "auto",
                      force: bool = False) -> Path:
    """The SDXL checkpoint's path, building it first unless a valid one is there (imports ComfyUI)."""
    path = Path(path) if path else default_path(host)
    if not force and is_valid(path):
        return path
    import torch

    dev = pick_device(device)
    bootstrap_comfy(host, cpu=dev == "cpu" or not torch.cuda.is_available())
    return write_checkpoint(path, dev)


def ensure_lora(checkpoint: str | os.PathLike, output: str | os.PathLike | None = None, rank: int = 16,
                force: bool = False, name: str = LORA_NAME) -> Path:
    """A kohya-format LoRA for every transformer projection of ``checkpoint``'s UNet (no ComfyUI)."""
    return tiny_lora.ensure_tiny_lora(checkpoint, output or default_lora_path(checkpoint, name), rank=rank,
                                      seed=7, scale=0.5, force=force)


def verify(host: str | os.PathLike, path: str | os.PathLike, lora: str | os.PathLike | None = None,
           steps: int = 1, size: int = 64) -> dict[str, Any]:
    """Load ``path`` through ComfyUI's loader (and ``lora`` through its LoRA loader), encode a prompt,
    sample and decode a small image; raises where the model is not detected as SDXL, a key is
    missing or unexpected, the LoRA patches nothing or an output is not finite."""
    import torch

    if "comfy.model_management" not in sys.modules:
        bootstrap_comfy(host, cpu=not torch.cuda.is_available())
    import comfy.cli_args
    import comfy.sample
    import comfy.sd
    import comfy.supported_models
    import comfy.utils

    if not torch.cuda.is_available() and is_valid(path):
        # full size on the CPU: bf16 weights (ComfyUI's CPU default, fp32, would take 13 GB)
        comfy.cli_args.args.bf16_unet = True
        comfy.cli_args.args.bf16_vae = True

    messages: list[str] = []

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(f"{record.levelname}: {record.getMessage()}")

    root = logging.getLogger()
    grab, level = _Grab(level=logging.DEBUG), root.level
    root.addHandler(grab)
    root.setLevel(logging.DEBUG)
    try:
        t0 = time.perf_counter()
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=True)
        t_load = time.perf_counter() - t0
        lora_keys = 0
        if lora is not None:
            lora_sd = comfy.utils.load_torch_file(str(lora), safe_load=True)
            model2, _clip2 = comfy.sd.load_lora_for_models(model, clip, lora_sd, 0.8, 0.0)
            lora_keys = len(model2.patches)
            if not lora_keys:
                raise RuntimeError(f"LoRA {lora} patched no weight of the model")
            model = model2
    finally:
        root.removeHandler(grab)
        root.setLevel(level)
    cfg = model.model.model_config
    bad = [m for m in messages if m.startswith("WARNING") and any(
        w in m.lower() for w in ("missing", "unexpected", "lora key not loaded"))]
    leftover = [m[:300] for m in messages if "left over keys" in m.lower() or "leftover vae keys" in m.lower()]
    if tiny_checkpoint.METADATA_KEY not in (_metadata(path) or {}) and type(cfg) is not comfy.supported_models.SDXL:
        raise RuntimeError(f"checkpoint detected as {type(cfg).__name__}, expected SDXL")
    if bad:
        raise RuntimeError("ComfyUI's loader reported: " + " | ".join(m[:300] for m in bad))
    pos = clip.encode_from_tokens_scheduled(clip.tokenize("a lighthouse on a cliff"))
    neg = clip.encode_from_tokens_scheduled(clip.tokenize(""))
    latent = torch.zeros(1, 4, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, 0)
    t0 = time.perf_counter()
    samples = comfy.sample.sample(model, noise, steps, 5.0, "euler", "normal", pos, neg, latent, seed=0)
    t_sample = time.perf_counter() - t0
    image = vae.decode(samples)
    if not (torch.isfinite(samples).all() and torch.isfinite(image).all()):
        raise RuntimeError("sampled latent or decoded image is not finite")
    return {"arch": type(cfg).__name__, "unet_params": sum(p.numel() for p in model.model.diffusion_model.parameters()),
            "lora_patched_weights": lora_keys, "left_over": leftover, "image_shape": tuple(image.shape), "load_s": round(t_load, 1),
            "sample_s": round(t_sample, 1)}


def _metadata(path: str | os.PathLike) -> dict[str, str] | None:
    header = tiny_checkpoint.read_header(path)
    return None if header is None else header[0]


def ensure_tiny(host: str | os.PathLike, output: str | os.PathLike | None = None,
                lora: str | os.PathLike | None = None, force: bool = False) -> tuple[Path, Path]:
    """The tiny SD1.5 checkpoint (built in a subprocess: ComfyUI stays out of this one) and its LoRA."""
    import subprocess

    path = Path(output) if output else tiny_checkpoint.default_path(host)
    if force or not tiny_checkpoint.is_valid(path):
        cmd = [sys.executable, str(SCRIPTS / "tiny_checkpoint.py"), "--host", str(host), "--output", str(path)]
        if force:
            cmd.append("--force")
        subprocess.run(cmd, check=True)
    lora_path = tiny_lora.ensure_tiny_lora(path, lora or tiny_lora.default_path(path), force=force)
    return path, lora_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default=os.environ.get("COMFY") or os.environ.get("NEXFORT_HOST") or ".host/ComfyUI",
                    help="ComfyUI tree (default: $COMFY, $NEXFORT_HOST or .host/ComfyUI)")
    ap.add_argument("--output", default=None, help=f"checkpoint file (default: <host>/models/checkpoints/{CHECKPOINT_NAME})")
    ap.add_argument("--lora", default=None, help=f"LoRA file (default: <models>/loras/{LORA_NAME})")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--no-lora", action="store_true", help="the checkpoint only")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where the weights are drawn")
    ap.add_argument("--tiny", action="store_true", help="the tiny SD1.5 checkpoint and LoRA (CPU tests)")
    ap.add_argument("--force", action="store_true", help="rebuild even if valid files exist")
    ap.add_argument("--verify", action="store_true",
                    help="load both through ComfyUI's loaders and sample a 64x64 image (1 step)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="random_checkpoint: %(message)s")
    for handler in logging.getLogger().handlers:  # verify() reads ComfyUI's debug messages, not this console
        handler.setLevel(logging.INFO)

    t0 = time.perf_counter()
    if args.tiny:
        path, lora = ensure_tiny(args.host, args.output, args.lora, force=args.force)
    else:
        path = Path(args.output) if args.output else default_path(args.host)
        if not args.force and is_valid(path):
            print(f"random checkpoint: present and valid: {path}")
        else:
            ensure_checkpoint(args.host, path, args.device, force=True)
        lora = None if args.no_lora else ensure_lora(path, args.lora, rank=args.lora_rank, force=args.force)
    print(f"checkpoint: {path} ({path.stat().st_size / 1e9:.2f} GB)")
    if lora is not None:
        print(f"lora: {lora} ({lora.stat().st_size / 1e6:.1f} MB)")
    print(f"ready in {time.perf_counter() - t0:.1f} s")
    if args.verify:
        print(f"verified: {verify(args.host, path, lora, size=64)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
