"""Linear weights stored in e4m3 while compiled (``"fp8_weights": true``): the engine's layer
(``nexfort_engine/fp8_weights.py``) against plain torch, and the node layer's swap through
ComfyUI's object patches on the tiny Flux, sampled through ComfyUI's real sampler: the weights are
e4m3 while the clone runs, the originals come back bit for bit, a LoRA goes through the layers'
patch protocol, and under O3 every token-wise GEMM reads the stored tensor."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from test_fp8_stored import _cpu_rowwise_scaled_mm

import nexfort_engine
from nexfort_engine.fp8 import _key
from nexfort_engine.fp8_weights import (
    E4M3,
    E4M3_MAX,
    HEADROOM,
    Fp8StoredLinear,
    quantize_per_tensor,
    storable,
    stored_copy,
)

# the fp8 weights' rounding moved the tiny Flux's image by 0.023 relative L2 (float32 weights)
WEIGHT_ERR = 0.06


def test_quantize_per_tensor_against_torch():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 0.02
    q, s = quantize_per_tensor(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.dim() == 0
    assert torch.equal(s, w.abs().amax() * HEADROOM / E4M3_MAX)
    assert torch.equal(q, (w / s).to(E4M3))  # plain torch: divide, cast
    assert q.float().abs().max() == E4M3_MAX / HEADROOM and tm.rel_l2(q.float() * s, w) < 0.05
    q2, s2 = quantize_per_tensor(w * 4, s)  # a given scale: values past its range clip at 448
    assert torch.equal(s2, s) and q2.float().abs().max() == E4M3_MAX
    zq, zs = quantize_per_tensor(torch.zeros(16, 16))
    assert zs == 1 and not zq.float().any()
    keep = w.clone()
    quantize_per_tensor(w)
    assert torch.equal(w, keep)  # a float32 weight is not divided in place
    for dtype in (torch.bfloat16, torch.float16):  # the bits of the plain fp32 formula
        wd = w.to(dtype)
        qd, sd = quantize_per_tensor(wd)
        ref_s = wd.float().abs().amax() * HEADROOM / E4M3_MAX
        assert torch.equal(sd, ref_s)
        assert torch.equal(qd.view(torch.uint8), (wd.float() / ref_s).clamp(-448, 448).to(E4M3).view(torch.uint8))


def test_cpu_rounding_in_row_blocks_gives_the_same_bits(monkeypatch):
    """A CPU weight past ``CPU_CHUNK`` elements is rounded a block of rows at a time (ComfyUI loads
    checkpoints to the CPU): the bits of the whole-tensor formula, for a given scale too, with a
    last block shorter than the others and for a transposed (non-contiguous) weight."""
    from nexfort_engine import fp8_weights

    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 32, generator=gen) * 0.02).to(torch.bfloat16)
    w[5, 7] = 3.0  # one outlier: most values round small
    want_q, want_s = quantize_per_tensor(w)  # under CPU_CHUNK: one block of all rows
    clipped_q, _ = quantize_per_tensor(w * 4, want_s)
    monkeypatch.setattr(fp8_weights, "CPU_CHUNK", 100)  # 3 rows a block: 21 blocks and one of 1 row
    q, s = quantize_per_tensor(w)
    assert torch.equal(s, want_s) and q.shape == w.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(quantize_per_tensor(w * 4, want_s)[0].view(torch.uint8), clipped_q.view(torch.uint8))
    qt, _ = quantize_per_tensor(w.t(), want_s)
    assert torch.equal(qt.view(torch.uint8), want_q.t().contiguous().view(torch.uint8))


def test_layer_against_its_twin():
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(32, 48)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=gen)
    layer = stored_copy(lin)
    assert layer.weight.dtype == E4M3 and layer.bias is not lin.bias and layer.bias.data_ptr() == lin.bias.data_ptr()
    assert lin.weight.dtype == torch.float32  # the original is untouched
    x = torch.randn(2, 7, 32, generator=gen)
    with torch.no_grad():
        twin = F.linear(x, layer.weight.float() * layer.scale_weight, lin.bias)
        assert torch.equal(layer(x), twin)
        assert torch.equal(layer.dequantized(), layer.weight.float() * layer.scale_weight)
        assert tm.rel_l2(layer(x), lin(x)) < 0.05
    assert not storable(layer) and not storable(torch.nn.Linear(30, 48)) and not storable(torch.nn.Conv2d(16, 16, 1))
    assert not storable(torch.nn.Linear(32, 48).to(E4M3))
    with pytest.raises(ValueError, match="multiples of 16"):
        stored_copy(torch.nn.Linear(30, 48))
    with pytest.raises(ValueError, match="does not match"):
        stored_copy(lin, torch.zeros(48, 16))
    other = stored_copy(lin, lin.weight * 2, torch.zeros(48))  # the originals a host passes
    assert torch.equal(other.scale_weight, layer.scale_weight * 2) and not other.bias.any()


def test_stored_layers_keep_the_model_width():
    """Auto fp8 (O3) decides by the linears' width (fp8.pays_off): a model whose block linears are
    swapped keeps its width, so O3 still turns fp8 on for it."""
    from nexfort_engine.fp8 import model_width

    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))
    before = model_width(net)
    net[1], net[2] = stored_copy(net[1]), stored_copy(net[2])
    assert before == model_width(net) == 64


def test_patch_protocol():
    """``convert_weight``/``set_weight`` as ComfyUI's weight patching calls them: the stored values
    as full precision, and a patched weight rounded back with the layer's scale."""
    lin = torch.nn.Linear(32, 32)
    layer = stored_copy(lin)
    full = layer.convert_weight(layer.weight.float())
    assert torch.equal(full, layer.dequantized())
    assert torch.equal(layer.convert_weight(layer.weight.float(), inplace=True), full)  # the returned tensor counts
    # float32 whatever the host casts to (newer ComfyUI patches in float16 on a GPU): a weight whose
    # scale is subnormal in float16 keeps its precision
    small = stored_copy(torch.nn.Linear(32, 32).requires_grad_(False).apply(lambda m: m.weight.mul_(0.01)))
    assert small.scale_weight < torch.finfo(torch.float16).smallest_normal
    conv = small.convert_weight(small.weight.half(), inplace=True)
    assert conv.dtype == torch.float32 and torch.equal(conv, small.dequantized())
    patched = full + 0.01
    q = layer.set_weight(patched, return_weight=True)
    assert q.dtype == E4M3 and torch.equal(q, (patched / layer.scale_weight).clamp(-448, 448).to(E4M3))
    ptr = layer.weight.data_ptr()
    layer.set_weight(patched, inplace_update=True)
    assert layer.weight.data_ptr() == ptr and torch.equal(layer.weight, q)
    layer.set_weight(full)
    assert layer.weight.data_ptr() != ptr and torch.equal(layer.dequantized(), full)


