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

The node classes are ComfyUI's (``comfy_extras``), called as ComfyUI calls them; backend
``aot_eager`` (the logic under test is Dynamo's handling of the patches and the glue's, not
Inductor's code).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import pytest
import tiny_models as tm
import torch

import nexfort_engine

OPTIONS = {"mode": "O2", "backend": "aot_eager"}
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
    config = nexfort_engine.parse_options(OPTIONS)
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
