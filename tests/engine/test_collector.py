"""The garbage collector's pace while the engine compiles (nexfort_engine/collector.py)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import nexfort_engine
from nexfort_engine import collector


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_thresholds_are_raised_inside_and_restored_after(thresholds):
    with collector.compiling():
        assert gc.get_threshold() == collector.COMPILE_THRESHOLDS
        with collector.compiling():  # nested: still raised, and the inner exit restores nothing
            pass
        assert gc.get_threshold() == collector.COMPILE_THRESHOLDS
    assert gc.get_threshold() == (700, 10, 10)


def test_an_exception_restores_them(thresholds):
    with pytest.raises(ValueError), collector.compiling():
        raise ValueError("compile failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_set_by_someone_else_meanwhile_are_kept(thresholds):
    with collector.compiling():
        gc.set_threshold(1234, 5, 5)
    assert gc.get_threshold() == (1234, 5, 5)


def test_concurrent_compiles_restore_once_the_last_one_ends(thresholds):
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector.compiling():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with collector.compiling():
        pass
    assert gc.get_threshold() == collector.COMPILE_THRESHOLDS  # the other thread still compiles
    release.set()
    t.join(10)
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_opt_out_leaves_the_collector_alone(thresholds, monkeypatch, value):
    monkeypatch.setenv("NEXFORT_COMPILE_GC", value)
    assert not collector.enabled()
    with collector.compiling():
        assert gc.get_threshold() == (700, 10, 10)


def test_the_engine_compiles_with_the_raised_thresholds(thresholds, monkeypatch, fresh_stats):
    seen = []
    original = nexfort_engine.CompiledModule._compile_graph

    def recording(self, gm, example_inputs):
        seen.append(gc.get_threshold())
        return original(self, gm, example_inputs)

    monkeypatch.setattr(nexfort_engine.CompiledModule, "_compile_graph", recording)
    mod = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    cm = nexfort_engine.compile(mod, {"backend": "eager"})
    x = torch.randn(2, 4)
    torch.testing.assert_close(cm(x), mod(x))
    assert seen == [collector.COMPILE_THRESHOLDS]
    assert gc.get_threshold() == (700, 10, 10)  # and restored once the call returned
    assert fresh_stats()["compiles"] == 1
