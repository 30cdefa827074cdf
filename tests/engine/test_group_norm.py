"""passes/group_norm: F.group_norm reduced in channels-last order, swapped into Dynamo graphs.

The function against its reference twin (``F.group_norm``) on plain tensors, then the rewrite on
the tiny ComfyUI SD1.5 UNet through the engine: forced on (``backend: aot_eager`` under dynamic
shape, so AOTAutograd traces the rewritten graph with symbolic sizes), and the auto rule (off on
the CPU and under static shape, where it was not measured to pay).
"""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from pass_helpers import aot_cache_saves

import nexfort_engine
from nexfort_engine.options import OptionsError, parse_options
from nexfort_engine.passes.group_norm import group_norm_channels_last, rewrite_group_norms, wanted


@pytest.mark.parametrize(
    "shape, groups",
    [((2, 64, 8, 8), 32), ((1, 32, 5, 7), 8), ((2, 16, 3, 4, 8), 4), ((3, 8, 10), 2), ((1, 6, 4, 4), 6)],
)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_matches_f_group_norm_in_float32(shape, groups, affine, channels_last):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3 + 5  # a large mean: the variance must not cancel
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(shape[1], generator=gen) if affine else None
    b = torch.randn(shape[1], generator=gen) if affine else None
    ref = F.group_norm(x, groups, w, b, 1e-5)
    out = group_norm_channels_last(x, groups, w, b, 1e-5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_half_inputs_are_normalised_in_float32_and_cast_once():
    x = (torch.randn(2, 64, 16, 16) * 4 + 2).half()
    w, b = torch.randn(64).half(), torch.randn(64).half()
    exact = F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5)
    out = group_norm_channels_last(x, 32, w, b, 1e-5)
    assert out.dtype == torch.float16
    # one rounding to fp16 at the end: within half an fp16 ulp of the float32 result
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-11 + 1e-6).all()


def test_channels_that_do_not_split_into_groups_raise_like_the_reference():
    x = torch.randn(1, 6, 4, 4)
    with pytest.raises(RuntimeError):
        F.group_norm(x, 4)
    with pytest.raises(RuntimeError):
        group_norm_channels_last(x, 4)  # delegated to F.group_norm: same error


def test_rewrite_points_every_group_norm_node_at_the_twin():
    gn = torch.nn.GroupNorm(4, 16)
    seen = {}

    def backend(gm, example_inputs):
        seen["n"] = rewrite_group_norms(gm)
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    x = torch.randn(2, 16, 8, 8)
    out = torch.compile(lambda t: F.silu(gn(gn(t))), backend=backend)(x)
    assert seen["n"] == 2
    assert seen["targets"].count(group_norm_channels_last) == 2 and F.group_norm not in seen["targets"]
    torch.testing.assert_close(out, F.silu(gn(gn(x))), rtol=1e-5, atol=1e-5)


def test_option_is_validated():
    assert parse_options({"group_norm_rewrite": True}).group_norm_rewrite is True
    assert parse_options({}).group_norm_rewrite is None
    with pytest.raises(OptionsError, match="true, false or null"):
        parse_options({"group_norm_rewrite": "yes"})


def test_unet_with_the_rewrite_matches_eager_under_dynamic_shape(zoo, fresh_stats, clean_dynamo):
    """Forced on: every GroupNorm of the real ComfyUI UNet is rewritten, AOTAutograd traces it with
    symbolic (folded) sizes, two resolutions share one graph, outputs match eager."""
    mp = zoo["sd15"]
    dm = mp.model.diffusion_model
    n_norms = sum(isinstance(m, torch.nn.GroupNorm) for m in dm.modules())
    cm = nexfort_engine.compile(dm, {"mode": "O2", "backend": "aot_eager", "group_norm_rewrite": True}, label="gn")
    for h, w in [(128, 128), (128, 192)]:
        out = tm.call_diffusion(mp, h, w, 2, 77, diffusion_model=cm)
        ref = tm.call_diffusion(mp, h, w, 2, 77)
        assert tm.rel_err(out, ref) < 1e-5
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0 and rec["fallbacks"] == 0
    # the output norm (out.0) is called once; each ResBlock's two norms once per block
    assert rec["group_norms_rewritten"] == n_norms > 0


