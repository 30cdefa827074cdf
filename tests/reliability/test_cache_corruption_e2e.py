"""Corrupt, truncated and foreign files in the compile cache between two server runs.

The shared server compiles (or reuses) the model's entry; it is stopped; one artifact is truncated,
another has a byte flipped and a foreign file is dropped into the entry; the server is started
again. The first prompt must detect the damage (counter ``corrupt_entries``), discard the entry,
rebuild it (a cold compile) and still produce the eager image; the foreign file is gone and the
rebuilt entry verifies.
"""

from __future__ import annotations

import pytest
from reliability_helpers import assert_same_output, engine, lora_graph, next_seed, one_record, run_ok

from nexfort_engine.cache import CacheStore

pytestmark = [pytest.mark.integration, pytest.mark.inductor]


def test_damaged_cache_is_discarded_and_rebuilt(srv, nexfort_cache_dir):
    run_ok(srv, lora_graph(seed=next_seed(), prefix="nx_corrupt_warm"))
    _, rec = one_record(srv, "2")
    store = CacheStore(nexfort_cache_dir)
    entry = store.entry(rec["cache_key"])
    artifacts = sorted((p for p in entry.artifacts.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    assert len(artifacts) >= 2, f"entry {entry.key} has too few artifacts: {artifacts}"

    srv.stop()
    big, other = artifacts[-1], artifacts[len(artifacts) // 2]
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])  # truncated
    data = bytearray(other.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    other.write_bytes(bytes(data))
    foreign = entry.artifacts / "fxgraph" / "foreign.py"
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_text("raise SystemExit('foreign code must never be loaded')\n")
    srv.start()

    seed = next_seed()
    compiled = run_ok(srv, lora_graph(seed=seed, prefix="nx_corrupt"))
    eager = run_ok(srv, lora_graph(seed=seed, compiled=False, prefix="nx_corrupt_eager"))
    assert_same_output(compiled, eager, "after rebuilding a corrupt entry")

    stats = engine(srv)
    assert stats["corrupt_entries"] >= 1, stats
    assert stats["fallbacks"] == 0, stats["fallback_reasons"]
    _, rec = one_record(srv, "2")
    assert rec["corrupt_entries"] == 1 and rec["state"] == "compiled", rec
    assert rec["cache_misses"] > 0, "a discarded entry must be rebuilt, not served"
    assert not foreign.exists(), "a file the manifest does not list must be removed"
    with entry.lock(timeout=60):
        assert entry.verify() == "hit", "the rebuilt entry does not verify"
    assert "discarding entry" in srv.log_text()
