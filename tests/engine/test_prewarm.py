"""nexfort_engine.prewarm (the compile stack's modules imported in a background thread) and
nexfort_engine.threads (CUDA-graph trees' per-thread state).

Imports depend on what a process has imported before, so the checks that import run in fresh
interpreters (subprocesses); the list's own logic runs in-process.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from pass_helpers import fresh

from nexfort_engine import prewarm

REPO = Path(__file__).resolve().parents[2]


def _fresh(script: str, *argv: str, env: dict | None = None) -> dict:
    """The JSON ``script`` prints last, run in a fresh interpreter with the repo importable."""
    return fresh(textwrap.dedent(script), str(REPO), *argv, env=env)


def test_allowed_names():
    assert prewarm.allowed("torch._inductor.lowering")
    assert prewarm.allowed("sympy.solvers.solveset") and prewarm.allowed("networkx.algorithms.flow")
    assert not prewarm.allowed("comfy.ldm.flux.model")  # host code
    assert not prewarm.allowed("nexfort_engine.compiler") and not prewarm.allowed("custom_nodes.x")
    assert not prewarm.allowed("c53j4ev4rmiqq62eefdrk5uay65fy2c6orfbg5q2qu24qx7zvsf7.kernel")  # Inductor output
    assert not prewarm.allowed("torch._inductor.runtime.compile_tasks.ckgflghaa4admngqbhxogcyur4k7pquq33jrfw5dtpwo3t2pw")
    assert not prewarm.allowed("torch._inductor.cudagraph_trees")  # per-thread state at import
    assert not prewarm.allowed("torch.__main__") and not prewarm.allowed("torch.bad-name")


def test_record_merges_in_order_and_a_bad_list_is_rebuilt(tmp_path, caplog):
    before = set(sys.modules) - {"torch.fx", "json"}
    assert prewarm.record(tmp_path, before) == ["torch.fx"]  # json is not a compile-stack module
    assert prewarm.load(tmp_path) == ["torch.fx"]
    assert prewarm.record(tmp_path, before) == []  # already listed
    assert prewarm.record(tmp_path, set(sys.modules) - {"torch.nn", "torch.fx"}) == ["torch.nn"]
    assert prewarm.load(tmp_path) == ["torch.fx", "torch.nn"]
    assert prewarm.record(None, before) == []  # no cache dir: nothing kept

    doc = json.loads((tmp_path / prewarm.FILE).read_text())
    doc["modules"].append("comfy.sd")  # a hand-edited list: names outside the allowlist are dropped
    (tmp_path / prewarm.FILE).write_text(json.dumps(doc))
    assert prewarm.load(tmp_path) == ["torch.fx", "torch.nn"]

    (tmp_path / prewarm.FILE).write_text("{not json")
    assert prewarm.load(tmp_path) == []
    assert "unreadable" in caplog.text and not (tmp_path / prewarm.FILE).exists()
    assert prewarm.record(tmp_path, before) == ["torch.fx"]  # the next first call writes it again
    (tmp_path / prewarm.FILE).write_text(json.dumps({"version": 0, "modules": ["torch.fx"]}))
    assert prewarm.load(tmp_path) == []  # another version: rebuilt too


START = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from nexfort_engine import prewarm
root, names, background = sys.argv[2], sys.argv[3].split(","), sys.argv[4] == "thread"
import torch  # what ComfyUI has imported before any prompt
json.dump({"version": prewarm.VERSION, "modules": names}, open(root + "/" + prewarm.FILE, "w"))
before = {n: n in sys.modules for n in names}
started = prewarm.start(root, background=background)
again = prewarm.start(root)  # once per process
prewarm.wait()
print(json.dumps({"started": started, "again": again, "before": before, "status": prewarm.status(),
                  "after": {n: n in sys.modules for n in names}}))
"""


@pytest.mark.parametrize("how", ["thread", "inline"])  # inline: the twin, what a first call does itself
def test_start_imports_the_list(tmp_path, how):
    names = ["torch._inductor.lowering", "sympy.solvers.solveset", "torch.no_such_module"]
    out = _fresh(START, str(tmp_path), ",".join(names), how)
    assert out["started"] and not out["again"]
    assert not any(out["before"][n] for n in names[:2])  # a fresh interpreter had not imported them
    assert out["after"]["torch._inductor.lowering"] and out["after"]["sympy.solvers.solveset"]
    st = out["status"]
    assert st["state"] == "done" and st["listed"] == 3 and st["failed"] == 1, st
    assert st["imported"] >= 1 and st["imported"] + st["present"] == 2, st  # lowering imports sympy's solvers
    assert st["seconds"] > 0


def test_start_turned_off_or_without_a_list(tmp_path):
    out = _fresh(START, str(tmp_path), "torch._inductor.lowering", "thread", env={prewarm.ENV_PREWARM: "0"})
    assert not out["started"] and out["status"]["state"] == "idle" and not out["after"]["torch._inductor.lowering"]
    assert not prewarm.start(None)


FIRST_CALL = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import nexfort_engine
from nexfort_engine import prewarm
m = nexfort_engine.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()),
                           {"mode": "O2", "backend": "eager"}, cache_dir=sys.argv[2])
