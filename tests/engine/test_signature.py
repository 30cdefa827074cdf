"""signature.py: a call's structure as a digest, Dynamo's graph-break reasons, the user's line in its errors."""

from __future__ import annotations

import torch

from nexfort_engine import signature


def gate(h, sigma):
    return h * 2 if sigma[0].item() > 0.5 else h


def other_gate(h, sigma):
    return h


class Patch:
    def __call__(self, h):
        return h

    def method(self, h):
        return h


def _options(patch, sigma=1.0, size=8, cond=(0, 1)):
    return {"transformer_options": {"patches": {"output_block_patch": [patch]}, "sigmas": torch.tensor([sigma]),
                                    "cond_or_uncond": list(cond), "block": ("input", 4)},
            "context": torch.randn(2, size, 16)}


def test_sizes_and_scalar_values_do_not_change_the_signature():
    x, y = torch.randn(2, 4, 8, 8), torch.randn(1, 4, 16, 12)
    a = signature.call_signature((x, 0.5), _options(gate))
    assert a == signature.call_signature((y, 0.9), _options(gate, sigma=0.2, size=77, cond=(1,)))
    assert len(a) == 16 and int(a, 16) >= 0


def test_the_functions_a_call_carries_and_its_keys_do():
    x = torch.randn(2, 4, 8, 8)
    base = signature.call_signature((x,), _options(gate))
    assert base != signature.call_signature((x,), _options(other_gate))
    assert base != signature.call_signature((x,), {**_options(gate), "control": None})
    assert base != signature.call_signature((x.half(),), _options(gate))  # dtype
    assert base != signature.call_signature((x[0],), _options(gate))  # rank
    # callable objects by class, bound methods by function: stable across instances
    assert signature.call_signature((x,), _options(Patch())) == signature.call_signature((x,), _options(Patch()))
    assert signature.call_signature((x,), _options(Patch().method)) == signature.call_signature(
        (x,), _options(Patch().method))
    assert signature.call_signature((x,), _options(Patch())) != signature.call_signature((x,), _options(Patch().method))


def test_deep_or_self_referencing_structures_end():
    d: dict = {}
    d["self"] = d
    assert len(signature.call_signature((), {"o": d})) == 16


def test_graph_break_reasons_are_read_from_dynamo_once_each():
    before = signature.graph_break_counts()
    f = torch.compile(gate, backend="eager")
    torch._dynamo.reset()
    x = torch.randn(3)
    assert torch.equal(f(x, torch.tensor([1.0])), x * 2)
    reasons = signature.graph_break_reasons(before)
    assert len(reasons) == 1 and "item()" in reasons[0], reasons
    assert signature.graph_break_reasons(signature.graph_break_counts()) == []


def test_the_users_line_in_a_dynamo_error():
    text = ('Could not guard on data-dependent expression\nUser Stack:\n  File "/x/y.py", line 3, in f\n\n'
            'from user code:\n   File "/a/comfy/model.py", line 10, in forward\n    h = p(h)\n'
            '  File "/a/comfy_extras/nodes_model_downscale.py", line 37, in input_block_patch\n'
            '    sigma = transformer_options["sigmas"][0].item()\n\nSet TORCHDYNAMO_VERBOSE=1')
    assert signature.user_location(text) == "comfy_extras/nodes_model_downscale.py:37 in input_block_patch"
    assert signature.user_location("no frames here") is None


def test_a_graph_break_is_a_trace_failure_a_backend_error_is_not():
    from torch._dynamo import exc

    torch._dynamo.reset()  # the test above's compiled frames of gate would run instead
    try:
        torch.compile(gate, backend="eager", fullgraph=True)(torch.randn(3), torch.tensor([1.0]))
    except Exception as e:  # noqa: BLE001 - whatever Dynamo raises for it
        assert signature.dynamo_trace_failure(e), type(e)
    else:
        raise AssertionError("fullgraph traced a data-dependent branch")
    assert not signature.dynamo_trace_failure(RuntimeError("CUDA out of memory"))
    # (its constructor's arguments differ between torch versions)
    assert not signature.dynamo_trace_failure(exc.BackendCompilerFailed.__new__(exc.BackendCompilerFailed))
