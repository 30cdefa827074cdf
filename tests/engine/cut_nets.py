"""Small models whose Dynamo graphs the split and ship tests cut (test_split.py, test_ship.py)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from nexfort_engine.passes import group_norm


class Res(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.n1 = torch.nn.GroupNorm(4, c)
        self.c1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.n2 = torch.nn.GroupNorm(4, c)
        self.c2 = torch.nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(x))))))


class ConvNet(torch.nn.Module):
    """ResBlocks with GroupNorms (the pass rewrites them) and a skip across the whole net."""

    def __init__(self, c: int = 16, n: int = 6) -> None:
        super().__init__()
        self.i = torch.nn.Conv2d(4, c, 3, padding=1)
        self.blocks = torch.nn.ModuleList([Res(c) for _ in range(n)])
        self.o = torch.nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.i(x)
        skip = h
        for block in self.blocks:
            h = block(h)
        return self.o(h + skip)


def net() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet().eval().requires_grad_(False)


def dynamo_graph(net: torch.nn.Module, x: torch.Tensor, rewrite: bool = False, *,
                 context: Callable[[], ContextManager[object]] = contextlib.nullcontext,
                 on_graph: Callable[[torch.fx.GraphModule], None] | None = None,
                 fullgraph: bool = False) -> tuple[torch.fx.GraphModule, list]:
    """The graph Dynamo hands a backend (example values on every node; dynamic batch and size),
    and the inputs it was called with. ``context``: entered around the trace; ``on_graph``: called
    with the graph in the backend, after ``rewrite``'s GroupNorm rewrite."""
    got: dict[str, object] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        if rewrite:
            group_norm.rewrite_group_norms(gm)
        if on_graph is not None:
            on_graph(gm)
        got["gm"], got["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    x = x.clone()
    for d in (0, 2, 3):
        torch._dynamo.mark_dynamic(x, d)
    with torch.no_grad(), context():
        torch.compile(net, backend=backend, dynamic=None, fullgraph=fullgraph)(x)
    return got["gm"], got["inputs"]  # type: ignore[return-value]


HOST_GATE = "test.cut_nets.gate"


def _gate(tensors: list[torch.Tensor], ints: list[int], spec: str) -> torch.Tensor:
    """Reads the sigma on the host and branches on it (an IPAdapter-like window test)."""
    h, sigmas = tensors
    return h * 0.5 if sigmas.detach().cpu()[0].item() > ints[0] else h + float(spec)


class HostNet(ConvNet):
    """The conv net with a host call after every other block (``nexfort::host_call``)."""

    def forward(self, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from nexfort_engine import host_call

        h = self.i(x)
        skip = h
        for n, block in enumerate(self.blocks):
            h = block(h)
            if n % 2:
                h = host_call.call([h, sigmas], HOST_GATE, [n], "0.25")
        return self.o(h + skip)


def host_net() -> HostNet:
    """:class:`HostNet` with its resolver registered (in this process: a compile worker needs none)."""
    from nexfort_engine import host_call

    host_call.register(HOST_GATE, _gate)
    torch.manual_seed(0)
    return HostNet().eval().requires_grad_(False)
