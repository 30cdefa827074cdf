"""``"static_first"``: a cold first call compiles a static-shape graph for its own shape and runs it,
while a child process compiles the dynamic graph into the cache (compiler.py, background.py).

The option's validation and its place outside the cache key, the reasons it stays off, and - with
real Inductor compiles - the whole life of the static graph: it runs the calls it fits while the
child compiles, other shapes run eager, it keeps running its own shape after the child is done,
and the first call of another shape loads the dynamic graph (nothing compiled, no recompile).
Where no dynamic graph comes back (the child died), that call compiles it here and it counts as
the recompile it is.
"""

from __future__ import annotations

import time
import types

import pytest
import torch

import nexfort_engine
from nexfort_engine import background, intraop
from nexfort_engine.options import OptionsError, parse_options
from nexfort_engine.settings import resolve

CHILD_TIMEOUT_S = 600


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Linear(128, 16)

    def forward(self, x: torch.Tensor, opts: dict | None = None) -> torch.Tensor:
        if opts is not None:  # as ComfyUI's UNet adds to its transformer_options while it runs
            opts["seen"] = True
        return self.b(torch.nn.functional.gelu(self.a(x)))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval().requires_grad_(False)


def _records(stats) -> tuple[dict, dict]:
    """(the model's record, its static twin's)."""
    models = stats()["models"]
    twin = [v for k, v in models.items() if " (static)" in k]
    main = [v for k, v in models.items() if " (static)" not in k]
    assert len(main) == 1 and len(twin) <= 1, models
    return main[0], (twin[0] if twin else {})


def _wait_done(cm: nexfort_engine.CompiledModule) -> None:
    job = cm._nx_job
    assert job is not None
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not job.done():
        assert time.monotonic() < deadline, f"child still running; log: {job.path / background.LOG_FILE}"
        time.sleep(0.5)


def test_option_is_validated_and_shares_the_entry():
    with pytest.raises(OptionsError, match="static_first"):
        parse_options({"static_first": "soon"})
    digests = {resolve(c, cuda=False).digest(c)
               for c in (parse_options({"static_first": v}) for v in (True, False, None))}
    assert len(digests) == 1  # the dynamic graph's entry is the same, whatever the order


@pytest.mark.parametrize("case", ["backend", "no_cache", "static", "freezing"])
def test_off_where_it_cannot_apply(case, tmp_path, fresh_stats, clean_dynamo):
    opts: dict = {"static_first": True, "backend": "eager"}
    cache_dir = tmp_path
    if case == "no_cache":
        opts["backend"], cache_dir = "inductor", None
    elif case == "static":
        opts["dynamic"] = False
    elif case == "freezing":
        opts["mode"] = "O2:freezing"
    net = _net()
    cm = nexfort_engine.compile(net, opts, cache_dir=cache_dir)
    x = torch.randn(3, 64)
    with torch.no_grad():
        out = cm(x)
    main, twin = _records(fresh_stats)
    expected = {"backend": "saved graph", "no_cache": "no cache directory", "static": "static shape",
                "freezing": "freezing"}
    assert main["static_first"].startswith("off: ") and expected[case] in main["static_first"], main
    assert not twin and cm._nx_job is None and cm._nx_static is None
    torch.testing.assert_close(out, net(x))


def test_auto_stays_off_on_the_cpu(tmp_path, fresh_stats, clean_dynamo):
    cm = nexfort_engine.compile(_net(), {"backend": "eager"}, cache_dir=tmp_path)
    assert cm._static_first_off(torch.zeros(1)) is not None
    cm._nx_aot = True
    cm._setup(torch.zeros(1))
    cm._nx_aot = True
    assert cm._static_first_off(torch.zeros(1)) == "auto: CUDA devices only"


class Coder(Net):
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


@pytest.mark.parametrize("method", ["forward", "decode", "encode", "project"])
def test_auto_covers_a_forward_a_decode_and_an_encode(method, tmp_path, fresh_stats, clean_dynamo):
    """Auto (``None``) on a GPU: a UNet's forward and a VAE's decode and encode (measured, runs
    218-219 and 222); any other method compiles its dynamic graph at once."""
    torch.manual_seed(0)
    cm = nexfort_engine.compile(Coder().eval(), {"backend": "eager"}, cache_dir=tmp_path, method=method)
    cm._nx_aot = True
    cm._setup(torch.zeros(1))
    cm._nx_aot = True
    on_a_gpu = types.SimpleNamespace(is_cuda=True)  # only where the example lives is read
    why = cm._static_first_off(on_a_gpu)
    if method == "project":
        assert why is not None and why.startswith("auto: a model's forward or a VAE's decode/encode only"), why
    else:
        assert why is None
    assert cm._static_first_off(torch.zeros(1)) == "auto: CUDA devices only"


