"""The cuBLASLt algorithm benchmark's own checks (GPU only: it drives the libcublasLt torch loads)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,epilogue", [(torch.float16, "gelu_bias"), (torch.bfloat16, "bias")])
def test_search_finds_configurations_that_match_torch(dtype, epilogue):
    """A small linear: the heuristic answers, the search finds more configurations than it, torch's
    own algorithm (the heuristic's first) gives its output bit for bit, and the finalists are timed as graphs beside torch's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from benchmarks import cublaslt_algos as ca

    lt = ca.Lt()
    row = ca.shape_row(lt, 512, 256, 768, dtype, epilogue, count=8, workspace_bytes=32 << 20, iters=5,
                       search=200, finalists=3, rounds=3, screen_s=5.0)
    assert row["heuristic_candidates"] >= 1
    assert row["searched_candidates"] > row["heuristic_candidates"]
    timed = [a for a in row["algos"] if "ms" in a]
    assert timed
    # the heuristic's first answer is the algorithm torch itself runs: bit-identical output
    assert row["algos"][0]["source"] == "heuristic" and row["algos"][0]["max_diff_vs_torch"] == 0.0
    assert row["best"] is not None and row["best"]["graph_ms"] > 0 and row["torch_graph_ms"] > 0
    # the configuration reads back what was set (exact-size attribute reads)
    assert {"id", "tile_id", "stages_id", "cluster_shape_id"} <= set(row["best"])