@torch.no_grad()
@pytest.mark.parametrize("dequantized", [False, True], ids=["convert-in-patch", "dequantized-in"])
def test_weight_functions_get_what_the_host_expects(dequantized):
    """A low-VRAM load adds the LoRA through ``weight_function``. ComfyUI 0.3.75's patch converts
    the stored values cast up, patches and rounds back (the layer scales after); newer ComfyUI's
    adds the patch to what it is given, which must then be the dequantized weight. Both against
    ``F.linear`` with the dequantized weight plus the patch (rounded to e4m3 where the host rounds)."""
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(32, 48)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=gen)
    layer = stored_copy(lin)
    layer.dequantize_for_patches = dequantized
    delta = torch.randn(48, 32, generator=gen) * 0.02

    def old_host_patch(w):  # ComfyUI 0.3.75's LowVramPatch with the layer's convert/set functions
        return layer.set_weight(layer.convert_weight(w) + delta, return_weight=True).to(w.dtype)

    def new_host_patch(w):  # newer ComfyUI's: the patch on what it is given
        return w + delta

    layer.weight_function = [new_host_patch if dequantized else old_host_patch]
    x = torch.randn(2, 5, 32, generator=gen)
    patched = layer.dequantized() + delta
    want = patched if dequantized else quantize_per_tensor(patched, layer.scale_weight)[0].float() * layer.scale_weight
    assert torch.allclose(layer(x), F.linear(x, want, lin.bias), rtol=1e-5, atol=1e-6)
    layer.weight_function = []
    assert torch.equal(layer(x), F.linear(x, layer.dequantized(), lin.bias))  # no patch: the stored form


