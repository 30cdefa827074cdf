"""Flags -> scoped settings: GPU-only flags dropped on CPU (one warning), runtime switches restored,
the seeds' option keys mapped, and the flag table complete."""

from __future__ import annotations

import logging

import pytest
import torch

from nexfort_engine import FLAGS, parse_options
from nexfort_engine import settings as S


@pytest.fixture(autouse=True)
def _forget_warnings(monkeypatch):
    monkeypatch.setattr(S, "_warned", set())


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "GPU-only" in r.getMessage()]


def test_gpu_only_flags_dropped_on_cpu_with_one_warning(caplog):
    cfg = parse_options({"mode": "O3"})
    with caplog.at_level(logging.WARNING, logger="nexfort_engine.settings"):
        first = S.resolve(cfg, cuda=False)
        for _ in range(3):
            again = S.resolve(cfg, cuda=False)
    assert set(first.dropped) == {"max-autotune", "cudagraphs", "low-precision", "benchmark"}
    assert again == first
    warns = _warnings(caplog)
    assert len(warns) == 1
    assert all(f in warns[0].getMessage() for f in first.dropped)
    # nothing from a dropped flag survives
    assert "triton.cudagraphs" not in first.inductor and "max_autotune_gemm" not in first.inductor
    assert first.runtime == {}
    # what's left on CPU: max-optimize + cache-all + the base
    assert first.inductor["shape_padding"] is True and first.inductor["fx_graph_cache"] is True
    # aggressive fusion costs a whole UNet's compile 15 s on SDXL and buys no speed (BENCHMARKS.md)
    assert "aggressive_fusion" not in first.inductor


def test_o2_and_o3_reduce_to_the_same_cpu_settings():
    o2 = S.resolve(parse_options({"mode": "O2"}), cuda=False)
    o3 = S.resolve(parse_options({"mode": "O3"}), cuda=False)
    assert o2.inductor == o3.inductor and o2.runtime == o3.runtime == {}


def test_no_warning_without_gpu_only_flags(caplog):
    with caplog.at_level(logging.WARNING, logger="nexfort_engine.settings"):
        s = S.resolve(parse_options({"mode": "O1"}), cuda=False)
    assert s.dropped == () and not _warnings(caplog)
    assert s.inductor["max_autotune"] is False


def test_gpu_flags_kept_with_cuda():
    s = S.resolve(parse_options({"mode": "O3"}), cuda=True, fp8_capable=True)
    assert s.dropped == ()
    assert s.inductor["triton.cudagraphs"] is True and s.inductor["max_autotune"] is True
    assert s.runtime["matmul_allow_tf32"] is True and s.runtime["cudnn_benchmark"] is True
    s = S.resolve(parse_options({"mode": "max-optimize:cudagraphs:cache-all"}), cuda=True)
    assert "cudnn_benchmark" not in s.runtime  # only where the flag is


def test_seed_option_keys_are_mapped():
    cfg = parse_options({"mode": "O2", "options": {
        "inductor.optimize_linear_epilogue": False,
        "triton.fuse_attention_allow_fp16_reduction": True,
        "overrides.conv_benchmark": False,
        "overrides.matmul_allow_tf32": True,
        "overrides.matmul_allow_fp16_accumulation": True,
        "inductor.coordinate_descent_tuning": True,
        "triton.unique_kernel_names": True,
    }})
    s = S.resolve(cfg, cuda=True)
    assert s.inductor["epilogue_fusion"] is False  # overrides the max-optimize flag's True
    assert s.runtime["sdp_fp16_bf16_reduction"] is True
    assert s.runtime["cudnn_benchmark"] is False  # overrides the benchmark flag's True
    assert s.runtime["matmul_allow_tf32"] is True
    assert s.runtime["matmul_fp16_accumulation"] is True  # O2 alone would not set it
    assert s.inductor["coordinate_descent_tuning"] is True
    assert s.inductor["triton.unique_kernel_names"] is True
    for key, (where, target) in S.SEED_KEYS.items():
        assert where in ("inductor", "runtime") and key in cfg.to_dict()["overrides"]
        assert target in (s.inductor if where == "inductor" else s.runtime)


def test_every_inductor_patch_is_a_real_config_key():
    from torch._inductor import config as ic

    known = ic.get_config_copy()
    for flag, patches in S.FLAG_INDUCTOR.items():
        for k in patches:
            assert k in known, f"flag {flag}: {k} is not an Inductor config key in torch {torch.__version__}"


def test_runtime_overrides_restored_after_context():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
    want = {"matmul_allow_tf32": not before[0], "cudnn_benchmark": not before[1], "cudnn_allow_tf32": not before[2],
            "not_a_switch": True}
    with S.runtime_overrides(want):
        assert torch.backends.cuda.matmul.allow_tf32 == want["matmul_allow_tf32"]
        assert torch.backends.cudnn.benchmark == want["cudnn_benchmark"]
        assert torch.backends.cudnn.allow_tf32 == want["cudnn_allow_tf32"]
    after = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
    assert after == before


