"""A compile that fails inside Inductor: the prompt still completes, in eager, with the eager image.

The failure is real and passes validation: ``inductor.cpp.cxx`` is an Inductor setting (a tuple
of C++ compilers to try), so ``{"options": {"inductor.cpp.cxx": ["nexfort-no-such-compiler"]}}`` is
accepted at queue time, and Inductor then raises ``InvalidCxxCompiler`` while generating code.
The engine falls back to the eager module; ``/nexfort/stats`` shows the fallback, its reason and
``state == "fallback"`` on the record of that node id.
"""

from __future__ import annotations

import json

import pytest
from reliability_helpers import assert_same_output, engine, lora_graph, next_seed, one_record, run_ok

pytestmark = [pytest.mark.integration, pytest.mark.inductor]

BROKEN = json.dumps({"options": {"inductor.cpp.cxx": ["nexfort-no-such-compiler"]}})


def test_inductor_failure_falls_back_to_identical_eager_output(srv):
    seed = next_seed()
    before = engine(srv)
    compiled = run_ok(srv, lora_graph(seed=seed, options=BROKEN, compile_id="nx_broken", prefix="nx_broken"))
    eager = run_ok(srv, lora_graph(seed=seed, compiled=False, prefix="nx_broken_eager"))
    # the fallback runs the very same eager module: bit-identical
    assert_same_output(compiled, eager, "fallback vs eager", exact=True)

    after = engine(srv)
    assert after["fallbacks"] == before["fallbacks"] + 1, after["fallback_reasons"]
    label, rec = one_record(srv, "nx_broken")
    assert rec["state"] == "fallback", rec
    assert rec["fallbacks"] == 1 and rec["compiles"] == 0, rec
    assert any("InvalidCxxCompiler" in r and "nexfort-no-such-compiler" in r for r in rec["fallback_reasons"]), rec
    assert any(label in r for r in after["fallback_reasons"]), after["fallback_reasons"]

    # later prompts stay eager without retrying the compile
    run_ok(srv, lora_graph(seed=next_seed(), options=BROKEN, compile_id="nx_broken", prefix="nx_broken"))
    _, rec2 = one_record(srv, "nx_broken")
    assert rec2["fallbacks"] == 1 and rec2["state"] == "fallback", rec2
