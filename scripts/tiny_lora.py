"""Make a tiny, random LoRA for nexfort's tiny SD1.5 checkpoint, in ComfyUI's (kohya) LoRA key format.

Nothing is downloaded and ComfyUI is not imported: the UNet's linear layers are read from the
checkpoint's safetensors header, and for each attention / feed-forward projection of its
transformer blocks the LoRA holds::

    lora_unet_<module path with '.' -> '_'>.lora_down.weight   [rank, in]
    lora_unet_<module path with '.' -> '_'>.lora_up.weight     [out, rank]
    lora_unet_<module path with '.' -> '_'>.alpha              scalar (= rank: scale 1)

which is what ``comfy.lora.model_lora_keys_unet`` maps back to ``diffusion_model.<path>.weight``,
so ``LoraLoader`` applies it like any SD1.5 LoRA. UNet only: ``strength_clip`` has no effect.

The delta ``up @ down`` is drawn from a fixed seed with a standard deviation of about
``scale / sqrt(in)`` per entry — comparable to the weights themselves at ``scale=0.5`` — so a
strength change visibly changes the image (the reliability tests assert that it does).

Use as a function (``ensure_tiny_lora(checkpoint, output)``) or a CLI::

    python scripts/tiny_lora.py --checkpoint .host/ComfyUI/models/checkpoints/nexfort-tiny-sd15.safetensors \
        [--output <loras dir>/nexfort-tiny-sd15-lora.safetensors] [--rank 4] [--seed 7] [--scale 0.5] [--force]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tiny_checkpoint import save_safetensors_atomic  # scripts/ is on sys.path (run or imported)

LORA_NAME = "nexfort-tiny-sd15-lora.safetensors"
FORMAT_VERSION = "1"
METADATA_KEY = "nexfort.tiny_lora"
UNET_PREFIX = "model.diffusion_model."
#: projections (by the last parts of their module path) that get a LoRA
TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
           "ff.net.0.proj", "ff.net.2")


def default_path(checkpoint: str | os.PathLike) -> Path:
    """``<models>/loras/<LORA_NAME>`` next to ``<models>/checkpoints/<checkpoint>``."""
    return Path(checkpoint).resolve().parent.parent / "loras" / LORA_NAME


def target_shapes(checkpoint: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """UNet module path (without ``.weight``) -> (out, in) of every targeted linear layer."""
    from safetensors import safe_open

    shapes = {}
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in f.keys():
            if not (key.startswith(UNET_PREFIX) and key.endswith(".weight")):
                continue
            module = key[len(UNET_PREFIX):-len(".weight")]
            if not any(module.endswith(t) for t in TARGETS):
                continue
            shape = tuple(f.get_slice(key).get_shape())
            if len(shape) == 2:
                shapes[module] = (int(shape[0]), int(shape[1]))
    if not shapes:
        raise ValueError(f"{checkpoint} has no SD1.5 UNet transformer projections ({UNET_PREFIX}*.{TARGETS[0]}.weight); "
                         "build it with scripts/tiny_checkpoint.py")
    return dict(sorted(shapes.items()))


def build_lora(checkpoint: str | os.PathLike, rank: int = 4, seed: int = 7, scale: float = 0.5):
    """Return ``(state_dict, metadata)`` of the LoRA for ``checkpoint``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for module, (out_dim, in_dim) in target_shapes(checkpoint).items():
        name = "lora_unet_" + module.replace(".", "_")
        down = torch.randn(rank, in_dim, generator=gen) / in_dim ** 0.5
        up = torch.randn(out_dim, rank, generator=gen) * (scale / rank ** 0.5)
        sd[f"{name}.lora_down.weight"] = down.to(torch.float16).contiguous()
        sd[f"{name}.lora_up.weight"] = up.to(torch.float16).contiguous()
        sd[f"{name}.alpha"] = torch.tensor(float(rank))
    metadata = {METADATA_KEY: FORMAT_VERSION, "nexfort.seed": str(seed), "nexfort.rank": str(rank),
                "nexfort.scale": str(scale), "ss_network_dim": str(rank), "ss_network_alpha": str(rank)}
    return sd, metadata


def is_valid(path: str | os.PathLike, seed: int | None = None) -> bool:
    """True when ``path`` is a complete LoRA written by this module (header check only)."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            n = len(list(f.keys()))
    except Exception:  # noqa: BLE001 - missing, truncated or foreign file: not ours
        return False
    return meta.get(METADATA_KEY) == FORMAT_VERSION and n > 0 and (seed is None or meta.get("nexfort.seed") == str(seed))


def ensure_tiny_lora(checkpoint: str | os.PathLike, output: str | os.PathLike | None = None, *, rank: int = 4,
                     seed: int = 7, scale: float = 0.5, force: bool = False) -> Path:
    """Write the LoRA atomically (temp file + rename) unless a valid one with ``seed`` is there."""
    path = Path(output) if output else default_path(checkpoint)
    if not force and is_valid(path, seed):
        return path
    sd, metadata = build_lora(checkpoint, rank=rank, seed=seed, scale=scale)
    return save_safetensors_atomic(sd, metadata, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    host = os.environ.get("NEXFORT_HOST", ".host/ComfyUI")
    ap.add_argument("--checkpoint", default=str(Path(host) / "models" / "checkpoints" / "nexfort-tiny-sd15.safetensors"),
                    help="the tiny SD1.5 checkpoint (scripts/tiny_checkpoint.py) whose UNet the LoRA targets")
    ap.add_argument("--output", default=None, help=f"file to write (default: <models>/loras/{LORA_NAME})")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scale", type=float, default=0.5, help="size of the delta relative to the weights")
    ap.add_argument("--force", action="store_true", help="rewrite even if a valid file exists")
    args = ap.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        print(f"tiny LoRA: no checkpoint at {args.checkpoint}: run scripts/tiny_checkpoint.py first", file=sys.stderr)
        return 2
    path = ensure_tiny_lora(args.checkpoint, args.output, rank=args.rank, seed=args.seed, scale=args.scale,
                            force=args.force)
    print(f"tiny LoRA: {path} ({path.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
