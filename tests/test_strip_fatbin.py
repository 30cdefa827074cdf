"""``scripts/strip_fatbin.py``: the device bundle keeps only Hopper's SASS in comfy-kitchen's CUDA
extension. Checked on a synthetic file with two fat binaries (the layout the real 176 MB extension
has: a 16-byte header, entries of a 64-byte header and a padded payload): the sm_90 cubins keep
their bytes, PTX and other architectures are zeroed, and the file's size and every header stay."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "strip_fatbin.py"


@pytest.fixture(scope="module")
def strip_fatbin():
    spec = importlib.util.spec_from_file_location("strip_fatbin", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = struct.pack("<HHII", kind, 0x0101, 64, len(payload)) + bytes(16) + struct.pack("<I", sm)
    return header + bytes(64 - len(header)) + payload


def _fatbin(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_keeps_only_hopper_sass(strip_fatbin, tmp_path):
    sass90, sass80, ptx90 = b"\x7fELF" + b"H" * 60, b"\x7fELF" + b"A" * 28, b".version 8.0" + b"P" * 20
    blob = b"prefix" + _fatbin([_entry(2, 80, sass80), _entry(2, 90, sass90), _entry(1, 90, ptx90)]) \
        + b"middle" + _fatbin([_entry(2, 90, sass90), _entry(2, 120, sass80)]) + b"suffix"
    lib = tmp_path / "_C.abi3.so"
    lib.write_bytes(blob)
    assert strip_fatbin.main([str(lib)]) == 0
    out = lib.read_bytes()
    assert len(out) == len(blob)
    assert out.count(sass90) == 2 and sass80 not in out and ptx90 not in out
    for marker in (b"prefix", b"middle", b"suffix"):
        assert out.index(marker) == blob.index(marker)
    data = bytearray(out)
    assert strip_fatbin.strip(data, 90) == (2, 3)  # stripping again changes nothing
    assert bytes(data) == out


def test_no_hopper_code_leaves_the_file(strip_fatbin, tmp_path):
    blob = _fatbin([_entry(2, 80, b"\x7fELF" + b"A" * 12)])
    lib = tmp_path / "lib.so"
    lib.write_bytes(blob)
    assert strip_fatbin.main([str(lib)]) == 1
    assert lib.read_bytes() == blob
