"""A compile that fails never loses a run: eager output, one counted fallback with its reason, no
retries; user interrupts propagate. All with cheap backends (``eager``) or a failing fake backend."""

from __future__ import annotations

import errno

import pytest
import torch

import nexfort_engine
from nexfort_engine.cache import store as store_mod


class Breaks(torch.nn.Module):
    """A graph break in the middle (``fullgraph=True`` cannot compile it)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.tanh(h))


class InterruptProcessingException(Exception):
    """Named like ComfyUI's (the engine matches the class name, not the type)."""


class Interrupts(torch.nn.Module):
    def __init__(self, exc: type[BaseException]):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.exc = exc
        self.armed = False

    def forward(self, x):
        if self.armed:
            raise self.exc("stop")
        return self.lin(x)


def _one_fallback(stats: dict) -> str:
    assert stats["fallbacks"] == 1, stats
    [reason] = stats["fallback_reasons"]
    [(label, rec)] = [(k, v) for k, v in stats["models"].items() if v["fallbacks"]]
    assert rec["state"] == "fallback" and rec["fallback_reasons"] and label in reason
    return reason


def test_fullgraph_with_graph_break_falls_back_once(fresh_stats):
    torch.manual_seed(0)
    mod = Breaks()
    cm = nexfort_engine.compile(mod, {"backend": "eager", "fullgraph": True})
    x = torch.randn(3, 8)
    torch.testing.assert_close(cm(x), mod(x), rtol=0, atol=0)
    reason = _one_fallback(fresh_stats())
    assert "graph_break" in reason.lower() or "Unsupported" in reason or "graph break" in reason.lower()
    assert cm.failed is not None
    # later calls (other shapes too) run eager without retrying
    for shape in [(3, 8), (5, 8), (1, 8)]:
        y = torch.randn(*shape)
        torch.testing.assert_close(cm(y), mod(y), rtol=0, atol=0)
    s = fresh_stats()
    assert s["fallbacks"] == 1 and s["compiles"] == 0 and s["calls"] == 1  # no retry after the first
    # every call ran uncompiled, the failed first one included: counted apart from compiled calls
    assert s["eager_calls"] == 4 and s["models"][next(iter(s["models"]))]["eager_call_seconds"] > 0


def test_graph_break_without_fullgraph_is_fine(fresh_stats):
    mod = Breaks()
    cm = nexfort_engine.compile(mod, {"backend": "eager"})
    x = torch.randn(3, 8)
    torch.testing.assert_close(cm(x), mod(x))
    s = fresh_stats()
    assert s["fallbacks"] == 0 and s["compiles"] == 2  # two graphs around the break
    assert s["eager_calls"] == 0  # compiled in pieces is still compiled


def test_backend_that_raises_falls_back(fresh_stats, monkeypatch):
    calls = []

    def broken(self, gm, example_inputs):
        calls.append(1)
        raise RuntimeError("inductor exploded: fake codegen failure")

    monkeypatch.setattr(nexfort_engine.CompiledModule, "_backend", broken)
    mod = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    cm = nexfort_engine.compile(mod, {"backend": "inductor"})
    x = torch.randn(2, 4)
    torch.testing.assert_close(cm(x), mod(x), rtol=0, atol=0)
    reason = _one_fallback(fresh_stats())
    assert "RuntimeError: inductor exploded" in reason  # the backend's own error, not only Dynamo's wrapper
    for _ in range(3):
        y = torch.randn(7, 4)
        torch.testing.assert_close(cm(y), mod(y), rtol=0, atol=0)
    assert len(calls) == 1 and fresh_stats()["fallbacks"] == 1


def test_failure_on_a_later_shape_falls_back_from_then_on(fresh_stats, monkeypatch):
    """The first graph compiles; a later compile (a recompile) fails: that call and later ones run eager."""
    orig = nexfort_engine.CompiledModule._backend
    n = {"graphs": 0}

    def second_fails(self, gm, example_inputs):
        n["graphs"] += 1
        if n["graphs"] > 1:
            raise RuntimeError("second compile failed")
        return orig(self, gm, example_inputs)

    monkeypatch.setattr(nexfort_engine.CompiledModule, "_backend", second_fails)
    mod = torch.nn.Linear(4, 4)
    cm = nexfort_engine.compile(mod, {"backend": "eager", "dynamic": False})
    a, b = torch.randn(2, 4), torch.randn(2, 3, 4)  # a new rank always recompiles
    torch.testing.assert_close(cm(a), mod(a))
    torch.testing.assert_close(cm(b), mod(b))
    torch.testing.assert_close(cm(a), mod(a))
    s = fresh_stats()
    assert s["fallbacks"] == 1 and "second compile failed" in s["fallback_reasons"][0]
    assert n["graphs"] == 2


