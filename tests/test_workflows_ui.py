"""The UI-format workflows against a real server's ``/object_info``: the examples users open
(``example_workflows/``, on their own models) and the tiny-checkpoint ones the demo and the tests run
(``tests/workflows/ui``). Node types exist, ``widgets_values`` match each schema (count, order, types,
combo options; an example's model file names need not be on this server), links join existing slots
of matching types, and every UI graph equals its API twin.

Also: our nodes' schemas carry a description, a ``nexfort/`` category and a tooltip per input.
Nothing here runs a prompt, so these tests cost no compile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
API_DIR = REPO / "tests" / "workflows" / "api"
UI_DIR = REPO / "tests" / "workflows" / "ui"
EXAMPLE_DIR = REPO / "example_workflows"
EXAMPLE_API_DIR = EXAMPLE_DIR / "api"
#: UI directory -> its API twins' directory
SETS = {UI_DIR: API_DIR, EXAMPLE_DIR: EXAMPLE_API_DIR}
UI_WORKFLOWS = sorted(UI_DIR.glob("*.json")) + sorted(EXAMPLE_DIR.glob("*.json"))
OUR_NODES = ["NexfortCompileModel", "NexfortCompileVAE", "NexfortCompileControlNet", "NexfortCacheManager"]
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
MAX_TOOLTIP = 160
#: the loaders' file-name inputs (an example names the user's model file, not on the test server)
MODEL_FILE_INPUTS = {"ckpt_name", "unet_name", "clip_name", "vae_name", "lora_name", "control_net_name"}


@pytest.fixture(scope="module")
def object_info(comfy_server_instance, workflow_assets) -> dict:
    """The schemas, with the tiny checkpoint and LoRA in place so the loaders' combos list them."""
    if not comfy_server_instance.running:  # an earlier test stopped the shared server
        comfy_server_instance.start()
    return comfy_server_instance.object_info()


def _extra(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def _is_widget(spec: list) -> bool:
    return not _extra(spec).get("forceInput") and (isinstance(spec[0], list) or spec[0] in WIDGET_TYPES)


def _ordered(info: dict) -> list[tuple[str, list]]:
    order = info.get("input_order") or {g: list(info["input"].get(g, {})) for g in ("required", "optional")}
    return [(n, info["input"][g][n]) for g in ("required", "optional") for n in order.get(g, [])]


def _widget_slots(info: dict) -> list[tuple[str, list | None]]:
    """The frontend's widgets_values layout: (input name, spec), with (name, None) for the
    control_after_generate value the frontend adds after a seed."""
    slots = []
    for name, spec in _ordered(info):
        if _is_widget(spec):
            slots.append((name, spec))
            if spec[0] == "INT" and (_extra(spec).get("control_after_generate") or name in ("seed", "noise_seed")):
                slots.append((name, None))
    return slots


def _sockets(info: dict) -> list[tuple[str, str]]:
    return [(n, s[0]) for n, s in _ordered(info) if not _is_widget(s)]


def _combo_options(spec: list) -> list:
    return spec[0] if isinstance(spec[0], list) else _extra(spec).get("options", [])


def _check_value(where: str, spec: list, value, model_file: bool = False) -> None:
    """``model_file``: a loader's file-name combo in an example (the user's model, not on this server):
    any non-empty string."""
    kind, extra = ("COMBO" if isinstance(spec[0], list) else spec[0]), _extra(spec)
    if kind == "COMBO" and model_file:
        assert isinstance(value, str) and value.endswith((".safetensors", ".ckpt", ".pt", ".pth", ".gguf")), (
            f"{where}: {value!r} is not a model file name")
    elif kind == "COMBO":
        options = _combo_options(spec)
        assert value in options, f"{where}: {value!r} is not one of {options[:20]}"
    elif kind == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r} is not an INT"
    elif kind == "FLOAT":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: {value!r} not FLOAT"
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), f"{where}: {value!r} is not a BOOLEAN"
    elif kind == "STRING":
        assert isinstance(value, str), f"{where}: {value!r} is not a STRING"
    if kind in ("INT", "FLOAT"):
        if "min" in extra:
            assert value >= extra["min"], f"{where}: {value} < min {extra['min']}"
        if "max" in extra:
            assert value <= extra["max"], f"{where}: {value} > max {extra['max']}"


