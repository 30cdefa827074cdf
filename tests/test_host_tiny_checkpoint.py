"""The embedded default model loads through ComfyUI's real loader as SD1.5 and samples finite images."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent


def test_tiny_checkpoint_is_valid_and_idempotent(tiny_ckpt):
    assert tiny_checkpoint.is_valid(tiny_ckpt)
    mtime = tiny_ckpt.stat().st_mtime_ns
    assert tiny_checkpoint.ensure_tiny_checkpoint(tiny_ckpt.parent.parent.parent) == tiny_ckpt
    assert tiny_ckpt.stat().st_mtime_ns == mtime, "a valid checkpoint must not be rewritten"


def test_invalid_file_is_not_valid(tmp_path):
    bad = tmp_path / tiny_checkpoint.CHECKPOINT_NAME
    bad.write_bytes(b"not a safetensors file")
    assert not tiny_checkpoint.is_valid(bad)
    assert not tiny_checkpoint.is_valid(tmp_path / "absent.safetensors")


def test_loads_through_comfy_loader_and_samples(comfy_host, tiny_ckpt):
    # In a subprocess: verify() imports ComfyUI, which must stay out of the pytest process.
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "tiny_checkpoint.py"), "--host", str(comfy_host),
                           "--output", str(tiny_ckpt), "--verify"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "'arch': 'SD15'" in proc.stdout and "'image_shape': (1, 64, 64, 3)" in proc.stdout, proc.stdout
