"""Why ``max-optimize`` leaves Inductor's ``permute_fusion`` off.

On a GPU that flag makes every compile (warm ones too, before the cache lookup) run a fake
``ShapeProp`` over the whole Dynamo graph and then three linear/permute rewrites. Measured on the
H200: dropping it cut SDXL's warm start 40.4 → 31.1 s and its cold compile 184 → 149 s
(BENCHMARKS.md, sixth session). This checks the other half of the trade: on the graphs Dynamo
traces from ComfyUI's own UNet and DiT classes, the rewrites change nothing. If a ComfyUI release
adds layers they would rewrite, this fails and the flag should be reconsidered.
"""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import torch._dynamo
from torch._inductor.fx_passes import pre_grad
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from nexfort_engine import settings as S
from nexfort_engine.options import parse_options


def _dynamo_graph(fn, *args, **kwargs) -> tuple[torch.fx.GraphModule, list]:
    """The graph (and example inputs) Dynamo hands a backend for ``fn(*args, **kwargs)``, where
    ``fn`` calls a module compiled with the ``compile`` it is given."""
    captured: dict[str, object] = {}

    def capture(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    fn(lambda m, **opts: torch.compile(m, backend=capture, **opts), *args, **kwargs)
    return captured["gm"], captured["inputs"]  # type: ignore[return-value]


def _ops(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    return [(n.op, str(n.target)) for n in gm.graph.nodes]


def _rewrite(gm: torch.fx.GraphModule, inputs: list, *passes) -> torch.fx.GraphModule:
    """What fuse_fx does on a GPU with permute_fusion on (pre_grad.fuse_fx): a fake ShapeProp,
    then the rewrites."""
    ShapeProp(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    for rewrite in passes:
        gm = rewrite(gm)
    return gm


def test_max_optimize_leaves_permute_fusion_off():
    s = S.resolve(parse_options({"mode": "O2"}), cuda=True)
    assert "permute_fusion" not in s.inductor
    assert s.inductor["epilogue_fusion"] is True and s.inductor["pattern_matcher"] is True


@pytest.mark.parametrize("family", ["sd15", "pixart", "flux"])
def test_permute_rewrites_match_nothing_in_comfy_models(zoo, clean_dynamo, family):
    mp = zoo[family]

    def sample(compile_fn):
        compiled = compile_fn(mp.model.diffusion_model, dynamic=True)
        tm.call_diffusion(mp, h=512, w=512, batch=2, ctx_len=77, diffusion_model=compiled)

    gm, inputs = _dynamo_graph(sample)
    before = _ops(gm)
    gm = _rewrite(gm, inputs, pre_grad.linear_permute_fusion, pre_grad.permute_linear_fusion,
                  pre_grad.permute_matmul_fusion)
    assert len(before) > 100
    assert _ops(gm) == before


def test_the_check_sees_a_rewrite(clean_dynamo):
    """Control: the same harness does see a rewrite where the pattern is (linear of a permute)."""

    class PermuteLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x.permute(0, 2, 1))

    def call(compile_fn):
        with torch.no_grad():
            compile_fn(PermuteLinear())(torch.randn(2, 8, 5))

    gm, inputs = _dynamo_graph(call)
    before = _ops(gm)
    assert _ops(_rewrite(gm, inputs, pre_grad.permute_linear_fusion)) != before