def _newer_comfyui() -> bool:
    """Whether the ComfyUI under test is newer than the floor (0.3.75), from its comfyui_version.py."""
    import re

    import tiny_models

    text = (tiny_models.host_dir() / "comfyui_version.py").read_text()
    version = tuple(int(v) for v in re.search(r"(\d+)\.(\d+)\.(\d+)", text).groups())
    return version > (0, 3, 75)


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _ui_to_api(ui: dict, object_info: dict) -> dict:
    """The API graph a UI graph queues (what the frontend's graphToPrompt would send)."""
    links = {lk[0]: lk for lk in ui["links"]}
    graph = {}
    for node in ui["nodes"]:
        info = object_info[node["type"]]
        values = iter(node.get("widgets_values") or [])
        inputs = {}
        for name, spec in _widget_slots(info):
            value = next(values)
            if spec is not None:
                inputs[name] = value
        for inp in node.get("inputs") or []:
            if inp.get("link") is not None:
                lk = links[inp["link"]]
                inputs[inp["name"]] = [str(lk[1]), lk[2]]
        graph[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return graph


@pytest.mark.parametrize("ui_dir", list(SETS), ids=["tests", "examples"])
def test_every_api_workflow_has_a_ui_twin(ui_dir):
    api = {p.name for p in SETS[ui_dir].glob("*.json")}
    ui = {p.name for p in ui_dir.glob("*.json")}
    assert api == ui, f"API without UI twin: {sorted(api - ui)}; UI without API twin: {sorted(ui - api)}"


def test_examples_name_real_model_files_and_have_thumbnails():
    """The examples run on the user's models (never the tiny test checkpoint), and each has the
    thumbnail ComfyUI's template browser shows (``<name>.jpg`` beside it)."""
    examples = sorted(EXAMPLE_DIR.glob("*.json"))
    assert len(examples) >= 3
    for path in examples:
        assert "nexfort-tiny" not in path.read_text(), f"{path.name} loads the tiny test checkpoint"
        assert path.with_suffix(".jpg").is_file(), f"{path.name} has no thumbnail {path.stem}.jpg"


def _wid(workflow: Path) -> str:
    return f"{workflow.parent.name}/{workflow.stem}"


@pytest.mark.parametrize("workflow", UI_WORKFLOWS, ids=[_wid(w) for w in UI_WORKFLOWS])
def test_ui_workflow_matches_schemas(object_info, workflow):
    ui = _load(workflow)
    assert ui.get("version") == 0.4 and isinstance(ui.get("nodes"), list) and isinstance(ui.get("links"), list)
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]), "duplicate node ids"
    assert ui["last_node_id"] >= max(nodes), "last_node_id is below a node id"
    assert ui["last_link_id"] >= max((lk[0] for lk in ui["links"]), default=0)
    unknown = sorted({n["type"] for n in ui["nodes"]} - set(object_info))
    assert not unknown, f"{workflow.name}: node types not in /object_info: {unknown}"

    for node in ui["nodes"]:
        where = f"{workflow.name} node {node['id']} ({node['type']})"
        info = object_info[node["type"]]
        slots = _widget_slots(info)
        values = node.get("widgets_values") or []
        assert len(values) == len(slots), (
            f"{where}: {len(values)} widgets_values {values} for widgets {[s[0] for s in slots]}")
        for (name, spec), value in zip(slots, values, strict=True):
            if spec is None:
                assert value in CONTROL_VALUES, f"{where}: control_after_generate of {name} is {value!r}"
            else:
                model_file = workflow.parent == EXAMPLE_DIR and name in MODEL_FILE_INPUTS
                _check_value(f"{where} widget {name}", spec, value, model_file)
        # sockets: names/types as in the schema, required ones linked
        want = _sockets(info)
        have = [(i["name"], i["type"]) for i in node.get("inputs") or [] if "widget" not in i]
        assert have == want, f"{where}: socket inputs {have}, schema {want}"
        required = set(info["input"].get("required", {}))
        for inp in node.get("inputs") or []:
            if inp["name"] in required and "widget" not in inp:
                assert inp.get("link") is not None, f"{where}: required input {inp['name']} is unlinked"
        # outputs: the schema's types in order; a newer ComfyUI may add outputs after them (its SaveImage
        # passes the images on) and names a V3 node's output by its id where 0.3.75 used its type
        outs = node.get("outputs") or []
        schema = list(zip(info["output_name"], info["output"], strict=True))
        assert [o["type"] for o in outs] == [t for _, t in schema[: len(outs)]] and len(outs) <= len(schema), (
            f"{where}: outputs {outs}, schema {schema}")
        assert len(outs) == len(schema) or _newer_comfyui(), f"{where}: outputs {outs}, schema {schema}"
        for o, (name, type_) in zip(outs, schema, strict=False):
            assert o["name"] in (name, type_), f"{where}: output {o['name']!r}, schema {name!r} ({type_})"

    seen = set()
    for link in ui["links"]:
        link_id, src, src_slot, dst, dst_slot, ltype = link
        assert link_id not in seen, f"{workflow.name}: duplicate link id {link_id}"
        seen.add(link_id)
        assert src in nodes and dst in nodes, f"{workflow.name}: link {link} joins a missing node"
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert out["type"] == ltype == inp["type"], f"{workflow.name}: link {link} types {out['type']}->{inp['type']}"
        assert link_id in (out.get("links") or []), f"{workflow.name}: output of {src} does not list link {link_id}"
        assert inp["link"] == link_id, f"{workflow.name}: input of {dst} points at {inp['link']}, not {link_id}"
    for node in ui["nodes"]:
        for inp in node.get("inputs") or []:
            assert inp.get("link") is None or inp["link"] in seen, f"{workflow.name}: dangling link {inp}"
        for out in node.get("outputs") or []:
            for lk in out.get("links") or []:
                assert lk in seen, f"{workflow.name}: node {node['id']} lists unknown link {lk}"


