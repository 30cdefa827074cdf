"""cuDNN attention ahead of flash in a caller's priority list (``nexfort_engine.passes.sdpa_priority``).

ComfyUI 0.29+ wraps large attentions in ``sdpa_kernel([FLASH, CUDNN, EFFICIENT, MATH],
set_priority=True)``; Dynamo records that as ``_sdpa_kernel`` calls in the graph. Checked on CPU:

* the pass moves cuDNN right ahead of flash in those lists and nowhere else (lists without one of
  the two, lists already in that order, calls that do not set a priority);
* the order in force when the rewritten graph reaches the attention (what AOTAutograd's trace sees,
  which picks the fused kernel) starts with cuDNN, and the caller's set of backends is unchanged;
* the rule for "the device prefers cuDNN" (torch's own), the option, the settings and their cache
  digest, the counter, and a compile through the engine that gives eager's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import aot_cache_saves, rewritten
from torch.nn.attention import SDPBackend, sdpa_kernel

import nexfort_engine
from nexfort_engine import OptionsError, parse_options
from nexfort_engine import settings as S
from nexfort_engine.passes import sdpa_priority
from nexfort_engine.passes.sdpa_priority import device_prefers_cudnn, rewrite_sdpa_priorities

#: ComfyUI 0.33's list on Linux (comfy/ops.py): flash first, cuDNN second
COMFY = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention(priority: list[SDPBackend] | None, set_priority: bool = True):
    def fn(q, k, v):
        q = q * 0.5
        if priority is None:
            return F.scaled_dot_product_attention(q, k, v) + 1
        with sdpa_kernel(priority, set_priority=set_priority):
            out = F.scaled_dot_product_attention(q, k, v)
        return out + 1

    return fn


def _qkv():
    torch.manual_seed(0)
    return tuple(torch.randn(2, 3, 16, 8) for _ in range(3))


def _lists(gm: torch.fx.GraphModule) -> list[list[SDPBackend]]:
    return [[sdpa_priority._backend(a) for a in n.args[0]] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.nn.attention._sdpa_kernel]


def test_comfyui_list_gets_cudnn_first():
    out, ref, found, graphs = rewritten(rewrite_sdpa_priorities, _attention(COMFY), _qkv(), {})
    assert found == [1]  # entering (ComfyUI's list); the leaving call restores the order in force
    entering, leaving = _lists(graphs[0])
    assert set(leaving) == sdpa_priority.FULL_ORDER
    assert entering == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH]
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("priority,set_priority", [
    ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], True),  # no cuDNN: stays off
    ([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], True),  # no flash
    ([SDPBackend.MATH], True),  # math only (a caller that wants it): untouched
    (COMFY, False),  # enables backends without a priority
])
def test_other_lists_are_left_alone(priority, set_priority):
    fn = _attention(priority, set_priority)
    before = []
    out, ref, found, graphs = rewritten(lambda gm: before.append(_lists(gm)) or rewrite_sdpa_priorities(gm),
                                        fn, _qkv(), {})
    entering = before[0][0]
    assert _lists(graphs[0])[0] == entering == priority
    assert torch.allclose(out, ref, atol=1e-6)


def test_no_context_no_change():
    out, ref, found, graphs = rewritten(rewrite_sdpa_priorities, _attention(None), _qkv(), {})
    assert found == [0] and _lists(graphs[0]) == []


def test_order_in_force_at_the_attention(monkeypatch):
    """What AOTAutograd's trace sees when it reaches the attention (it runs the graph's Python
    calls): the rewritten graph's order starts with cuDNN, ComfyUI's own starts with flash, and
    the enabled backends are the caller's either way."""
    seen = []
    real = torch._C._nn.scaled_dot_product_attention

    def probe(*args, **kwargs):
        seen.append((list(torch._C._get_sdp_priority_order()), torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled()))
        return real(*args, **kwargs)

    graphs = []

    def keep(gm):
        graphs.append(torch.fx.GraphModule(gm, gm.graph.__deepcopy__()))  # before the pass
        return rewrite_sdpa_priorities(gm)

    q, k, v = _qkv()
    order_before = list(torch._C._get_sdp_priority_order())
    _, _, found, after = rewritten(keep, _attention(COMFY), (q, k, v), {})
    assert list(torch._C._get_sdp_priority_order()) == order_before  # a compile leaves the process's order
    monkeypatch.setattr(torch._C._nn, "scaled_dot_product_attention", probe)
    with torch.no_grad():
        graphs[0](q, k, v)
        after[0](q, k, v)
    assert [s[0][0] for s in seen] == [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)]
    assert seen[1][0][1] == int(SDPBackend.FLASH_ATTENTION)
    assert all(s[1] and s[2] for s in seen)  # cuDNN and flash enabled in both
    assert list(torch._C._get_sdp_priority_order()) == order_before  # restored on leaving