def test_the_child_gets_the_inputs_as_the_call_got_them():
    opts = {"k": 1, "nested": {"a": [1, 2]}}
    x = torch.zeros(2)
    args, kwargs = background.snapshot((x,)), background.snapshot({"opts": opts})
    opts["seen"] = True  # what the call adds while it runs
    opts["nested"]["b"] = 2
    assert kwargs == {"opts": {"k": 1, "nested": {"a": [1, 2]}}}
    assert args[0] is x  # tensors are shared, not copied


@pytest.mark.inductor
def test_static_graph_then_the_dynamic_one(tmp_path, fresh_stats, clean_dynamo):
    """Each call gets a fresh options dict that the model adds a key to, as ComfyUI's sampler and UNet
    do: the dynamic graph the child saves must fit the next call's dict, not the first call's as the
    call left it (a recompile at the hand-over on the GPU, run202, before ``background.snapshot``)."""
    net = _net()
    x, y = torch.randn(3, 64), torch.randn(5, 64)
    threads = torch.get_num_threads()
    cm = nexfort_engine.compile(net, {"mode": "O1", "static_first": True}, cache_dir=tmp_path)
    with torch.no_grad():
        ref_x, ref_y = net(x), net(y)
        torch.testing.assert_close(cm(x, opts={"k": 1}), ref_x, rtol=1e-4, atol=1e-5)  # the static graph, compiled here
        if threads > 1 and not cm._nx_job.done():  # one intra-op thread between calls (intraop.py)
            assert torch.get_num_threads() == 1 and intraop.saved_count() == threads
        main, twin = _records(fresh_stats)
        assert main["static_first"].startswith("static graph for (3, 64) in "), main
        assert main["state"] == "background" and main["background"].startswith("running"), main
        assert twin["compiles"] == 1 and twin["state"] == "compiled" and twin["precompiled_graphs"] == 1
        static_entry = cm._nx_static.cache_entry
        assert static_entry is not None and static_entry.committed()
        assert static_entry.key != cm.cache_entry.key  # its own entry: a restart loads it

        child_running = not cm._nx_job.done()
        torch.testing.assert_close(cm(x, opts={"k": 1}), ref_x, rtol=1e-4, atol=1e-5)  # its own shape: the static graph
        torch.testing.assert_close(cm(y, opts={"k": 1}), ref_y)  # another shape while the child compiles: eager
        main, twin = _records(fresh_stats)
        assert twin["calls"] == 2 and twin["compiles"] == 1 and twin["recompiles"] == 0
        if child_running:
            assert main["static_first_eager_calls"] == 1

        _wait_done(cm)
        torch.testing.assert_close(cm(x, opts={"k": 1}), ref_x, rtol=1e-4, atol=1e-5)  # done: the static graph still fits
        main, twin = _records(fresh_stats)
        assert twin["calls"] == 3 and main["background"].startswith("done in ") and twin["state"] == "compiled"
        assert main["state"] == "compiled"  # no longer "background": the bench's samplings stop here

        torch.testing.assert_close(cm(y, opts={"k": 1}), ref_y, rtol=1e-4, atol=1e-5)  # another shape: the dynamic graph
        torch.testing.assert_close(cm(x, opts={"k": 1}), ref_x, rtol=1e-4, atol=1e-5)  # and it serves every shape now
    main, twin = _records(fresh_stats)
    assert cm._nx_static is None and twin["state"] == "retired" and twin["calls"] == 3
    assert main["state"] == "compiled" and main["compiles"] == 0 and main["recompiles"] == 0, main
    assert torch.get_num_threads() == threads and intraop.saved_count() is None  # the child is done
    assert main["cache_hits"] == 1 and main["precompiled_graphs"] == 1 and main["fallbacks"] == 0
    assert cm.cache_entry.committed()
    assert not static_entry.path.exists()  # never read again: the dynamic entry is warm


@pytest.mark.inductor
def test_no_dynamic_graph_from_the_child_is_a_recompile(tmp_path, fresh_stats, clean_dynamo):
    net = _net()
    x, y = torch.randn(3, 64), torch.randn(5, 64)
    cm = nexfort_engine.compile(net, {"mode": "O1", "static_first": True}, cache_dir=tmp_path)
    cm._nx_child_globals = (("nexfort_no_such_module", "x", 1),)  # the child's import fails
    with torch.no_grad():
        torch.testing.assert_close(cm(x), net(x), rtol=1e-4, atol=1e-5)
        _wait_done(cm)
        torch.testing.assert_close(cm(x), net(x), rtol=1e-4, atol=1e-5)  # still the static graph
        torch.testing.assert_close(cm(y), net(y), rtol=1e-4, atol=1e-5)  # compiled here
    main, twin = _records(fresh_stats)
    assert main["background"].startswith("failed: exit code 1"), main
    assert main["compiles"] == 1 and main["recompiles"] == 1 and main["fallbacks"] == 0, main
    assert any("static_first" in r for r in main["recompile_reasons"]), main
    assert twin["calls"] == 2 and twin["state"] == "retired"
    assert len(cm._nx_store.keys()) == 2  # the static entry stays (the dynamic one was not committed at the hand-over)


