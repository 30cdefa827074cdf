"""intraop.py: one intra-op thread between compiled calls while a background child compiles, the
thread's own count inside each call (Dynamo's global-state guard reads it) and after the child.

A real child process stands for the background compile (a sleeping Python, registered as the
engine registers its children); the guard interaction is checked with a real ``torch.compile``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nexfort_engine import background, intraop


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    if n < 2:
        pytest.skip("needs an intra-op pool of at least two threads")
    yield n
    torch.set_num_threads(n)


@pytest.fixture
def child(tmp_path):
    """A running background child of this process; ``cancel()`` ends it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    job = background.Job(key="k", path=Path(tmp_path), proc=proc)
    with background._running_lock:
        background._running[proc.pid] = job
    yield job
    job.cancel()


def test_one_thread_between_calls_while_a_child_compiles(threads, child):
    assert background.compiling()
    seen = []
    with intraop.compiled_call():
        seen.append(torch.get_num_threads())
    assert torch.get_num_threads() == 1 and intraop.saved_count() == threads  # between calls
    with intraop.compiled_call():
        seen.append(torch.get_num_threads())
        with intraop.compiled_call():  # a compiled model calling another
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())  # the inner call does not decide
    assert seen == [threads] * 4
    assert torch.get_num_threads() == 1

    child.cancel()
    assert not background.compiling()
    with intraop.compiled_call():
        seen.append(torch.get_num_threads())
    assert seen[-1] == threads and torch.get_num_threads() == threads and intraop.saved_count() is None


def test_workers_do_not_count(threads, child):
    child.worker = True  # a compile worker: its caller waits for it, nothing samples meanwhile
    assert not background.compiling()
    with intraop.compiled_call():
        pass
    assert torch.get_num_threads() == threads and intraop.saved_count() is None


def test_switch_off(threads, child, monkeypatch):
    monkeypatch.setenv("NEXFORT_QUIET_OMP", "0")
    with intraop.compiled_call():
        pass
    assert torch.get_num_threads() == threads and intraop.saved_count() is None


def test_a_compiled_function_sees_its_own_count_and_does_not_recompile(threads, child):
    """Why each call gets the count back: it is part of Dynamo's global-state guard."""
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=backend)
    x = torch.randn(8)
    for _ in range(3):
        with intraop.compiled_call():
            torch.testing.assert_close(fn(x), x * 2 + 1)
        assert torch.get_num_threads() == 1
    assert len(frames) == 1  # compiled once: the guard saw the same count each time
    fn(x)  # outside a compiled call, under one thread: the guard fails
    assert len(frames) == 2
    torch._dynamo.reset()
