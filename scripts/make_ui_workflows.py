"""Generate the UI-format twins (what users drag onto the ComfyUI canvas) of every API-format workflow,
from the node schemas in ``/object_info``: ``example_workflows/api/*.json`` -> ``example_workflows/*.json``
(the user's models; ComfyUI's template browser lists them) and ``tests/workflows/api/*.json`` ->
``tests/workflows/ui/*.json`` (the embedded tiny checkpoint: the demo and the tests).

Each UI node keeps its API node id; ``widgets_values`` follow the frontend's order: the schema's
``input_order`` (required, then optional), widget-typed inputs only, with KSampler-style
``control_after_generate`` value ("fixed") right after an INT input that asks for one (the seed).

    python scripts/make_ui_workflows.py                      # starts a throwaway server for /object_info
    python scripts/make_ui_workflows.py --url http://127.0.0.1:8188
    python scripts/make_ui_workflows.py --object-info object_info.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
API_DIR = REPO / "tests" / "workflows" / "api"
UI_DIR = REPO / "tests" / "workflows" / "ui"
EXAMPLE_API_DIR = REPO / "example_workflows" / "api"
EXAMPLE_DIR = REPO / "example_workflows"
#: (API-format sources, where their UI twins go)
SETS = {"tests": (API_DIR, UI_DIR), "examples": (EXAMPLE_API_DIR, EXAMPLE_DIR)}

#: input types the frontend draws as widgets (anything else, e.g. MODEL, is a socket)
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUE = "fixed"  # keep the shipped seed: reproducible results


def is_widget(spec: list) -> bool:
    kind = spec[0]
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if extra.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def has_control(name: str, spec: list) -> bool:
    extra = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return spec[0] == "INT" and bool(extra.get("control_after_generate") or name in ("seed", "noise_seed"))


def ordered_inputs(info: dict) -> list[tuple[str, list]]:
    """(name, spec) of a node's required then optional inputs, in ``input_order``."""
    spec = info["input"]
    order = info.get("input_order") or {k: list(spec.get(k, {})) for k in ("required", "optional")}
    out = []
    for group in ("required", "optional"):
        for name in order.get(group, []):
            out.append((name, spec[group][name]))
    return out


def socket_type(spec: list) -> str:
    return "COMBO" if isinstance(spec[0], list) else spec[0]


def _layout(graph: dict) -> tuple[dict[str, list[float]], dict[str, int]]:
    depth: dict[str, int] = {}

    def d(nid: str) -> int:
        if nid not in depth:
            ups = [str(v[0]) for v in graph[nid]["inputs"].values() if isinstance(v, list)]
            depth[nid] = 1 + max((d(u) for u in ups), default=-1)
        return depth[nid]

    rows: dict[int, int] = {}
    pos = {}
    for nid in graph:
        col = d(nid)
        row = rows.get(col, 0)
        rows[col] = row + 1
        pos[nid] = [50 + 400 * col, 50 + 300 * row]
    return pos, depth


def api_to_ui(graph: dict, object_info: dict) -> dict:
    ids = sorted(graph, key=int)
    pos, depth = _layout(graph)
    run_order = {nid: i for i, nid in enumerate(sorted(ids, key=lambda n: (depth[n], int(n))))}
    links: list[list] = []
    nodes = {}
    for nid in ids:
        api = graph[nid]
        info = object_info[api["class_type"]]
        inputs, widgets = [], []
        for name, spec in ordered_inputs(info):
            value = api["inputs"].get(name)
            if is_widget(spec) and isinstance(value, list):
                raise ValueError(f"node {nid}: widget {name!r} driven by a link is not supported here")
            if is_widget(spec):
                if name not in api["inputs"]:
                    raise ValueError(f"node {nid} ({api['class_type']}): widget {name!r} has no value")
                widgets.append(value)
                if has_control(name, spec):
                    widgets.append(CONTROL_VALUE)
            elif not is_widget(spec):
                inputs.append({"name": name, "type": socket_type(spec), "link": None})
        nwidgets = sum(1 for _, s in ordered_inputs(info) if is_widget(s))
        node = {
            "id": int(nid),
            "type": api["class_type"],
            "pos": pos[nid],
            "size": [320, 80 + 26 * (nwidgets + len(inputs))],
            "flags": {},
            "order": run_order[nid],
            "mode": 0,
            "inputs": inputs,
            "outputs": [{"name": n, "type": t, "links": [], "slot_index": i}
                        for i, (n, t) in enumerate(zip(info["output_name"], info["output"], strict=True))],
            "properties": {"Node name for S&R": api["class_type"]},
            "widgets_values": widgets,
        }
        if api.get("_meta", {}).get("title"):
            node["title"] = api["_meta"]["title"]
        nodes[nid] = node
    # links, in target order
    for nid in ids:
        node = nodes[nid]
        optional = set(object_info[node["type"]]["input"].get("optional", {}))
        for slot, inp in enumerate(node["inputs"]):
            src = graph[nid]["inputs"].get(inp["name"])
            if src is None and inp["name"] in optional:
                continue  # an optional socket left open (ControlNetApplyAdvanced's vae): "link": null
            if not isinstance(src, list):
                raise ValueError(f"node {nid} ({node['type']}): socket input {inp['name']!r} is not linked")
            src_id, src_slot = str(src[0]), int(src[1])
            link_id = len(links) + 1
            ltype = nodes[src_id]["outputs"][src_slot]["type"]
            links.append([link_id, int(src_id), src_slot, int(nid), slot, ltype])
            inp["link"] = link_id
            nodes[src_id]["outputs"][src_slot]["links"].append(link_id)
    for node in nodes.values():
        if not node["inputs"]:
            del node["inputs"]
        for out in node["outputs"]:
            if not out["links"]:
                out["links"] = None
        if not node["outputs"]:
            del node["outputs"]
    return {
        "last_node_id": max(int(i) for i in ids),
        "last_link_id": len(links),
        "nodes": [nodes[i] for i in ids],
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"offset": [0, 0], "scale": 1}},
        "version": 0.4,
    }


def fetch_object_info(url: str | None) -> dict:
    if url:
        with urllib.request.urlopen(url.rstrip("/") + "/object_info", timeout=60) as r:
            return json.load(r)
    sys.path.insert(0, str(REPO / "scripts"))
    import comfy_server

    host = os.environ.get("NEXFORT_HOST", str(REPO / ".host" / "ComfyUI"))
    with tempfile.TemporaryDirectory() as tmp:
        base = comfy_server.make_base_dir(Path(tmp) / "base")
        env = {"NEXFORT_CACHE_DIR": str(Path(tmp) / "cache")}
        with comfy_server.ComfyServer(host, base_dir=base, env=env) as srv:
            return srv.object_info()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running ComfyUI with the pack (default: start one)")
    ap.add_argument("--object-info", type=Path, help="a saved /object_info JSON instead of a server")
    ap.add_argument("--set", choices=[*SETS, "all"], default="all", help="which workflows (default: all)")
    args = ap.parse_args(argv)
    info = json.loads(args.object_info.read_text()) if args.object_info else fetch_object_info(args.url)
    for name, (api_dir, ui_dir) in SETS.items():
        if args.set not in (name, "all"):
            continue
        ui_dir.mkdir(parents=True, exist_ok=True)
        for api_path in sorted(api_dir.glob("*.json")):
            ui = api_to_ui(json.loads(api_path.read_text()), info)
            dest = ui_dir / api_path.name
            dest.write_text(json.dumps(ui, indent=2) + "\n")
            print(f"{api_path.relative_to(REPO)} -> {dest.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
