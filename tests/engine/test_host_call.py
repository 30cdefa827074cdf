"""``nexfort::host_call``: host code (a ``.item()`` read and a branch on it) kept inside one compiled
graph as an opaque op, against its eager twin (the resolver called directly)."""

from __future__ import annotations

import pytest
import torch

from nexfort_engine import background, host_call


def _gate(tensors: list[torch.Tensor], ints: list[int], spec: str) -> torch.Tensor:
    """Reads the sigma on the host and branches on it, as IPAdapter's attention patch does."""
    x, sigmas = tensors
    sigma = sigmas.detach().cpu()[0].item()
    scale = float(spec.split("=")[1])
    return x * scale if sigma > ints[0] else x - scale


host_call.register("test.gate", _gate)


def _fn(x: torch.Tensor, sigmas: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w
    z = host_call.call([y, sigmas], "test.gate", [5, y.shape[0]], "scale=" + str(2))
    return torch.relu(z) + 1


def _graphs(backend: str) -> tuple[list[torch.fx.GraphModule], object]:
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        if backend == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    return graphs, record


def test_host_code_runs_inside_one_graph_for_every_value_and_size():
    torch._dynamo.reset()
    graphs, record = _graphs("aot_eager")
    compiled = torch.compile(_fn, backend=record, fullgraph=True, dynamic=True)
    w = torch.randn(8, 8)
    for n, sigma in ((4, 10.0), (4, 1.0), (6, 3.0), (5, 7.0)):
        x, sigmas = torch.randn(n, 8), torch.tensor([sigma])
        torch.testing.assert_close(compiled(x, sigmas, w), _fn(x, sigmas, w))
    assert len(graphs) == 1  # neither the sigma nor the size compiled another graph
    assert host_call.in_graph(graphs[0])


@pytest.mark.inductor
def test_inductor_compiles_a_graph_with_a_host_call():
    torch._dynamo.reset()
    compiled = torch.compile(_fn, backend="inductor", fullgraph=True, dynamic=True)
    w = torch.randn(8, 8)
    for n, sigma in ((4, 10.0), (6, 1.0)):
        x, sigmas = torch.randn(n, 8), torch.tensor([sigma])
        torch.testing.assert_close(compiled(x, sigmas, w), _fn(x, sigmas, w))


def test_a_missing_resolver_or_a_wrong_result_is_a_clear_error():
    x = torch.randn(2, 3)
    with pytest.raises(host_call.HostCallError, match="no resolver 'test.nope'.*test.gate"):
        host_call.run([x], "test.nope", [], "")
    host_call.register("test.wrong", lambda t, i, s: t[0].sum(0))
    with pytest.raises(host_call.HostCallError, match=r"returned \(3,\).*expects \(2, 3\)"):
        host_call.run([x], "test.wrong", [], "")


def test_a_result_never_shares_an_inputs_memory():
    host_call.register("test.same", lambda t, i, s: t[0])
    x = torch.randn(2, 3)
    out = host_call.run([x], "test.same", [], "")
    assert torch.equal(out, x) and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    y = torch.randn(3, 2).t()  # not contiguous: the declared form is
    host_call.register("test.strided", lambda t, i, s: y)
    assert host_call.run([torch.empty(2, 3)], "test.strided", [], "").is_contiguous()


def test_live_state_nests_and_is_per_thread():
    import threading

    assert host_call.current() is None
    with host_call.live("outer"):
        with host_call.live("inner"):
            assert host_call.current() == "inner"
        assert host_call.current() == "outer"
        seen = []
        t = threading.Thread(target=lambda: seen.append(host_call.current()))
        t.start()
        t.join()
        assert seen == [None]
    assert host_call.current() is None


def test_the_spec_carries_what_it_can_and_decodes_as_it_was():
    values = {"block": ("output", 4), "index": 0, "shape": [2, 4, 8, 12], "dtype": torch.bfloat16, "none": None,
              "flag": True, "name": "a=b\x1ec", "nested": (["x", 1], ())}
    ints: list = []
    text = host_call.spec("attn1", {**values, "skipped": object(), "bad_list": [1, object()]}, ints)
    assert ints == [4, 0, 2, 4, 8, 12, 1]  # none of bad_list's: it is left out whole
    assert host_call.decode(text, ints) == ("attn1", values)
    assert host_call.encode(object(), []) is None and host_call.encode(("a", object()), []) is None
    assert host_call.encode(torch.int8, []) is None  # float dtypes only
    # decoded once per (spec, ints), each call handed its own dict and lists (a patch may change them)
    first = host_call.decode(text, ints)[1]
    first["shape"].append(99)
    first["nested"][0].append("y")
    first["index"] = 7
    assert host_call.decode(text, ints) == ("attn1", values)
    assert host_call.decode(text, [5, 0, 2, 4, 8, 12, 1])[1]["block"] == ("output", 5)  # other integers


def test_a_stand_in_is_one_host_call_and_travels_to_a_background_child_as_itself():
    import copy
    import pickle

    seen = []

    def resolver(tensors, ints, spec):
        seen.append(host_call.decode(spec, ints))
        return tensors[0] * 2

    host_call.register("test.stand_in", resolver)
    stand_in = host_call.StandIn("test.stand_in", "attn2", ("block", "n_heads"))
    q, k = torch.randn(2, 3), torch.randn(2, 5)
    out = stand_in(q, k, {"block": ("input", 4), "n_heads": 8, "sigmas": torch.ones(1)})
    assert torch.equal(out, q * 2) and seen == [("attn2", {"block": ("input", 4), "n_heads": 8})]
    assert copy.deepcopy(stand_in) is stand_in and copy.copy(stand_in) is stand_in
    back = pickle.loads(background.dumps({"options": {"patch": stand_in}}))["options"]["patch"]
    assert type(back) is host_call.StandIn and (back.resolver, back.tag, back.keys) == (
        "test.stand_in", "attn2", ("block", "n_heads"))
    with host_call.placeholders():  # a child's run: zeros of the declared form, no resolver called
        assert torch.equal(back(q, k, {"block": ("input", 4)}), torch.zeros_like(q))
    assert len(seen) == 1


class _ServesHostCode:
    __nexfort_foreground__ = True


def test_a_background_child_never_gets_an_object_that_serves_host_code():
    with pytest.raises(background.Unavailable, match="_ServesHostCode"):
        background.dumps({"options": {"patch": _ServesHostCode()}})
    background.dumps({"options": {"patch": 1}})


def _reads(t: torch.Tensor) -> list:
    """The host reads host patches make of the step's sigmas, in the forms custom nodes write them."""
    return [t.detach().cpu()[0].item(), t.cpu().tolist(), t[0].item(), float(t[1]), int(t[0]), bool(t[:1]),
            t.to("cpu").tolist(), t.to(device="cpu", dtype=torch.float64).tolist(), t[-1:].tolist(),
            t.detach().clone().cpu().tolist()]


def test_a_host_copied_tensor_reads_as_the_tensor_it_wraps_and_computes_as_it():
    """Its twin is the plain tensor: every host read gives the same values; any other use gives
    the same plain tensor; reading never changes what it holds (``cpu()`` hands out a copy)."""
    import copy

    sigmas = torch.tensor([14.6, 0.03])
    wrapped = host_call.host_copied(sigmas)
    assert isinstance(wrapped, host_call.HostCopied) and host_call.host_copied(wrapped) is wrapped
    assert _reads(wrapped) == _reads(sigmas)
    for got, want in ((wrapped * 2 + 1, sigmas * 2 + 1), (torch.randn(3, 1).add(wrapped), None),
                      (wrapped.to(torch.float16), sigmas.to(torch.float16)), (wrapped.view(2, 1), sigmas.view(2, 1))):
        assert type(got) is torch.Tensor, type(got)
        if want is not None:
            assert torch.equal(got, want)
    wrapped.cpu().mul_(0)  # a caller that changes what it got
    assert _reads(wrapped) == _reads(sigmas)
    assert _reads(copy.deepcopy(wrapped)) == _reads(sigmas)
    # a tensor index is not a plain index: the result is the device tensor's
    assert type(wrapped[torch.tensor([1])]) is torch.Tensor


def test_the_wrappers_a_patch_makes_wait_for_the_copy_once():
    """A patch reads ``sigmas.detach().cpu()[0].item()`` in every layer, each time through a new
    wrapper (``detach``): the first read waits for the copy's event, the others know it landed."""

    class Event:
        waits = 0

        def synchronize(self) -> None:
            Event.waits += 1

    sigmas = torch.tensor([14.6, 0.03])
    wrapped = host_call.HostCopied._wrap(sigmas, sigmas.clone(), [Event()])
    derived = [wrapped.detach(), wrapped.clone(), wrapped[0:1], wrapped.detach().detach()]
    assert all(isinstance(d, host_call.HostCopied) for d in derived)
    for _ in range(3):
        assert [d.cpu()[0].item() for d in derived] == [sigmas[0].item()] * 4
        assert wrapped.detach().cpu()[0].item() == sigmas[0].item()
    assert Event.waits == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_a_host_read_of_a_copied_gpu_tensor_does_not_wait_for_the_gpus_queue():
    sigmas = torch.tensor([14.6, 0.03], device="cuda")
    want = _reads(sigmas.cpu())  # before the queue: a plain read waits for it
    wrapped = host_call.host_copied(sigmas)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # queued after the copy (about 0.1 s on an H200)
        a = a @ a / 64
    done = torch.cuda.Event()
    done.record()
    assert _reads(wrapped) == want
    assert not done.query()  # read while the matmuls were still running
    assert wrapped.device.type == "cuda" and torch.equal(wrapped * 1, sigmas)
