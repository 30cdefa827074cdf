"""Experiment: 16-bit attention for head dims that are not a power of two, with the head dim split.

What: :func:`split_d_attention` computes ``scaled_dot_product_attention(q, k, v)`` (no mask, not
causal; ``q``/``k``/``v`` ``[B, H, N, D]`` in float16 or bfloat16, any strides with the last one 1)
in one Triton kernel (``split_d_attention_kernel.py``) whose head dimension is two power-of-two
blocks: ``D0`` columns and a ``D1``-column tail masked to the real width (:func:`split_dims`).
:func:`split_d_attention_reference` is the torch twin (SDPA in float32, rounded to the dtype).

Why: PixArt-α's heads are 72 wide. cuDNN runs them in its 128-wide kernel (the twentieth session:
80, 96 and 128 cost what 72 does), so 44 % of its tensor-core work multiplies zeros; its one fast
plan (fifty-second session, ``benchmarks/attention_plans.py``) is the one torch builds, and it
takes 13.3 of PixArt's 32.2 ms step on an H200. 64 + 16 columns do 62.5 % of that work. What it
has to beat: cuDNN at 0.411 ms for PixArt's 2 × 16 × 4096² self-attention (376 TFLOP/s counted at
72), where the eleventh session's Triton kernel reached 87 % of cuDNN's rate at SDXL's 64-wide
heads (211 against 184 µs) without warp specialisation. A kernel at that efficiency on 80 columns
would roughly tie; warp specialisation (``tl.range(..., warp_specialize=True)``, which Triton has
on Hopper in recent versions), tensor-descriptor (TMA) loads (``tma``), two exponentials per
instruction (``exp_f16x2``) or lazy rescaling (``lazy_rescale``) would have to make the difference.

    python -m benchmarks.split_d_attention --output-json out.json [--quick]

times every configuration of :data:`CONFIGS` at ``attention_plans``' :data:`SHAPES` beside torch's SDPA backends, with
each output's error against float32 SDPA; GPU only. In a whole model:
``python -m benchmarks.text_to_image --model pixart --attention-experiment split-d:128x64x8x3``
(:func:`install_in_comfy`: ComfyUI's attention sends such heads to the kernel as a custom op).
Nothing here is used by the engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.attention_plans import SHAPES, bnhd, time_ms
from nexfort_engine.rowwise_quant import _cdiv, _pow2_at_least

__all__ = ["CONFIGS", "DEFAULT_VARIANT", "SHAPES", "Variant", "comfy_attention", "format_config", "install_in_comfy",
           "parse_config", "split_d_attention", "split_d_attention_reference", "split_dims", "uninstall_from_comfy"]

#: (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize, tma) tried for each shape
CONFIGS: list[tuple[int, int, int, int, bool, bool]] = [
    (bm, bn, w, s, ws, tma)
    for bm, bn, w, s, ws, tma in itertools.product((64, 128), (64, 128), (4, 8), (2, 3), (False, True), (False, True))
    if not (bm == 64 and w == 8)
]
_DTYPES = (torch.float16, torch.bfloat16)
_kernels: Any = None


def split_dims(head_dim: int) -> tuple[int, int]:
    """``(D0, D1)``: the power-of-two main block (the largest one that fits, at least 16) and the
    power-of-two tail block (at least 16; 0 when there is none) that cover ``head_dim``; one
    padded block where two would not be narrower (72 -> (64, 16), 96 -> (64, 32), 64 -> (64, 0),
    120 -> (128, 0))."""
    if head_dim < 1:
        raise ValueError(f"split_dims: head dim {head_dim} must be positive")
    d0 = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - d0
    if rest <= 0:
        return d0, 0
    d1 = max(16, _pow2_at_least(rest))
    if d0 + d1 >= _pow2_at_least(head_dim):
        return _pow2_at_least(head_dim), 0
    return d0, d1


def split_d_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                scale: float | None = None) -> torch.Tensor:
    """The twin: ``scaled_dot_product_attention`` in float32, rounded to ``q``'s dtype."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale).to(q.dtype)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("split_d_attention: q, k, v must be [batch, heads, tokens, head dim]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES + (torch.float32,):
        raise ValueError(f"split_d_attention: dtypes {q.dtype}, {k.dtype}, {v.dtype}; valid: one of "
                         "torch.float16, torch.bfloat16 (torch.float32 under the interpreter)")
    if q.shape[:2] != k.shape[:2] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"split_d_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "do not match (same batch, heads and head dim; k and v alike)")
    if q.shape[-1] > 256:
        raise ValueError(f"split_d_attention: head dim {q.shape[-1]} not supported; valid: 1 to 256")


