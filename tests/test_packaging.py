"""What a user installs: the registry's metadata, the shipped file list, the licence, and the runtime
check of torch/Triton versions. No ComfyUI, no torch import: these run in a second."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: what a registry install may weigh (the runtime pack is under 1 MB; benchmark results, tests and
#: research stay in git)
MAX_SHIPPED_BYTES = 1_500_000


def _pack():
    """The pack's top-level module, loaded as ComfyUI loads it (outside ComfyUI: no nodes)."""
    spec = importlib.util.spec_from_file_location("nexfort_pack_under_test", REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    mod = importlib.util.module_from_spec(spec)
    # outside ComfyUI even when another test of this process imported it: `import comfy_api.latest`
    # then fails, as it does without a host (a None entry in sys.modules makes an import raise)
    saved = sys.modules.get("comfy_api.latest", _MISSING)
    sys.modules["comfy_api.latest"] = None  # type: ignore[assignment]
    try:
        spec.loader.exec_module(mod)
    finally:
        if saved is _MISSING:
            del sys.modules["comfy_api.latest"]
        else:
            sys.modules["comfy_api.latest"] = saved
    return mod


_MISSING = object()


def _ignored(path: str, patterns: list[str]) -> bool:
    """gitignore matching for the forms .comfyignore uses: ``/dir/``, ``dir/``, ``/file``, ``*.ext``."""
    parts = path.split("/")
    for pat in patterns:
        anchored, is_dir, pat = pat.startswith("/"), pat.endswith("/"), pat.strip("/")
        if is_dir:
            dirs = parts[:-1]
            if (dirs[:1] == [pat]) if anchored else (pat in dirs):
                return True
        elif anchored:
            if fnmatch.fnmatchcase(path, pat):
                return True
        elif any(fnmatch.fnmatchcase(p, pat) for p in parts):
            return True
    return False


def shipped_files() -> list[str]:
    """The files ``comfy node publish`` packs: tracked (and new, not ignored) minus .comfyignore,
    plus ``[tool.comfy].includes``."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    lines = (REPO / ".comfyignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    files = {f for f in out if (REPO / f).is_file() and not _ignored(f, patterns)}
    files |= set(PYPROJECT["tool"]["comfy"].get("includes", []))
    return sorted(files)


def test_registry_metadata_is_complete():
    project, comfy = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
    # the registry's naming advice: short, letters/digits/-/_/., no "ComfyUI" in it
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,98}", project["name"]) and "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["urls"]["Repository"].startswith("https://github.com/")
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert comfy["Icon"].startswith("https://") and comfy["Icon"].endswith(".png")
    icon = comfy["Icon"].split("/main/", 1)[1]
    assert (REPO / icon).is_file(), f"the Icon URL points at {icon}, which is not in the repository"


def test_license_file_matches_the_declared_license():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}


def test_the_shipped_file_list_stays_small():
    files = shipped_files()
    size = sum((REPO / f).stat().st_size for f in files)
    heavy = sorted(files, key=lambda f: -(REPO / f).stat().st_size)[:5]
    assert size <= MAX_SHIPPED_BYTES, f"a registry install ships {size:,} bytes; largest: {heavy}"
    stray = [f for f in files if f.split("/")[0] in ("tests", "benchmarks", "scripts", ".ci")]
    assert not stray, f"tests, benchmarks or scripts would ship: {stray[:10]}"
    for needed in ("__init__.py", "nodes/__init__.py", "nexfort_engine/__init__.py", "web/nexfort.js",
                   "LICENSE", "README.md", "pyproject.toml", "requirements.txt"):
        assert needed in files, f"{needed} would not ship"
    assert any(f.startswith("example_workflows/") and f.endswith(".json") for f in files)


def test_min_versions_match_the_declared_dependencies():
    declared = {}
    for dep in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dep)
        floor = next((s.version for s in req.specifier if s.operator == ">="), None)
        if floor:
            declared[req.name] = tuple(int(p) for p in floor.split("."))
    assert _pack().MIN_VERSIONS == {k: declared[k] for k in ("torch", "triton")}


def _versions(found: dict[str, str]):
    def version(name: str) -> str:
        if name not in found:
            raise metadata.PackageNotFoundError(name)
        return found[name]
    return version


@pytest.mark.parametrize(("found", "expect"), [
    ({"torch": "2.11.0+cu130", "triton": "3.6.0"}, []),
    ({"torch": "2.14.1+cpu"}, []),  # no Triton on a CPU-only install: nothing to say
    ({"torch": "2.5.1+cu124", "triton": "3.1.0"}, ["torch >= 2.11, found torch 2.5.1+cu124"]),
    ({"torch": "2.11.0", "triton": "2.3.1"}, ["triton >= 3.0, found triton 2.3.1"]),
    ({"torch": "2.11.0", "triton-windows": "2.1.0"}, ["triton >= 3.0, found triton-windows 2.1.0"]),
])
def test_old_torch_or_triton_gets_a_clear_message(found, expect):
    problems = _pack().version_problems(_versions(found))
    assert len(problems) == len(expect)
    for problem, want in zip(problems, expect, strict=True):
        assert want in problem and "install guide" in problem


def test_the_installed_versions_are_supported():
    assert _pack().version_problems() == [], sys.version