@pytest.mark.inductor
def test_comfy_unet_static_first_then_another_size(patcher, tmp_path, monkeypatch, fresh_stats, clean_dynamo):
    """ComfyUI's SD1.5 UNet through the node layer, sampled by ComfyUI's sampler: the first size
    runs the static graph, the child's dynamic graph loads at the second size with nothing compiled
    and no recompile (ComfyUI's UNet adds to ``transformer_options`` while it runs)."""
    import tiny_models

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    mp = tiny_models.tiny_sd15()
    (h, w), (h2, w2) = tiny_models.RESOLUTIONS["sd15"][:2]
    ref, ref2 = tiny_models.sample(mp, h, w, steps=2), tiny_models.sample(mp, h2, w2, steps=2)
    m = patcher.compile_model_patcher(mp, parse_options({"mode": "O1", "static_first": True}))
    out = tiny_models.sample(m, h, w, steps=2)
    main, twin = _records(fresh_stats)
    assert main["static_first"].startswith(f"static graph for (2, 4, {h // 8}, {w // 8}) in "), main
    assert twin["compiles"] == 1 and twin["calls"] == 2, twin  # two steps
    cm = next(iter(mp.model.diffusion_model.__dict__[patcher._ATTR].values()))
    _wait_done(cm)
    out_again = tiny_models.sample(m, h, w, steps=2)  # still the static graph
    out2 = tiny_models.sample(m, h2, w2, steps=2)  # the dynamic graph, loaded
    main, twin = _records(fresh_stats)
    assert main["compiles"] == 0 and main["recompiles"] == 0 and main["cache_hits"] == 1, main
    assert twin["calls"] == 4 and twin["state"] == "retired" and main["fallbacks"] == 0
    for got, want in ((out, ref), (out_again, ref), (out2, ref2)):
        assert tiny_models.rel_err(got, want) <= 1e-3


@pytest.mark.inductor
def test_a_restart_before_the_child_is_done_loads_the_static_graph(tmp_path, fresh_stats, clean_dynamo):
    """ComfyUI exits while the child compiles (the child exits with it): the next start loads the
    static graph from its entry (nothing compiled) and starts the child again."""
    net = _net()
    x = torch.randn(3, 64)
    cm = nexfort_engine.compile(net, {"mode": "O1", "static_first": True}, cache_dir=tmp_path)
    with torch.no_grad():
        cm(x, opts={"k": 1})
    job = cm._nx_job
    assert job is not None
    job.cancel()  # as at ComfyUI's exit
    job.proc.wait(timeout=30)
    assert not cm.cache_entry.committed()  # no dynamic graph

    nexfort_engine.reset_stats()
    torch._dynamo.reset()
    cm2 = nexfort_engine.compile(_net(), {"mode": "O1", "static_first": True}, cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(cm2(x, opts={"k": 1}), net(x), rtol=1e-4, atol=1e-5)
    main, twin = _records(fresh_stats)
    assert twin["compiles"] == 0 and twin["cache_hits"] == 1 and twin["precompiled_graphs"] == 1, twin
    assert main["state"] == "background" and main["background"].startswith("running"), main
    cm2._nx_job.cancel()


@pytest.mark.inductor
def test_an_interrupted_first_call_starts_over(tmp_path, fresh_stats, clean_dynamo, monkeypatch):
    """The user interrupts the first prompt while the static graph compiles: the next call compiles
    it again (static first, not the dynamic graph in the foreground)."""
    from nexfort_engine import compiler

    first_call = compiler.CompiledModule._first_call
    interrupted: list[str] = []

    def interrupt_once(self, args, kwargs):
        if " (static)" in self.label and not interrupted:
            interrupted.append(self.label)
            raise KeyboardInterrupt
        return first_call(self, args, kwargs)

    monkeypatch.setattr(compiler.CompiledModule, "_first_call", interrupt_once)
    net = _net()
    x = torch.randn(3, 64)
    cm = nexfort_engine.compile(net, {"mode": "O1", "static_first": True}, cache_dir=tmp_path)
    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            cm(x, opts={"k": 1})
        assert cm._nx_job is None and cm._nx_static is None
        torch.testing.assert_close(cm(x, opts={"k": 1}), net(x), rtol=1e-4, atol=1e-5)
    main, twin = _records(fresh_stats)
    assert interrupted and main["static_first"].startswith("static graph for (3, 64)"), main
    assert main["compiles"] == 0 and twin["compiles"] == 1 and main["state"] == "background", (main, twin)
    cm._nx_job.cancel()
