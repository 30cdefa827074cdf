"""ComfyUI's own model-patch nodes on a compiled model, through the pack's glue and ComfyUI's sampler.

Nodes like FreeU, Perturbed-Attention Guidance or Kohya Deep Shrink clone the MODEL and add
functions to its ``transformer_options`` that the UNet calls inside its forward (block patches,
attention patches and replacements), or sampler functions that call the model again with other
options. Placed after *Nexfort Compile Model* or before it, the compiled model must give eager's
image, and the patch must reach it (the image differs from the unpatched one). Patches Dynamo
traces compile into the graph (a second graph where a node calls the model with other options:
PAG's and SAG's guidance passes); a size and step-count change then compiles nothing. Patches it
cannot trace whole (Deep Shrink reads the sigma with ``Tensor.item()`` and branches on it,
HyperTile draws random tile sizes on the host) break the graph: the image is still eager's, and the
breaks are counted with their reason (``graph_breaks``, ``graph_break_reasons``).

The node classes are ComfyUI's (``comfy_extras``), called as ComfyUI calls them. The logic under
test is Dynamo's handling of the patches and the glue's, not Inductor's code: backend ``eager``,
and ``aot_eager`` (AOTAutograd's functional trace too, 20 s more per case on CI's machine) for
FreeU and PAG placed after the compile node, and for the host-reading attention patch.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import pytest
import tiny_models as tm
import torch

import nexfort_engine

OPTIONS = {"mode": "O2", "backend": "aot_eager"}
#: the cases that also go through AOTAutograd (module docstring)
AOT_CASES = {("FreeU", "after"), ("PerturbedAttentionGuidance", "after")}
TOL = 1e-4


def _node(module: str, name: str, **inputs: Any) -> Callable[[Any], Any]:
    """``model -> patched model`` through ComfyUI's node ``name`` (classic or V3 schema)."""
    cls = getattr(importlib.import_module(f"comfy_extras.{module}"), name)

    def apply(model: Any) -> Any:
        if hasattr(cls, "FUNCTION"):
            return getattr(cls(), cls.FUNCTION)(model=model, **inputs)[0]
        return cls.execute(model=model, **inputs).args[0]

    return apply


#: name -> (node, graphs a first sampling compiles with it, whether its patch breaks the graph)
PATCHES: dict[str, tuple[tuple[str, str, dict[str, Any]], int, bool]] = {
    "FreeU": (("nodes_freelunch", "FreeU", dict(b1=1.3, b2=1.4, s1=0.9, s2=0.2)), 1, False),
    "FreeU_V2": (("nodes_freelunch", "FreeU_V2", dict(b1=1.3, b2=1.4, s1=0.9, s2=0.2)), 1, False),
    "PerturbedAttentionGuidance": (("nodes_pag", "PerturbedAttentionGuidance", dict(scale=3.0)), 2, False),
    "SelfAttentionGuidance": (("nodes_sag", "SelfAttentionGuidance", dict(scale=0.5, blur_sigma=2.0)), 2, False),
    "UNetSelfAttentionMultiply": (
        ("nodes_attention_multiply", "UNetSelfAttentionMultiply", dict(q=1.1, k=0.9, v=1.2, out=1.0)), 1, False),
    "TomePatchModel": (("nodes_tomesd", "TomePatchModel", dict(ratio=0.3)), 1, False),
    "HyperTile": (("nodes_hypertile", "HyperTile", dict(tile_size=32, swap_size=2, max_depth=0,
                                                        scale_depth=False)), 0, True),
    "PatchModelAddDownscale": (("nodes_model_downscale", "PatchModelAddDownscale", dict(
        block_number=1, downscale_factor=2.0, start_percent=0.0, end_percent=0.35, downscale_after_skip=True,
        downscale_method="bicubic", upscale_method="bicubic")), 0, True),
}


def _sample(mp: Any, h: int = 64, w: int = 64, steps: int = 3) -> torch.Tensor:
    torch.manual_seed(0)  # ToMe picks its merge targets with torch.randint, HyperTile its tiles
    return tm.sample(mp, h=h, w=w, steps=steps)


def _record(stats: dict, node_id: str) -> dict:
    recs = [r for r in stats["models"].values() if node_id in r["node_ids"]]
    assert len(recs) == 1, sorted(stats["models"])
    return recs[0]


_plain: dict[str, torch.Tensor] = {}


def _unpatched(mp: Any) -> torch.Tensor:
    if "image" not in _plain:
        _plain["image"] = _sample(mp)
    return _plain["image"]


# every patch after the compile node (where users put it); two before it (the order is the glue's
# concern, not the patch's)
CASES = [(name, "after") for name in PATCHES] + [("FreeU", "before"), ("PatchModelAddDownscale", "before")]


