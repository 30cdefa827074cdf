"""The status badge of ``web/nexfort.js`` in a real ComfyUI front end, driven by headless Chromium.

The session's shared ComfyUI server (``tests/conftest.py``: isolated base directory, tiny checkpoint)
serves the installed front end and this pack. If nothing has compiled yet in this session, the test
runs ``tests/workflows/api/txt2img_compiled.json`` once, so ``GET /nexfort/stats`` holds a real model
record for its Compile Model node ("2"). Debian's chromium (``scripts/setup_browser.sh``; Playwright
drives it through ``executable_path`` and never downloads a browser) opens the UI, a workflow with
our nodes (same node id) is loaded through ``app.loadGraphData``, and each badge is checked three
ways: the text the extension computed, its colour painted on the canvas inside the node's region
(screenshots saved under pytest's tmp dir), and the state the server reports. Further states
(compiling, fell back, route missing) are served to the page through request routing.

Skips only when chromium cannot be installed on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
HOST = Path(os.environ.get("NEXFORT_HOST", REPO / ".host" / "ComfyUI"))
COMPILED_WORKFLOW = REPO / "tests" / "workflows" / "api" / "txt2img_compiled.json"

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}

# Badge backgrounds from web/nexfort.js (LOOK).
COLORS = {
    "idle": (0x54, 0x6E, 0x7A),
    "compiling": (0x9A, 0x6B, 0x00),
    "background": (0x6A, 0x4C, 0x93),
    "compiled": (0x2E, 0x7D, 0x32),
    "fallback": (0xB3, 0x26, 0x1E),
    "cache": (0x1F, 0x5F, 0xA8),
}

COMPILE_ID, CACHE_ID = 2, 9  # COMPILE_ID: the Compile Model node of COMPILED_WORKFLOW


def _workflow() -> dict:
    """UI-format graph with a Compile Model and a Cache Manager node, view at scale 1."""

    def node(nid: int, type_: str, pos: list[int]) -> dict:
        return {"id": nid, "type": type_, "pos": pos, "size": [340, 130], "flags": {}, "order": 0,
                "mode": 0, "inputs": [], "outputs": [], "properties": {}}

    return {
        "last_node_id": CACHE_ID, "last_link_id": 0,
        "nodes": [node(COMPILE_ID, "NexfortCompileModel", [120, 260]),
                  node(CACHE_ID, "NexfortCacheManager", [620, 260])],
        "links": [], "groups": [], "config": {},
        "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4,
    }


def _fake_stats(state: str, hits: int = 3, fallbacks: int = 0, skips: int = 0, breaks: int = 0) -> dict:
    model = {"compiles": 1, "recompiles": 0, "recompile_reasons": [], "cache_hits": hits, "cache_misses": 1,
             "fallbacks": fallbacks, "fallback_reasons": ["boom"] * fallbacks, "compile_seconds": 1.5,
             "cudagraph_skips": skips, "graph_breaks": breaks, "graph_break_reasons": ["item()"] * breaks,
             "state": state, "node_ids": [str(COMPILE_ID)]}
    engine = {k: v for k, v in model.items() if k not in ("state", "node_ids")}
    engine["models"] = {} if state == "idle" else {"diffusion_model": model}
    cache = [{"key": "abc", "label": "diffusion_model", "size_bytes": 10, "hits": 4, "last_used": 0.0},
             {"key": "def", "label": "vae", "size_bytes": 10, "hits": 1, "last_used": 0.0}]
    return {"engine": engine, "cache": cache, "errors": []}


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium() -> str:
    """Path of Debian's chromium, installed by scripts/setup_browser.sh if missing."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup_browser.sh")], capture_output=True,
                          text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    path = lines[-1] if lines else ""
    if proc.returncode != 0 or not path or not os.access(path, os.X_OK):
        pytest.skip(f"chromium could not be installed (setup_browser.sh rc={proc.returncode}):\n"
                    f"{proc.stderr[-2000:]}")
    return path


@pytest.fixture(scope="module")
def server(comfy_server_instance, comfy_base):
    """The session's shared server (tests/conftest.py), running, with no first-run dialogs."""
    settings = comfy_base / "user" / "default" / "comfy.settings.json"
    if not settings.exists():  # no tutorial/template dialog over the canvas on first load
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    if not comfy_server_instance.running:
        comfy_server_instance.start()
    return comfy_server_instance


