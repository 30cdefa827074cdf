"""Option parsing: presets, flags, JSON; every bad input is an OptionsError naming the valid values."""

from __future__ import annotations

import json

import pytest

from nexfort_engine import FLAGS, PRESETS, CompileConfig, OptionsError, parse_options
from nexfort_engine.options import BACKENDS, MEMORY_FORMATS, SEED_OPTION_KEYS, parse_mode


def test_default_is_o2():
    cfg = parse_options(None)
    assert cfg.flags == tuple(sorted(PRESETS["O2"], key=list(FLAGS).index))
    assert (cfg.memory_format, cfg.dynamic, cfg.fullgraph, cfg.backend) == ("contiguous", True, False, "inductor")
    assert parse_options("") == cfg == parse_options({}) == parse_options("   ")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_expand_to_their_flags(preset):
    cfg = parse_options({"mode": preset})
    assert set(cfg.flags) == set(PRESETS[preset])
    assert cfg.mode == preset


def test_flags_combine_canonically():
    a = parse_options({"mode": "max-autotune:cudagraphs"})
    b = parse_options({"mode": " cudagraphs : max-autotune :: max-autotune"})
    assert a.flags == b.flags == ("max-autotune", "cudagraphs")
    assert a == b and a.digest() == b.digest()  # mode text is display only
    # a preset plus a flag is the union
    assert set(parse_mode("O1:freezing")) == {*PRESETS["O1"], "freezing"}


def test_seed_shaped_json_string():
    text = json.dumps({
        "mode": "max-optimize:max-autotune:low-precision", "memory_format": "channels_last",
        "dynamic": True, "fullgraph": False, "fuse_qkv_projections": True,
        "options": {"inductor.optimize_linear_epilogue": False, "overrides.matmul_allow_tf32": True},
    })
    cfg = parse_options(text)
    assert cfg.memory_format == "channels_last" and cfg.fuse_qkv_projections
    assert dict(cfg.overrides) == {"inductor.optimize_linear_epilogue": False, "overrides.matmul_allow_tf32": True}
    assert parse_options(cfg) is cfg


def test_digest_changes_with_identity_fields():
    base = parse_options({"mode": "O2"})
    others = [
        {"mode": "O1"}, {"mode": "O2", "memory_format": "channels_last"}, {"mode": "O2", "dynamic": False},
        {"mode": "O2", "backend": "eager"}, {"mode": "O2", "options": {"inductor.epilogue_fusion": False}},
    ]
    digests = {parse_options(o).digest() for o in others}
    assert base.digest() not in digests and len(digests) == len(others)
    assert isinstance(base, CompileConfig) and hash(base) == hash(parse_options({"mode": "O2"}))


def test_real_inductor_keys_accepted():
    cfg = parse_options({"options": {"inductor.coordinate_descent_tuning": True, "triton.cudagraphs": False,
                                     "inductor.max_fusion_size": 32}})
    assert dict(cfg.overrides)["inductor.max_fusion_size"] == 32


def _err(options) -> str:
    with pytest.raises(OptionsError) as ei:
        parse_options(options)
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


def test_unknown_flag_names_presets_and_flags():
    msg = _err({"mode": "O2:turbo"})
    assert "'turbo'" in msg
    for name in list(PRESETS) + list(FLAGS):
        assert repr(name) in msg


def test_unknown_top_level_key_names_valid_keys():
    msg = _err({"mode": "O2", "modee": "O3"})
    assert "'modee'" in msg and "'mode'" in msg and "'memory_format'" in msg and "'options'" in msg


def test_bad_memory_format_names_choices():
    msg = _err({"memory_format": "nhwc"})
    assert all(repr(m) in msg for m in MEMORY_FORMATS)


def test_bad_backend_names_choices():
    msg = _err({"backend": "tensorrt"})
    assert all(repr(b) in msg for b in BACKENDS)


@pytest.mark.parametrize("text", ['{"mode": "O2",}', "{mode: O2}", '{"mode": "O2"'])
def test_malformed_json_says_where_and_shows_example(text):
    with pytest.raises(OptionsError) as ei:
        parse_options(text)
    assert "not valid JSON" in str(ei.value) and "line 1" in str(ei.value) and '"mode"' in str(ei.value)
    assert ei.value.__cause__ is not None  # chained from the JSONDecodeError


@pytest.mark.parametrize(
    "options, needle",
    [
        ("[1, 2]", "JSON object"),
        ('"O2"', "JSON object"),
        (42, "JSON object"),
        ({"mode": 2}, "mode must be a string"),
        ({"dynamic": "yes"}, "'dynamic' must be true or false"),
        ({"fullgraph": 1}, "'fullgraph' must be true or false"),
        ({"fuse_qkv_projections": None}, "must be true or false"),
        ({"options": [1]}, "'options' must be an object"),
        ({"options": {"overrides.matmul_allow_tf32": "true"}}, "must be true or false"),
        ({"spatial_multiple": 3}, "one of 1, 2, 4, 8, 16"),
        ({"spatial_multiple": True}, "'spatial_multiple' must be null (auto)"),
        ({"spatial_multiple": "8"}, "'spatial_multiple' must be null (auto)"),
    ],
)
def test_wrong_types(options, needle):
    assert needle in _err(options)


def test_unknown_option_namespace_names_seed_keys():
    msg = _err({"options": {"cudnn.benchmark": True}})
    assert all(repr(k) in msg for k in SEED_OPTION_KEYS) and "inductor.<key>" in msg


def test_unknown_inductor_key_suggests_close_ones():
    msg = _err({"options": {"inductor.max_autotun": True}})
    assert "'max_autotun' is not an Inductor config key" in msg and "did you mean" in msg and "max_autotune" in msg
    assert "not an Inductor config key" in _err({"options": {"triton.no_such_thing": 1}})


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("inductor.max_autotune", "yes", "true or false"),
        ("inductor.max_autotune", 1, "true or false"),
        ("inductor.max_fusion_size", "64", "must be a number"),
        ("inductor.max_fusion_size", True, "must be a number"),
        ("inductor.memory_pool", 3, "must be a string"),
        ("inductor.cpp.simdlen", "avx", None),  # default None: any value accepted (documented)
    ],
)
def test_wrong_typed_value_for_real_inductor_key(key, value, needle):
    if needle is None:
        parse_options({"options": {key: value}})
        return
    assert needle in _err({"options": {key: value}})


def test_spatial_multiple_parsed_and_kept_out_of_the_settings_digest():
    from nexfort_engine.settings import resolve

    assert parse_options({}).spatial_multiple is None
    assert parse_options({"spatial_multiple": 4}).spatial_multiple == 4
    # the decision (not the option) is in the entry's structure key (compiler.py), so entries made
    # before the option existed keep their settings digest
    auto, eight = parse_options({}), parse_options({"spatial_multiple": 8})
    assert resolve(auto, cuda=False).digest(auto) == resolve(eight, cuda=False).digest(eight)
