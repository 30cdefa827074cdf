"""Reliability tests: a real ComfyUI, real files, real compiles — failures, races, bad inputs, soak.

Reuses the session fixtures of ``tests/conftest.py`` (one shared server, one shared compile cache)
and adds what only these tests need: the tiny LoRA (``scripts/tiny_lora.py``) and a second tiny
checkpoint drawn from another seed (for the checkpoint swap), both placed in the shared server's
base directory. Helpers live in ``reliability_helpers.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import tiny_checkpoint
import tiny_lora
from reliability_helpers import REPO, SECOND_CKPT, SECOND_SEED, comfy_server


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def lora_name(comfy_base, tiny_ckpt) -> str:
    """The tiny LoRA, written into the shared base dir's ``models/loras``."""
    tiny_lora.ensure_tiny_lora(tiny_ckpt, comfy_base / "models" / "loras" / tiny_lora.LORA_NAME)
    return tiny_lora.LORA_NAME


@pytest.fixture(scope="session")
def second_ckpt(comfy_host, comfy_base, tiny_ckpt) -> str:
    """A second tiny checkpoint (same architecture, another seed), built once next to the first."""
    path = tiny_ckpt.parent / SECOND_CKPT
    if not tiny_checkpoint.is_valid(path):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import tiny_checkpoint as t; "
                "t.SEED = int(sys.argv[3]); t.ensure_tiny_checkpoint(sys.argv[2], sys.argv[4], force=True)")
        proc = subprocess.run([sys.executable, "-c", code, str(REPO / "scripts"), str(comfy_host), str(SECOND_SEED),
                               str(path)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"building the second checkpoint failed:\n{proc.stderr[-4000:]}"
    comfy_server.make_base_dir(comfy_base, [path])
    return SECOND_CKPT


@pytest.fixture
def srv(comfy, lora_name):
    """The shared server (started if needed), with the tiny LoRA installed."""
    return comfy