def test_device_rule(monkeypatch):
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    assert device_prefers_cudnn((9, 0), 91900)  # H100/H200 with the device's torch 2.11 (cuDNN 9.19)
    assert device_prefers_cudnn((10, 0), 91600)
    assert not device_prefers_cudnn((9, 0), 91400)  # older cuDNN: torch keeps flash first
    assert not device_prefers_cudnn((8, 9), 91900)  # Ada: flash is torch's first choice too
    assert not device_prefers_cudnn((12, 0), 91900)  # consumer Blackwell
    assert not device_prefers_cudnn(None, None)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not device_prefers_cudnn((9, 0), 91900)


def test_option_and_settings():
    assert parse_options({}).sdpa_cudnn_first is None
    assert parse_options({"sdpa_cudnn_first": False}).sdpa_cudnn_first is False
    with pytest.raises(OptionsError, match="sdpa_cudnn_first"):
        parse_options({"sdpa_cudnn_first": "cudnn"})
    auto = parse_options({"mode": "O2"})
    assert S.resolve(auto, cuda=True, cudnn_attention_preferred=True).sdpa_cudnn_first
    assert not S.resolve(auto, cuda=True, cudnn_attention_preferred=False).sdpa_cudnn_first
    assert not S.resolve(auto, cuda=False, cudnn_attention_preferred=True).sdpa_cudnn_first
    assert not S.resolve(parse_options({"sdpa_cudnn_first": False}), cuda=True,
                         cudnn_attention_preferred=True).sdpa_cudnn_first
    forced = S.resolve(parse_options({"sdpa_cudnn_first": True}), cuda=False)
    assert forced.sdpa_cudnn_first
    # the graph changes with it, so the cache digest does; the auto value off keeps older keys
    plain = S.resolve(auto, cuda=False)
    assert forced.digest(auto) != plain.digest(auto)
    assert parse_options({}).digest() == parse_options({"mode": "O2"}).digest()
    assert "sdpa_cudnn_first" not in parse_options({}).to_dict() or parse_options({}).to_dict()["sdpa_cudnn_first"] is None


class _ComfyAttention(torch.nn.Module):
    """ComfyUI 0.33's attention path: a projection, then SDPA inside its backend priority."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(COMFY, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, n, -1)


@torch.no_grad()
def test_engine_compile_counts_and_matches_eager(fresh_stats, monkeypatch):
    monkeypatch.delenv("NEXFORT_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ComfyAttention().eval()
    x = torch.randn(2, 12, 16)
    ref = model(x)
    cm = nexfort_engine.compile(model, {"backend": "aot_eager", "sdpa_cudnn_first": True}, label="sdpa-order")
    out = cm(x)
    rec = fresh_stats()["models"][cm.label]
    assert rec["sdpa_cudnn_first"] == 1 and rec["fallbacks"] == 0
    assert torch.allclose(out, ref, atol=1e-6)
    off = nexfort_engine.compile(_ComfyAttention().eval(), {"backend": "aot_eager"}, label="sdpa-order-off")
    off(x)
    assert fresh_stats()["models"][off.label]["sdpa_cudnn_first"] == 0  # CPU: auto is off
    torch._dynamo.reset()


def test_cache_marks_make_the_graph_cacheable():
    """AOTAutograd's cacheability check refuses a graph with ComfyUI's priority block unless the
    two functions are marked (torch 2.11 then has no saved graph to serialize; 2.14 falls back to a
    one-off key under ``enable_aot_compile``, so the check itself is what is tested here)."""
    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor import config as inductor_config

    marks = sdpa_priority.cache_marks()
    assert set(marks) == {"torch.nn.attention._sdpa_kernel", "torch.nn.attention._backend_from_string"}
    assert len(set(marks.values())) == 1 and len(next(iter(marks.values()))) == 16
    _, _, _, graphs = rewritten(rewrite_sdpa_priorities, _attention(COMFY), _qkv(), {})
    with inductor_config.patch(unsafe_marked_cacheable_functions={}):
        with pytest.raises(autograd_cache.BypassAOTAutogradCache, match="attention"):
            autograd_cache.check_cacheable(graphs[0])
    with inductor_config.patch(unsafe_marked_cacheable_functions=marks):
        autograd_cache.check_cacheable(graphs[0])


@pytest.mark.inductor
@torch.no_grad()
def test_inductor_saves_graphs_with_a_priority_block(fresh_stats, nx_cache):
    """A real Inductor compile (CPU) of ComfyUI 0.33's attention path with the list rewritten: it
    matches eager, a second token count shares the graph, and AOTAutograd's cache stores it (on
    torch 2.11 a refused graph could not be saved: SDXL's first call compiled for 338 s on an H200).
    CI's torch 2.14 stores such a graph under a one-off key even without the marks, so the marks
    themselves are checked by ``test_cache_marks_make_the_graph_cacheable``."""
    torch.manual_seed(0)
    model = _ComfyAttention().eval()
    with aot_cache_saves():
        cm = nexfort_engine.compile(model, {"mode": "max-optimize:cache-all", "sdpa_cudnn_first": True},
                                    cache_dir=nx_cache, label="sdpa-order-inductor")
        for tokens in (12, 20):
            x = torch.randn(2, tokens, 16)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-5)
    rec = fresh_stats()["models"][cm.label]
    assert rec["fallbacks"] == 0 and rec["compiles"] == 1 and rec["recompiles"] == 0
    assert rec["sdpa_cudnn_first"] == 1