def test_runtime_overrides_restored_on_exception():
    before = torch.backends.cudnn.benchmark
    with pytest.raises(RuntimeError), S.runtime_overrides({"cudnn_benchmark": not before}):
        raise RuntimeError("boom")
    assert torch.backends.cudnn.benchmark == before


def test_flag_table_lists_every_flag():
    table = S.flag_table()
    for flag in FLAGS:
        assert f"| `{flag}`" in table
    for flag in S.GPU_ONLY:
        assert f"`{flag}` (GPU only)" in table
    assert set(S.FLAG_INDUCTOR) == set(FLAGS)  # every flag has a row of settings (maybe empty)
    assert len(table.splitlines()) == len(FLAGS) + 2


def test_dynamic_shape_drops_coordinate_descent_tuning_unless_asked():
    """Its results are not reused by a second process for dynamic-shape kernels (a Flux O3 warm
    start re-tuned for 40 s), so O3 with dynamic shape autotunes GEMMs only; static keeps it."""
    dyn = S.resolve(parse_options({"mode": "O3"}), cuda=True, fp8_capable=True)
    static = S.resolve(parse_options({"mode": "O3", "dynamic": False}), cuda=True, fp8_capable=True)
    assert dyn.inductor["max_autotune"] and dyn.inductor["coordinate_descent_tuning"] is False
    assert static.inductor["coordinate_descent_tuning"] is True
    forced = S.resolve(parse_options({"mode": "O3", "options": {"inductor.coordinate_descent_tuning": True}}), cuda=True,
                       fp8_capable=True)
    assert forced.inductor["coordinate_descent_tuning"] is True


def test_max_autotune_leaves_convolutions_to_cudnn_unless_asked():
    """cuDNN won 17 of SDXL's 18 convolution shapes while autotuning them cost 129 s of a cold
    compile (run63), so max-autotune tunes GEMMs and pointwise kernels only."""
    for options in ({"mode": "O3"}, {"mode": "O3", "dynamic": False}, {"mode": "max-autotune"}):
        assert S.resolve(parse_options(options), cuda=True, fp8_capable=True).inductor["max_autotune_conv_backends"] == "ATEN"
    assert "max_autotune_conv_backends" not in S.resolve(parse_options({"mode": "O2"}), cuda=True).inductor
    forced = parse_options({"mode": "O3", "options": {"inductor.max_autotune_conv_backends": "ATEN,TRITON"}})
    assert S.resolve(forced, cuda=True, fp8_capable=True).inductor["max_autotune_conv_backends"] == "ATEN,TRITON"


@pytest.mark.parametrize(
    ("options", "capability", "want"),
    [
        ({"mode": "O3"}, (8, 6), True),  # low precision, no fp8, fp16 accumulation pays: on
        ({"mode": "O3"}, (7, 5), True),
        ({"mode": "O3"}, (8, 0), None),  # A100: same rate either way, only the error grows
        ({"mode": "O3"}, (9, 0), None),  # fp8 GPU: fp8 linears instead
        ({"mode": "O3", "fp8": False}, (9, 0), None),  # measured slower there (H200): not even then
        ({"mode": "O2"}, (8, 6), None),  # lossless preset: never
        ({"mode": "O3", "options": {"overrides.matmul_allow_fp16_accumulation": False}}, (8, 6), False),
        ({"mode": "O2", "options": {"overrides.matmul_allow_fp16_accumulation": True}}, (9, 0), True),
    ],
)
def test_low_precision_accumulates_fp16_in_fp16_only_where_it_pays(options, capability, want):
    cfg = parse_options(options)
    s = S.resolve(cfg, cuda=True, fp8_capable=capability >= (8, 9),
                  fp16_accumulation=S.fp16_accumulation_pays(capability))
    assert s.runtime.get("matmul_fp16_accumulation") is want
    assert "matmul_fp16_accumulation" not in S.resolve(cfg, cuda=False, fp16_accumulation=True).runtime


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation"), reason="torch < 2.7")
def test_fp16_accumulation_switch_set_and_restored():
    m = torch.backends.cuda.matmul
    before = m.allow_fp16_accumulation
    with S.runtime_overrides({"matmul_fp16_accumulation": not before}):
        assert m.allow_fp16_accumulation is (not before)
    assert m.allow_fp16_accumulation is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuBLAS fp16 GEMMs)")
def test_fp16_accumulation_changes_cublas_results():
    """On a GPU the switch reaches cuBLAS: a long fp16 dot product rounds differently."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 8192, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(8192, 256, device="cuda", dtype=torch.float16, generator=g)
    ref = a.float() @ b.float()
    plain = a @ b
    with S.runtime_overrides({"matmul_fp16_accumulation": True}):
        fast = a @ b
    err_plain = (plain.float() - ref).abs().max().item()
    err_fast = (fast.float() - ref).abs().max().item()
    assert err_fast > err_plain


def test_aggressive_fusion_is_the_users_choice():
    """max-optimize leaves Inductor's aggressive fusion off (compile time, no speed: BENCHMARKS.md,
    twentieth session); the user's own option turns it on, and that is a different cache entry."""
    plain_cfg = parse_options({"mode": "O2"})
    opted_cfg = parse_options({"mode": "O2", "options": {"inductor.aggressive_fusion": True}})
    plain, opted = S.resolve(plain_cfg, cuda=True), S.resolve(opted_cfg, cuda=True)
    assert "aggressive_fusion" not in plain.inductor
    assert opted.inductor["aggressive_fusion"] is True
    assert opted.digest(opted_cfg) != plain.digest(plain_cfg)


