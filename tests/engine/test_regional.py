"""Regional compilation (nexfort_engine/regions.py): each stack of identical DiT blocks compiles once.

Tiny PixArt-alpha (5 blocks) and Flux (4 double + 4 single) built with ComfyUI's classes, sampled
through ComfyUI's sampler. With ``backend: eager`` the graph count is Dynamo's: one graph per block
class, plus one for batch 1 vs batch 2 (size 1 is specialised, the same bound as whole-model
compiles) - over 3 resolutions x 2 cfg x 2 prompt lengths, including Flux, whose whole-model
compile specialises on the resolution (test_dynamic_shapes.py) because the size-dependent Python
is in the eager glue here.
"""

from __future__ import annotations

import itertools

import pytest
import tiny_models as tm
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import nexfort_engine
from nexfort_engine import regions
from nexfort_engine.options import OptionsError, parse_options


@pytest.fixture(scope="module")
def deep(comfy_inproc):
    return {"pixart": tm.tiny_pixart(depth=5), "flux": tm.tiny_flux(depth=4, depth_single=4)}


@pytest.fixture
def clean_dynamo(monkeypatch, fresh_stats):
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    counters.clear()
    yield fresh_stats
    torch._dynamo.reset()


def test_finds_top_level_block_stacks(deep, zoo):
    pix = deep["pixart"].model.diffusion_model
    [r] = regions.find_regions(pix)
    assert r.path == "blocks" and len(r.blocks) == 5 and r.name == "blocks[PixArtMSBlockx5]"
    assert regions.select_regions(pix, None) == [r]
    flux = deep["flux"].model.diffusion_model
    assert [r.name for r in regions.select_regions(flux, None)] == [
        "double_blocks[DoubleStreamBlockx4]", "single_blocks[SingleStreamBlockx4]"]
    # a UNet has no stack of >= 4 identical top-level blocks: compiled whole
    assert regions.select_regions(zoo["sd15"].model.diffusion_model, None) == []
    # 2 blocks: below MIN_REPEATS, even when forced
    assert regions.select_regions(zoo["pixart"].model.diffusion_model, True) == []
    assert regions.select_regions(pix, False) == []


def test_auto_needs_most_of_the_weights():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
            self.head = torch.nn.Linear(64, 64)

    net = Net()
    assert regions.region_share(net, regions.find_regions(net)) < regions.MIN_SHARE
    assert regions.select_regions(net, None) == []
    assert len(regions.select_regions(net, True)) == 1


def test_blocks_with_hooks_are_left_alone():
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(5))
    blocks[0].register_forward_hook(lambda *a: None)
    root = torch.nn.Module()
    root.blocks = blocks
    [r] = regions.find_regions(root)
    assert len(r.blocks) == 4 and blocks[0] not in r.blocks


def test_option_validation():
    assert parse_options({"regional": True}).regional is True
    assert parse_options({}).regional is None
    with pytest.raises(OptionsError, match="true, false or null"):
        parse_options({"regional": "auto"})


@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_regional_sweep_one_graph_per_block_class(deep, clean_dynamo, family):
    mp = deep[family]
    dm = mp.model.diffusion_model
    cm = nexfort_engine.compile(dm, {"backend": "eager", "mode": "O1"}, label=f"regional-{family}")
    compiled = tm.with_diffusion_model(mp, cm)
    worst = 0.0
    for (h, w), cfg, ctx in itertools.product(tm.RESOLUTIONS[family], (1.0, 5.0), (77, 154)):
        ref = tm.sample(mp, h, w, 1, 3, cfg, ctx)
        out = tm.sample(compiled, h, w, 1, 3, cfg, ctx)
        worst = max(worst, tm.rel_err(out, ref))
        # nothing stays installed between calls: the shared model is plain outside our call
        assert all(b.__dict__.get("_compiled_call_impl") is None for b in dm.modules())
    assert worst == 0.0  # backend eager: the same kernels
    classes = len(regions.find_regions(dm))
    graphs = int(counters["stats"]["unique_graphs"])
    assert graphs <= 2 * classes, graphs  # batch 1 and batch 2 per class, nothing per resolution
    [rec] = clean_dynamo()["models"].values()
    assert rec["regions"] == [r.name for r in regions.find_regions(dm)]
    assert rec["compiles"] == graphs and rec["recompiles"] == graphs - classes
    assert rec["fallbacks"] == 0