@pytest.mark.parametrize("workflow", UI_WORKFLOWS, ids=[_wid(w) for w in UI_WORKFLOWS])
def test_ui_workflow_equals_its_api_twin(object_info, workflow):
    api_path = SETS[workflow.parent] / workflow.name
    assert api_path.is_file(), f"{workflow.name} has no API twin in {SETS[workflow.parent]}"
    api = {nid: {"class_type": n["class_type"], "inputs": n["inputs"]} for nid, n in _load(api_path).items()}
    assert _ui_to_api(_load(workflow), object_info) == api, (
        f"{workflow.name} differs from its API twin: regenerate with scripts/make_ui_workflows.py")


@pytest.mark.parametrize("node", OUR_NODES)
def test_our_nodes_document_every_input(object_info, node):
    info = object_info[node]
    assert info.get("description", "").strip(), f"{node} has no description"
    assert info["category"].startswith("nexfort/"), f"{node} category {info['category']!r}"
    inputs = _ordered(info)
    assert inputs, f"{node} lists no inputs"
    missing = [name for name, spec in inputs if not _extra(spec).get("tooltip", "").strip()]
    assert not missing, f"{node}: inputs without a tooltip: {missing}"
    # a tooltip is one line; the longer help is in docs/, linked from the description
    long = {name: len(_extra(spec)["tooltip"]) for name, spec in inputs
            if len(_extra(spec)["tooltip"]) > MAX_TOOLTIP or "\n" in _extra(spec)["tooltip"]}
    assert not long, f"{node}: tooltips over {MAX_TOOLTIP} characters or with line breaks: {long}"
    assert "/docs/" in info["description"], f"{node}: the description links no docs/ page"
    tips = info.get("output_tooltips") or []
    assert len(tips) == len(info["output"]) and all(tips), f"{node}: output tooltips {tips}"