m(torch.randn(2, 8))
print(json.dumps({"listed": prewarm.load(sys.argv[2]), "fallbacks": nexfort_engine.stats()["fallbacks"]}))
"""


def test_first_call_lists_what_it_imported(tmp_path):
    out = _fresh(FIRST_CALL, str(tmp_path))
    assert out["fallbacks"] == 0
    listed = out["listed"]
    assert any(m.startswith("torch._dynamo.") for m in listed), listed[:20]
    assert all(prewarm.allowed(m) for m in listed)


ADOPT = """
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import torch
from nexfort_engine.threads import adopt_cudagraph_trees, join
before = adopt_cudagraph_trees()  # not imported yet: nothing to do
t = threading.Thread(target=lambda: __import__("torch._inductor.cudagraph_trees"))
t.start(); join(t)  # not t.join(): the exit can abort while the OS thread tears down (threads.join)
ct = sys.modules["torch._inductor.cudagraph_trees"]
had = hasattr(ct.local, "tree_manager_containers")
first, second = adopt_cudagraph_trees(), adopt_cudagraph_trees()
out = {"before": before, "had": had, "first": first, "second": second,
       "has": hasattr(ct.local, "tree_manager_containers") and hasattr(ct.local, "tree_manager_locks"),
       "tls": torch._C._is_key_in_tls("tree_manager_containers")}
# torch 2.11 has no _initialize_tls: the same state, set up by hand, in yet another thread
if hasattr(ct, "_initialize_tls"):
    del ct._initialize_tls
res = {}
def other():
    res["adopted"] = adopt_cudagraph_trees()
    res["has"] = hasattr(ct.local, "tree_manager_containers") and torch._C._is_key_in_tls("tree_manager_locks")
t = threading.Thread(target=other); t.start(); join(t)
out["other"] = res
print(json.dumps(out))
"""


def test_adopt_cudagraph_trees_in_another_thread():
    out = _fresh(ADOPT)
    assert out["before"] is False and out["had"] is False  # imported by another thread: none here
    assert out["first"] is True and out["second"] is False and out["has"] and out["tls"]
    assert out["other"] == {"adopted": True, "has": True}


def test_join_waits_for_the_os_thread():
    import os
    import threading

    from nexfort_engine.threads import join

    for _ in range(20):  # Thread.join alone can return while /proc/self/task still lists it (under load)
        t = threading.Thread(target=lambda: None)
        t.start()
        assert join(t) is True and not os.path.exists(f"/proc/self/task/{t.native_id}")
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    assert join(stuck, 0.05) is False  # bounded: a thread that does not finish
    release.set()
    assert join(stuck, 5) is True


def test_wait_is_bounded(monkeypatch, caplog):
    import threading

    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)  # an import that does not return
    stuck.start()
    monkeypatch.setattr(prewarm, "_thread", stuck)
    try:
        assert prewarm.wait(0.2) is False
        assert "still importing" in caplog.text
    finally:
        release.set()
        stuck.join()
    assert prewarm.wait(0.2) is True


@pytest.mark.parametrize("bad", ["[]", json.dumps({"version": prewarm.VERSION, "modules": "torch"})])
def test_load_rejects_other_shapes(tmp_path, bad):
    (tmp_path / prewarm.FILE).write_text(bad)
    assert prewarm.load(tmp_path) == [] and not (tmp_path / prewarm.FILE).exists()


GPU_THREADS = """
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import torch
import nexfort_engine
from nexfort_engine import compiler
from nexfort_engine.threads import join
# another thread imports CUDA-graph trees first (the prewarm thread, another custom node)
t = threading.Thread(target=lambda: __import__("torch._inductor.cudagraph_trees"))
t.start(); join(t)
if sys.argv[3] == "no-adopt":  # the control: the engine without threads.py's adoption
    compiler.adopt_cudagraph_trees = lambda: False
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).cuda().half()
cm = nexfort_engine.compile(m, {"mode": "O2"}, cache_dir=sys.argv[2])
x = torch.randn(4, 64, device="cuda", dtype=torch.half)
outs = [cm(x) for _ in range(4)]
ref = m(x)
s = nexfort_engine.stats()
ct = sys.modules["torch._inductor.cudagraph_trees"]
print(json.dumps({"fallbacks": s["fallbacks"], "reasons": s["fallback_reasons"], "compiles": s["compiles"],
                  "err": float((outs[-1] - ref).abs().max()), "torch_inits_threads": hasattr(ct, "_initialize_tls")}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cudagraphs_run_after_another_thread_imported_them(tmp_path):
    out = _fresh(GPU_THREADS, str(tmp_path / "a"), "adopt")
    assert out["fallbacks"] == 0 and out["compiles"] == 1, out
    assert out["err"] < 1e-2, out
    control = _fresh(GPU_THREADS, str(tmp_path / "b"), "no-adopt")
    if not control["torch_inits_threads"]:  # torch 2.11: without the adoption the run falls back
        assert control["fallbacks"] == 1 and "AssertionError" in control["reasons"][0], control
