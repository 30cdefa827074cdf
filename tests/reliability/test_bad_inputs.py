"""Bad inputs through POST /prompt are refused at queue time with HTTP 400 and node_errors that say
what is valid — nothing is queued, nothing compiles.

Note on ``"dynamic": "yes"``: as a *widget* value ComfyUI itself coerces any BOOLEAN input with
``bool(val)`` (execution.py), so the widget accepts it as True; the wrong type is caught where a
user can actually write it — in the options JSON — and that is what is tested here.
"""

from __future__ import annotations

import json
import urllib.error

import pytest
from reliability_helpers import engine, lora_graph

pytestmark = pytest.mark.integration

MODE_FLAGS = ("max-autotune", "cudagraphs", "freezing", "low-precision", "cache-all")


def _post(server, graph: dict) -> tuple[int, dict]:
    try:
        resp = server.request("POST", "/prompt", {"prompt": graph, "client_id": server.client_id})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")
    return 200, resp


def _errors(body: dict, node_id: str) -> list[dict]:
    node = body.get("node_errors", {}).get(node_id)
    assert node, f"node {node_id} not named in node_errors: {json.dumps(body)[:2000]}"
    return node["errors"]


def _text(errors: list[dict]) -> str:
    return " ".join(f"{e.get('type')} {e.get('message')} {e.get('details')}" for e in errors)


CASES = {
    "unknown_mode_flag": ('{"mode": "O2:turbo"}', ["unknown mode flag 'turbo'", *MODE_FLAGS, "'O1'", "'O3'"]),
    "malformed_json": ('{"mode": "O2",', ["not valid JSON", "line 1"]),
    "dynamic_not_bool": ('{"dynamic": "yes"}', ["'dynamic' must be true or false", "'yes'"]),
    "unknown_key": ('{"mdoe": "O2"}', ["unknown option key", "'mode'", "'memory_format'", "'dynamic'"]),
    "bad_memory_format": ('{"memory_format": "nhwc"}', ["'contiguous'", "'channels_last'"]),
    "bad_backend": ('{"backend": "tensorrt"}', ["'inductor'", "'aot_eager'", "'eager'"]),
    "not_an_inductor_key": ('{"options": {"inductor.no_such_setting": 1}}', ["not an Inductor config key"]),
    "inductor_wrong_type": ('{"options": {"inductor.max_autotune": "yes"}}', ["must be true or false"]),
    "options_not_object": ('["O2"]', ["must be a JSON object"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_options_json_refused_at_queue_time(srv, case):
    options, needles = CASES[case]
    before = engine(srv)
    code, body = _post(srv, lora_graph(options=options))
    assert code == 400, f"{case}: expected HTTP 400, got {code}: {body}"
    text = _text(_errors(body, "2"))
    assert "custom_validation_failed" in text and "nexfort:" in text, text
    for needle in needles:
        assert needle in text, f"{case}: {needle!r} missing from the error: {text}"
    assert engine(srv)["compiles"] == before["compiles"], "a refused prompt must not compile anything"


def test_mode_not_in_dropdown_refused(srv):
    graph = lora_graph()
    graph["2"]["inputs"]["mode"] = "O4"
    code, body = _post(srv, graph)
    assert code == 400, body
    details = _text(_errors(body, "2"))
    for valid in ("O1", "O2", "O3", "max-autotune", "jit:disable-runtime-fusion"):
        assert f"'{valid}'" in details, f"valid mode {valid} not named: {details}"


def test_memory_format_not_in_dropdown_refused(srv):
    graph = lora_graph()
    graph["2"]["inputs"]["memory_format"] = "nchw"
    code, body = _post(srv, graph)
    assert code == 400, body
    details = _text(_errors(body, "2"))
    assert "'contiguous'" in details and "'channels_last'" in details, details


def test_cache_manager_action_not_in_dropdown_refused(srv):
    graph = {"1": {"class_type": "NexfortCacheManager",
                   "inputs": {"action": "delete_everything", "key": "", "bundle_path": "x.tar.gz"}}}
    code, body = _post(srv, graph)
    assert code == 400, body
    details = _text(_errors(body, "1"))
    for valid in ("refresh", "clear_all", "clear_model", "export_bundle", "import_bundle"):
        assert valid in details, details


@pytest.mark.parametrize("width", [0, 10**6])
def test_absurd_latent_size_refused_by_comfyui(srv, width):
    graph = lora_graph()
    graph["5"]["inputs"]["width"] = width
    code, body = _post(srv, graph)
    assert code == 400, body
    errors = _errors(body, "5")
    want = "value_smaller_than_min" if width == 0 else "value_bigger_than_max"
    assert errors[0]["type"] == want, errors


def test_wrong_widget_type_refused_by_comfyui(srv):
    graph = lora_graph()
    graph["5"]["inputs"]["batch_size"] = "two"
    code, body = _post(srv, graph)
    assert code == 400, body
    assert _errors(body, "5")[0]["type"] == "invalid_input_type"
