"""A call's structure, as a short digest, and the graph breaks Dynamo reports.

A host passes more than tensors to a diffusion model: ComfyUI's ``transformer_options`` carry the
patches other nodes added (functions called inside the model). Some of them cannot be traced as
one graph (Kohya Deep Shrink reads the sigma with ``Tensor.item()`` and branches on it, HyperTile
draws random tile sizes), so whether a call traces whole depends on the call, not on the model.
:func:`call_signature` names that structure: the nested dict keys, the callables by qualified name,
the tensors by rank and dtype; not sizes nor scalar values, which vary per step and per prompt. The
engine keys a saved graph's trace failure by it (precompile.py), so one workflow's patch does not
turn saved graphs off for the plain calls of the next.

:func:`graph_break_reasons` reads what Dynamo counted since a snapshot; :func:`user_location`
finds the user's line in a Dynamo error message.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch

#: how deep and how wide the structure is read (ComfyUI's options nest 3-4 levels)
MAX_DEPTH = 8
MAX_ITEMS = 64


def _key(k: Any) -> str:
    return repr(k) if isinstance(k, (str, int, float, bool, tuple, type(None))) else type(k).__qualname__


def _describe(v: Any, depth: int) -> str:
    if depth > MAX_DEPTH:
        return "..."
    if isinstance(v, torch.Tensor):
        return f"T{v.dim()}:{str(v.dtype).removeprefix('torch.')}"
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, (int, float, str, bytes)):
        return type(v).__name__
    if isinstance(v, dict):
        items = sorted(v.items(), key=lambda kv: _key(kv[0]))[:MAX_ITEMS]
        return "{" + ",".join(f"{_key(k)}:{_describe(x, depth + 1)}" for k, x in items) + "}"
    if isinstance(v, (list, tuple)):
        parts: list[str] = []
        for x in list(v)[:MAX_ITEMS]:
            d = _describe(x, depth + 1)
            if not parts or parts[-1] != d:  # a run of alike items reads as one ([0, 1] and [1] alike)
                parts.append(d)
        return ("[" if isinstance(v, list) else "(") + ",".join(parts) + ("]" if isinstance(v, list) else ")")
    fn = getattr(v, "__func__", v)  # a bound method: its function
    qualname = getattr(fn, "__qualname__", None)
    if callable(v) and isinstance(qualname, str):
        return f"fn:{getattr(fn, '__module__', '?')}.{qualname}"
    return f"obj:{type(v).__module__}.{type(v).__qualname__}"


def call_signature(args: tuple, kwargs: dict) -> str:
    """A digest of the call's structure (16 hex digits), equal across processes for the same
    structure. Sizes and scalar values are left out."""
    text = _describe(tuple(args), 0) + _describe(dict(kwargs), 0)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def graph_break_counts() -> dict[str, int]:
    """Dynamo's graph-break counter (reason -> times), copied."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""


def graph_break_reasons(before: dict[str, int]) -> list[str]:
    """The reasons Dynamo counted graph breaks for since ``before`` (:func:`graph_break_counts`),
    each once, by their first line."""
    out: list[str] = []
    for reason, n in graph_break_counts().items():
        if n > before.get(reason, 0) and (line := _first_line(reason)) and line not in out:
            out.append(line)
    return out


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def user_location(text: str) -> str | None:
    """``file.py:N in function`` of the innermost user frame a Dynamo error names, or ``None``."""
    section = text.split("from user code:")[-1]
    found = _FILE_LINE.findall(section)
    if not found:
        return None
    path, line, fn = found[-1]
    parts = path.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line} in {fn}"


def dynamo_trace_failure(err: BaseException) -> bool:
    """Whether ``err`` is Dynamo refusing to trace user code as one graph (a graph break under
    ``fullgraph``, a data-dependent branch), not a backend or runtime failure."""
    from torch._dynamo import exc

    if isinstance(err, exc.BackendCompilerFailed):
        return False
    return isinstance(err, (exc.Unsupported, exc.UserError)) or type(err).__name__ in (
        "Unsupported", "UserError", "GuardOnDataDependentSymNode")