@pytest.mark.parametrize(("name", "order"), CASES)
def test_a_comfyui_patch_node_on_a_compiled_model_gives_eagers_image(patcher, comfy_inproc, fresh_stats, name, order):
    (module, cls, inputs), graphs, breaks = PATCHES[name]
    patch = _node(module, cls, **inputs)
    mp = tm.tiny_sd15(seed=11)
    config = nexfort_engine.parse_options(OPTIONS if (name, order) in AOT_CASES else {**OPTIONS, "backend": "eager"})
    node_id = f"{name}-{order}"
    if order == "after":  # the usual place: the patch node between the compile node and the sampler
        compiled = patch(patcher.compile_model_patcher(mp, config, node_id=node_id))
    else:
        compiled = patcher.compile_model_patcher(patch(mp), config, node_id=node_id)
    ref = _sample(patch(mp))
    out = _sample(compiled)
    assert tm.rel_err(out, ref) <= TOL, (name, tm.rel_err(out, ref))
    assert tm.rel_err(out, _unpatched(mp)) > 1e-2, f"{name}'s patch did not reach the compiled model"
    rec = _record(fresh_stats(), node_id)
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    if not breaks:
        assert rec["graph_breaks"] == 0, rec["graph_break_reasons"]
        assert rec["compiles"] == graphs, (rec["compiles"], rec["recompile_reasons"])
        # another size and step count: the same graph(s)
        ref2 = _sample(patch(mp), 64, 96, steps=4)
        assert tm.rel_err(_sample(compiled, 64, 96, steps=4), ref2) <= TOL
        assert _record(fresh_stats(), node_id)["compiles"] == graphs
    else:
        # the graph breaks at the host read; the pieces compile, the image is still eager's
        assert rec["graph_breaks"] >= 1, rec
        assert any("item()" in r for r in rec["graph_break_reasons"]), rec["graph_break_reasons"]


class _HostSigmaAttn2:
    """An attn2 replacement as custom nodes write them (ComfyUI_IPAdapter_plus's CrossAttentionPatch,
    not installable here): cross-attention plus ``weight`` x attention to extra keys and values,
    only while the sigma, read on the host with ``.item()`` in every call, is inside the window."""

    def __init__(self, weight: float, sigma_start: float = 1e9, sigma_end: float = 0.0) -> None:
        self.weight, self.sigma_start, self.sigma_end = weight, sigma_start, sigma_end
        self.calls = 0
        self.sigmas_seen: set[str] = set()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra_options: dict) -> torch.Tensor:
        from comfy.ldm.modules.attention import optimized_attention

        self.calls += 1
        self.sigmas_seen.add(type(extra_options["sigmas"]).__name__)
        # math with the sigmas on their device (a no-op scale), beside the host read
        out = optimized_attention(q, k, v, extra_options["n_heads"]) * (extra_options["sigmas"][:1] * 0 + 1).to(q)
        sigma = extra_options["sigmas"].detach().cpu()[0].item()
        if self.sigma_end <= sigma <= self.sigma_start:
            b, _, oh, ow = extra_options["original_shape"]  # set by the UNet while it runs
            assert b == q.shape[0] and extra_options["block"][0] in ("input", "middle", "output")
            ip = optimized_attention(q, k[:, :4] * 0.5, v[:, :4] * 0.5, extra_options["n_heads"])
            out = out + self.weight * ip
        return out.to(dtype=q.dtype)


def _host_patched(mp: Any, patch: _HostSigmaAttn2) -> Any:
    m = mp.clone()
    unet = m.model.diffusion_model
    for kind, blocks in (("input", unet.input_blocks), ("middle", [unet.middle_block]), ("output", unet.output_blocks)):
        for n, block in enumerate(blocks):
            for layer in block:
                for i, _ in enumerate(getattr(layer, "transformer_blocks", [])):
                    m.set_model_attn2_replace(patch, kind, 0 if kind == "middle" else n, i)
    return m