@pytest.fixture(scope="module")
def compiled_stats(server) -> dict:
    """Real stats holding a record for node COMPILE_ID (runs the compiled workflow once if needed)."""
    import comfy_server

    def record(stats):
        return [m for m in (stats or {}).get("engine", {}).get("models", {}).values()
                if str(COMPILE_ID) in map(str, m.get("node_ids", []))]

    stats = server.stats()
    if not record(stats):
        server.run(comfy_server.load_workflow(COMPILED_WORKFLOW), timeout=900)
        stats = server.stats()
    assert record(stats), f"no model record for node {COMPILE_ID} after running {COMPILED_WORKFLOW.name}: {stats}"
    return stats


@pytest.fixture(scope="module")
def page(chromium, server, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    errors: list[str] = []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=CHROMIUM_FLAGS,
            viewport=VIEWPORT, device_scale_factor=1)
        try:
            pg = ctx.new_page()
            # Errors raised by our script (other front-end noise, e.g. blocked registry look-ups, is not ours).
            pg.on("pageerror", lambda e: errors.append(f"pageerror: {e}\n{e.stack}")
                  if "nexfort.js" in (e.stack or "") else None)
            pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}")
                  if m.type == "error" and "nexfort.js" in (m.location or {}).get("url", "") else None)
            pg.goto(server.url, wait_until="domcontentloaded", timeout=120_000)
            # Our node types registered (from /object_info) and our extension loaded.
            pg.wait_for_function(
                "() => window.comfyAPI?.app?.app?.graph && window.nexfortStatus"
                " && window.LiteGraph?.registered_node_types?.NexfortCompileModel",
                timeout=120_000)
            # newer front ends load their default workflow after the app is up: load ours until it stays
            pg.wait_for_function(_LOAD_OURS, arg=_workflow(), timeout=120_000, polling=1000)
            pg.nexfort_errors = errors
            yield pg
        finally:
            ctx.close()


# -- helpers -------------------------------------------------------------------------------------

#: load the workflow whenever the graph does not hold its nodes; true once it has held them for
#: three polls in a row (newer front ends load their default workflow a while after the app is up,
#: over ours; their node ids are strings: compare as strings)
_LOAD_OURS = """(wf) => {
    const app = window.comfyAPI.app.app;
    const nodes = app.graph?.nodes ?? app.graph?._nodes ?? [];
    const has = wf.nodes.every((w) => nodes.some(
        (n) => String(n.id) === String(w.id) && (n.comfyClass ?? n.type) === w.type));
    if (!has) {
        window.__nexfortStable = 0;
        if (!window.__nexfortLoading) {
            window.__nexfortLoading = Promise.resolve(app.loadGraphData(wf, true, true))
                .finally(() => { window.__nexfortLoading = null; });
        }
        return false;
    }
    window.__nexfortStable = (window.__nexfortStable ?? 0) + 1;
    return window.__nexfortStable >= 3;
}"""


def _status(pg, node_id: int) -> dict:
    """Force a stats refresh and a full canvas redraw; return the node's badge state + screen box."""
    return pg.evaluate(
        """async (id) => {
            const app = window.comfyAPI.app.app;
            await window.nexfortStatus.refresh();
            const node = (app.graph.nodes ?? app.graph._nodes ?? []).find((n) => String(n.id) === String(id));
            app.canvas.draw(true, true);
            const [x, y, w, h] = node.getBounding();
            const ds = app.canvas.ds;
            const r = app.canvas.canvas.getBoundingClientRect();
            const [sx, sy] = ds.convertOffsetToCanvas([x, y]);
            return {status: node.nexfortStatus, type: node.comfyClass ?? node.type,
                    box: [r.left + sx, r.top + sy - 40 * ds.scale, w * ds.scale, h * ds.scale + 40 * ds.scale]};
        }""",
        node_id,
    )


def _shot(pg, path: Path, box: list[float]):
    from PIL import Image

    pg.screenshot(path=str(path))
    img = Image.open(path).convert("RGB")
    x, y, w, h = box
    region = img.crop((max(0, int(x)), max(0, int(y)), min(img.width, int(x + w)), min(img.height, int(y + h))))
    return img, region


def _count_color(colors: list[tuple[int, tuple]], rgb: tuple[int, int, int], tol: int = 10) -> int:
    """Pixels within ``tol`` of ``rgb``, from ``Image.getcolors()`` output."""
    return sum(n for n, c in colors if all(abs(a - b) <= tol for a, b in zip(c, rgb)))


