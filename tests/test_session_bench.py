"""benchmarks/session.py: seconds per prompt and per session through a real ComfyUI server.

The integration test runs the 3-prompt ``test`` sequence (64² twice with two seeds, then 96x64) on
CPU with the tiny checkpoint: eager once, and nexfort with ``{"mode": "O1", "backend": "eager"}``
(Dynamo traces the real model through the pack's wrapper without Inductor's 50-100 s CPU compile)
cold, then warm on the same cache directories, each in a fresh server. Speed is not asserted; the
saved images, the rows, their totals and the engine's counters are. The other tests check the
sequences, the graphs and the reading of the counters without a server.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NEXFORT_EAGER = 'nexfort:{"mode": "O1", "backend": "eager"}'


def _module(name: str):
    """``benchmarks.<name>``, imported with the repo on ``sys.path`` for the import only."""
    sys.path.insert(0, str(REPO))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO))


@pytest.fixture(scope="module")
def session():
    return _module("benchmarks.session")


# -- without a server ------------------------------------------------------------------------------
def test_sequences_and_graphs(session):
    seq = session.sequence("sdxl")
    assert len(seq) == 12
    sizes = {(p.width, p.height) for p in seq}
    assert sizes == {(1024, 1024), (832, 1216), (1216, 832)}
    assert {p.steps for p in seq} == {20, 30} and {p.batch for p in seq} == {1, 2}
    assert [p.lora for p in seq].count(1.0) == 8 and {p.lora for p in seq} == {1.0, 0.5}
    assert sum(1 for p in seq if p.hires) == 1
    assert all(p.lora is None for p in session.sequence("sdxl", lora=False))
    tiny = session.sequence("tiny")
    assert len(tiny) == 12 and all(p.width % 8 == 0 and p.height % 8 == 0 for p in tiny)

    hires = next(p for p in seq if p.hires)
    g = session.build_graph(hires, 9, 77, "O2", "m.safetensors", "l.safetensors", 7.0, "x")
    kinds = sorted(n["class_type"] for n in g.values())
    assert kinds.count("KSampler") == 2 and "LatentUpscaleBy" in kinds and "LoraLoader" in kinds
    assert g[session.COMPILE_NODE]["class_type"] == "NexfortCompileModel"
    assert g[session.COMPILE_NODE]["inputs"]["mode"] == "O2"
    assert g[session.HIRES_SAMPLER_NODE]["inputs"]["denoise"] == 0.5
    assert g[session.SAMPLER_NODE]["inputs"]["model"] == [session.COMPILE_NODE, 0]
    assert g["2"]["inputs"]["strength_model"] == 0.5

    eager = session.build_graph(seq[0], 0, 1, "eager", "m.safetensors", "l.safetensors", 7.0, "x")
    assert session.COMPILE_NODE not in eager and eager[session.SAMPLER_NODE]["inputs"]["model"] == ["2", 0]
    comfy = session.build_graph(seq[0], 0, 1, "comfy", "m.safetensors", "l.safetensors", 7.0, "x")
    assert comfy[session.COMPILE_NODE] == {"class_type": "TorchCompileModel",
                                           "inputs": {"model": ["2", 0], "backend": "inductor"}}
    custom = session.build_graph(seq[0], 0, 1, 'nexfort:{"mode": "O3", "background": true}', "m", "l", 7.0, "x")
    assert json.loads(custom[session.COMPILE_NODE]["inputs"]["options"]) == {"mode": "O3", "background": True}
    # every prompt differs (seed and text): ComfyUI's result cache never answers one
    texts = {session.build_graph(p, i, i, "eager", "m", "l", 7.0, "x")["4"]["inputs"]["text"]
             for i, p in enumerate(seq)}
    assert len(texts) == len(seq)
    assert session.split_contenders('eager,comfy,nexfort:{"a": 1, "b": 2},O2') == \
        ["eager", "comfy", 'nexfort:{"a": 1, "b": 2}', "O2"]


def _stats(**models) -> dict:
    return {"engine": {"models": models}}


def _rec(state: str, calls: int = 0, node: str = "3", **kw) -> dict:
    base = {"calls": calls, "compiles": 0, "recompiles": 0, "fallbacks": 0, "cache_hits": 0, "cache_misses": 0,
            "static_first_eager_calls": 0, "graph_breaks": 0, "compile_seconds": 0.0, "compiled_call_seconds": 0.0,
            "background_seconds": 0.0, "state": state, "node_ids": [node] if node else [], "updated": 1.0}
    return base | kw


def test_uncompiled_from_counters(session):
    # compiled at its first call: not uncompiled
    d = session.engine_delta(_stats(), _stats(**{"UNetModel:0123abcd": _rec("compiled", 20, compiles=1, compile_seconds=9.0)}))
    assert (d["calls"], d["compiles"], d["state"], d["compile_seconds"]) == (20, 1, "compiled", 9.0)
    assert session.uncompiled(d) == ("", 0)
    # a background compile without a static graph: every call of the prompt ran eager
    before = _stats(**{"UNetModel:0123abcd": _rec("background", 20)})
    d = session.engine_delta(before, _stats(**{"UNetModel:0123abcd": _rec("background", 40)}))
    assert session.uncompiled(d) == ("background compile", 20)
    d = session.engine_delta(before, _stats(**{"UNetModel:0123abcd": _rec("compiled", 40)}))
    assert session.uncompiled(d)[0] == "background compile (finished during it)"
    # static shape first: the static twin's calls ran compiled, the misfits eager
    twin0 = _rec("compiled", 20, node="", compiles=1)
    before = _stats(**{"UNetModel:0123abcd": _rec("background", 20), "UNetModel (static):4567cdef": twin0})
    fits = _stats(**{"UNetModel:0123abcd": _rec("background", 40), "UNetModel (static):4567cdef": _rec("compiled", 40, node="", compiles=1)})
    assert session.uncompiled(session.engine_delta(before, fits)) == ("", 0)
    misfit = _stats(**{"UNetModel:0123abcd": _rec("background", 40, static_first_eager_calls=20), "UNetModel (static):4567cdef": twin0})
    d = session.engine_delta(before, misfit)
    assert d["static_calls"] == 0 and session.uncompiled(d)[1] == 20
    # a fallback; and another node's model is not counted
    fell = _stats(**{"UNetModel:0123abcd": _rec("fallback", 40, fallbacks=1, fallback_reasons=["boom"]),
                     "AutoencoderKL.decode:89abcdef": _rec("compiled", 99, node="12")})
    d = session.engine_delta(_stats(**{"UNetModel:0123abcd": _rec("compiled", 20)}), fell)
    assert session.uncompiled(d) == ("fallback", 20) and d["fallback_reasons"] == ["boom"]
    assert d["models"] == ["UNetModel:0123abcd"]


def test_streaming_safetensors_writer(tmp_path):
    import random_checkpoint as rc  # scripts/ is on sys.path (conftest.py)
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    tensors = {"w": torch.randn(3, 5, dtype=torch.float16), "ids": torch.arange(77).expand(1, -1),
               "v": torch.randn(7), "s": torch.tensor(1.5), "empty": torch.zeros(0, 3),
               "t": torch.randn(4, 6).t(), "bf": torch.randn(2, 3, dtype=torch.bfloat16)}
    path = rc.write_safetensors_streaming(tensors, tmp_path / "x.safetensors", {"k": "v"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
    assert not rc.is_valid(path)  # not a random SDXL checkpoint
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temp file left


# -- through a real server -------------------------------------------------------------------------
@pytest.mark.integration
def test_session_through_real_server(session, comfy_host, tiny_ckpt, tmp_path):
    out_json = tmp_path / "session.json"
    args = session.parse_args([
        "--comfy-root", str(comfy_host), "--checkpoint", str(tiny_ckpt), "--device", "cpu",
        "--sequence", "test", "--contenders", f"eager,{NEXFORT_EAGER}", "--cfg", "4",
        "--work-dir", str(tmp_path / "work"), "--output-json", str(out_json), "--no-preread",
    ])
    out = session.run(args)
    assert json.loads(out_json.read_text())["sessions"] == json.loads(json.dumps(out["sessions"], default=str))
    rows = out["sessions"]
    assert [(r["contender"], r["cache"]) for r in rows] == [("eager", "-"), (NEXFORT_EAGER, "cold"),
                                                            (NEXFORT_EAGER, "warm")]
    seen_images: set[str] = set()
    for r in rows:
        prompts = r["prompts"]
        assert [p["label"] for p in prompts] == ["64x64 4st b1", "64x64 4st b1", "96x64 4st b1"]
        assert len({p["seed"] for p in prompts}) == 3
        for p in prompts:
            assert p["images"], p
            for img in p["images"]:
                assert Path(img).read_bytes()[:8] == PNG_MAGIC, img
                assert img not in seen_images, f"{img} saved twice"
                seen_images.add(img)
            assert p["wall_s"] > 0 and p["server_s"] is not None
            assert p["server_s"] <= p["wall_s"] + 0.05, p  # the server's time lies inside the client's
        assert r["prompts_s"] == pytest.approx(sum(p["wall_s"] for p in prompts), abs=0.01)
        assert r["per_prompt_s"] == pytest.approx(r["prompts_s"] / 3, abs=0.01)
        assert r["server_start_s"] > 0
        assert r["session_s"] >= r["server_start_s"] + r["prompts_s"] - 0.01
        assert r["log_path"] and Path(r["log_path"]).is_file()
    eager, cold, warm = rows
    assert all(p["uncompiled"] == "eager" for p in eager["prompts"]) and eager["uncompiled_prompts"] == 3
    for r in (cold, warm):
        assert r["totals"]["compiles"] >= 1 and r["totals"]["fallbacks"] == 0, r["totals"]
        assert r["uncompiled_prompts"] == 0 and r["uncompiled_s"] == 0
        assert r["prompts"][0]["engine"]["compiles"] >= 1
        for p in r["prompts"]:
            e = p["engine"]
            assert e["state"] == "compiled" and e["fallbacks"] == 0 and e["calls"] >= 4, e
        assert r["cache_dir"] == cold["cache_dir"]  # warm: a fresh server on the cold run's directories
    assert Path(cold["cache_dir"], "nexfort").is_dir()
    md = out["markdown"]
    assert md["sessions"].count("\n") == 4 and NEXFORT_EAGER in md["sessions"] and "all (eager)" in md["sessions"]
    assert md["prompts"].count("\n") == 4 and "96x64 4st b1" in md["prompts"]

    # a prompt ComfyUI rejects ends its session early, with the error and the rows so far kept
    bad = 'nexfort:{"mode": "O9"}'
    failed = session.run_session(
        host=comfy_host, base=tmp_path / "work" / "base", contender=bad, cache="cold", previews="none",
        cache_dir=tmp_path / "bad_cache", seq=session.sequence("test"), checkpoint=tiny_ckpt.name, lora=None,
        cfg=4.0, seed=1, device="cpu", log_dir=tmp_path / "work" / "logs", server_args=[], prompt_timeout=120)
    assert failed.prompts == [] and "rejected" in failed.error and "O9" in failed.error, failed.error[:2000]
    assert "FAILED after 0 prompts" in session.summary_table([failed])
