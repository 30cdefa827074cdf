"""Persistent row reductions (reductions.py): the policy, its scope, and where settings turn it on."""

from __future__ import annotations

import sympy
import torch
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

from nexfort_engine import parse_options
from nexfort_engine import reductions as R
from nexfort_engine import settings as S


class Features:
    """The two things the policy reads from Inductor's ``SIMDKernelFeatures``."""

    def __init__(self, numel, hint=ReductionHint.INNER, strict=None):
        self.reduction_numel = numel
        self._hint = hint
        self._strict = strict

    def get_reduction_hint(self):
        return self._hint

    def strict_sum_rblock(self):
        return self._strict


def test_wide_static_inner_rows_are_persistent_up_to_the_limit():
    assert R.wants_persistent(Features(sympy.Integer(5120)), False, R.DEFAULT_LIMIT)
    assert R.wants_persistent(Features(640), False, R.DEFAULT_LIMIT)
    assert not R.wants_persistent(Features(sympy.Integer(12288)), False, R.DEFAULT_LIMIT)
    assert R.wants_persistent(Features(sympy.Integer(15360)), False, 16384)


def test_other_reductions_are_left_to_inductor():
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    assert not R.wants_persistent(Features(s0 * 64), False, 16384)  # symbolic row length
    assert not R.wants_persistent(Features(4096, ReductionHint.OUTER), False, 16384)
    assert not R.wants_persistent(Features(4096), True, 16384)  # cooperative
    assert not R.wants_persistent(Features(4096, strict=1024), False, 16384)  # strict sum
    assert not R.wants_persistent(Features(4096), False, 0)


def test_handler_is_scoped_to_the_block_and_keeps_inductor_default_otherwise():
    before = V.choices
    with R.persistent_rows(8192):
        inside = V.choices
        assert inside is not before
        assert inside.should_use_persistent_reduction(Features(sympy.Integer(8192)), False)
        assert inside.uuid() == ("nexfort.persistent_rows", 8192)
    assert V.choices is before
    with R.persistent_rows(0):
        assert V.choices is before


def test_settings_turn_it_on_on_the_gpu_only_and_key_the_cache():
    fp8 = parse_options({"mode": "O2", "fp8": True})
    gpu = S.resolve(fp8, cuda=True, fp8_capable=True)
    assert gpu.persistent_rows == R.DEFAULT_LIMIT
    assert S.resolve(fp8, cuda=False).persistent_rows == 0  # CPU codegen has no such choice
    bf16 = parse_options({"mode": "O2"})
    # without fp8 too: LayerNorm rows (SDXL's 640/1280) are single-pass kernels (eighth session)
    assert S.resolve(bf16, cuda=True).persistent_rows == R.DEFAULT_LIMIT
    assert S.resolve(bf16, cuda=False).persistent_rows == 0
    other = S.Settings(inductor=gpu.inductor, runtime=gpu.runtime, fp8=True, persistent_rows=0)
    assert gpu.digest(fp8) != other.digest(fp8)


def test_compile_under_the_handler_runs_on_cpu():
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with R.persistent_rows(R.DEFAULT_LIMIT):
            return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    x = torch.randn(8, 2048)
    fn = torch.compile(lambda t: (t / t.abs().amax(-1, keepdim=True)), backend=backend)
    torch.testing.assert_close(fn(x), x / x.abs().amax(-1, keepdim=True))
