"""fp8 graphs through the saved-graph path (``precompile.py``): a model compiled whole with fp8
linears is traced once into a saved graph, cut among compile workers, and a restart loads it
without tracing, as O2's graphs are. Before, fp8 graphs always compiled through ``torch.compile``:
no compile workers, no static graph first, and a restart re-traced the whole model (SDXL with
``"fp8": true`` did not finish its cold compile within 150 s on an H200, BENCHMARKS.md).

The trace runs under ``Fp8LinearMode`` (the compiler's call scope), so the quantization and the
``nexfort::fp8_mm_*`` ops are in the saved graph; ``F.linear``'s trace stand-in (``trace_ops.py``)
is left off there, since the mode must see every ``F.linear`` call. Checked on CPU with real
Inductor, real compile workers and a real cache directory:

* the cold process saves one graph, cut into parts compiled by a child, and runs it: the output
  is the torch twin's (activations rounded to e4m3 per row; the bf16 weight per output channel, the
  e4m3-stored weight as stored), not eager's;
* another token count runs the same graph (dynamic shape, no recompile);
* a restart (Dynamo reset, a new wrapper) loads it: nothing traced or compiled, the same output
  bit for bit; an in-place patch of a weight is seen there too (the weight cache stays outside the
  graph).

``torch._scaled_mm`` with rowwise scales runs on CPU in torch >= 2.14 only (see test_fp8.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fp8_stored import CastLinear, _cpu_rowwise_scaled_mm, _randn, _twin_layer
from test_split import _record
from tiny_models import rel_l2

import nexfort_engine
from nexfort_engine import compiler, split, stream
from nexfort_engine.fp8 import clear_cache, fp8_linear_reference

pytestmark = [
    pytest.mark.skipif(not _cpu_rowwise_scaled_mm(),
                       reason="this torch's CPU _scaled_mm has no rowwise scales (torch >= 2.14 has)"),
    pytest.mark.inductor,
]


class MixedMLP(torch.nn.Module):
    """A bf16 linear (fp8 copy from the weight cache), an e4m3-stored one (the stored path) and a
    bf16 one again, with GELUs between (the quantizations Inductor fuses with them)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a = torch.nn.Linear(32, 64).to(torch.bfloat16)
        self.b = CastLinear(64, 48, seed=8, scale=0.5)
        self.c = torch.nn.Linear(48, 32).to(torch.bfloat16)
        with torch.no_grad():
            for lin in (self.a, self.c):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


def _twin(m: MixedMLP, x: torch.Tensor) -> torch.Tensor:
    """The fp8 graph's torch twin: activations per row, bf16 weights per output channel, the stored
    weight as stored (times its scale); float32 products, bf16 outputs."""
    h = F.gelu(fp8_linear_reference(x, m.a.weight, m.a.bias))
    h = F.gelu(_twin_layer(m.b, h))
    return fp8_linear_reference(h, m.c.weight, m.c.bias)


def _compile(m: MixedMLP, cache_dir) -> nexfort_engine.CompiledModule:
    # O1: Inductor without CUDA graphs; compiled whole; two processes compile the cut graph
    return nexfort_engine.compile(m, {"mode": "O1", "fp8": True, "dynamic": True, "compile_workers": 2},
                                  cache_dir=str(cache_dir), label="fp8-saved")


@torch.no_grad()
def test_fp8_graph_is_saved_cut_among_workers_and_loaded_on_restart(tmp_path, fresh_stats, cache, clean_dynamo,
                                                                     monkeypatch):
    monkeypatch.setenv(split.ENV_MIN_PART_NODES, "4")  # the tiny graph is cut too
    monkeypatch.setenv(stream.ENV_STREAM, "0")  # cut once Dynamo's trace has ended
    m = MixedMLP()
    x = _randn(2, 7, 32, seed=20).to(torch.bfloat16)
    x2 = _randn(2, 11, 32, seed=21).to(torch.bfloat16)

    # what torch.compile's fp8 graph computes (the path fp8 took before), in another cache dir
    monkeypatch.setenv(compiler.ENV_PRECOMPILE, "0")
    via_torch_compile = _compile(m, tmp_path / "torch_compile")
    # (copies: torch.compile's path marks its inputs' dynamic dims in place, which a saved graph's
    # guards refuse; the sampler's inputs are new tensors at every step anyway)
    want, want2 = via_torch_compile(x.clone()), via_torch_compile(x2.clone())
    assert _record(fresh_stats)["precompiled"] == "off"
    monkeypatch.delenv(compiler.ENV_PRECOMPILE)
    nexfort_engine.reset_stats()
    torch._dynamo.reset()
    clear_cache()

    cm = _compile(m, tmp_path / "saved")
    out = cm(x)
    rec = _record(fresh_stats)
    assert rec["fallbacks"] == 0, rec["fallback_reasons"]
    assert rec["precompiled"] == "on" and rec["precompiled_graphs"] == 1, rec
    assert rec["compile_parts"].startswith("2 parts, 1 from child processes"), rec["compile_parts"]
    assert rec["fp8"] is True and rec["fp8_stored_weights"] == 1
    assert rec["trace_stand_ins"] == 0  # the mode saw every F.linear
    # torch.compile's fp8 numbers bit for bit; near the torch twin's (0.022-0.027 over four
    # inputs: Inductor quantizes the GELUs' float32 values, the twin their bf16 roundings, so a
    # few e4m3 steps differ), as far from eager's as the twin (each linear's input in e4m3: 0.05)
    assert torch.equal(out, want)
    assert rel_l2(out, _twin(m, x)) < 3.5e-2
    assert rel_l2(out, m(x)) > 4e-2 and rel_l2(_twin(m, x), m(x)) > 4e-2

    # another token count: the same saved graph
    out2 = cm(x2)
    assert torch.equal(out2, want2)
    # the bf16 linears' weights: quantized inline at the first call, copied into the weight cache
    # outside the graph before the second (the e4m3-stored weight never goes there)
    assert len(cache) == 2
    rec = _record(fresh_stats)
    assert rec["compiles"] == 1 and rec["recompiles"] == 0, rec["recompile_reasons"]
    assert rec["precompiled_graphs"] == 1

    # a restart: the saved graph loads; nothing traced, the same numbers bit for bit
    nexfort_engine.reset_stats()
    torch._dynamo.reset()
    cm2 = _compile(m, tmp_path / "saved")
    assert torch.equal(cm2(x), out) and torch.equal(cm2(x2), out2)
    rec2 = _record(fresh_stats)
    assert rec2["compiles"] == 0 and rec2["cache_hits"] == 1 and rec2["fallbacks"] == 0, rec2
    # an in-place patch of a bf16 weight (ComfyUI's weight_inplace_update) is re-quantized outside
    # the graph before the next call; the loaded graph reads the new copy
    m.a.weight.mul_(1.5)
    cm2.weights_changed()
    patched = cm2(x)
    assert rel_l2(patched, out) > 2e-2 and rel_l2(patched, _twin(m, x)) < 3.5e-2
    assert _record(fresh_stats)["compiles"] == 0
