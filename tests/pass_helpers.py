"""Shared helpers of the kernel and graph-pass tests.

- ``fresh``: run a script in a fresh interpreter and return the JSON it printed last.
- ``interpreted``: run a check script under Triton's interpreter in a subprocess
  (``TRITON_INTERPRET=1`` must be set before Triton builds a kernel, so it cannot run in-process)
  and return the JSON rows it printed last.
- ``rewritten``: trace a function with Dynamo, apply a pass to each graph, run the rewritten
  graph with ``aot_eager``; returns what the pass found and the graphs, with eager's output.
- ``targets``: the call targets of a graph, in order.
- ``aot_cache_saves``: around a compile, AOTAutograd's cache must store ``count`` graphs and
  bypass none (a bypassed cache re-traces the whole model on every warm start).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.registry import lookup_backend


def fresh(script: str, *argv: str, env: dict[str, str] | None = None) -> Any:
    """The JSON ``script`` prints last, run in a fresh interpreter (``env`` added to this one's)."""
    proc = subprocess.run([sys.executable, "-c", script, *argv], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreted(script: str, *argv: str) -> list[dict]:
    """The rows ``script`` prints as JSON (its last line), run by Triton's interpreter in a subprocess."""
    return fresh(script, *argv, env={"TRITON_INTERPRET": "1"})


def rewritten(rewrite: Callable[[torch.fx.GraphModule], Any], fn: Callable, args: tuple, kwargs: dict, *,
              dynamic: bool | None = None,
              mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> tuple:
    """Trace ``fn`` (under ``mode()``, ``torch.compile(dynamic=dynamic)``); ``rewrite`` each graph and
    keep what it returns; run the graph with aot_eager. Returns (output, eager output, [what
    ``rewrite`` returned, per graph], [rewritten graph modules])."""
    found, graphs = [], []

    def backend(gm, example_inputs):
        found.append(rewrite(gm))
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad(), mode():
        ref = fn(*args, **kwargs)
        out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args, **kwargs)
    return out, ref, found, graphs


def targets(gm: torch.fx.GraphModule) -> list:
    """The targets of the graph's function and method calls, in graph order."""
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@contextlib.contextmanager
def aot_cache_saves(count: int = 1):
    """Assert that the compiles inside the block stored ``count`` graphs in AOTAutograd's cache and
    bypassed it for none."""
    from torch._dynamo.utils import counters

    counters["aot_autograd"].clear()
    yield
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_bypass"] == 0 and aot["autograd_cache_saved"] == count, dict(aot)
