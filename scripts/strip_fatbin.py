"""Zero the CUDA code a device will not load, so a carried extension packs small.

comfy-kitchen's CUDA extension holds SASS for sm_75/80/89/90/100/120 and PTX for three of them
(176 MB, 21 MB with xz): over the device call's carry limit beside a ComfyUI tree. The lent GPUs
are Hopper (sm_90), so this keeps every fat binary's entry headers (the file's layout and size do
not change) and zeroes the payloads of the entries for other architectures: xz then packs them to
nothing. The driver picks the sm_90 SASS and never reads the others.

Usage: python3 scripts/strip_fatbin.py LIB.so [--keep-sm 90]
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
ELF_KIND = 2  # an entry of kind 1 is PTX, 2 is an ELF cubin


def strip(data: bytearray, keep_sm: int) -> tuple[int, int]:
    """Zero the payloads of the entries not (SASS, keep_sm); returns (kept, zeroed) entry counts."""
    magic = struct.pack("<I", FATBIN_MAGIC)
    kept = zeroed = 0
    pos = data.find(magic)
    while pos >= 0:
        _, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        p, end = pos + header_size, pos + header_size + fat_size
        if end > len(data):
            raise ValueError(f"fat binary at {pos:#x} runs past the end of the file")
        while p < end:
            kind, _, entry_header, padded = struct.unpack_from("<HHII", data, p)
            sm = struct.unpack_from("<I", data, p + 28)[0]
            start = p + entry_header
            if kind == ELF_KIND and sm == keep_sm:
                kept += 1
            else:
                data[start:start + padded] = bytes(padded)
                zeroed += 1
            p = start + padded
        pos = data.find(magic, end)
    return kept, zeroed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", type=Path)
    ap.add_argument("--keep-sm", type=int, default=90)
    args = ap.parse_args(argv)
    data = bytearray(args.lib.read_bytes())
    kept, zeroed = strip(data, args.keep_sm)
    if kept == 0:
        print(f"{args.lib}: no sm_{args.keep_sm} SASS found; left as it was", file=sys.stderr)
        return 1
    args.lib.write_bytes(bytes(data))
    print(f"{args.lib}: kept {kept} sm_{args.keep_sm} cubins, zeroed {zeroed} other entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
