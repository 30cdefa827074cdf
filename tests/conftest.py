"""Shared fixtures: one real ComfyUI host, one tiny checkpoint, one server, one compile cache.

CI has 90 minutes on 2 cores with cold caches and a cold Inductor compile costs 50-100 s there, so
the integration tests share a single session-scoped server (and so a single compile) wherever they
can. The server runs with an isolated ``--base-directory`` (its own output/user/custom_nodes) and
``NEXFORT_CACHE_DIR`` in a temp dir, so tests never read or pollute the developer's host or cache.

Environment:
  NEXFORT_HOST              ComfyUI tree (default: <repo>/.host/ComfyUI, made by `make host`)
  NEXFORT_TEST_KEEP_CACHE   a directory to use as the compile cache instead of a fresh temp dir
  NEXFORT_TEST_PACK         the pack checkout to link into custom_nodes (default: this repository)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# before torch loads libgomp, for this process and every server or child it starts (make test runs two pytest
# processes side by side, scripts/run_tests.sh):
# idle OpenMP pool threads sleep instead of spinning beside another busy process
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import comfy_server  # noqa: E402
import tiny_checkpoint  # noqa: E402
import tiny_controlnet  # noqa: E402
import tiny_lora  # noqa: E402


def _host_dir() -> Path:
    return Path(os.environ.get("NEXFORT_HOST") or REPO / ".host" / "ComfyUI").resolve()


@pytest.fixture(scope="session")
def comfy_host() -> Path:
    """The ComfyUI tree; tests that need it are skipped (with the fix) where it is missing."""
    host = _host_dir()
    if not (host / "main.py").is_file():
        pytest.skip(f"no ComfyUI host at {host}: run `make host` (scripts/setup_host.sh)")
    return host


@pytest.fixture
def pack_cache_env(tmp_path_factory, monkeypatch) -> Path:
    """The pack's cache root (``$NEXFORT_CACHE_DIR``) in a session temp dir, never the user's: for
    tests that compile through the node layer in this process."""
    root = tmp_path_factory.getbasetemp() / "nexfort_pack_cache"
    root.mkdir(exist_ok=True)
    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def comfy_inproc():
    """ComfyUI imported in this process (--cpu, SDPA attention, grad off), for in-process tests."""
    import tiny_models

    host = tiny_models.host_dir()
    if not (host / "comfy").is_dir():
        pytest.skip(f"no ComfyUI host at {host}: run `make host` (scripts/setup_host.sh)")
    tiny_models.boot()
    return host


@pytest.fixture(scope="session")
def tiny_ckpt(comfy_host) -> Path:
    """The embedded default model, built once (in a subprocess, so ComfyUI stays out of pytest)."""
    path = tiny_checkpoint.default_path(comfy_host)
    if not tiny_checkpoint.is_valid(path):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "tiny_checkpoint.py"), "--host",
                               str(comfy_host)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"building the tiny checkpoint failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert tiny_checkpoint.is_valid(path)
    return path


@pytest.fixture(scope="session")
def comfy_base(tmp_path_factory, tiny_ckpt) -> Path:
    """An isolated ComfyUI base directory with the pack and the tiny checkpoint linked in."""
    pack = os.environ.get("NEXFORT_TEST_PACK") or REPO
    return comfy_server.make_base_dir(tmp_path_factory.mktemp("comfy_base"), [tiny_ckpt], pack=pack)


@pytest.fixture(scope="session")
def workflow_assets(comfy_host, comfy_base, tiny_ckpt) -> dict[str, Path]:
    """Every file the shipped ``tests/workflows/api`` graphs refer to, placed in the shared base dir (the
    checkpoint is already linked; the tiny LoRA and ControlNet are written next to it, without
    ComfyUI; the img2img and ControlNet graphs' ``example.png`` is the one ComfyUI ships in its
    ``input/``, as a user's ComfyUI has it)."""
    models = comfy_base / "models"
    lora = tiny_lora.ensure_tiny_lora(tiny_ckpt, models / "loras" / tiny_lora.LORA_NAME)
    controlnet = tiny_controlnet.ensure_tiny_controlnet(tiny_ckpt, models / "controlnet" / tiny_controlnet.CONTROLNET_NAME)
    image = comfy_base / "input" / "example.png"
    if not image.exists():
        shutil.copyfile(comfy_host / "input" / "example.png", image)
    return {"checkpoints": tiny_ckpt, "loras": lora, "controlnet": controlnet, "input": image}


@pytest.fixture(scope="session")
def nexfort_cache_dir(tmp_path_factory) -> Path:
    keep = os.environ.get("NEXFORT_TEST_KEEP_CACHE")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(keep)
    return tmp_path_factory.mktemp("nexfort_cache")


@pytest.fixture(scope="session")
def comfy_server_instance(comfy_host, comfy_base, nexfort_cache_dir):
    """One real ComfyUI server for the whole session (restartable: see test_host_integration)."""
    srv = comfy_server.ComfyServer(comfy_host, base_dir=comfy_base,
                                   log_path=comfy_base / "comfyui.log",
                                   env={"NEXFORT_CACHE_DIR": str(nexfort_cache_dir)})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def comfy(comfy_server_instance):
    """The shared server, started again if an earlier test stopped it; log tail on failure."""
    if not comfy_server_instance.running:
        comfy_server_instance.start()
    return comfy_server_instance


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    srv = item.funcargs.get("comfy") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and srv is not None:
        report.sections.append(("ComfyUI log tail", srv.log_tail(80)))
