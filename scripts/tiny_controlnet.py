"""Make a tiny, random ControlNet for nexfort's tiny SD1.5 checkpoint, in ComfyUI's ControlNet format.

A ControlNet is a copy of its UNet's encoder (``time_embed``, ``input_blocks``, ``middle_block``)
plus a hint encoder (``input_hint_block``: eight convolutions taking the control image down 8x
to the latent's size) and one 1x1 "zero" convolution per encoder output (``zero_convs.<i>``,
``middle_block_out``). The file holds those keys without a prefix, as the ControlNet 1.1
safetensors files do, so ComfyUI's ``ControlNetLoader`` detects it from the encoder's keys (SD1.5)
and builds ``comfy.cldm.cldm.ControlNet`` from it.

The encoder is copied from the checkpoint's UNet (how ControlNets start training); the hint
encoder and the zero convolutions are random (fixed seed), the latter *not* zero as at the start
of training, so the control changes the image: a test can see that the control reached the UNet.
ComfyUI is not imported: every shape is read from the checkpoint's header and tensors.

Use as a function (``ensure_tiny_controlnet(checkpoint, output)``) or a CLI::

    python scripts/tiny_controlnet.py --checkpoint .host/ComfyUI/models/checkpoints/nexfort-tiny-sd15.safetensors \\
        [--output <controlnet dir>/nexfort-tiny-sd15-controlnet.safetensors] [--seed 9] [--force]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from tiny_checkpoint import read_header, save_safetensors_atomic  # scripts/ is on sys.path (run or imported)

CONTROLNET_NAME = "nexfort-tiny-sd15-controlnet.safetensors"
FORMAT_VERSION = "1"
METADATA_KEY = "nexfort.tiny_controlnet"
UNET_PREFIX = "model.diffusion_model."
#: the UNet parts a ControlNet copies
ENCODER = ("time_embed.", "input_blocks.", "middle_block.")
#: (in, out, stride) of the hint encoder's convolutions (3x3), at keys input_hint_block.{0,2,...,14}
HINT_CONVS = ((3, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 96, 2), (96, 96, 1), (96, 256, 2),
              (256, None, 1))


def default_path(checkpoint: str | os.PathLike) -> Path:
    """``<models>/controlnet/<CONTROLNET_NAME>`` next to ``<models>/checkpoints/<checkpoint>``."""
    return Path(checkpoint).resolve().parent.parent / "controlnet" / CONTROLNET_NAME


def _block_channels(encoder: dict, index: int) -> int:
    """Channels out of ``input_blocks.<index>``: its first conv (the stem), its ResBlock's last conv,
    or its downsampling conv."""
    for key in (f"input_blocks.{index}.0.out_layers.3.weight", f"input_blocks.{index}.0.op.weight",
                f"input_blocks.{index}.0.weight"):
        if key in encoder:
            return int(encoder[key].shape[0])
    raise ValueError(f"input_blocks.{index}: no stem, ResBlock or downsampling convolution found")


def build_controlnet(checkpoint: str | os.PathLike, seed: int = 9):
    """Return ``(state_dict, metadata)`` of the ControlNet for ``checkpoint``."""
    import torch
    from safetensors import safe_open

    encoder = {}
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in f.keys():
            if key.startswith(UNET_PREFIX) and key[len(UNET_PREFIX):].startswith(ENCODER):
                encoder[key[len(UNET_PREFIX):]] = f.get_tensor(key)
    if "input_blocks.0.0.weight" not in encoder or "time_embed.0.weight" not in encoder:
        raise ValueError(f"{checkpoint} has no SD1.5 UNet encoder ({UNET_PREFIX}input_blocks.0.0.weight); "
                         "build it with scripts/tiny_checkpoint.py")
    model_channels = int(encoder["input_blocks.0.0.weight"].shape[0])
    dtype = encoder["input_blocks.0.0.weight"].dtype
    gen = torch.Generator().manual_seed(seed)

    def conv(name: str, c_in: int, c_out: int, k: int, gain: float = 1.0) -> None:
        w = torch.randn(c_out, c_in, k, k, generator=gen) * (gain / (c_in * k * k) ** 0.5)
        sd[f"{name}.weight"] = w.to(dtype).contiguous()
        sd[f"{name}.bias"] = (torch.randn(c_out, generator=gen) * 0.02).to(dtype).contiguous()

    sd = dict(encoder)
    for i, (c_in, c_out, _stride) in enumerate(HINT_CONVS):
        conv(f"input_hint_block.{2 * i}", c_in, c_out or model_channels, 3)
    blocks = sorted({int(m.group(1)) for k in encoder if (m := re.match(r"input_blocks\.(\d+)\.", k))})
    for i in blocks:
        ch = _block_channels(encoder, i)
        conv(f"zero_convs.{i}.0", ch, ch, 1, gain=0.5)
    middle = int(encoder[max((k for k in encoder if re.match(r"middle_block\.\d+\.out_layers\.3\.weight", k)))].shape[0])
    conv("middle_block_out.0", middle, middle, 1, gain=0.5)
    metadata = {METADATA_KEY: FORMAT_VERSION, "nexfort.seed": str(seed)}
    return sd, metadata


def is_valid(path: str | os.PathLike, seed: int | None = None) -> bool:
    """True when ``path`` is a complete ControlNet written by this module (header check only)."""
    header = read_header(path)
    if header is None:
        return False
    meta, keys = header
    complete = {"input_hint_block.14.weight", "zero_convs.0.0.weight", "middle_block_out.0.weight"} <= keys
    return meta.get(METADATA_KEY) == FORMAT_VERSION and complete and (seed is None or meta.get("nexfort.seed") == str(seed))


def ensure_tiny_controlnet(checkpoint: str | os.PathLike, output: str | os.PathLike | None = None, *,
                           seed: int = 9, force: bool = False) -> Path:
    """Write the ControlNet atomically (temp file + rename) unless a valid one with ``seed`` is there."""
    path = Path(output) if output else default_path(checkpoint)
    if not force and is_valid(path, seed):
        return path
    sd, metadata = build_controlnet(checkpoint, seed=seed)
    return save_safetensors_atomic(sd, metadata, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    host = os.environ.get("NEXFORT_HOST", ".host/ComfyUI")
    ap.add_argument("--checkpoint", default=str(Path(host) / "models" / "checkpoints" / "nexfort-tiny-sd15.safetensors"),
                    help="the tiny SD1.5 checkpoint (scripts/tiny_checkpoint.py) whose UNet encoder the ControlNet copies")
    ap.add_argument("--output", default=None, help=f"file to write (default: <models>/controlnet/{CONTROLNET_NAME})")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--force", action="store_true", help="rewrite even if a valid file exists")
    args = ap.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        print(f"tiny ControlNet: no checkpoint at {args.checkpoint}: run scripts/tiny_checkpoint.py first", file=sys.stderr)
        return 2
    path = ensure_tiny_controlnet(args.checkpoint, args.output, seed=args.seed, force=args.force)
    print(f"tiny ControlNet: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
