"""The pack's glue (``compile_model_patcher``) on every tiny family of the zoo: one UNet (SD1.5) and
two DiTs (PixArt-alpha, Flux), built through ComfyUI's own model classes, sampled through ComfyUI's
real sampler. Backend eager (the logic under test is the wrapper, not Inductor's code): outputs
equal the unwrapped model's, the compile is counted under the node id, nothing falls back.
"""

from __future__ import annotations

import pytest
import tiny_models as tm

import nexfort_engine

EAGER = {"mode": "O2", "backend": "eager"}
TOL = 1e-4


@pytest.mark.parametrize("family", ["sd15", "pixart", "flux"])
def test_compile_model_patcher_on_each_family(patcher, comfy_inproc, fresh_stats, family):
    mp = tm.FAMILIES[family](seed=11)
    cfg = nexfort_engine.parse_options(EAGER)
    compiled = patcher.compile_model_patcher(mp, cfg, node_id=f"n-{family}")
    (h, w) = tm.RESOLUTIONS[family][1]  # non-square
    cfg_scale = 1.0 if family == "flux" else 5.0
    for steps in (2, 3):
        ref = tm.sample(mp, h, w, 1, steps, cfg_scale, 77, seed=steps)
        out = tm.sample(compiled, h, w, 1, steps, cfg_scale, 77, seed=steps)
        assert tm.rel_err(out, ref) <= TOL, f"{family}: compiled sampling differs from eager"
    s = fresh_stats()
    recs = [r for r in s["models"].values() if f"n-{family}" in r["node_ids"]]
    assert len(recs) == 1, s["models"].keys()
    rec = recs[0]
    assert rec["state"] == "compiled" and rec["fallbacks"] == 0, rec["fallback_reasons"]
    # a new step count reuses the graph (the schedule length is symbolic)
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
