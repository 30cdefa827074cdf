"""Make nexfort's embedded default model: a tiny, random-weight SD1.5 checkpoint.

Nothing is downloaded. The checkpoint is built from ComfyUI's own model classes with a fixed seed,
so every machine produces the same file, and it is in the ordinary SD1.5 single-file format that
ComfyUI's ``CheckpointLoaderSimple`` detects:

* UNet: SD1.5's detection keys (``model_channels=320``, ``context_dim=768``, no ADM, conv proj) but
  one level deep (``channel_mult=[1]``, one res block, one transformer block): ~26M parameters.
* Text encoder: the full CLIP-L text model (ComfyUI builds CLIP-L from a fixed config, so the shapes
  must be the real ones), random weights.
* VAE: TAESD-keyed (``first_stage_model.taesd_*``), ~2.4M parameters, 8x downscale, 4 channels.

ComfyUI's ``comfy.ops`` layers are created with ``torch.empty`` and their ``reset_parameters`` is a
no-op, so every parameter is first filled with NaN, then initialised through the plain ``torch.nn``
initialiser of its layer class; anything still NaN afterwards gets an explicit init. The result is
checked to be finite before it is written (fp16, ~300 MB) atomically next to its final path.

Use as a function (``ensure_tiny_checkpoint(host)``) or a CLI::

    python scripts/tiny_checkpoint.py --host .host/ComfyUI [--verify] [--force]

Building imports ComfyUI into the calling process (sys.path, CLI args); callers that must stay clean
(the demo, the test fixtures) run the CLI in a subprocess. ``is_valid()`` only reads the header.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

CHECKPOINT_NAME = "nexfort-tiny-sd15.safetensors"
FORMAT_VERSION = "1"
SEED = 20261122
METADATA_KEY = "nexfort.tiny_checkpoint"

UNET_CONFIG = {
    "use_checkpoint": False,
    "image_size": 32,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "adm_in_channels": None,
    "in_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [1],
    "transformer_depth": [1],
    "transformer_depth_output": [1, 1],
    "channel_mult": [1],
    "transformer_depth_middle": 1,
    "use_linear_in_transformer": False,
    "context_dim": 768,
    "num_heads": 8,
    "num_head_channels": -1,
    "use_temporal_resblock": False,
    "use_temporal_attention": False,
    "dims": 2,
    "num_classes": None,
}

# Keys whose presence (with these leading dims) makes a file "ours and complete".
_REQUIRED_KEYS = (
    "model.diffusion_model.input_blocks.0.0.weight",
    "model.diffusion_model.out.2.weight",
    "cond_stage_model.transformer.text_model.final_layer_norm.weight",
    "cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc2.weight",
    "first_stage_model.taesd_decoder.1.weight",
    "first_stage_model.taesd_encoder.0.weight",
)


def default_path(host: str | os.PathLike) -> Path:
    """Where the checkpoint lives inside a ComfyUI tree (or base directory)."""
    return Path(host) / "models" / "checkpoints" / CHECKPOINT_NAME


def read_header(path: str | os.PathLike) -> tuple[dict[str, str], set[str]] | None:
    """(metadata, tensor names) of a safetensors file, or ``None`` when it is missing, truncated or
    not safetensors: the header check every generated model file's ``is_valid`` makes."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, set(f.keys())
    except Exception:  # noqa: BLE001 - missing, truncated or foreign file: not ours
        return None


def is_valid(path: str | os.PathLike) -> bool:
    """True when ``path`` is a complete checkpoint written by this module (header check only)."""
    path = Path(path)
    header = read_header(path) if path.is_file() else None
    if header is None:
        return False
    meta, keys = header
    return meta.get(METADATA_KEY) == FORMAT_VERSION and all(k in keys for k in _REQUIRED_KEYS)


def bootstrap_comfy(host: str | os.PathLike) -> None:
    """Make ComfyUI's modules importable in this process, on CPU, with SDPA attention."""
    host = str(Path(host).resolve())
    if host not in sys.path:
        sys.path.insert(0, host)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.use_pytorch_cross_attention = True
    import torch

    torch.set_grad_enabled(False)
    import comfy.model_management  # noqa: F401
    import utils.install_util  # noqa: F401  (before nodes: see HOST.md)


def _torch_reset(module) -> bool:
    """Call the plain torch.nn initialiser of ``module``'s class (comfy.ops disables its own)."""
    import torch

    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn") and "reset_parameters" in cls.__dict__:
            cls.reset_parameters(module)
            return True
        if cls is torch.nn.Module:
            break
    return False


def _init_random(root) -> None:
    """Deterministically initialise every parameter of ``root``; no uninitialised memory survives."""
    import torch

    with torch.no_grad():
        for p in root.parameters():
            p.fill_(float("nan"))
        for m in root.modules():
            _torch_reset(m)
        for name, p in root.named_parameters():
            if not torch.isnan(p).any():
                continue
            if name.endswith("logit_scale"):
                p.fill_(4.6055)
            elif name.endswith("vae_scale"):
                p.fill_(1.0)
            elif name.endswith("vae_shift"):
                p.fill_(0.0)
            elif p.ndim >= 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                p.zero_()