@torch.no_grad()
def test_low_vram_lora_through_this_comfyuis_patch(patcher, comfy_inproc):
    """The running ComfyUI's own low-VRAM patch (``LowVramPatch`` with the layer's convert/set
    functions, as its partial load builds it) on a stored copy made by the node layer: the layer
    multiplies by the original weight plus the LoRA, within one e4m3 rounding of the patched weight."""
    import comfy.model_patcher

    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 64)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=gen)
    layer = patcher._stored_copy_of(lin, lin.weight, lin.bias, torch.device("cpu"))
    key = "m.weight"
    delta = torch.randn(64, 64, generator=gen) * 0.02
    patch = comfy.model_patcher.LowVramPatch(key, {key: [(1.0, (delta,), 1.0, None, None)]},
                                             layer.convert_weight, layer.set_weight)
    layer.weight_function = [patch]
    try:
        x = torch.randn(2, 5, 64, generator=gen)
        want = F.linear(x, lin.weight + delta, lin.bias)
        base = F.linear(x, lin.weight, lin.bias)
        assert tm.rel_err(layer(x), want) < 0.05 < tm.rel_err(base, want)
    finally:
        layer.weight_function = []


@torch.no_grad()
def test_originals_parked_while_the_copies_run(patcher, comfy_inproc, monkeypatch):
    """Where the originals and the stored copies are, through ComfyUI's real load/sample flow:
    eager, compiled, eager, compiled on one model. The offload device is made distinct from the load
    device (``cpu:0`` against ``cpu``: the same memory, told apart) and every ``Module.to`` (ComfyUI's
    and ours) is recorded for the module and all below it. The compiled clone loads after the eager
    patcher: with the model's weight-patch id ComfyUI only swapped the object patches in and loaded
    nothing, so on a GPU the copies stayed on the CPU, moved at every call (Flux-dev at 0.45 it/s,
    BENCHMARKS.md fortieth session), and the bf16 originals stayed on the GPU. No layer may run while
    it is on the offload device; each handover puts both sides where they belong, and the clone's
    own reloads (every sampling) move nothing."""
    mp = tm.tiny_flux(seed=4, depth=2, depth_single=1)
    load, off = torch.device("cpu"), torch.device("cpu", 0)
    mp.offload_device = off
    where: dict[int, torch.device] = {}
    moves: list[int] = []
    to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            for m in self.modules():
                if where.get(id(m), load) != device:
                    moves.append(id(m))
                where[id(m)] = device
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    ran_parked: list[str] = []

    def watch(name):
        def hook(module, _args):
            if where.get(id(module), load) == off:
                ran_parked.append(name)
        return hook

    dm = mp.model.diffusion_model
    originals = {n: m for n, m in _block_linears(dm).items() if "blocks." in n}
    for n, m in originals.items():
        m.register_forward_pre_hook(watch(n))
    h, w = tm.RESOLUTIONS["flux"][1]
    ref = tm.sample(mp, h, w, 1, 2, 1.0, 20, seed=2)
    cfg = nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "fp8_weights": True})
    compiled = patcher.compile_model_patcher(mp, cfg)
    assert compiled.patches_uuid != mp.patches_uuid
    assert patcher.compile_model_patcher(mp, cfg).patches_uuid == compiled.patches_uuid  # node run again
    copies = {k.removeprefix("diffusion_model."): v for k, v in compiled.object_patches.items()
              if isinstance(v, Fp8StoredLinear)}
    assert copies.keys() == originals.keys()
    assert all(where[id(c)] == off for c in copies.values())  # made, then parked until the clone loads
    for n, c in copies.items():
        c.register_forward_pre_hook(watch(n + " (copy)"))

    def placed(mods):
        return {where.get(id(m), load) for m in mods.values()}

    for _ in range(2):
        out = tm.sample(compiled, h, w, 1, 2, 1.0, 20, seed=2)
        assert placed(originals) == {off} and placed(copies) == {load}
        moves.clear()
        assert torch.equal(tm.sample(compiled, h, w, 1, 2, 1.0, 20, seed=2), out)
        assert not moves  # the clone reloading itself
        assert 0 < tm.rel_err(out, ref) < WEIGHT_ERR
        again = tm.sample(mp, h, w, 1, 2, 1.0, 20, seed=2)  # the eager patcher takes the model back
        assert placed(originals) == {load} and placed(copies) == {off}
        assert torch.equal(again, ref)
    assert not ran_parked


