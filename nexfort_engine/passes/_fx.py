"""FX helpers the graph passes share: node tests, argument and example-value access, fake
metadata for inserted nodes, dead-chain removal, and cache marks for the functions passes insert."""

from __future__ import annotations

import hashlib
import inspect
import sys
from typing import Any, Callable

import torch
from torch import fx

__all__ = ["arg", "cache_marks_for", "erase_dead", "fake_meta", "is_call", "is_method", "static", "static_width", "val"]


def cache_marks_for(fns: tuple[Callable[..., Any], ...]) -> dict[str, str]:
    """Inductor's ``unsafe_marked_cacheable_functions`` entries for plain functions a pass puts into
    graphs (AOTAutograd's cache bypasses graphs calling functions it does not know). The functions
    must be pure and determined by their modules' sources: the value is a hash of those sources
    (sorted by module name; where no source is shipped, the functions' bytecode and constants), so
    it joins the cache keys and an edited module never reuses an old artifact."""
    digest = hashlib.sha256()
    for name in sorted({fn.__module__ for fn in fns}):
        try:
            digest.update(inspect.getsource(sys.modules[name]).encode())
        except (OSError, TypeError):
            for fn in fns:
                if fn.__module__ == name:
                    digest.update(fn.__code__.co_code + repr(fn.__code__.co_consts).encode())
    value = digest.hexdigest()[:16]
    return {f"{fn.__module__}.{fn.__name__}": value for fn in fns}


def is_method(node: Any, name: str) -> bool:
    """Whether ``node`` calls the tensor method ``name``."""
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def is_call(node: Any, targets: tuple) -> bool:
    """Whether ``node`` calls one of the functions ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The call's argument at position ``index`` or keyword ``name``, else ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def val(node: Any) -> torch.Tensor | None:
    """The (fake) tensor Dynamo recorded for ``node``, or None."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def static(n: Any) -> int | None:
    """``n`` as an int, or None when it is symbolic (or not a size)."""
    try:
        return int(n)
    except (TypeError, ValueError):
        return None


def static_width(node: Any) -> int | None:
    """The last dimension of ``node``'s value when it is a static size, else None."""
    v = val(node)
    if v is None or v.dim() < 1:
        return None
    return static(v.shape[-1])


def fake_meta(node: fx.Node, fn: Any, *args: Any) -> None:
    """``node.meta['example_value']``: Inductor's pre-grad passes read it on every node."""
    vals = [val(a) if isinstance(a, fx.Node) else a for a in args]
    if any(v is None for v, a in zip(vals, args, strict=True) if isinstance(a, fx.Node)):
        return
    from torch._subclasses.fake_tensor import FakeTensor

    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None:
        return
    with mode:
        node.meta["example_value"] = fn(*vals)


def erase_dead(nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` nothing reads any more, repeatedly (a chain dies back to front)."""
    pending = {n: None for n in nodes}
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if n.graph is not None and not n.users and n in pending:
                n.graph.erase_node(n)
                del pending[n]
                changed = True