def build_state_dict():
    """Return ``(state_dict, metadata)`` of the tiny SD1.5 checkpoint (needs bootstrap_comfy)."""
    import comfy.sd1_clip
    import comfy.supported_models
    import comfy.taesd.taesd
    import torch

    torch.manual_seed(SEED)
    model_config = comfy.supported_models.SD15(dict(UNET_CONFIG))
    model = model_config.get_model({})
    _init_random(model.diffusion_model)

    clip = comfy.sd1_clip.SD1ClipModel(device="cpu", dtype=torch.float32)
    _init_random(clip)

    vae = comfy.taesd.taesd.TAESD(latent_channels=4)
    _init_random(vae)

    # newer ComfyUI takes the UNet's state dict first (0.3.75 reads it from the model itself)
    parts = {"clip_state_dict": clip.state_dict(), "vae_state_dict": vae.state_dict()}
    if "unet_state_dict" in inspect.signature(model.state_dict_for_saving).parameters:
        parts["unet_state_dict"] = model.diffusion_model.state_dict()
    sd = model.state_dict_for_saving(**parts)
    out = {}
    for k, t in sd.items():
        if not torch.is_tensor(t):
            continue
        if not torch.isfinite(t).all():
            raise RuntimeError(f"tiny checkpoint: tensor {k} is not finite after init")
        if t.is_floating_point():
            t = t.to(torch.float16)
        out[k] = t.contiguous()
    metadata = {METADATA_KEY: FORMAT_VERSION, "nexfort.seed": str(SEED), "modelspec.architecture": "sd1.5"}
    return out, metadata


def write_checkpoint(path: str | os.PathLike) -> Path:
    """Build and write the checkpoint atomically (temp file in the same dir, then rename)."""
    sd, metadata = build_state_dict()
    return save_safetensors_atomic(sd, metadata, path)


def save_safetensors_atomic(sd: dict, metadata: dict, path: str | os.PathLike) -> Path:
    """Write a safetensors file so readers see the old file or the whole new one (temp + rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(sd, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def ensure_tiny_checkpoint(host: str | os.PathLike, path: str | os.PathLike | None = None,
                           force: bool = False) -> Path:
    """Return the checkpoint path, building it first unless a valid one is already there.

    Building imports ComfyUI from ``host`` into this process; use the CLI in a subprocess where that
    matters.
    """
    path = Path(path) if path else default_path(host)
    if not force and is_valid(path):
        return path
    bootstrap_comfy(host)
    return write_checkpoint(path)


def verify(host: str | os.PathLike, path: str | os.PathLike, steps: int = 4, size: int = 64) -> dict:
    """Load ``path`` through ComfyUI's real loader and run text-encode, sample, decode on CPU.

    Returns a small report; raises if the model is not detected as SD1.5 or an output is not finite.
    """
    bootstrap_comfy(host)
    import comfy.sample
    import comfy.sd
    import comfy.supported_models
    import torch

    t0 = time.perf_counter()
    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=True)
    t_load = time.perf_counter() - t0
    cfg = model.model.model_config
    if type(cfg) is not comfy.supported_models.SD15:
        raise RuntimeError(f"checkpoint detected as {type(cfg).__name__}, expected SD15")

    def encode(text):
        tokens = clip.tokenize(text)
        return clip.encode_from_tokens_scheduled(tokens)

    pos, neg = encode("a tiny test image"), encode("")
    for c in pos + neg:
        if not torch.isfinite(c[0]).all():
            raise RuntimeError("text encoder output is not finite")
    latent = torch.zeros(1, 4, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, 0)
    t0 = time.perf_counter()
    samples = comfy.sample.sample(model, noise, steps, 3.0, "euler", "normal", pos, neg, latent, seed=0)
    t_sample = time.perf_counter() - t0
    image = vae.decode(samples)
    if not (torch.isfinite(samples).all() and torch.isfinite(image).all()):
        raise RuntimeError("sampled latent or decoded image is not finite")
    n_unet = sum(p.numel() for p in model.model.diffusion_model.parameters())
    return {
        "arch": type(cfg).__name__,
        "unet_params": n_unet,
        "image_shape": tuple(image.shape),
        "load_s": round(t_load, 2),
        "sample_s": round(t_sample, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default=os.environ.get("NEXFORT_HOST", ".host/ComfyUI"),
                    help="ComfyUI tree (default: $NEXFORT_HOST or .host/ComfyUI)")
    ap.add_argument("--output", default=None, help=f"file to write (default: <host>/models/checkpoints/{CHECKPOINT_NAME})")
    ap.add_argument("--force", action="store_true", help="rebuild even if a valid file exists")
    ap.add_argument("--verify", action="store_true", help="load through ComfyUI's loader and sample once")
    args = ap.parse_args(argv)

    path = Path(args.output) if args.output else default_path(args.host)
    if not args.force and is_valid(path):
        print(f"tiny checkpoint: present and valid: {path}")
    else:
        t0 = time.perf_counter()
        ensure_tiny_checkpoint(args.host, path, force=True)
        print(f"tiny checkpoint: wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - t0:.1f} s")
    if args.verify:
        print(f"tiny checkpoint: verified {verify(args.host, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
