"""FX helpers the graph passes share: node tests, argument and example-value access, fake
metadata for inserted nodes, and dead-chain removal."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["arg", "erase_dead", "fake_meta", "is_call", "is_method", "static", "static_width", "val"]


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