def test_regional_failure_falls_back_and_uninstalls(deep, clean_dynamo, monkeypatch):
    mp = deep["pixart"]
    dm = mp.model.diffusion_model
    cm = nexfort_engine.compile(dm, {"backend": "aot_eager", "mode": "O1"}, label="regional-broken")

    def broken(self, gm, example_inputs):
        raise RuntimeError("injected backend failure")

    monkeypatch.setattr(type(cm), "_compile_graph", broken)
    ref = tm.call_diffusion(mp, 384, 384, 2, 77)
    out = tm.call_diffusion(mp, 384, 384, 2, 77, diffusion_model=cm)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert cm.failed and "injected backend failure" in cm.failed
    assert all(b.__dict__.get("_compiled_call_impl") is None for b in dm.modules())
    assert clean_dynamo()["fallbacks"] == 1


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _Stack(torch.nn.Module):
    """The first block gets a transposed view (like Wan's patch embedding), the rest contiguous."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):  # [B, 16, L]
        h = x.transpose(1, 2)
        for b in self.blocks:
            h = b(h)
        return h


@pytest.mark.parametrize("dynamic", [False, True])
def test_block_inputs_get_one_layout(clean_dynamo, dynamic):
    torch.manual_seed(0)
    net = _Stack()
    cm = nexfort_engine.compile(net, {"backend": "eager", "mode": "O1", "dynamic": dynamic}, label="stack")
    for length in ((5,) if not dynamic else (5, 7, 9)):
        x = torch.randn(2, 16, length)
        torch.testing.assert_close(cm(x), net(x))
    assert int(counters["stats"]["unique_graphs"]) == 1
    [rec] = clean_dynamo()["models"].values()
    assert rec["regions"] == ["blocks[_Blockx4]"] and rec["recompiles"] == 0


def test_regional_with_fp8_quantizes_inside_blocks(deep, clean_dynamo):
    """fp8 forced with regional compilation: the mode is entered per compiled block (the eager
    glue stays in the model's dtype); output close to eager, visibly quantized, no fallback."""
    mp = deep["pixart"]
    dm = mp.model.diffusion_model
    cm = nexfort_engine.compile(dm, {"backend": "aot_eager", "mode": "O1", "fp8": True}, label="regional-fp8")
    ref = tm.call_diffusion(mp, 384, 384, 2, 77)
    out = tm.call_diffusion(mp, 384, 384, 2, 77, diffusion_model=cm)
    err = tm.rel_err(out, ref)
    assert 0 < err < 0.1, err
    [rec] = clean_dynamo()["models"].values()
    assert rec["fp8"] is True and rec["fallbacks"] == 0 and rec["regions"]


def test_cache_key_follows_the_regional_decision(deep, clean_dynamo, tmp_path):
    """auto and true compile the same regions: one cache entry; whole-model compiles another."""
    mp = deep["pixart"]
    keys = {}
    for regional in (None, True, False):
        cm = nexfort_engine.compile(mp.model.diffusion_model, {"backend": "eager", "mode": "O1", "regional": regional},
                                    cache_dir=tmp_path, label=f"key-{regional}")
        tm.call_diffusion(mp, 384, 384, 2, 77, diffusion_model=cm)
        keys[regional] = cm.cache_entry.key
    assert keys[None] == keys[True] != keys[False]


def test_deep_regions_find_a_unets_transformer_stacks(deep, comfy_inproc):
    """``regional: true`` searches lists at any depth and counts identical blocks across lists: the
    tiny UNet's 14 BasicTransformerBlocks (two widths) in 7 SpatialTransformers become 2 regions;
    auto leaves the UNet whole; a DiT's deep search finds its top-level stacks, so auto and true
    agree there (same cache key suffix)."""
    unet = tm.tiny_sd15(depth=2).model.diffusion_model
    found = regions.select_regions(unet, True)
    assert sorted(len(r.blocks) for r in found) == [6, 8]
    assert {type(r.blocks[0]).__name__ for r in found} == {"BasicTransformerBlock"}
    assert all(".transformer_blocks" in r.path for r in found)
    # auto takes top-level stacks only: nested ones are the explicit choice (BENCHMARKS.md run18)
    assert regions.select_regions(unet, None) == []
    key = regions.regions_key(found)
    assert key.startswith(".regional.") and key == regions.regions_key(regions.select_regions(unet, True))
    pix = deep["pixart"].model.diffusion_model
    assert [r.name for r in regions.find_regions(pix, deep=True)] == [r.name for r in regions.find_regions(pix)]
    assert regions.regions_key(regions.select_regions(pix, True)) == ".regional"


def test_deep_regions_do_not_nest():
    """Blocks inside a block that is already in a region are not regions of their own."""
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList(Outer() for _ in range(4))
    [r] = regions.find_regions(root, deep=True)
    assert r.path == "blocks" and len(r.blocks) == 4
    lone = torch.nn.Module()
    lone.wrap = torch.nn.ModuleList([Outer()])  # one outer block: its inner stack is the region
    [r] = regions.find_regions(lone, deep=True)
    assert r.path == "wrap.0.inner" and len(r.blocks) == 4


class _InPlaceBlock(torch.nn.Module):
    """Updates its input in place, as ComfyUI's Flux blocks do (``img += gate * attn(img)``)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        x += scale * self.lin(x)
        return x


def _mutated_placeholders(gm: torch.fx.GraphModule) -> list[str]:
    import operator

    inplace = {operator.iadd, operator.imul, operator.isub}
    out = []
    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if not (isinstance(first, torch.fx.Node) and first.op == "placeholder"):
            continue
        name = str(node.target)
        if node.target in inplace or (node.op == "call_method" and name.endswith("_") and not name.startswith("_")):
            out.append(f"{name}({first.name})")
    return out


def test_compiled_blocks_do_not_mutate_their_inputs(clean_dynamo):
    """The compiled block works on in-graph copies of its tensor inputs (block_forward): its graph
    has no in-place op on an input, which is what lets CUDA-graph trees replay it instead of
    running it kernel by kernel; the caller's tensor is left alone and the result is eager's."""
    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList(_InPlaceBlock() for _ in range(4))
    [region] = regions.find_regions(root)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = regions.compile_block_forward(region, lambda f: torch.compile(f, backend=backend))
    # one wrapper (one Dynamo cache) per block class
    assert regions.compile_block_forward(region, lambda f: f) is regions._block_forwards[_InPlaceBlock]
    x = torch.randn(2, 3, 8)
    kept = x.clone()
    with torch.no_grad():
        out = fn(root.blocks[0], x, 0.5)
        expected = root.blocks[0](kept.clone(), 0.5)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, kept)  # the caller's tensor was not updated in place
    assert graphs and all(_mutated_placeholders(g) == [] for g in graphs)
    # the check can fail: the plain forward does mutate its input in the graph
    torch._dynamo.reset()
    graphs.clear()
    with torch.no_grad():
        torch.compile(_InPlaceBlock.forward, backend=backend)(root.blocks[0], x.clone(), 0.5)
    assert any(_mutated_placeholders(g) for g in graphs)


def test_block_inputs_are_never_views_under_dynamic_shape():
    """A view input is guarded through its base by Dynamo, and the next block of the stack, given a
    plain tensor, would fail that guard (Flux's first double block on the GPU): large views pass
    as plain tensors on the same memory, small ones as copies."""
    from nexfort_engine.shapes import SMALL_VIEW_NUMEL, prepare_block_inputs

    big = torch.randn(2, SMALL_VIEW_NUMEL).view(2, 4, SMALL_VIEW_NUMEL // 4)
    small = torch.randn(8).view(2, 4)
    (a,), kw = prepare_block_inputs((big,), {"pe": small}, dynamic=True)
    assert big._base is not None and a._base is None and a.data_ptr() == big.data_ptr()
    assert torch.equal(a, big)
    assert kw["pe"]._base is None and kw["pe"].data_ptr() != small.data_ptr()
    (same,), _ = prepare_block_inputs((big,), {}, dynamic=False)  # static shape: untouched
    assert same is big