def _block_linears(dm: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in dm.named_modules() if isinstance(m, (torch.nn.Linear, Fp8StoredLinear))}


@torch.no_grad()
def test_swapped_while_the_clone_runs_and_put_back(patcher, comfy_inproc, fresh_stats):
    mp = tm.tiny_flux(seed=5, depth=2, depth_single=1)
    dm = mp.model.diffusion_model
    before = _block_linears(dm)
    weights = {n: m.weight for n, m in before.items()}
    h, w = tm.RESOLUTIONS["flux"][1]
    ref = tm.sample(mp, h, w, 1, 2, 1.0, 20, seed=2)
    cfg = nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "fp8_weights": True})
    compiled = patcher.compile_model_patcher(mp, cfg, node_id="f8w")
    out = tm.sample(compiled, h, w, 1, 2, 1.0, 20, seed=2)
    during = _block_linears(dm)
    swapped = {n for n, m in during.items() if isinstance(m, Fp8StoredLinear)}
    # every block linear, none of the embedders or the final layer
    assert swapped == {n for n in before if "blocks." in n} and len(swapped) >= 15
    assert all(during[n].weight.dtype == E4M3 for n in swapped)
    assert 0 < tm.rel_err(out, ref) < WEIGHT_ERR
    rec = next(r for r in fresh_stats()["models"].values() if "f8w" in r["node_ids"])
    assert rec["fp8_weight_layers"] == len(swapped) and rec["fallbacks"] == 0

    # the original patcher loads again: ComfyUI puts the original layers back, untouched
    again = tm.sample(mp, h, w, 1, 2, 1.0, 20, seed=2)
    assert torch.equal(again, ref)
    after = _block_linears(dm)
    assert all(after[n] is m and after[n].weight is weights[n] for n, m in before.items())

    # the node run again on the same model reuses the stored copies (and so the compiled graph)
    compiled2 = patcher.compile_model_patcher(mp, cfg, node_id="f8w")
    assert all(compiled2.object_patches[k] is v for k, v in compiled.object_patches.items())
    assert torch.equal(tm.sample(compiled2, h, w, 1, 2, 1.0, 20, seed=2), out)


@torch.no_grad()
def test_copies_come_from_the_unpatched_weights(patcher, comfy_inproc):
    """The node runs while another clone of the model with a LoRA is loaded (the last prompt's): the
    stored copies are made from ComfyUI's backup of the original weights, not from the patched ones
    in the model, so the image equals the one made without that prompt."""
    h, w = tm.RESOLUTIONS["flux"][1]
    cfg = nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "fp8_weights": True})
    clean = tm.sample(patcher.compile_model_patcher(tm.tiny_flux(seed=9, depth=2, depth_single=1), cfg), h, w,
                      1, 2, 1.0, 20, seed=5)
    mp = tm.tiny_flux(seed=9, depth=2, depth_single=1)
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    lora = mp.clone()
    lora.add_patches({key: (torch.ones_like(mp.model.get_parameter(key)) * 0.05,)}, 1.0)
    tm.sample(lora, h, w, 1, 2, 1.0, 20, seed=5)  # loaded with the patch applied
    assert not torch.equal(mp.model.get_parameter(key), lora.backup[key].weight)
    out = tm.sample(patcher.compile_model_patcher(mp, cfg), h, w, 1, 2, 1.0, 20, seed=5)
    assert torch.equal(out, clean)