def test_auto_rule():
    """Auto: a conv net's forward that Inductor keeps channels-last (GPU), dynamic or static shape."""
    assert wanted(None, channels_last_forced=True, inductor=True)  # a UNet on the GPU, any shape mode
    assert not wanted(None, channels_last_forced=False, inductor=True)  # CPU / DiT
    assert not wanted(None, channels_last_forced=True, inductor=False)  # eager backends
    assert not wanted(None, channels_last_forced=True, inductor=True, forward=False)  # VAE decode
    assert wanted(True, channels_last_forced=False, inductor=False)
    assert not wanted(False, channels_last_forced=True, inductor=True)


@pytest.mark.parametrize("options", [{}, {"group_norm_rewrite": False}])
def test_unrewritten_unet_is_untouched(zoo, fresh_stats, clean_dynamo, options):
    mp = zoo["sd15"]
    cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2", "backend": "eager", **options})
    out = tm.call_diffusion(mp, 128, 128, 2, 77, diffusion_model=cm)
    assert torch.equal(out, tm.call_diffusion(mp, 128, 128, 2, 77))
    assert fresh_stats()["models"][cm.label]["group_norms_rewritten"] == 0


class _DecoderBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Conv2d(4, 24, 3, padding=1)
        self.norm = torch.nn.GroupNorm(8, 32)
        self.conv = torch.nn.Conv2d(32, 4, 3, padding=1)
        self.skip = torch.nn.Conv2d(32, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.up(x), x.repeat(1, 2, 1, 1)], dim=1)
        return self.conv(F.silu(self.norm(h))) + self.skip(h)


def test_input_pin_is_a_channels_last_copy_in_eager():
    """The op's eager reference: same values, channels-last memory, never the input itself."""
    x = torch.randn(2, 8, 5, 6)
    for inp in (x, x.contiguous(memory_format=torch.channels_last)):
        out = torch.ops.nexfort.channels_last_input(inp)
        assert torch.equal(out, inp) and out.is_contiguous(memory_format=torch.channels_last)
        assert out.data_ptr() != inp.data_ptr()


def test_every_view_changes_rank():
    """Traced with symbolic sizes, the twin's views all change the tensor's rank: a same-rank view
    onto a constant group count made torch 2.11's pointless-view pass guard on ``4*W != 32``, and
    SD2.1 recompiled at 512² on the GPU (BENCHMARKS.md, eighth session)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, w, b):
        return group_norm_channels_last(x, 8, w, b, 1e-5)

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(2, 32, 12, 16), torch.randn(32), torch.randn(32))
    views = [n for n in gm.graph.nodes if n.op == "call_function" and "view" in str(n.target)]
    assert views, "expected the twin to view its input"
    for n in views:
        src, dst = n.args[0].meta["val"], n.meta["val"]
        assert src.dim() != dst.dim(), f"{n.target}: {tuple(src.shape)} -> {tuple(dst.shape)}"
    assert any("channels_last_input" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.inductor
def test_inductor_compiles_the_rewrite_under_dynamic_shape(tmp_path, fresh_stats, clean_dynamo):
    """Real Inductor (CPU) on a UNet decoder's pattern (conv, concatenation with a skip, GroupNorm,
    SiLU, conv, 1x1 skip conv) with the rewrite forced, so the GroupNorm's input pin is lowered on
    a concatenation: two resolutions share one graph and match eager, and AOTAutograd's cache stores the graph (a
    bypassed AOTAutograd cache re-traces the whole model on every warm start: an SD2.1 warm start
    took 51 s instead of 24 s on the GPU until the rewritten function was marked cacheable)."""
    torch.manual_seed(0)
    net = _DecoderBlock().eval()
    with aot_cache_saves():
        cm = nexfort_engine.compile(net, {"mode": "O2", "group_norm_rewrite": True}, cache_dir=tmp_path,
                                    label="gn-ind")
        with torch.no_grad():
            for h, w in [(16, 16), (24, 32)]:
                x = torch.randn(2, 4, h, w)
                torch.testing.assert_close(cm(x), net(x), rtol=1e-4, atol=1e-4)
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0 and rec["fallbacks"] == 0
    assert rec["group_norms_rewritten"] == 1


def test_cache_mark_names_the_function_and_follows_its_source(monkeypatch):
    from nexfort_engine.passes import group_norm

    (name, digest), = group_norm.cache_marks().items()
    fn = group_norm.group_norm_channels_last
    assert name == f"{fn.__module__}.{fn.__name__}" and len(digest) == 16
    # without source files (e.g. a bytecode-only install) the mark still exists, from the code object
    import inspect

    def no_source(obj):
        raise OSError("no source")

    monkeypatch.setattr(inspect, "getsource", no_source)
    (name2, digest2), = group_norm.cache_marks().items()
    assert name2 == name and len(digest2) == 16 and digest2 != digest
