"""Importing the pack starts no CUDA and needs no Triton (STYLE.md: "Imports are cheap and safe").

Each import runs in a fresh interpreter, outside ComfyUI (ComfyUI's tree is not on sys.path), so
nothing imported earlier by pytest or other tests can hide a heavy import.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys
    repo = sys.argv[1]
    what = sys.argv[2]
    sys.path.insert(0, repo)
    if what == "pack":
        # The pack as ComfyUI loads it: a package from the repo directory under its folder name.
        spec = importlib.util.spec_from_file_location(
            "nexfort", repo + "/__init__.py", submodule_search_locations=[repo])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["nexfort"] = mod
        spec.loader.exec_module(mod)
        names = sorted(n for n in ("WEB_DIRECTORY", "NODE_CLASS_MAPPINGS") if hasattr(mod, n))
    else:
        mod = __import__(what)
        names = sorted(getattr(mod, "__all__", []))
    import torch
    print(json.dumps({
        "cuda_initialized": torch.cuda.is_initialized(),
        "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")),
        "comfy": sorted(m for m in sys.modules if m in ("comfy", "nodes", "folder_paths", "comfy_api")),
        "names": names,
    }))
    """
)


def _probe(what: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(REPO), what], cwd="/", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"importing {what} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what", ["pack", "nexfort_engine"])
def test_import_is_lean(what):
    result = _probe(what)
    assert result["cuda_initialized"] is False, f"importing {what} initialised CUDA"
    assert result["triton"] == [], f"importing {what} imported Triton: {result['triton'][:5]}"
    assert result["comfy"] == [], f"importing {what} outside ComfyUI pulled in {result['comfy']}"
    assert result["names"], f"importing {what} exposed nothing"
    if what == "pack":
        assert "WEB_DIRECTORY" in result["names"]