def test_pointwise_kernels_take_the_heuristics_block_size_unless_autotuning():
    """Benchmarking every pointwise kernel's candidate block sizes at its first call took 8-10 s
    of a cold UNet compile's first step, for no speed (run186): off unless max-autotune (which
    tunes them on purpose) or the user's option asks for it, and that is a different cache entry."""
    for options in ({"mode": "O2"}, {"mode": "O2", "dynamic": False}, {"mode": "max-optimize:cudagraphs"}):
        assert S.resolve(parse_options(options), cuda=True).inductor["triton.autotune_pointwise"] is False
    o3 = S.resolve(parse_options({"mode": "O3"}), cuda=True, fp8_capable=True).inductor
    assert o3["max_autotune_pointwise"] is True and "triton.autotune_pointwise" not in o3
    plain_cfg = parse_options({"mode": "O2"})
    asked_cfg = parse_options({"mode": "O2", "options": {"triton.autotune_pointwise": True}})
    plain, asked = S.resolve(plain_cfg, cuda=True), S.resolve(asked_cfg, cuda=True)
    assert asked.inductor["triton.autotune_pointwise"] is True
    assert asked.digest(asked_cfg) != plain.digest(plain_cfg)


def test_o3_leaves_max_autotune_out_on_a_unet_compiled_whole():
    """SDXL ran 6.5 % slower with max-autotune and its cold compile did not finish in 380 s (twice),
    so the O3 preset leaves it out where it does not pay (``autotune_pays``: a convolutional UNet
    compiled whole); a mode string that names it keeps it, and the cache key follows."""
    o3 = parse_options({"mode": "O3"})
    skipped = S.resolve(o3, cuda=True, autotune_pays=False)
    assert skipped.autotune_skipped and not skipped.inductor.get("max_autotune")
    without = parse_options({"mode": "max-optimize:benchmark:cudagraphs:low-precision:cache-all"})
    assert skipped.inductor == S.resolve(without, cuda=True).inductor
    kept = S.resolve(o3, cuda=True, fp8_capable=True)
    assert kept.inductor["max_autotune"] and not kept.autotune_skipped
    assert skipped.digest(o3) != kept.digest(o3)
    named = parse_options({"mode": "max-optimize:max-autotune:low-precision"})
    assert S.resolve(named, cuda=True, autotune_pays=False).inductor["max_autotune"]
    assert not S.resolve(o3, cuda=False, autotune_pays=False).autotune_skipped  # CPU: dropped anyway


def test_o3_leaves_max_autotune_out_without_fp8_linears():
    """16-bit GEMMs stay on cuBLAS under max-autotune (it beat every Inductor template on PixArt's
    and Flux's shapes, run292) and PixArt O3 ran 2.4 % slower than O2 for a 77 s cold compile
    against 6 s (run294): the O3 preset keeps max-autotune only where fp8 linears run."""
    o3 = parse_options({"mode": "O3"})
    with_fp8 = S.resolve(o3, cuda=True, fp8_capable=True)
    assert with_fp8.fp8 and with_fp8.inductor["max_autotune"] and not with_fp8.autotune_skipped
    for no_fp8 in (S.resolve(o3, cuda=True),  # no fp8 tensor cores (A100)
                   S.resolve(o3, cuda=True, fp8_capable=True, fp8_pays=False),  # PixArt, SDXL: too narrow
                   S.resolve(parse_options({"mode": "O3", "fp8": False}), cuda=True, fp8_capable=True)):
        assert not no_fp8.fp8 and no_fp8.autotune_skipped and not no_fp8.inductor.get("max_autotune")
    assert with_fp8.digest(o3) != S.resolve(o3, cuda=True).digest(o3)
    named = parse_options({"mode": "max-optimize:max-autotune:cudagraphs:low-precision"})
    assert S.resolve(named, cuda=True).inductor["max_autotune"]  # asked for by name: kept


@pytest.mark.parametrize(("net", "pays"), [
    (torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(8)), False),
    (torch.nn.Sequential(torch.nn.Linear(16, 16)), True),
])
def test_compiled_module_asks_whether_autotune_pays(resolve_kwargs, net, pays):
    import nexfort_engine

    x = torch.randn(2, 4, 6, 6) if pays is False else torch.randn(2, 16)
    net(x)  # the lazy linear's size
    cm = nexfort_engine.compile(net, {"mode": "O3", "backend": "eager"}, cache_dir=None)
    cm(x)
    assert resolve_kwargs["autotune_pays"] is pays
