"""shapes.fold_spatial: under dynamic shape a conv net's image input is traced with its spatial
sizes as multiples of 8 (``[B, C, h, 8, w, 8]``, merged back inside the graph).

Units on plain tensors, then the engine on the tiny SD1.5 UNet with ``backend: eager`` (graph
counts and recompile reasons are Dynamo's decisions), then one real Inductor compile whose
generated code is read: with the fold it has no runtime floor division of a spatial size.
"""

from __future__ import annotations

import re

import pytest
import tiny_models as tm
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import nexfort_engine
from nexfort_engine import shapes


def _fold(x: torch.Tensor, m: int = 8) -> torch.Tensor:
    return shapes.fold_spatial((x,), m)[0]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_fold_is_a_plain_tensor_on_the_same_memory_and_unfolds_exactly(memory_format):
    x = torch.randn(2, 4, 16, 24).contiguous(memory_format=memory_format)
    f = _fold(x)
    assert f.shape == (2, 4, 2, 8, 3, 8)
    assert f._base is None and f.data_ptr() == x.data_ptr()  # no copy, and not a view Dynamo would trace
    seen = []
    back = shapes.unfolding(lambda t, *a, **k: seen.append((t, a, k)) or t, ndim=4)(f, 1, k=2)
    assert torch.equal(back, x) and back.stride() == x.stride()
    assert seen[0][1:] == ((1,), {"k": 2})
    # a plain input goes through untouched
    assert shapes.unfolding(lambda t: t, ndim=4)(x) is x


def test_every_unfolding_wrapper_has_its_own_code_object():
    """Dynamo caches graphs per code object: a VAE's decode and encode wrappers must not share one."""
    a, b = shapes.unfolding(lambda t: t, ndim=4), shapes.unfolding(lambda t: -t, ndim=4)
    assert a.__code__ is not b.__code__
    x = torch.randn(1, 2, 16, 16)
    assert torch.equal(b(_fold(x)), -x)


def test_video_latents_fold_every_spatial_dim():
    x = torch.randn(1, 16, 16, 32, 48)
    f = _fold(x)
    assert f.shape == (1, 16, 2, 8, 4, 8, 6, 8)
    assert torch.equal(shapes.unfolding(lambda t: t, ndim=5)(f), x)


@pytest.mark.parametrize(
    "shape, m",
    [
        ((2, 4, 12, 16), 8),  # 12 is not a multiple of 8
        ((2, 4, 8, 16), 8),  # a quotient of 1 would be specialised: not folded
        ((2, 4, 16, 16), 1),  # off
        ((2, 77, 64), 8),  # a text context, not an image
    ],
)
def test_inputs_that_are_not_folded_pass_as_they_are(shape, m):
    x = torch.randn(*shape)
    assert _fold(x, m) is x
    ints = torch.arange(2 * 4 * 16 * 16).view(2, 4, 16, 16)
    assert _fold(ints) is ints  # integer inputs (masks, ids) are not images


def test_only_the_first_argument_is_folded():
    x, hint = torch.randn(1, 4, 16, 16), torch.randn(1, 3, 128, 128)
    args = shapes.fold_spatial((x, hint), 8)
    assert args[0].dim() == 6 and args[1] is hint


def test_multiple_is_decided_by_model_kind_and_shape_policy():
    unet = tm.tiny_sd15().model.diffusion_model
    dit = tm.tiny_pixart().model.diffusion_model
    assert shapes.spatial_multiple(unet, None, dynamic=True) == shapes.SPATIAL_MULTIPLE == 8
    assert shapes.spatial_multiple(dit, None, dynamic=True) == 1  # a DiT's patch embed is one conv
    assert shapes.spatial_multiple(unet, None, dynamic=False) == 1  # static sizes are constants
    assert shapes.spatial_multiple(unet, 1, dynamic=True) == 1
    assert shapes.spatial_multiple(dit, 4, dynamic=True) == 4


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_engine_traces_aligned_latents_folded_with_one_graph(zoo, fresh_stats, clean_dynamo):
    """Latents in multiples of 8 (images in multiples of 64 px) share one folded graph; an
    unaligned one makes exactly one more (plain) graph, counted with Dynamo's reason; every
    output equals eager."""
    mp = zoo["sd15"]
    cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2", "backend": "eager"}, label="fold")
    g0 = _graphs()
    for h, w, ctx in [(128, 128, 77), (128, 192, 154), (256, 128, 77)]:
        out = tm.call_diffusion(mp, h, w, 2, ctx, diffusion_model=cm)
        assert torch.equal(out, tm.call_diffusion(mp, h, w, 2, ctx))
    assert _graphs() - g0 == 1
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0
    assert cm._nx_fold == 8 and rec["spatial_multiple"] == 8  # shown by the Cache Manager

    out = tm.call_diffusion(mp, 96, 128, 2, 77, diffusion_model=cm)  # latent 12 x 16
    assert torch.equal(out, tm.call_diffusion(mp, 96, 128, 2, 77))
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == 2 and rec["recompiles"] == 1
    assert "rank mismatch" in rec["recompile_reasons"][-1], rec["recompile_reasons"]
    # both graphs stay valid: back to an aligned size, then the unaligned one again, no new graph
    for h, w in [(192, 192), (96, 128)]:
        assert torch.equal(tm.call_diffusion(mp, h, w, 2, 77, diffusion_model=cm), tm.call_diffusion(mp, h, w, 2, 77))
    assert fresh_stats()["models"][cm.label]["compiles"] == 2