def _assert_badge(pg, tmp_path: Path, name: str, node_id: int, state: str, *texts: str) -> None:
    info = _status(pg, node_id)
    status = info["status"]
    assert status and status["state"] == state, info
    for t in texts:
        assert t in status["text"], status
    img, region = _shot(pg, tmp_path / f"{name}.png", info["box"])
    # Non-blank: the node's region has structure, and the badge's colour is painted inside it.
    colors = region.getcolors(maxcolors=1 << 16) or []
    assert len(colors) > 20, f"node region of {name}.png looks blank ({len(colors)} colours)"
    background = img.getpixel((VIEWPORT["width"] - 5, VIEWPORT["height"] // 2))
    assert any(c != background for _, c in colors)
    painted = _count_color(colors, COLORS[state])
    assert painted > 150, f"badge colour {COLORS[state]} not painted in {name}.png ({painted} px): {status}"


# -- tests ---------------------------------------------------------------------------------------

def test_server_serves_route_and_extension(server):
    assert "/extensions/nexfort/nexfort.js" in server.get_json("/extensions")
    stats = server.stats()
    assert stats is not None, "GET /nexfort/stats is not registered (nodes/__init__.py -> routes.register_routes)"
    assert set(stats) >= {"engine", "cache"}
    for key in ("compiles", "recompiles", "recompile_reasons", "cache_hits", "cache_misses", "fallbacks",
                "fallback_reasons", "compile_seconds", "models"):
        assert key in stats["engine"], key
    assert isinstance(stats["cache"], list)
    assert server.get_json("/api/nexfort/stats").keys() == stats.keys()


def _expected(stats: dict, node_id: int) -> tuple[str, tuple[str, ...]]:
    """What web/nexfort.js should show for a Compile node: (state, substrings of the text)."""
    models = [m for m in stats["engine"]["models"].values() if str(node_id) in map(str, m.get("node_ids", []))]
    if not models:
        return "idle", ("not run yet",)
    states = [m.get("state") for m in models]
    state = next((s for s in ("compiling", "background", "fallback", "pending", "compiled") if s in states), "pending")
    return state, (f"{sum(m.get('cache_hits', 0) for m in models)} cache hit",)


def test_badge_shows_real_state_of_compiled_workflow(page, server, compiled_stats, tmp_path):
    names = page.evaluate("() => window.comfyAPI.app.app.extensions.map((e) => e.name)")
    assert "nexfort.status" in names
    assert _status(page, COMPILE_ID)["type"] == "NexfortCompileModel"

    real = server.stats()
    state, texts = _expected(real, COMPILE_ID)
    assert state == "compiled", f"the compiled workflow's model is {state!r}: {real['engine']}"
    _assert_badge(page, tmp_path, "real-compile", COMPILE_ID, state, "compiled", *texts)

    hits = sum(e.get("hits", 0) for e in real["cache"])
    n = len(real["cache"])
    _assert_badge(page, tmp_path, "real-cache", CACHE_ID, "cache",
                  "1 entry" if n == 1 else f"{n} entries", f"{hits} hit")
    assert not page.nexfort_errors


@pytest.mark.parametrize(
    ("state", "fallbacks", "skips", "breaks", "texts"),
    [("idle", 0, 0, 0, ("not run yet",)),
     ("compiling", 0, 0, 0, ("compiling",)),
     ("background", 0, 0, 0, ("compiling in background",)),
     ("compiled", 0, 0, 0, ("compiled", "3 cache hits")),
     ("fallback", 2, 0, 0, ("fell back", "2 fallbacks")),
     ("compiled", 0, 2, 0, ("compiled", "2 CUDA-graph skips")),  # graphs run kernel by kernel
     ("compiled", 0, 0, 1, ("compiled", "1 graph break"))],  # compiled in pieces (a patch, usually)
)
def test_badge_follows_stats(page, tmp_path, state, fallbacks, skips, breaks, texts):
    """Every state the engine reports is drawn (stats served by the test through request routing)."""
    body = json.dumps(_fake_stats(state, fallbacks=fallbacks, skips=skips, breaks=breaks))
    page.route("**/nexfort/stats", lambda route: route.fulfill(status=200, content_type="application/json",
                                                               body=body))
    try:
        _assert_badge(page, tmp_path, f"fake-{state}", COMPILE_ID, state, *texts)
        _assert_badge(page, tmp_path, f"fake-{state}-cache", CACHE_ID, "cache", "2 entries", "5 hits")
    finally:
        page.unroute("**/nexfort/stats")
    assert not page.nexfort_errors


def test_missing_route_hides_badges_without_errors(page, tmp_path):
    page.route("**/nexfort/stats", lambda route: route.fulfill(status=404, body="404: Not Found"))
    try:
        info = _status(page, COMPILE_ID)
        assert info["status"] is None
        page.screenshot(path=str(tmp_path / "no-route.png"))
    finally:
        page.unroute("**/nexfort/stats")
    assert _status(page, COMPILE_ID)["status"] is not None  # back once the route answers again
    assert not page.nexfort_errors