def tma_eligible(t: torch.Tensor) -> bool:
    """Whether ``t`` (``[B, H, N, D]``) is a ``[B * N, H * D]`` matrix a tensor descriptor can read:
    heads side by side in a row, rows evenly spaced across the batch, 16-byte aligned base and row
    stride (ComfyUI's q/k/v: views of ``[B, N, H, D]`` or of a fused ``[B, N, 3, H, D]`` projection)."""
    b, h, n, d = t.shape
    return (t.stride(3) == 1 and (h == 1 or t.stride(1) == d) and (b == 1 or t.stride(0) == n * t.stride(2))
            and t.data_ptr() % 16 == 0 and t.stride(2) * t.element_size() % 16 == 0)


def _descriptors(t: torch.Tensor, rows: int, d0: int, d1: int) -> tuple[Any, Any]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, n, d = t.shape
    shape, strides = [b * n, h * d], [t.stride(2), 1]
    return (TensorDescriptor(t, shape, strides, [rows, d0]), TensorDescriptor(t, shape, strides, [rows, d1 or 16]))


def split_d_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                      config: tuple[int, int, int, int, bool] = (128, 64, 8, 3, False),
                      exp_f16x2: bool = False, lazy_rescale: bool = False, tma: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, scale=scale)`` by the Triton kernel (module
    docstring). ``config`` is ``(BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize)``;
    ``tma`` reads q, k and v through tensor descriptors where they allow it (:func:`tma_eligible`;
    pointers otherwise). The output is a ``[B, H, N, D]`` view of ``[B, N, H, D]`` memory, as SDPA's
    kernels return it for ComfyUI's inputs (its ``transpose(1, 2).reshape`` is then free)."""
    global _kernels
    _check(q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if _kernels is None:
        from benchmarks import split_d_attention_kernel as _kernels
    b, h, n_q, d = q.shape
    n_kv = k.shape[2]
    d0, d1 = split_dims(d)
    bm, bn, warps, stages, ws = config
    out = torch.empty(b, n_q, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * 1.4426950408889634
    kw: dict[str, Any] = {"num_warps": warps, "num_stages": stages} if q.device.type == "cuda" else {}
    meta = dict(HEAD_DIM=d, D0=d0, D1=d1 or 16, HAS_TAIL=d1 > 0, BLOCK_M=bm, BLOCK_N=bn, EVEN_KV=n_kv % bn == 0,
                WARP_SPECIALIZE=ws, EXP_F16X2=exp_f16x2, LAZY_RESCALE=lazy_rescale, **kw)
    grid = (_cdiv(n_q, bm), b * h)
    if tma and all(tma_eligible(t) for t in (q, k, v)):
        _kernels.split_d_attention_tma_kernel[grid](
            *_descriptors(q, bm, d0, d1), *_descriptors(k, bn, d0, d1), *_descriptors(v, bn, d0, d1), out, qk_scale,
            out.stride(0), out.stride(1), out.stride(2), h, n_q, n_kv, **meta)
        return out
    _kernels.split_d_attention_kernel[grid](
        q, k, v, out, qk_scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, n_q, n_kv, **meta,
    )
    return out


# --- in a ComfyUI model (the text-to-image bench's --attention-experiment split-d) --------------

_OP: Any = None


def _register_op() -> Any:
    """``nexfort_bench::split_d_attention(q, k, v, config)`` as a custom op (Dynamo keeps it whole,
    CUDA graphs capture it: it does no host work), its fake the kernel's output layout."""
    global _OP
    if _OP is not None:
        return _OP

    @torch.library.custom_op("nexfort_bench::split_d_attention", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: list[int]) -> torch.Tensor:
        bm, bn, warps, stages, ws, exp_f16x2, lazy, tma = config
        return split_d_attention(q, k, v, config=(bm, bn, warps, stages, bool(ws)), exp_f16x2=bool(exp_f16x2),
                                 lazy_rescale=bool(lazy), tma=bool(tma))

    @op.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: list[int]) -> torch.Tensor:
        b, h, n, d = q.shape
        return q.new_empty((b, n, h, d)).transpose(1, 2)

    _OP = op
    return op


#: how many attention calls :func:`comfy_attention` sent to the op (Python calls: eager runs and traces)
routed = 0


#: a kernel variant: (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize, exp_f16x2, lazy_rescale, tma)
Variant = tuple[int, int, int, int, bool, bool, bool, bool]
DEFAULT_VARIANT: Variant = (128, 64, 8, 3, False, False, False, False)


def comfy_attention(original: Any, config: Variant, *, cpu: bool = False) -> Any:
    """ComfyUI's ``optimized_attention`` with unmasked 16-bit CUDA attention whose head dim is not a
    power of two (PixArt-α's 72) sent to the op; everything else (masks, attention patches, float32
    - the bench's float32 reference -, power-of-two heads, CPU) to ``original``. ``cpu``: CPU
    tensors in any of the kernel's dtypes go to the op too (the tests, under Triton's interpreter)."""
    op = _register_op()
    cfg = [int(c) for c in config]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: Any = None,
                  attn_precision: Any = None, skip_reshape: bool = False, skip_output_reshape: bool = False,
                  **kwargs: Any) -> torch.Tensor:
        global routed
        d = q.shape[-1] if skip_reshape else q.shape[-1] // heads
        takes = (q.is_cuda and q.dtype in _DTYPES) or (
            cpu and q.device.type == "cpu" and q.dtype in _DTYPES + (torch.float32,))
        if (mask is not None or (kwargs.get("transformer_options") or {}).get("patches_replace") or not takes
                or d & (d - 1) == 0 or d > 256):
            return original(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                            skip_output_reshape=skip_output_reshape, **kwargs)
        routed += 1
        b = q.shape[0]
        if not skip_reshape:
            q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
        out = op(q, k, v, cfg)
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(b, -1, heads * d)

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    return attention


