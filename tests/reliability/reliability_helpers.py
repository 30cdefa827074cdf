"""Helpers of the reliability tests: build graphs from the shipped LoRA workflow, run them on a real
server, read back images and latents, compare compiled with eager, read counters and RSS.

Every comparison is compiled vs eager on the same server with the same seed. The tolerances are
stated once, here (``LATENT_ATOL``/``PIXEL_ATOL``), set from what this 2-core CPU measured (compiled
vs eager latents, values of order 1, differed by at most 7e-4; 8-bit images by at most 1) with a
margin; a stale or missing LoRA changes the latents by far more (``assert_differs`` guards that).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))

import comfy_server  # noqa: E402

LORA_WORKFLOW = REPO / "tests" / "workflows" / "api" / "txt2img_lora.json"
SECOND_SEED = 20261123
SECOND_CKPT = "nexfort-tiny-sd15-seed2.safetensors"
#: compiled vs eager: max |latent difference| and max |pixel difference| (0..255) allowed
LATENT_ATOL = 5e-3
PIXEL_ATOL = 3
_seeds = itertools.count(71_000)


def next_seed() -> int:
    return next(_seeds)


# -- graphs --------------------------------------------------------------------------------------
def lora_graph(*, lora: float | None = 1.0, compiled: bool = True, ckpt: str | None = None, width: int = 64,
               height: int = 64, batch: int = 1, seed: int | None = None, options: str = "",
               compile_id: str = "2", prefix: str = "nx_rel") -> dict:
    """The shipped LoRA workflow, varied: LoRA strength (``None`` removes the LoraLoader), eager or
    compiled (``compile_id`` is the compile node's id), checkpoint, size, batch, seed, options.
    A ``SaveLatent`` node ("9") is added so latents can be compared, not only 8-bit images."""
    g = comfy_server.load_workflow(LORA_WORKFLOW)
    if ckpt:
        g["1"]["inputs"]["ckpt_name"] = ckpt
    if lora is None:
        del g["10"]
        g["2"]["inputs"]["model"] = ["1", 0]
        for nid in ("3", "4"):
            g[nid]["inputs"]["clip"] = ["1", 1]
    else:
        g["10"]["inputs"]["strength_model"] = lora
    g["2"]["inputs"]["options"] = options
    g["5"]["inputs"].update(width=width, height=height, batch_size=batch)
    g["8"]["inputs"]["filename_prefix"] = prefix
    g["9"] = {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{prefix}"}}
    if compile_id != "2":
        g[compile_id] = g.pop("2")
        g["6"]["inputs"]["model"] = [compile_id, 0]
    if not compiled:
        g = comfy_server.without_nodes(g, "NexfortCompileModel")
    if seed is not None:
        g = comfy_server.set_seed(g, seed)
    return g


def run_ok(server, graph: dict, timeout: float = 900) -> comfy_server.PromptResult:
    res = server.run(graph, timeout=timeout)
    assert res.status.get("status_str") == "success", res.status
    return res


def latent_files(res: comfy_server.PromptResult) -> list[Path]:
    out = []
    for node_out in res.outputs.values():
        for item in node_out.get("latents", []):
            out.append(res.output_dir / item.get("subfolder", "") / item["filename"])
    return out


def latent(res: comfy_server.PromptResult) -> np.ndarray:
    from safetensors.numpy import load_file

    files = latent_files(res)
    assert len(files) == 1, f"expected one saved latent, got {files}"
    return load_file(str(files[0]))["latent_tensor"].astype(np.float64)


def images(res: comfy_server.PromptResult) -> list[np.ndarray]:
    from PIL import Image

    assert res.images, f"no saved image: {json.dumps(res.outputs)[:1000]}"
    return [np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in res.images]


def assert_same_output(compiled: comfy_server.PromptResult, eager: comfy_server.PromptResult, what: str,
                       exact: bool = False) -> dict:
    """Compiled vs eager: latents within LATENT_ATOL and pixels within PIXEL_ATOL (or bit-exact)."""
    lc, le = latent(compiled), latent(eager)
    assert lc.shape == le.shape, (what, lc.shape, le.shape)
    dl = float(np.max(np.abs(lc - le)))
    ic, ie = images(compiled), images(eager)
    assert len(ic) == len(ie), what
    dp = max(int(np.max(np.abs(a - b))) for a, b in zip(ic, ie, strict=True))
    if exact:
        assert dl == 0.0 and dp == 0, f"{what}: expected bit-identical output, latent diff {dl}, pixel diff {dp}"
    assert dl <= LATENT_ATOL, f"{what}: compiled vs eager latent max |diff| {dl} > {LATENT_ATOL}"
    assert dp <= PIXEL_ATOL, f"{what}: compiled vs eager pixel max |diff| {dp} > {PIXEL_ATOL}"
    return {"latent_diff": dl, "pixel_diff": dp}


def assert_differs(a: comfy_server.PromptResult, b: comfy_server.PromptResult, what: str,
                   min_diff: float = 0.05) -> None:
    """Guard against vacuous comparisons: the change under test must change the output."""
    d = float(np.max(np.abs(latent(a) - latent(b))))
    assert d > min_diff, f"{what}: outputs differ by only {d}; the test would not notice a stale model"


# -- counters --------------------------------------------------------------------------------------
def engine(server) -> dict:
    stats = server.stats()
    assert stats is not None, "GET /nexfort/stats is missing"
    return stats["engine"]


def records(server, node_id: str) -> dict[str, dict]:
    """label -> per-model record of every compiled module that node ``node_id`` used."""
    return {label: m for label, m in engine(server)["models"].items() if str(node_id) in m.get("node_ids", [])}


def one_record(server, node_id: str) -> tuple[str, dict]:
    recs = records(server, node_id)
    assert len(recs) == 1, f"expected one compiled model for node {node_id}, got {json.dumps(recs)[:2000]}"
    return next(iter(recs.items()))


# -- processes and files ------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file under ``root`` (lock files excluded)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name != ".lock" and "locks" not in p.parts:
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def wait_for_log(server, needle: str, after: int, timeout: float = 30.0) -> None:
    """Wait until ``needle`` appears in the server log past offset ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in server.log_text()[after:]:
            return
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} did not appear in the log within {timeout:.0f}s" + server.log_tail_text())


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
