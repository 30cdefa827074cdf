"""``nexfort_engine.transfer.to_device_async``: CPU tensors (also in lists/tuples) moved to a CUDA
device from pinned memory; everything else, and every value for a non-CUDA device, unchanged."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from nexfort_engine.transfer import map_cpu_tensors, to_device_async


def test_non_cuda_device_or_values_are_unchanged():
    t = torch.randn(3)
    for value in (t, [t, 1], (t,), {"a": t}, 3.5, None, "text"):
        assert to_device_async(value, torch.device("cpu")) is value
    assert to_device_async(3.5, torch.device("cuda")) == 3.5
    assert to_device_async("text", torch.device("cuda")) == "text"
    d = {"a": t}  # dicts (ComfyUI's transformer_options) are not walked
    assert to_device_async(d, torch.device("cuda")) is d
    needs_grad = torch.randn(2, requires_grad=True)
    assert to_device_async(needs_grad, torch.device("cuda")) is needs_grad


def test_containers_keep_their_type_and_untouched_values():
    """The walk ``to_device_async`` makes, with a visible ``move`` (runs on CPU)."""
    Pair = namedtuple("Pair", "cond extra")
    t, frozen = torch.randn(2), torch.randn(2, requires_grad=True)

    def move(x):
        return x * 0 + 7

    out = map_cpu_tensors([t, (t, 1), Pair(t, "x"), frozen, {"a": t}], move)
    assert isinstance(out, list) and torch.equal(out[0], torch.full((2,), 7.0))
    assert isinstance(out[1], tuple) and out[1][1] == 1 and torch.equal(out[1][0], out[0])
    assert isinstance(out[2], Pair) and out[2].extra == "x" and torch.equal(out[2].cond, out[0])
    assert out[3] is frozen and out[4]["a"] is t  # grad-requiring tensors and dicts are left alone
    plain = (1, "a")
    assert map_cpu_tensors(plain, move) is plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_tensors_reach_the_gpu_with_their_values():
    dev = torch.device("cuda")
    src = torch.randn(4, 77, 64)
    guidance = torch.tensor([3.5])
    out = to_device_async(src, dev)
    moved = to_device_async([guidance, src.half()], dev)
    tup = to_device_async((guidance,), dev)
    src_copy = src.clone()
    src.add_(1)  # a later change of the source does not reach the copy
    torch.cuda.synchronize()
    assert out.is_cuda and torch.equal(out.cpu(), src_copy)
    assert isinstance(moved, list) and moved[0].is_cuda and torch.equal(moved[1].cpu(), src_copy.half())
    assert isinstance(tup, tuple) and tup[0].is_cuda
    on_gpu = torch.ones(2, device=dev)
    assert to_device_async(on_gpu, dev) is on_gpu