def install_in_comfy(config: Variant = DEFAULT_VARIANT, *, cpu: bool = False) -> list[str]:
    """Point every loaded ``comfy.ldm`` module's ``optimized_attention`` (each imported the name
    from ``comfy.ldm.modules.attention``) at :func:`comfy_attention`; returns the modules changed
    (:func:`uninstall_from_comfy` puts ComfyUI's back). Call after ComfyUI is imported."""
    import importlib
    import sys

    attn = importlib.import_module("comfy.ldm.modules.attention")
    importlib.import_module("comfy.ldm.pixart.blocks")
    original = attn.optimized_attention
    patched = comfy_attention(original, config, cpu=cpu)
    changed = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("comfy.ldm") and getattr(mod, "optimized_attention", None) is original:
            mod.optimized_attention = patched
            changed.append(name)
    return changed


def uninstall_from_comfy() -> list[str]:
    """Undo :func:`install_in_comfy`; returns the modules changed back."""
    import sys

    changed = []
    for name, mod in list(sys.modules.items()):
        fn = getattr(mod, "optimized_attention", None) if name.startswith("comfy.ldm") else None
        if fn is not None and getattr(fn, "__wrapped__", None) is not None and fn.__name__ == "attention":
            mod.optimized_attention = fn.__wrapped__
            changed.append(name)
    return changed


def parse_config(text: str) -> Variant:
    """``BMxBNxWARPSxSTAGES`` plus any of ``xws``, ``xf16`` (float16 exponentials), ``xlazy``, ``xtma``
    (e.g. ``128x64x8x3``, ``128x128x8x2xwsxlazy``) -> a :data:`Variant`; :func:`format_config` is the
    inverse."""
    parts = text.split("x")
    flags = {"ws": False, "f16": False, "lazy": False, "tma": False}
    while parts and parts[-1] in flags:
        flags[parts.pop()] = True
    try:
        bm, bn, warps, stages = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"attention config {text!r}: valid: BMxBNxWARPSxSTAGES with optional xws, xf16, xlazy, "
                         "xtma, e.g. 128x64x8x3 or 128x128x8x2xlazyxtma") from None
    return bm, bn, warps, stages, flags["ws"], flags["f16"], flags["lazy"], flags["tma"]


def format_config(variant: Variant) -> str:
    bm, bn, warps, stages, ws, exp_f16x2, lazy, tma = variant
    return f"{bm}x{bn}x{warps}x{stages}" + "xws" * ws + "xf16" * exp_f16x2 + "xlazy" * lazy + "xtma" * tma


# --- the GPU benchmark ------------------------------------------------------------------------