def test_fold_off_and_static_shapes_trace_the_input_as_it_is(zoo, fresh_stats, clean_dynamo):
    mp = zoo["sd15"]
    for options in ({"spatial_multiple": 1}, {"dynamic": False}):
        cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2", "backend": "eager", **options})
        out = tm.call_diffusion(mp, 128, 128, 2, 77, diffusion_model=cm)
        assert torch.equal(out, tm.call_diffusion(mp, 128, 128, 2, 77))
        assert cm._nx_fold == 1


def test_the_fold_is_part_of_the_cache_key(zoo, tmp_path, fresh_stats, clean_dynamo):
    """Folded and plain graphs of the same model live in different entries."""
    dm = zoo["sd15"].model.diffusion_model
    keys = set()
    for sm in (None, 8, 1):
        cm = nexfort_engine.compile(dm, {"mode": "O2", "backend": "eager", "spatial_multiple": sm}, cache_dir=tmp_path)
        tm.call_diffusion(zoo["sd15"], 128, 128, 2, 77, diffusion_model=cm)
        keys.add(cm.cache_entry.key)
    assert len(keys) == 2  # auto == 8 for a UNet; 1 is its own entry


@pytest.mark.inductor
def test_inductor_code_of_a_folded_unet_has_no_runtime_floor_division(zoo, tmp_path, fresh_stats, clean_dynamo):
    """Real Inductor (CPU): the folded UNet matches eager at two aligned sizes with one graph, and
    its generated code never splits an index by a symbolic spatial size at run time (the same UNet
    traced plain has ``c10::div_floor_integer`` in ~1800 places, BENCHMARKS.md). What remains in
    the contiguous CPU layout (shapes.layout_patches) is a handful of loop bounds: a row of
    ``8 * q`` elements cut into 16-lane vectors, ``16 * (q // 2)``."""
    mp = zoo["sd15"]
    cm = nexfort_engine.compile(mp.model.diffusion_model, {"mode": "O2"}, cache_dir=tmp_path, label="fold-inductor")
    for h, w, ctx in [(128, 128, 77), (192, 128, 154)]:
        out = tm.call_diffusion(mp, h, w, 2, ctx, diffusion_model=cm)
        assert tm.rel_err(out, tm.call_diffusion(mp, h, w, 2, ctx)) <= 1e-3
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0 and rec["fallbacks"] == 0
    code = [p.read_text(errors="replace") for p in cm.cache_entry.path.rglob("*.py")]
    kernels = [c for c in code if 'extern "C"' in c]
    assert kernels, "no generated C++ kernels found in the cache entry"
    divisions = [m for c in kernels for m in re.findall(r"div_floor_integer\(([^;]*?)\)\)", c)]
    assert len(divisions) <= 32, f"{len(divisions)} runtime floor divisions in the generated code"
    # a symbolic size by a constant (a loop bound), never an index variable (x0, x1_inner, ...)
    assert not any(re.search(r"\bx\d", d) for d in divisions), divisions[:5]
    assert any("ks0" in c for c in kernels)  # the code is symbolic (dynamic shape), not specialised


def test_channels_last_inputs_fold_too(zoo, fresh_stats, clean_dynamo):
    """``memory_format: channels_last`` converts the latent before the fold: the split view keeps
    the NHWC strides, the graph merges it back to a channels-last tensor, outputs equal eager's up to
    rounding (channels-last convolutions run other oneDNN kernels than the contiguous eager ones)."""
    mp = zoo["sd15"]
    cm = nexfort_engine.compile(
        mp.model.diffusion_model, {"mode": "O2", "backend": "eager", "memory_format": "channels_last"}, label="cl"
    )
    for h, w in [(128, 128), (192, 128)]:
        out = tm.call_diffusion(mp, h, w, 2, 77, diffusion_model=cm)
        assert tm.rel_err(out, tm.call_diffusion(mp, h, w, 2, 77)) <= 1e-5, tm.rel_err(out, tm.call_diffusion(mp, h, w, 2, 77))
    rec = fresh_stats()["models"][cm.label]
    assert cm._nx_fold == 8 and rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
