"""requirements.txt is what ComfyUI-Manager installs (``pip install -r``) into the ComfyUI it runs
in: only the optional fp8-attention dependency, the same as pyproject's ``fp8-attention`` extra,
never torch/triton (a pip install of those would replace the user's CUDA build)."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> list[Requirement]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_requirements_match_the_fp8_attention_extra():
    reqs = _requirements()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["fp8-attention"]
    assert [str(r) for r in reqs] == [str(Requirement(e)) for e in extra]
    assert {r.name for r in reqs} == {"nvidia-cudnn-frontend"}
    req = reqs[0]
    assert req.specifier.contains("1.20.0") and not req.specifier.contains("1.32.0")  # the version measured
    assert req.marker.evaluate({"sys_platform": "linux"}) and not req.marker.evaluate({"sys_platform": "win32"})


def test_requirements_leave_the_hosts_torch_alone():
    assert not {r.name for r in _requirements()} & {"torch", "triton", "torchvision", "safetensors"}