def _rel(t: torch.Tensor, ref: torch.Tensor) -> float:
    return float((t.float() - ref).norm() / ref.norm())


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: tuple, **kw: Any) -> torch.Tensor:
    """``cfg``: a :data:`CONFIGS` entry (the launch configuration and ``tma``)."""
    bm, bn, warps, stages, ws, tma = cfg
    return split_d_attention(q, k, v, config=(bm, bn, warps, stages, ws), tma=tma, **kw)


def _shape_rows(name: str, configs: list[tuple[int, int, int, int, bool, bool]]) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d, dtype = SHAPES[name]
    q, k, v = (bnhd(b, h, n, d, dtype, seed) for seed in (1, 2, 3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4.0 * b * h * n * n * d
    row: dict[str, Any] = {"shape": [b, h, n, d, str(dtype)], "split": list(split_dims(d)), "torch": {}, "triton": []}
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v)
                ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v))
            row["torch"][label] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": _rel(out, ref)}
        except Exception as exc:  # a backend that does not take this shape
            row["torch"][label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    for cfg in configs:
        entry: dict[str, Any] = {"config": list(cfg)}
        try:
            t0 = time.perf_counter()
            out = _run(q, k, v, cfg)
            torch.cuda.synchronize()
            entry["first_call_s"] = time.perf_counter() - t0
            ms = time_ms(lambda cfg=cfg: _run(q, k, v, cfg))
            entry.update(ms=ms, tflops=flops / ms / 1e9, rel_err=_rel(out, ref))
        except Exception as exc:  # a configuration this Triton cannot build (registers, shared memory)
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["triton"].append(entry)
    timed = [e for e in row["triton"] if "ms" in e]
    if not timed:
        return row
    best = min(timed, key=lambda e: e["ms"])
    cfg = tuple(best["config"])
    row["best"] = best
    # the best configuration again with each cheaper softmax, and both
    variants: dict[str, tuple[bool, bool]] = {"best": (False, False)}
    for key, (f16, lazy) in (("best_exp_f16x2", (True, False)), ("best_lazy_rescale", (False, True)),
                             ("best_both", (True, True))):
        variants[key] = (f16, lazy)
        try:
            out = _run(q, k, v, cfg, exp_f16x2=f16, lazy_rescale=lazy)
            ms = time_ms(lambda f16=f16, lazy=lazy: _run(q, k, v, cfg, exp_f16x2=f16, lazy_rescale=lazy))
            row[key] = {"config": list(cfg), "ms": ms, "tflops": flops / ms / 1e9, "rel_err": _rel(out, ref)}
        except Exception as exc:
            row[key] = {"config": list(cfg), "error": f"{type(exc).__name__}: {exc}"[:300]}
    cudnn = row["torch"].get("cudnn", {})
    if "ms" in cudnn:
        row["best_vs_cudnn"] = cudnn["ms"] / best["ms"]
        row["best_err_vs_cudnn_err"] = best["rel_err"] / cudnn["rel_err"]
    # what the whole-model row runs: the fastest variant within the lossless bound (1.5x cuDNN's error)
    bound = 1.5 * cudnn["rel_err"] if "rel_err" in cudnn else float("inf")
    ok = [(row[key]["ms"], key) for key in variants if "ms" in row.get(key, {}) and row[key]["rel_err"] <= bound]
    if ok:
        f16, lazy = variants[min(ok)[1]]
        bm, bn, warps, stages, ws, tma = cfg
        row["pick"] = format_config((bm, bn, warps, stages, ws, f16, lazy, tma))
        if "ms" in cudnn:
            row["pick_vs_cudnn"] = cudnn["ms"] / min(ok)[0]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--quick", action="store_true", help="PixArt's shape with every configuration, the others "
                    "with PixArt's best four")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("split_d_attention: needs a CUDA GPU")
    import triton

    result: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__,
                              "device": torch.cuda.get_device_name(), "shapes": {}}
    configs = CONFIGS
    for name in args.shapes:
        row = _shape_rows(name, configs)
        result["shapes"][name] = row
        if args.quick and name == "pixart_self":
            timed = sorted((e for e in row["triton"] if "ms" in e), key=lambda e: e["ms"])
            configs = [tuple(e["config"]) for e in timed[:4]] or CONFIGS[:4]
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
        print(name, json.dumps({k: row.get(k) for k in ("best", "best_vs_cudnn", "best_err_vs_cudnn_err", "pick",
                                                          "pick_vs_cudnn")}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