@pytest.mark.parametrize("exc", [InterruptProcessingException, KeyboardInterrupt])
def test_interrupts_propagate_from_compiled_calls(fresh_stats, exc):
    mod = Interrupts(exc)
    cm = nexfort_engine.compile(mod, {"backend": "eager"})
    x = torch.randn(2, 4)
    torch.testing.assert_close(cm(x), mod(x))  # compiled
    mod.armed = True
    with pytest.raises(exc):
        cm(x)
    assert fresh_stats()["fallbacks"] == 0 and cm.failed is None
    mod.armed = False
    torch.testing.assert_close(cm(x), mod(x))


@pytest.mark.parametrize("exc", [InterruptProcessingException, KeyboardInterrupt])
def test_interrupts_propagate_from_the_first_call(fresh_stats, exc):
    mod = Interrupts(exc)
    mod.armed = True
    cm = nexfort_engine.compile(mod, {"backend": "eager"})
    with pytest.raises(exc):
        cm(torch.randn(2, 4))
    assert fresh_stats()["fallbacks"] == 0 and cm.failed is None


def test_interrupt_raised_inside_the_backend_propagates(fresh_stats, monkeypatch):
    """An interrupt while Inductor compiles (ComfyUI's cancel) must not become a silent eager fallback."""

    def interrupted(self, gm, example_inputs):
        raise InterruptProcessingException("cancelled while compiling")

    monkeypatch.setattr(nexfort_engine.CompiledModule, "_backend", interrupted)
    cm = nexfort_engine.compile(torch.nn.Linear(4, 4), {"backend": "inductor"})
    with pytest.raises(BaseException) as ei:
        cm(torch.randn(2, 4))
    chain, e = [], ei.value
    while e is not None:
        chain.append(type(e).__name__)
        e = e.__cause__
    assert "InterruptProcessingException" in chain
    assert fresh_stats()["fallbacks"] == 0


def test_disk_full_while_committing_keeps_the_compiled_module(tmp_path, fresh_stats, monkeypatch):
    """The compile worked; only persisting its manifest failed: no fallback to eager, no partial manifest."""

    def enospc(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "fsync", enospc)
    mod = torch.nn.Linear(4, 4)
    cm = nexfort_engine.compile(mod, {"backend": "eager"}, cache_dir=tmp_path / "c")
    x = torch.randn(2, 4)
    torch.testing.assert_close(cm(x), mod(x))
    assert not list((tmp_path / "c").rglob("manifest.json")) and not list((tmp_path / "c").rglob("*.tmp"))
    s = fresh_stats()
    assert s["fallbacks"] == 0, s["fallback_reasons"]
    assert cm.failed is None and s["compiles"] == 1


def test_cudagraph_skips_reported_during_a_call_are_counted(fresh_stats):
    """Inductor's CUDA-graph skip counter, bumped while our compiled call runs (CUDA-graph trees
    decided to run a graph kernel by kernel), shows up in our counters."""
    from torch._dynamo.utils import counters as torch_counters

    class Skipping(torch.nn.Module):
        def forward(self, x):
            return x * 2

    cm = nexfort_engine.compile(Skipping(), {"mode": "O1", "backend": "eager"}, label="skips")
    x = torch.randn(3)
    cm(x)
    cm._nx_cudagraphs = True  # as on a GPU with the cudagraphs flag

    class Skip(torch.nn.Module):  # what CUDA-graph trees do when they give up on a graph
        def __init__(self, real):
            super().__init__()
            self.real = real

        def forward(self, *a, **k):
            torch_counters["inductor"]["cudagraph_skips"] += 2
            return self.real(*a, **k)

    cm._nx_compiled = Skip(cm._nx_compiled)
    assert fresh_stats()["cudagraph_skips"] == 0
    cm(x)
    assert fresh_stats()["cudagraph_skips"] == 2
