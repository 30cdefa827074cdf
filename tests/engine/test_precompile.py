"""Ahead-of-time traced graphs (nexfort_engine/precompile.py): saved in the cache entry by the first
compile, loaded by a restarted process instead of a Dynamo re-trace, and never used where they do
not apply (another torch, edited sources, a monkeypatched global, other shapes).

The unit tests need no compile. The process tests run real Inductor on CPU on a small plain torch
module (one child script, a mode per test), so each child is cheap.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from nexfort_engine import precompile
from nexfort_engine.cache import CacheStore, environment_fingerprint

# -- units


def helper_function(x):
    return x + 1


class Outer:
    class Inner:
        pass


def test_fingerprints_name_what_a_guard_saw():
    fp = precompile.fingerprint
    assert fp(os) == "module:os"
    assert fp(Outer.Inner) == f"class:{__name__}.Outer.Inner"
    assert fp(helper_function).startswith(f"function:{__name__}.helper_function:")
    assert fp(len) == "builtin:builtins.len"
    assert fp(3) == "const:int:3" and fp("a") == "const:str:'a'" and fp(None) == "const:NoneType:None"
    assert fp(torch.float16) == "const:dtype:torch.float16"

    def other(x):
        return x + 2

    # an install path in a module name (ComfyUI's custom nodes) is not part of it
    moved = types.FunctionType(helper_function.__code__, {}, "helper_function")
    moved.__qualname__, moved.__module__ = helper_function.__qualname__, f"/srv/ComfyUI/custom_nodes/{__name__}"
    assert fp(moved) == fp(helper_function)
    # same qualified name, other code: another fingerprint
    other.__qualname__, other.__module__ = helper_function.__qualname__, helper_function.__module__
    assert fp(other) != fp(helper_function)


def test_guard_names_split_into_per_call_and_once():
    per_call = precompile._per_call
    assert not per_call("G['comfy'].ops", "self")
    assert not per_call("type(self._modules['0'])", "self")
    assert not per_call("dict(type(self).__mro__[2].__dict__)", "self")
    assert not per_call("L['self']._modules", "self")
    assert per_call("transformer_options['wrappers']['x'][0]", "self")
    assert per_call("L['x'].size()", "self")
    assert precompile._rooted_at("type(self._modules['0'])", "self")
    assert not precompile._rooted_at("G['self']", "self")


def test_globals_resolve_dynamos_installed_names():
    live = {"a": 1}
    ns = precompile._Globals(live, {"a": 0, "b": 2})
    assert ns["a"] == 1 and ns["b"] == 2
    live["a"] = 3  # the module's own dict, not a copy
    assert ns["a"] == 3
    assert ns["__builtins_dict___3"]["len"] is len
    assert ns["__import_torch_dot_nn_dot_functional"] is torch.nn.functional
    with pytest.raises(KeyError):
        ns["missing"]


def _entry(name, guard_type, value=None, is_global=False, derived=()):
    return types.SimpleNamespace(name=name, guard_type=guard_type, has_value=value is not None, value=value,
                                 is_global=is_global, derived_guard_types=derived)


def test_recorder_keeps_what_torch_saves_and_fingerprints_the_rest():
    rec = precompile.GuardRecorder("self")
    keep = rec([
        _entry("L['x']", "TENSOR_MATCH", torch.zeros(1)),
        _entry("G['helper_function']", "CLOSURE_MATCH", helper_function, is_global=True),
        _entry("self._modules['a']", "TYPE_MATCH", Outer.Inner()),  # a nested class: torch cannot save it
        _entry("self._modules['b']", "TYPE_MATCH", Outer()),
        _entry("dict(type(self).__mro__[1].__dict__)", "DICT_NOT_CONTAINS", {}),
        _entry("transformer_options['patch']", "ID_MATCH", helper_function),
    ])
    assert keep == [True, False, False, True, False, False]
    assert rec.kept == 2
    dropped = {d.name: d for d in rec.dropped}
    assert dropped["G['helper_function']"].fingerprint == precompile.fingerprint(helper_function)
    assert not dropped["G['helper_function']"].per_call
    assert dropped["transformer_options['patch']"].per_call
    assert dropped["self._modules['a']"].fingerprint == f"object:{__name__}.Outer.Inner"  # its type


def test_key_presence_guards_fingerprint_the_key_not_the_whole_dict():
    """Dynamo guards that a class attribute is absent (``DICT_NOT_CONTAINS`` on a class's
    ``__dict__``, dropped: it walks the MRO). Once a ``torch.compile``'d call runs, Dynamo adds its
    own attribute to ``nn.Module``: a process that loads the graph then has another key set than
    the one that traced it (a background compile's parent), and the answer to the guard is the
    same."""
    import functools

    guard = types.SimpleNamespace(create_fn=functools.partial(print, key="forward_hook_x"))
    rec = precompile.GuardRecorder("self")
    entry = _entry("dict(type(self).__mro__[0].__dict__)", "DICT_NOT_CONTAINS", {"a": 1})
    entry.orig_guard = guard
    rec([entry])
    (d,) = rec.dropped
    assert d.key == "forward_hook_x" and d.fingerprint == "contains:'forward_hook_x':False"
    artifact = precompile.Artifact(compiled=None, dropped=[d], sources=[], namespace={}, self_name="self")

    class M:
        pass

    m = M()
    assert artifact._resolve(artifact._global, {"self": m}) is None
    M.___needs_generation_tag_patch = False  # what Dynamo adds: the guard still passes
    assert artifact._resolve(artifact._global, {"self": m}) is None
    M.forward_hook_x = None  # the guarded key appears: it fails
    assert "contains:'forward_hook_x':True" in artifact._resolve(artifact._global, {"self": m})


def test_guard_sources_with_computed_fields_pickle_so_they_load():
    from torch._dynamo.source import DefaultsSource, LocalSource

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return precompile.source_reduction(obj) or NotImplemented

    for source in (DefaultsSource(LocalSource("fn"), 2), DefaultsSource(LocalSource("fn"), "scale", is_kw=True)):
        buf = io.BytesIO()
        Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(source)
        loaded = pickle.loads(buf.getvalue())
        assert loaded == source and loaded.name == source.name
    assert precompile.source_reduction(LocalSource("x")) is None  # no computed fields: torch's own way
    assert precompile.source_reduction(3) is None


def test_edited_sources_make_an_artifact_stale(tmp_path, monkeypatch):
    mod = tmp_path / "nexfort_src_probe.py"
    mod.write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import hashlib
    import importlib

    importlib.import_module("nexfort_src_probe")
    sources = [("nexfort_src_probe", 1, 3, hashlib.sha256(b"def f(x):\n    return x + 1\n").hexdigest())]
    assert precompile._stale_sources(sources) is None
    mod.write_text("def f(x):\n    return x + 2\n")
    import linecache

    linecache.checkcache(str(mod))
    assert "changed since the trace" in precompile._stale_sources(sources)
    sys.modules.pop("nexfort_src_probe", None)


def test_foreign_files_are_stale_not_errors():
    with pytest.raises(precompile.StaleArtifact, match="unreadable"):
        precompile.from_bytes(b"not a pickle", {})
    with pytest.raises(precompile.StaleArtifact, match="another file format"):
        precompile.from_bytes(pickle.dumps({"format": precompile.FORMAT + 1}), {})
    with pytest.raises(precompile.StaleArtifact, match="saved by torch 0.0"):
        precompile.from_bytes(pickle.dumps({"format": precompile.FORMAT, "torch": "0.0"}), {})


def test_files_are_listed_in_trace_order(tmp_path):
    for n in (10, 2, 1):
        (tmp_path / f"{n}.bin").write_bytes(b"")
    (tmp_path / precompile.UNSUPPORTED).write_text("x")
    assert [p.name for p in precompile.files(tmp_path)] == ["1.bin", "2.bin", "10.bin"]
    assert precompile.files(tmp_path / "none") == []


# -- real processes, real Inductor


CHILD = textwrap.dedent('''
    import json, sys
    import torch
    import nexfort_engine

    def act(x):
        return torch.nn.functional.silu(x)

    def other_act(x):
        return torch.tanh(x)

    def sigma_gate(h, sigma):  # a patch as ComfyUI's nodes write them: the sigma read on the host
        if sigma[0].item() > 0.5:
            return h * 2
        return h

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, scale=None, options=None):
            h = act(self.conv(x))
            if BREAK:
                torch._dynamo.graph_break()
            if options is not None:
                h = options["patch"](h, options["sigma"])
            t = self.proj(h.flatten(2).transpose(1, 2))
            return t.transpose(1, 2).reshape(h.shape)

    mode = sys.argv[2]
    BREAK = mode == "break"
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    net = Net().eval()
    cm = nexfort_engine.compile(net, {"mode": "O1"}, cache_dir=sys.argv[1], label="net")
    x = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(cm(x), net(x), rtol=1e-4, atol=1e-4)
    if mode == "patch":  # a node monkeypatching a function the graph inlined
        act = other_act
        torch.testing.assert_close(cm(x), net(x), rtol=1e-4, atol=1e-4)
    if mode == "patched":  # calls with a patch that breaks the trace, between plain ones
        for sigma in (1.0, 0.2):
            opts = {"patch": sigma_gate, "sigma": torch.tensor([sigma])}
            torch.testing.assert_close(cm(x, options=opts), net(x, options=opts), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cm(x), net(x), rtol=1e-4, atol=1e-4)
    if mode == "shapes":
        for shape in [(2, 4, 8, 12), (1, 4, 8, 8)]:
            y = torch.randn(*shape)
            torch.testing.assert_close(cm(y), net(y), rtol=1e-4, atol=1e-4)
    s = nexfort_engine.stats()
    s["info"] = s["models"][cm.label]
    s["entry"] = cm.cache_entry.key
    s["artifacts"] = str(cm.cache_entry.artifacts)
    print("STATS " + json.dumps(s, default=str))
''')


def _run(script: Path, cache: Path, mode: str, tmp_path: Path, **env: str) -> dict:
    full = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"default-{mode}"), "NEXFORT_CACHE_DIR": "",
            **env}
    proc = subprocess.run([sys.executable, str(script), str(cache), mode], capture_output=True, text=True,
                          env=full, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("STATS ")]
    return json.loads(line[len("STATS "):])


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    p = tmp_path_factory.mktemp("precompile") / "child.py"
    p.write_text(CHILD)
    return p


@pytest.fixture(scope="module")
def warm_cache(child, tmp_path_factory):
    """One cold process: its entry holds one saved graph."""
    tmp = tmp_path_factory.mktemp("warm")
    cache = tmp / "cache"
    first = _run(child, cache, "plain", tmp)
    return cache, first


@pytest.mark.inductor
def test_cold_process_saves_one_graph_and_runs_it(warm_cache):
    _, first = warm_cache
    assert first["compiles"] == 1 and first["cache_misses"] == 1 and first["fallbacks"] == 0
    assert first["info"]["precompiled"] == "on" and first["info"]["precompiled_graphs"] == 1
    # the first call ran the graph this process compiled, not the file loaded back (that is the
    # next test's restart, and test_stale_graph_is_removed_and_traced_again's NEXFORT_RUN_AS_COMPILED=0)
    assert first["info"]["precompiled_first_call"] == "as compiled"
    # the Linear was traced through its stand-in (trace_ops.py) and restored in the graph
    assert first["info"]["trace_stand_ins"] == 1
    phases = first["info"]["compile_phases"]
    assert 0 < phases["dynamo_trace"] <= phases["trace_and_compile"]
    assert {"setup", "verify", "settle", "commit"} <= set(phases)
    assert [p.name for p in precompile.files(Path(first["artifacts"]) / precompile.DIRNAME)] == ["0.bin"]


@pytest.mark.inductor
def test_restarted_process_runs_the_saved_graph_without_tracing(child, warm_cache, tmp_path):
    cache, first = warm_cache
    second = _run(child, cache, "plain", tmp_path)
    assert second["entry"] == first["entry"]
    assert second["compiles"] == 0 and second["recompiles"] == 0 and second["fallbacks"] == 0, second
    assert second["cache_hits"] == 1 and second["cache_misses"] == 0
    assert second["corrupt_entries"] == 0
    e = CacheStore(cache).entry(first["entry"])
    with e.lock():
        assert e.verify() == "hit"


@pytest.mark.inductor
def test_monkeypatched_global_is_noticed(child, warm_cache, tmp_path):
    """The saved graph inlined ``act``; a process that swaps it after the first call gets a new
    graph (counted as a recompile, with the guard named), and the right output."""
    cache, _ = warm_cache
    s = _run(child, cache, "patch", tmp_path)
    assert s["cache_hits"] == 1 and s["compiles"] == 1 and s["recompiles"] == 1 and s["fallbacks"] == 0, s
    assert "precompiled graph guards" in s["recompile_reasons"][0] and "act" in s["recompile_reasons"][0]


@pytest.mark.inductor
def test_other_shapes_trace_more_graphs_and_restart_uses_them(child, tmp_path):
    cache = tmp_path / "cache"
    cold = _run(child, cache, "shapes", tmp_path)
    assert cold["fallbacks"] == 0
    # (2,4,8,8) -> (2,4,8,12) shares the dynamic graph; batch 1 is specialised: one more graph
    assert cold["compiles"] == 2 and cold["recompiles"] == 1, cold
    warm = _run(child, cache, "shapes", tmp_path)
    assert warm["compiles"] == 0 and warm["cache_hits"] == 2 and warm["fallbacks"] == 0, warm


@pytest.mark.inductor
def test_stale_graph_is_removed_and_traced_again(child, tmp_path):
    cache = tmp_path / "cache"
    first = _run(child, cache, "plain", tmp_path)
    path = Path(first["artifacts"]) / precompile.DIRNAME / "0.bin"
    envelope = pickle.loads(path.read_bytes())
    envelope["torch"] = "0.0-other"
    path.write_bytes(pickle.dumps(envelope))
    entry = CacheStore(cache).entry(first["entry"])
    with entry.lock():  # a consistent entry (the manifest matches): only the graph is stale
        entry.commit(environment_fingerprint("cpu"))
    # traced again, and this time the first call loads the new file back, as a later process does
    again = _run(child, cache, "plain", tmp_path, NEXFORT_RUN_AS_COMPILED="0")
    assert again["compiles"] == 1 and again["fallbacks"] == 0 and again["corrupt_entries"] == 0, again
    assert again["info"]["precompiled_first_call"] == "loaded back"
    assert "saved by torch 0.0-other" in again["info"]["precompiled_stale"]
    assert pickle.loads(path.read_bytes())["torch"] == torch.__version__
    with entry.lock():
        assert entry.verify() == "hit"


@pytest.mark.inductor
def test_graph_break_and_opt_out_compile_through_torch_compile(child, tmp_path):
    cache = tmp_path / "cache"
    broken = _run(child, cache, "break", tmp_path)
    assert broken["fallbacks"] == 0, broken
    assert broken["info"]["precompiled"].startswith("on; 1 call structure(s) through torch.compile"), broken
    assert broken["graph_breaks"] >= 1 and broken["info"]["graph_break_reasons"], broken
    aot = Path(broken["artifacts"]) / precompile.DIRNAME
    marker = aot / precompile.UNSUPPORTED_CALLS
    assert marker.exists() and precompile.files(aot) == []
    written = marker.stat().st_mtime_ns
    again = _run(child, cache, "break", tmp_path)  # not traced as one graph again
    assert again["info"]["precompiled"].startswith("on; 1 call structure(s)") and again["fallbacks"] == 0, again
    assert marker.stat().st_mtime_ns == written
    off = _run(child, tmp_path / "off", "plain", tmp_path, NEXFORT_PRECOMPILE="0")
    assert off["info"]["precompiled"] == "off" and off["compiles"] == 1 and off["fallbacks"] == 0
    assert not (Path(off["artifacts"]) / precompile.DIRNAME).exists()


@pytest.mark.inductor
def test_a_call_whose_patch_breaks_the_trace_keeps_saved_graphs_for_the_others(child, tmp_path):
    """A graph break that comes with the call (a patch in its options reading a tensor's value on
    the host, as Kohya Deep Shrink's does), not with the model: those calls compile through
    torch.compile (counted graph breaks, the reason named), the plain calls keep their saved graph,
    in this process and in the next, which does not trace the broken structure again."""
    cache = tmp_path / "cache"
    cold = _run(child, cache, "patched", tmp_path)
    info = cold["info"]
    assert cold["fallbacks"] == 0, cold
    assert info["precompiled"].startswith("on; 1 call structure(s) through torch.compile"), info["precompiled"]
    assert "sigma_gate" in info["precompiled"], info["precompiled"]  # where the trace broke
    assert info["precompiled_graphs"] == 1 and info["graph_breaks"] >= 1, info
    assert any("item()" in r for r in info["graph_break_reasons"]), info["graph_break_reasons"]
    aot = Path(cold["artifacts"]) / precompile.DIRNAME
    assert [p.name for p in precompile.files(aot)] == ["0.bin"]
    assert len(precompile.broken_calls(aot)) == 1 and not (aot / precompile.UNSUPPORTED).exists()
    written = (aot / precompile.UNSUPPORTED_CALLS).stat().st_mtime_ns
    warm = _run(child, cache, "patched", tmp_path)
    assert warm["fallbacks"] == 0 and warm["cache_hits"] >= 1, warm
    assert warm["info"]["precompiled_graphs"] == 1, warm["info"]  # the plain calls: the saved graph
    assert (aot / precompile.UNSUPPORTED_CALLS).stat().st_mtime_ns == written  # not traced whole again


OPS_CHILD = textwrap.dedent('''
    import json, os, sys
    import torch
    import nexfort_engine

    sys.path.insert(0, os.environ["NEXFORT_TESTS_DIR"])
    from tiny_models import FluxAttentionBlock, rel_l2, rotations  # no engine import

    options = {"mode": "max-optimize:cache-all", "fused_rope": True}
    if sys.argv[2] == "fp8_attention":
        options["fp8_attention"] = True
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    block = FluxAttentionBlock().to(torch.bfloat16)
    cm = nexfort_engine.compile(block, options, cache_dir=sys.argv[1], label="block")
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    pe = rotations(1, 12, 32, seed=1)
    # the op modules are imported by the passes while tracing; a process loading the saved graph
    # has not imported them
    before = sorted(m for m in sys.modules if m in ("nexfort_engine.rope", "nexfort_engine.absmax"))
    out = cm(x, pe)
    s = nexfort_engine.stats()
    s["info"] = s["models"][cm.label]
    s["ops_modules_before_call"] = before
    s["out"] = out.float().flatten().tolist()
    s["eager_err"] = rel_l2(out, block(x, pe))
    print("STATS " + json.dumps(s, default=str))
''')


def test_register_ops_covers_every_op_the_engine_defines():
    """Every ``nexfort::`` op defined anywhere in the engine is registered by
    ``compiler.register_ops()`` in a fresh process (a new op module left out of it would make
    restarts and compile workers fail on graphs that call it)."""
    import re

    import nexfort_engine

    root = Path(nexfort_engine.__file__).parent
    defined = sorted({m for f in root.rglob("*.py")
                      for m in re.findall(r'custom_op\(\s*"nexfort::(\w+)"', f.read_text())})
    assert {"rms_norm_rope", "sdpa_fp8", "fp8_mm_cached"} <= set(defined), defined
    probe = ("import json, sys, torch\nimport nexfort_engine\nfrom nexfort_engine import compiler\n"
             "compiler.register_ops()\nprint(json.dumps([n for n in sys.argv[1:] if not hasattr(torch.ops.nexfort, n)]))")
    proc = subprocess.run([sys.executable, "-c", probe, *defined], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["fused_rope", "fp8_attention"])
def test_a_restart_registers_the_ops_a_saved_graph_calls(tmp_path, mode):
    """A saved graph with the fused query/key norm + RoPE op (``nexfort::rms_norm_rope``: on by
    default on Hopper for Flux-family models compiled whole) or fp8 attention (``sdpa_fp8``,
    ``absmax``, ``rms_norm_rope_fp8``) loads in a new process that never ran the passes defining
    those ops. Before ``compiler.register_ops``, that restart fell back to eager
    (``torch.ops.nexfort`` has no attribute ``rms_norm_rope``)."""
    script = tmp_path / "ops_child.py"
    script.write_text(OPS_CHILD)
    cache = tmp_path / "cache"
    tests_dir = str(Path(__file__).resolve().parent.parent)
    cold = _run(script, cache, mode, tmp_path, NEXFORT_TESTS_DIR=tests_dir)
    assert cold["compiles"] == 1 and cold["fallbacks"] == 0, cold["info"]["fallback_reasons"]
    assert cold["info"]["precompiled"] == "on" and cold["info"]["rope_fused"] == 2
    assert cold["info"]["attention_fp8"] == (1 if mode == "fp8_attention" else 0)
    warm = _run(script, cache, mode, tmp_path, NEXFORT_TESTS_DIR=tests_dir)
    assert warm["ops_modules_before_call"] == []
    assert warm["compiles"] == 0 and warm["cache_hits"] == 1, warm
    assert warm["fallbacks"] == 0, warm["info"]["fallback_reasons"]
    assert warm["out"] == cold["out"]
    # the fused ops are eager's roundings (fused_rope: 0.0 here, ComfyUI's apply_rope1); fp8
    # attention rounds q, k and v to e4m3 (0.045)
    assert warm["eager_err"] < (0.06 if mode == "fp8_attention" else 0.01), warm["eager_err"]


@pytest.mark.inductor
def test_comfyui_attention_patches_change_the_graph_not_the_output(comfy_inproc, fresh_stats, tmp_path):
    """The tiny ComfyUI SD1.5 UNet, compiled whole (precompiled graphs), sampled through ComfyUI's
    sampler: an attention replace patch in ``transformer_options`` and then another patch function
    at the same position each get a graph of their own, and every output equals eager's."""
    import tiny_models as tm

    mp = tm.tiny_sd15(seed=21)
    cm = nexfort_engine_compile(mp.model.diffusion_model, tmp_path)

    def half_v(q, k, v, extra_options):
        import comfy.ldm.modules.attention as attention

        return attention.optimized_attention(q, k, v * 0.5, extra_options["n_heads"])

    def double_v(q, k, v, extra_options):
        import comfy.ldm.modules.attention as attention

        return attention.optimized_attention(q, k, v * 2.0, extra_options["n_heads"])

    models = [mp]
    for patch in (half_v, double_v):
        patched = mp.clone()
        patched.set_model_attn2_replace(patch, "input", 1, 0)
        models.append(patched)
    for m in models + [mp]:  # back to the unpatched model: its graph is reused
        ref = tm.sample(m, 64, 96, 1, 2, 5.0, 77)
        out = tm.sample(tm.with_diffusion_model(m, cm), 64, 96, 1, 2, 5.0, 77)
        assert tm.rel_err(out, ref) <= 1e-3
    rec = fresh_stats()["models"][cm.label]
    assert rec["precompiled"] == "on" and rec["fallbacks"] == 0, rec
    assert rec["compiles"] == 3 and rec["recompiles"] == 2 and rec["precompiled_graphs"] == 3, rec
    assert all("precompiled graph guards" in r for r in rec["recompile_reasons"]), rec["recompile_reasons"]


def nexfort_engine_compile(module, cache_dir):
    import nexfort_engine

    return nexfort_engine.compile(module, {"mode": "O2"}, cache_dir=cache_dir, label="unet-patches")


def test_a_recompile_reason_names_the_parts_of_a_guard_that_failed():
    """torch reports every part of a failed relational guard (the shape environment's); the reason
    keeps those false for the call, or all where none can be evaluated here."""
    x = torch.zeros(2, 12, 8)
    parts = [
        "L['x'].size()[0] == L['x'].size()[0]  # batch",
        "((1 + L['x'].size()[1]) // 2) == 4  # ids = torch.linspace(0, h - 1, steps=h)",
        "___check_obj_id(G['act'], 1234)  # act",
        "L['x'].size()[2] >= 2  # pad",
    ]
    assert precompile.failing_parts(parts, {"x": x}) == [parts[1]]
    assert precompile.failing_parts(parts[2:3], {"x": x}) == parts[2:3]
    assert precompile.failing_parts([], {"x": x}) == []