@torch.no_grad()
def test_lora_through_the_stored_layers(patcher, comfy_inproc):
    """A LoRA-like patch on a swapped layer, added by ComfyUI on top of the fp8 clone (as a LoRA
    loader after the node does): it moves the image as it does on the original weights, within the
    fp8 rounding, and is gone once the unpatched clone loads again. The patch is rank 1 with its
    largest entry 0.9 of the weight's: a strong LoRA, within the stored scale's headroom."""
    mp = tm.tiny_flux(seed=6, depth=2, depth_single=1)
    gen = torch.Generator().manual_seed(7)
    patches = {}
    for key in ("diffusion_model.double_blocks.1.img_attn.qkv.weight", "diffusion_model.double_blocks.1.img_mlp.0.weight",
                "diffusion_model.single_blocks.0.linear1.weight"):
        w = mp.model.get_parameter(key)
        delta = torch.outer(torch.randn(w.shape[0], generator=gen), torch.randn(w.shape[1], generator=gen))
        patches[key] = (delta * (0.9 * w.abs().max() / delta.abs().max()),)
    cfg = nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "fp8_weights": True})
    h, w_px = tm.RESOLUTIONS["flux"][1]
    fp8 = patcher.compile_model_patcher(mp, cfg, node_id="f8w-lora")
    fp8_lora = fp8.clone()
    fp8_lora.add_patches(patches, 1.0)
    full_lora = mp.clone()
    full_lora.add_patches(patches, 1.0)
    plain = tm.sample(fp8, h, w_px, 1, 2, 1.0, 20, seed=3)
    with_lora = tm.sample(fp8_lora, h, w_px, 1, 2, 1.0, 20, seed=3)
    assert isinstance(mp.model.diffusion_model.double_blocks[1].img_attn.qkv, Fp8StoredLinear)
    ref_lora = tm.sample(full_lora, h, w_px, 1, 2, 1.0, 20, seed=3)
    assert tm.rel_err(with_lora, plain) > 0.1  # the patch reached the stored layer
    assert tm.rel_err(with_lora, ref_lora) < WEIGHT_ERR
    assert torch.equal(tm.sample(fp8, h, w_px, 1, 2, 1.0, 20, seed=3), plain)  # and was taken off again


@pytest.mark.skipif(not _cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm has no rowwise scales")
@torch.no_grad()
def test_o3_gemms_read_the_stored_weights(patcher, comfy_inproc, fresh_stats, cache):
    """O3 with fp8 linears on the swapped model (aot_eager): the swapped layers' GEMMs take the
    stored e4m3 tensors (``fp8_mm_stored``) with no fp8 copy made for them, and the image is within
    the activations' rounding of the eager fp8-weights run."""
    mp = tm.tiny_flux(seed=8, depth=2, depth_single=1)
    h, w = tm.RESOLUTIONS["flux"][1]
    eager = patcher.compile_model_patcher(
        mp, nexfort_engine.parse_options({"mode": "O2", "backend": "eager", "fp8_weights": True}), node_id="f8w-e")
    ref = tm.sample(eager, h, w, 1, 2, 1.0, 20, seed=4)
    cfg = nexfort_engine.parse_options({"mode": "O3", "fp8": True, "backend": "aot_eager", "fp8_weights": True})
    compiled = patcher.compile_model_patcher(mp, cfg, node_id="f8w-o3")
    out = tm.sample(compiled, h, w, 1, 2, 1.0, 20, seed=4)
    assert tm.rel_err(out, ref) < 6e-2
    rec = next(r for r in fresh_stats()["models"].values() if "f8w-o3" in r["node_ids"])
    assert rec["fp8"] is True and rec["fallbacks"] == 0, rec["fallback_reasons"]
    # every swapped layer's GEMM reads its stored tensor (measured: 23 of 23)
    assert rec["fp8_stored_weights"] == rec["fp8_weight_layers"] >= 15
    # fp8 copies exist only for the token-wise linears outside the blocks (img_in, txt_in, the final
    # layer: still in their own dtype), none for a swapped one
    outside = {_key(m.weight) for n, m in mp.model.diffusion_model.named_modules()
               if isinstance(m, torch.nn.Linear) and "blocks." not in n}
    assert 0 < len(cache) <= 4 and set(cache._entries) <= outside
