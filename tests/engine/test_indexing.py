"""indexing: 32-bit symbolic size arguments in Inductor's Triton kernels that index in 32 bits.

The Triton kernels themselves need a GPU; here the typing decision is checked where Inductor
makes it (``signature_to_meta`` in its Triton codegen modules, fed the same argument objects its
codegen builds), the wrapper's scope (restored on exit, nested use), the auto rule, the option
and the cache key.
"""

from __future__ import annotations

import pytest
import sympy

from nexfort_engine import indexing
from nexfort_engine.options import OptionsError, parse_options
from nexfort_engine.settings import resolve

triton_codegen = pytest.importorskip("torch._inductor.codegen.triton")


def _meta(size_dtype: str, *, is_template: bool = False) -> dict[str, str]:
    from torch._inductor.codegen.common import ArgName, SizeArg

    signature = [
        SizeArg("ks0", sympy.Symbol("s0", integer=True, positive=True)),
        SizeArg("xnumel", sympy.Symbol("s1", integer=True, positive=True)),
    ]
    argdefs = [ArgName("ks0"), ArgName("xnumel")]
    return triton_codegen.signature_to_meta(signature, size_dtype=size_dtype, argdefs=argdefs,
                                            is_template=is_template)


def test_ks_args_follow_a_32_bit_kernel_only_inside_the_scope():
    assert _meta("tl.int32")["ks0"] == "i64"  # Inductor's own rule: always 64-bit
    template = _meta("tl.int32", is_template=True)
    with indexing.int32_size_args():
        m = _meta("tl.int32")
        assert m["ks0"] == "i32" and m["xnumel"] == "i32"
        assert _meta("tl.int64")["ks0"] == "i64"  # a 64-bit kernel keeps 64-bit sizes
        assert _meta("tl.int32", is_template=True) == template  # templates: Inductor's typing
    assert _meta("tl.int32")["ks0"] == "i64"  # restored


def test_scope_restores_the_functions_and_nests():
    original = triton_codegen.signature_to_meta
    with indexing.int32_size_args():
        wrapped = triton_codegen.signature_to_meta
        assert wrapped is not original
        with indexing.int32_size_args():  # nested: not wrapped twice
            assert triton_codegen.signature_to_meta is wrapped
        assert triton_codegen.signature_to_meta is wrapped
    assert triton_codegen.signature_to_meta is original
    with indexing.int32_size_args(False):
        assert triton_codegen.signature_to_meta is original
    with pytest.raises(RuntimeError), indexing.int32_size_args():
        raise RuntimeError("a failed compile")
    assert triton_codegen.signature_to_meta is original


def test_auto_rule_option_and_cache_key():
    assert indexing.wanted(None, cuda=True, dynamic=True)
    assert not indexing.wanted(None, cuda=True, dynamic=False)  # static: sizes are constants
    assert not indexing.wanted(None, cuda=False, dynamic=True)  # CPU: C++ kernels
    assert not indexing.wanted(False, cuda=True, dynamic=True)
    assert indexing.wanted(True, cuda=False, dynamic=False)
    assert parse_options({}).int32_size_args is None
    assert parse_options({"int32_size_args": False}).int32_size_args is False
    with pytest.raises(OptionsError, match="true, false or null"):
        parse_options({"int32_size_args": 1})
    on = resolve(parse_options({"mode": "O2"}), cuda=True)
    off = resolve(parse_options({"mode": "O2", "int32_size_args": False}), cuda=True)
    assert on.int32_size_args and not off.int32_size_args
    cfg = parse_options({"mode": "O2"})
    assert on.digest(cfg) != off.digest(cfg)  # the FX-graph cache cannot see the patch: our key does
    # off (and every CPU setting) keeps the keys made before the option existed
    assert not resolve(cfg, cuda=False).int32_size_args
