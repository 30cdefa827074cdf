"""LoRA through ComfyUI's ``LoraLoader`` on a compiled model: apply, change strength, remove, swap
the checkpoint. Every step is compared with the eager twin of the same graph and seed (latents within
``LATENT_ATOL``, pixels within ``PIXEL_ATOL``, see reliability_helpers), every change is checked to
actually change the output, and the weight changes cause no recompile: ComfyUI writes LoRA patches
into the live parameters, which the compiled graph reads.
"""

from __future__ import annotations

import pytest
from reliability_helpers import (
    assert_differs,
    assert_same_output,
    lora_graph,
    next_seed,
    records,
    run_ok,
)

pytestmark = [pytest.mark.integration, pytest.mark.inductor]


def _pair(srv, seed, **kw):
    tag = f"nx_lora_{kw.get('lora')}_{kw.get('ckpt') or 'a'}".replace(".", "p")
    compiled = run_ok(srv, lora_graph(seed=seed, compile_id="nx_lora", prefix=tag, **kw))
    eager = run_ok(srv, lora_graph(seed=seed, compiled=False, prefix=f"{tag}_eager", **kw))
    return compiled, eager


def _counts(srv):
    recs = records(srv, "nx_lora")
    return {k: sum(r[k] for r in recs.values()) for k in ("compiles", "recompiles", "fallbacks", "cache_hits")}, recs


def test_lora_apply_change_remove_swap_matches_eager(srv, second_ckpt):
    seed = next_seed()
    diffs = {}
    full_c, full_e = _pair(srv, seed, lora=1.0)
    diffs["lora 1.0"] = assert_same_output(full_c, full_e, "LoRA strength 1.0")
    start, recs = _counts(srv)
    # traced here, or loaded from the session's cache (nexfort_engine/precompile.py)
    assert start["compiles"] + start["cache_hits"] >= 1 and start["fallbacks"] == 0, recs

    half_c, half_e = _pair(srv, seed, lora=0.3)
    diffs["lora 0.3"] = assert_same_output(half_c, half_e, "LoRA strength 0.3")
    assert_differs(full_c, half_c, "strength 1.0 vs 0.3 (compiled)")

    none_c, none_e = _pair(srv, seed, lora=None)
    diffs["no lora"] = assert_same_output(none_c, none_e, "LoRA removed")
    assert_differs(half_c, none_c, "strength 0.3 vs removed (compiled)")

    again_c, _ = _pair(srv, seed, lora=1.0)
    diffs["lora 1.0 again"] = assert_same_output(again_c, full_e, "LoRA re-applied")

    weights, recs = _counts(srv)
    assert weights["recompiles"] == start["recompiles"], f"weight changes recompiled: {recs}"
    assert weights["compiles"] == start["compiles"], f"weight changes compiled new graphs: {recs}"
    assert weights["fallbacks"] == 0, recs

    swap_c, swap_e = _pair(srv, seed, lora=1.0, ckpt=second_ckpt)
    diffs["checkpoint 2 + lora"] = assert_same_output(swap_c, swap_e, "second checkpoint + LoRA")
    assert_differs(full_c, swap_c, "checkpoint 1 vs 2 (compiled)")
    swapped, recs = _counts(srv)
    assert swapped["fallbacks"] == 0, recs
    assert swapped["recompiles"] == start["recompiles"], f"the checkpoint swap counted as a recompile: {recs}"
    print("compiled vs eager max |diff|:", diffs, "counters:", swapped)