def test_an_attention_patch_that_reads_the_sigma_on_the_host_keeps_one_graph(patcher, comfy_inproc, fresh_stats):
    """IPAdapter-style patches read the sigma with ``.item()`` in every cross-attention layer:
    traced as they are, the graph breaks in each one (0.58x eager on SDXL, run274). The glue swaps
    them, for the call, for host calls (nodes/host_patches.py): one graph, no graph break, eager's
    image; another window, weight, patch object, size or step count compiles nothing."""
    host_patches = __import__(patcher.__name__.rsplit(".", 1)[0] + ".host_patches", fromlist=["x"])
    mp = tm.tiny_sd15(seed=11)
    config = nexfort_engine.parse_options(OPTIONS)
    compiled = patcher.compile_model_patcher(mp, config, node_id="host-sigma")
    plain = _unpatched(mp)
    # the whole schedule inside the window, then a window over part of it (the branch flips per step)
    for kwargs, (h, w, steps) in (({"weight": 0.7}, (64, 64, 3)), ({"weight": 0.4, "sigma_start": 5.0}, (64, 96, 4))):
        patch = _HostSigmaAttn2(**kwargs)
        ref = _sample(_host_patched(mp, _HostSigmaAttn2(**kwargs)), h, w, steps)
        out = _sample(_host_patched(compiled, patch), h, w, steps)
        assert tm.rel_err(out, ref) <= TOL, tm.rel_err(out, ref)
        assert patch.calls == 7 * steps  # each of the tiny UNet's 7 cross-attentions, every step, on the host
        # the sigmas come with a host copy taken once per model call (host_call.host_copied)
        assert patch.sigmas_seen == {"HostCopied"}, patch.sigmas_seen
    assert tm.rel_err(_sample(_host_patched(compiled, _HostSigmaAttn2(0.7))), plain) > 1e-2
    rec = _record(fresh_stats(), "host-sigma")
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["graph_breaks"] == 0, rec["graph_break_reasons"]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
    assert rec["host_patches"] == 7 and rec["host_calls"] == 7, rec
    # a replacement that reads nothing on the host (as ComfyUI's own) stays in the graph as it is
    from comfy.ldm.modules.attention import optimized_attention

    assert not host_patches.reads_host(optimized_attention)
    assert host_patches.reads_host(_HostSigmaAttn2(1.0))

    class Helper:  # the read in another method of the patch's class
        def window(self, sigmas: torch.Tensor) -> list:
            return sigmas.tolist()

        def __call__(self, q: Any, k: Any, v: Any, extra: dict) -> Any:
            return q

    assert host_patches.reads_host(Helper()) and host_patches.reads_host(Helper().__call__)


def test_a_host_call_carries_the_options_the_unet_sets_while_it_runs(patcher, comfy_inproc):
    """What the stand-in's op carries (the values ComfyUI's UNet sets while it runs), decoded as
    the resolver gets them; the rest (``cond_or_uncond``, the sigmas) comes from the live options."""
    from nexfort_engine import host_call

    host_patches = __import__(patcher.__name__.rsplit(".", 1)[0] + ".host_patches", fromlist=["x"])
    values = {"block": ("output", 4), "block_index": 0, "transformer_index": 2, "original_shape": [2, 4, 8, 12],
              "n_heads": 2, "dim_head": 16, "attn_precision": torch.float32, "activations_shape": None,
              "cond_or_uncond": [1, 0]}
    stand_in = host_patches.STAND_INS["attn2"]
    assert (stand_in.resolver, stand_in.tag, stand_in.keys) == (host_patches.RESOLVER, "attn2",
                                                                 host_patches.TRACED_KEYS)
    ints: list[Any] = []
    text = host_call.spec("attn2", {k: values[k] for k in stand_in.keys if k in values}, ints)
    kind, decoded = host_call.decode(text, ints)
    assert kind == "attn2" and decoded == {k: v for k, v in values.items() if k != "cond_or_uncond"}


def test_a_host_reading_patch_compiles_in_the_background(patcher, comfy_inproc, fresh_stats, tmp_path, monkeypatch):
    """The stand-ins are engine objects: they travel to a background compile's child, which traces
    them and runs its graph with placeholder host calls (it has none of the patches). ComfyUI
    samples eager meanwhile, with the patch; then it runs the graph the child compiled, the patch
    called on the host in every layer: eager's image both times. Before, such a call compiled in
    the foreground (its stand-in could not be sent), and with ``"static_first"`` (auto on a GPU) the
    dynamic graph was compiled at the first other size, in ComfyUI's process."""
    import time

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    mp = tm.tiny_sd15(seed=11)
    config = nexfort_engine.parse_options({"backend": "eager", "background": True})
    compiled = patcher.compile_model_patcher(mp, config, node_id="host-bg")
    ref = _sample(_host_patched(mp, _HostSigmaAttn2(0.7, sigma_start=5.0)))
    first = _HostSigmaAttn2(0.7, sigma_start=5.0)
    assert tm.rel_err(_sample(_host_patched(compiled, first)), ref) <= TOL
    rec = _record(fresh_stats(), "host-bg")
    assert rec["state"] == "background", rec.get("background")
    assert first.calls == 7 * 3  # eager meanwhile, the patch on the host
    cm = next(iter(mp.model.diffusion_model.__dict__[patcher._ATTR].values()))
    deadline = time.monotonic() + 300
    while not cm._nx_job.done():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    then = _HostSigmaAttn2(0.7, sigma_start=5.0)
    assert tm.rel_err(_sample(_host_patched(compiled, then)), ref) <= TOL
    rec = _record(fresh_stats(), "host-bg")
    assert rec["background"].startswith("done in "), rec["background"]
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["graph_breaks"] == 0 and rec["host_calls"] == 7, rec
    assert then.calls == 7 * 3 and then.sigmas_seen == {"HostCopied"}
