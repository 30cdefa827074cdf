"""Soak: 50 queued prompts through the real server, alternating 3 resolutions, 2 LoRA strengths and
batch sizes 1/2, on a compiled model (dynamic shape, O2), LoRA via ``LoraLoaderModelOnly``.

Bounds (a fresh server process, so the counters are this test's own):
* every prompt succeeds, nothing falls back;
* the model compiles at most ``MAX_GRAPHS`` graphs (dynamic shape: resolution, batch and LoRA strength
  changes must not recompile beyond that);
* the server's RSS (``VmRSS`` in /proc/<pid>/status) grows by less than ``MAX_RSS_GROWTH`` between
  the end of the warm-up (the first ``WARMUP`` prompts, which cover every combination) and the end.
"""

from __future__ import annotations

import itertools

import pytest
from reliability_helpers import engine, lora_graph, one_record, rss_bytes

pytestmark = [pytest.mark.integration, pytest.mark.inductor]

N = 50
WARMUP = 12
MAX_GRAPHS = 2
MAX_RSS_GROWTH = 300 * 2**20
SIZES = [(64, 64), (96, 64), (64, 96)]
STRENGTHS = [0.5, 1.0]
BATCHES = [1, 2]


def _graphs():
    combos = list(itertools.product(SIZES, STRENGTHS, BATCHES))  # 12: the warm-up sees each once
    for i in range(N):
        (w, h), strength, batch = combos[i % len(combos)]
        g = lora_graph(lora=strength, width=w, height=h, batch=batch, seed=900_000 + i, prefix="nx_soak")
        # the tiny LoRA patches the UNet only: LoraLoaderModelOnly keeps the text encoder (and its
        # cached conditioning) out of each strength change
        g["10"] = {"class_type": "LoraLoaderModelOnly",
                   "inputs": {"model": ["1", 0], "lora_name": g["10"]["inputs"]["lora_name"], "strength_model": strength}}
        for nid in ("3", "4"):
            g[nid]["inputs"]["clip"] = ["1", 1]
        yield g


def _run_all(srv, graphs) -> None:
    ids = [srv.submit(g) for g in graphs]  # all queued at once
    for pid in ids:
        srv.wait(pid, timeout=900)


def test_soak_50_prompts(srv):
    srv.restart()
    graphs = list(_graphs())
    _run_all(srv, graphs[:WARMUP])
    rss_warm = rss_bytes(srv.proc.pid)
    _run_all(srv, graphs[WARMUP:])
    rss_end = rss_bytes(srv.proc.pid)

    stats = engine(srv)
    assert stats["fallbacks"] == 0, stats["fallback_reasons"]
    label, rec = one_record(srv, "2")
    assert rec["compiles"] <= MAX_GRAPHS, f"{label} compiled {rec['compiles']} graphs: {rec['recompile_reasons']}"
    assert rec["calls"] > 0 and rec["state"] == "compiled", rec
    growth = rss_end - rss_warm
    print(f"soak: {N} prompts, compiles={rec['compiles']} recompiles={rec['recompiles']}, "
          f"RSS after warm-up {rss_warm / 2**20:.0f} MiB, at the end {rss_end / 2**20:.0f} MiB "
          f"(+{growth / 2**20:.0f} MiB)")
    assert growth < MAX_RSS_GROWTH, f"RSS grew by {growth / 2**20:.0f} MiB over {N - WARMUP} prompts"
