"""benchmarks/text_to_image.py on CPU with tiny twins: valid JSON and Markdown, eager and nexfort.

The tool runs in subprocesses (as on a GPU machine), so ComfyUI never enters the pytest process.
nexfort runs with ``{"backend": "eager"}``: Dynamo traces the real ComfyUI model through the pack's
APPLY_MODEL wrapper, without Inductor's 50-100 s CPU compile. Speed is not asserted (CI machines
are shared); the structure of the results, the counters and the eager-vs-compiled error are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HOST = Path(os.environ.get("NEXFORT_HOST") or REPO / ".host" / "ComfyUI").resolve()
TOOL = REPO / "benchmarks" / "text_to_image.py"

pytestmark = pytest.mark.skipif(not (HOST / "comfy").is_dir(), reason=f"no ComfyUI host at {HOST}: run `make host`")


def _bench(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    md = tmp_path / f"{name}.md"
    cmd = [sys.executable, str(TOOL), "--comfy-root", str(HOST), "--device", "cpu", "--tiny", "--model", "flux",
           "--steps", "3", "--repeat", "1", "--cache-dir", str(tmp_path / "cache"),
           "--output-json", str(out), "--output-markdown", str(md), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "RESULT model=flux" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "nexfort-bench/1"
    assert doc["env"]["torch"] and doc["env"]["comfyui"]
    assert md.read_text().startswith("### Metric")
    return doc["runs"][0]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("bench")
    return {
        "none": _bench(tmp, "none", "--compiler", "none"),
        "nexfort": _bench(tmp, "nexfort", "--compiler", "nexfort", "--compiler-config", '{"backend": "eager"}'),
        "_dir": {"path": str(tmp)},
    }


def test_eager_run(results):
    r = results["none"]
    assert r["compiler"] == "none" and r["model"] == "flux" and r["tiny"]
    assert r["dtype"] == "float32"  # ComfyUI picks float32 on the CPU
    assert r["it_s"] > 0 and r["e2e_s"] > 0 and r["warmup_s"] > 0
    assert r["runs"][0]["steps_seen"] == 3
    assert r["latent_finite"] and r["latent_std"] > 0
    assert r["compiles"] == 0 and r["peak_mem_gib"] is None


def test_nexfort_run(results):
    r = results["nexfort"]
    assert r["compiler"] == "nexfort"
    assert r["compiler_config_resolved"]["backend"] == "eager"
    assert r["compiles"] >= 1 and r["fallbacks"] == 0, r.get("fallback_reasons")
    assert r["it_s"] > 0 and r["warmup_s"] > 0
    # the eager backend runs the same kernels: the compiled latent equals eager's up to rounding
    err = r["err_vs_eager"]
    assert err["finite"] and err["max_abs"] < 1e-3, err


def test_report_merges_runs(results, tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import report
    finally:
        sys.path.remove(str(REPO))
    d = Path(results["_dir"]["path"])
    docs = report.load([d / "none.json", d / "nexfort.json"])
    md = report.render(docs)
    assert "| PyTorch (eager) iteration speed |" in md
    nexfort_row = next(line for line in md.splitlines() if line.startswith("| nexfort iteration speed"))
    assert "it/s (" in nexfort_row and "%)" in nexfort_row  # speed-up against the eager column
    summary = [line for line in md.splitlines() if line.startswith("| CPU | flux |")]
    assert len(summary) == 2
    msg = report.chart(docs, tmp_path / "chart.png")
    assert msg.startswith("chart written") or "matplotlib is not installed" in msg
