"""A real ComfyUI with the pack in custom_nodes: node registration, every shipped API workflow, and a
restart that reuses the persisted compile cache (proved by the engine's counters, not by timing).

All tests share one server (conftest.py): the first compiled workflow pays the cold Inductor compile
(50-100 s on 2 CPU cores); everything after it reuses that work.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import comfy_server
import demo
import procs
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((REPO / "tests" / "workflows" / "api").glob("*.json"))
COMPILED_WORKFLOW = REPO / "tests" / "workflows" / "api" / "txt2img_compiled.json"
IMG2IMG_WORKFLOW = REPO / "tests" / "workflows" / "api" / "img2img_compiled.json"
CONTROLNET_WORKFLOW = REPO / "tests" / "workflows" / "api" / "controlnet_compiled.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_seeds = itertools.count(1000)

# node id -> (inputs that must be listed, output types)
NODES = {
    "NexfortCompileModel": ({"model", "mode", "memory_format", "dynamic", "fuse_qkv", "options"}, ["MODEL"]),
    "NexfortCompileVAE": ({"vae", "mode", "memory_format", "dynamic", "options"}, ["VAE"]),
    "NexfortCompileControlNet": ({"control_net", "mode", "memory_format", "dynamic", "options"}, ["CONTROL_NET"]),
    "NexfortCacheManager": ({"action", "key", "bundle_path"}, ["STRING"]),
}


def _inputs(info: dict, node: str) -> dict:
    spec = info[node]["input"]
    return {**spec.get("required", {}), **spec.get("optional", {})}


def _combo(spec: list) -> tuple[list, object]:
    """(options, default) of a combo input in either the V1 or the V3 /object_info encoding."""
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    options = spec[0] if isinstance(spec[0], list) else extra.get("options", [])
    return options, extra.get("default")


def _engine(srv) -> dict:
    stats = srv.stats()
    assert stats is not None, "GET /nexfort/stats is missing: nodes/routes.py must be registered"
    return stats["engine"]


def _run(srv, workflow: Path) -> comfy_server.PromptResult:
    graph = comfy_server.set_seed(comfy_server.load_workflow(workflow), next(_seeds))
    result = srv.run(graph, timeout=900)
    assert result.status.get("status_str") == "success", result.status
    if not any(n["class_type"] in ("SaveImage", "PreviewImage") for n in graph.values()):
        # a report-only graph (cache_manager.json): every output node shows ui text in /history
        texts = [t for out in result.outputs.values() for t in out.get("text", [])]
        assert texts and all(isinstance(t, str) and t.startswith("nexfort cache:") for t in texts), result.outputs
        assert len(result.outputs) == sum(1 for n in graph.values() if n["class_type"] == "NexfortCacheManager")
        return result
    assert result.images, f"{workflow.name} produced no saved image: {json.dumps(result.outputs)[:2000]}"
    saves = sum(1 for n in graph.values() if n["class_type"] == "SaveImage")
    assert len(result.images) >= saves, f"{workflow.name}: {saves} SaveImage nodes, images {result.images}"
    for img in result.images:
        assert img.is_file(), f"{img} is listed in /history but not on disk"
        assert img.read_bytes()[:8] == PNG_MAGIC, f"{img} is not a PNG"
    return result


def _uses_nexfort(workflow: Path) -> bool:
    return any(n["class_type"].startswith("NexfortCompile") for n in comfy_server.load_workflow(workflow).values())


def test_object_info_lists_our_nodes(comfy):
    info = comfy.object_info()
    missing = [n for n in NODES if n not in info]
    assert not missing, f"nodes not registered: {missing}" + comfy.log_tail_text()
    for node, (want_inputs, outputs) in NODES.items():
        have = _inputs(info, node)
        assert want_inputs <= set(have), f"{node} lacks inputs {sorted(want_inputs - set(have))}"
        assert list(info[node]["output"]) == outputs, f"{node} outputs {info[node]['output']}"
        assert info[node]["category"].startswith("nexfort"), info[node]["category"]
    modes, default = _combo(_inputs(info, "NexfortCompileModel")["mode"])
    assert {"O1", "O2", "O3"} <= set(modes) and default == "O2", (modes, default)
    formats, _ = _combo(_inputs(info, "NexfortCompileModel")["memory_format"])
    assert {"contiguous", "channels_last"} <= set(formats), formats
    actions, _ = _combo(_inputs(info, "NexfortCacheManager")["action"])
    assert {"refresh", "clear_all", "clear_model", "export_bundle", "import_bundle"} <= set(actions), actions


def test_stats_route_answers(comfy):
    engine = _engine(comfy)
    for key in ("compiles", "recompiles", "recompile_reasons", "cache_hits", "cache_misses", "fallbacks",
                "fallback_reasons", "compile_seconds", "models"):
        assert key in engine, f"engine stats lack {key!r}: {sorted(engine)}"


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.stem for w in WORKFLOWS])
def test_api_workflow_produces_image(comfy, workflow_assets, workflow):
    before = _engine(comfy) if _uses_nexfort(workflow) else None
    _run(comfy, workflow)
    if before is not None:
        after = _engine(comfy)
        assert after["fallbacks"] == before["fallbacks"], f"compiled path fell back: {after['fallback_reasons']}"
        # traced here, or loaded from a graph an earlier test saved (nexfort_engine/precompile.py)
        assert after["compiles"] + after["cache_hits"] > 0, f"nothing was compiled or loaded: {after}"


def test_img2img_runs_the_compiled_encode_and_decode(comfy, workflow_assets):
    """The shipped img2img graph: ComfyUI's example.png scaled, encoded by the compiled VAE, sampled
    at denoise 0.75 by the compiled UNet, decoded by the compiled VAE. A second run at another image
    size (ComfyUI would reuse the first run's latent for the same image) compiles nothing: every
    compiled part's graph serves it, with no recompile. Smaller, not larger: on CPU a batch-1 conv
    net's graph guards on the input's size where oneDNN's convolution takes over from the plain
    one (``input numel > 20480``, Dynamo's fake convolution asks ATen which backend runs it), and a
    64x64 image's encode sits just below that line (README, *Dynamic shape without recompiles*)."""
    _run(comfy, IMG2IMG_WORKFLOW)
    before = _engine(comfy)
    graph = comfy_server.set_seed(comfy_server.load_workflow(IMG2IMG_WORKFLOW), next(_seeds))
    graph[comfy_server.find_node(graph, "ImageScale")]["inputs"]["width"] = 48
    result = comfy.run(graph, timeout=900)
    assert result.status.get("status_str") == "success" and result.images, result.status
    after = _engine(comfy)
    vae = {label: m for label, m in after["models"].items() if m.get("node_ids") and "9" in map(str, m["node_ids"])}
    methods = {label.split(":")[0].rsplit(".", 1)[-1] for label in vae}
    assert {"encode", "decode"} <= methods, sorted(after["models"])
    for label, m in vae.items():
        assert m["state"] == "compiled" and m["fallbacks"] == 0, (label, m)
        assert m["calls"] > before["models"][label]["calls"], (label, m)  # the second run called it
    assert after["compiles"] == before["compiles"] and after["recompiles"] == before["recompiles"], after
    assert after["fallbacks"] == before["fallbacks"], after["fallback_reasons"]


def _pixels(path: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_controlnet_workflow_equals_eager_and_applies_the_control(comfy, workflow_assets):
    """The shipped ControlNet graph (the tiny ControlNet on ComfyUI's example.png, compiled by
    *Nexfort Compile ControlNet*, applied by ControlNetApplyAdvanced to the compiled UNet): both
    compiled, and the image equals the same graph's eager one (both compile nodes bypassed), which
    differs from the image without the ControlNet (the control reached the UNet)."""
    seed = next(_seeds)
    graph = comfy_server.set_seed(comfy_server.load_workflow(CONTROLNET_WORKFLOW), seed)
    sampler = comfy_server.find_node(graph, "KSampler")
    apply = comfy_server.find_node(graph, "ControlNetApplyAdvanced")
    compiled_node = comfy_server.find_node(graph, "NexfortCompileModel")
    compiled_cn = comfy_server.find_node(graph, "NexfortCompileControlNet")
    before = _engine(comfy)
    compiled = comfy.run(graph, timeout=900)
    assert compiled.status.get("status_str") == "success" and compiled.images, compiled.status
    after = _engine(comfy)
    assert after["fallbacks"] == before["fallbacks"], after["fallback_reasons"]
    for node in (compiled_node, compiled_cn):
        rec = [m for m in after["models"].values() if node in map(str, m.get("node_ids", []))]
        assert rec and all(m["state"] == "compiled" and m["calls"] > 0 for m in rec), (node, after["models"])

    eager = json.loads(json.dumps(graph))
    eager[sampler]["inputs"]["model"] = graph[compiled_node]["inputs"]["model"]
    eager[apply]["inputs"]["control_net"] = graph[compiled_cn]["inputs"]["control_net"]
    eager_result = comfy.run(eager, timeout=900)
    plain = json.loads(json.dumps(eager))
    plain[sampler]["inputs"]["positive"] = graph[apply]["inputs"]["positive"]
    plain[sampler]["inputs"]["negative"] = graph[apply]["inputs"]["negative"]
    plain_result = comfy.run(plain, timeout=900)
    for r in (eager_result, plain_result):
        assert r.status.get("status_str") == "success" and r.images, r.status
    a, b, c = (_pixels(r.images[0]) for r in (compiled, eager_result, plain_result))
    assert int(abs(a - b).max()) <= 2, f"compiled vs eager: max pixel difference {int(abs(a - b).max())}/255"
    assert int(abs(b - c).max()) > 10, "the ControlNet did not change the eager image"


def test_restart_reuses_persisted_compile_cache(comfy, nexfort_cache_dir):
    if _engine(comfy)["compiles"] == 0:  # run alone (-k): populate the cache first
        _run(comfy, COMPILED_WORKFLOW)
    assert any(nexfort_cache_dir.iterdir()), f"nothing was persisted under {nexfort_cache_dir}"

    comfy.restart()
    fresh = _engine(comfy)
    assert fresh["compiles"] == 0, "a new server process should start with zero counters"

    _run(comfy, COMPILED_WORKFLOW)
    warm = _engine(comfy)
    # the first process listed the modules its first compile imported; the prompt started their
    # prewarm in the new process, and the compile waited for it (nexfort_engine/prewarm.py)
    assert (nexfort_cache_dir / "prewarm.json").is_file()
    prewarm = comfy.stats()["prewarm"]
    assert prewarm["state"] == "done" and prewarm["listed"] > 0, prewarm
    assert prewarm["imported"] + prewarm["present"] + prewarm["failed"] == prewarm["listed"], prewarm
    assert warm["fallbacks"] == 0, warm["fallback_reasons"]
    # models compiled whole load their saved graphs: nothing is traced (nexfort_engine/precompile.py)
    loaded = [m for m in warm["models"].values() if m.get("precompiled") == "on"]
    assert loaded and all(m["compiles"] == 0 and m["precompiled_graphs"] >= 1 for m in loaded), warm
    assert warm["cache_hits"] > 0, f"restart did not hit the persisted cache: {warm}"
    assert warm["cache_misses"] == 0, f"restart compiled cold again ({warm['cache_misses']} misses): {warm}"

    # steady state: the engine times every compiled call that neither compiled nor loaded a graph;
    # the demo reports that time per call next to ComfyUI's per-step times (scripts/demo.py)
    before = comfy.stats()
    again = _run(comfy, COMPILED_WORKFLOW)
    after = comfy.stats()
    graph = comfy_server.load_workflow(COMPILED_WORKFLOW)
    steps = graph[comfy_server.find_node(graph, "KSampler")]["inputs"]["steps"]
    assert after["engine"]["calls"] - before["engine"]["calls"] == steps  # one UNet call per step (CFG batched)
    per_call = demo._compiled_call_seconds(before, after)
    assert per_call is not None and 0 < per_call * steps < again.execution_seconds, (per_call, again.execution_seconds)
    assert demo._compiled_call_seconds(after, after) is None  # no calls in between: nothing to report


def test_background_compile_through_the_server(comfy, nexfort_cache_dir):
    """``"background": true`` in a real ComfyUI: the first prompt samples eager while a child
    process compiles (it imports ComfyUI and the engine from the server's ``sys.path`` and parses
    the server's command line); a prompt after the child is done runs the graph it committed,
    with nothing compiled in the server."""
    import time

    graph = comfy_server.load_workflow(COMPILED_WORKFLOW)
    node = comfy_server.find_node(graph, "NexfortCompileModel")
    # O1: another cache entry than the other tests' O2 compiles, so this one starts cold
    graph[node]["inputs"]["options"] = json.dumps({"mode": "O1", "background": True})

    def record() -> dict:
        models = [m for m in _engine(comfy)["models"].values() if m.get("config") == "cache-all:jit"]
        assert len(models) == 1, _engine(comfy)["models"]
        return models[0]

    first = comfy.run(comfy_server.set_seed(graph, next(_seeds)), timeout=900)
    assert first.status.get("status_str") == "success", first.status
    assert first.images
    rec = record()
    assert rec["state"] == "background" and rec["background"].startswith("running"), rec
    assert rec["compiles"] == 0 and rec["fallbacks"] == 0
    job = nexfort_cache_dir / "jobs" / rec["cache_key"]
    assert (job / "child.log").is_file()

    pid = int(rec["background"].removeprefix("running (pid ").rstrip(")"))
    deadline = time.monotonic() + 900  # the child writes its report as it finishes
    while not (job / "result.json").is_file():
        assert time.monotonic() < deadline, (job / "child.log").read_text()[-3000:]
        time.sleep(0.5)
    reported = time.monotonic()
    while procs.alive(pid):  # and exits at once (background.exit_now), its compile pool with it
        assert time.monotonic() < reported + 60, f"the child {pid} is still running after its report"
        time.sleep(0.1)
    assert time.monotonic() - reported < 5, time.monotonic() - reported

    second = comfy.run(comfy_server.set_seed(graph, next(_seeds)), timeout=900)
    assert second.status.get("status_str") == "success", second.status
    rec = record()
    assert rec["state"] == "compiled" and rec["background"].startswith("done in "), rec
    assert rec["compiles"] == 0 and rec["cache_hits"] == 1 and rec["fallbacks"] == 0, rec
