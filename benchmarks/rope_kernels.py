"""Microbenchmark: Flux's query/key RMSNorm + rotary embedding, Inductor's kernels vs ``nexfort::rms_norm_rope``.

For Flux's two attention input paths at 1024² (4096 image + 512 text tokens, 24 heads of 128)
this times

* ``eager``: ComfyUI's ops (``QKNorm`` = ``torch.rms_norm`` per head, ``flux.math.apply_rope1``);
* ``inductor``: the same function compiled by Inductor under dynamic shape the way nexfort
  compiles it (:func:`nexfort_engine.reductions.persistent_rows`), what the graphs ran until now;
* ``triton BLOCK_RxWARPS``: :func:`nexfort_engine.rope.triton_rms_norm_rope` for several
  launch configurations (``default`` = :data:`nexfort_engine.rope.DEFAULT_CONFIG`);

and, with ``--sdpa``, each followed by the attention it feeds (cuDNN), since Inductor's kernels
write the layout that attention reads. Each kernel's output is compared with Inductor's (largest
absolute difference, fraction of differing values). GB/s counts q and k read once and written
once, plus the rotation matrices once. The single block's q/k are views of ``linear1``'s output
(row stride 21504); the double block concatenates the text and image streams (the image's
``v`` concatenation is left to ``torch.cat`` in the fused variant and timed in both).

    python3 benchmarks/rope_kernels.py --output-json out.json --code-dir out/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402
from nexfort_engine.reductions import DEFAULT_LIMIT, persistent_rows  # noqa: E402
from nexfort_engine.rope import DEFAULT_CONFIG, torch_apply_rope, triton_rms_norm_rope  # noqa: E402

#: time each call eagerly (the host's launches included: kernels under ~50 us measure the host;
#: the default replays the calls from a CUDA graph, metrics.time_graph)
EAGER_TIMING = False

HEADS, D, IMG, TXT, EPS = 24, 128, 4096, 512, 1e-6
CONFIGS = [(8, 2), (16, 4), (32, 2), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8), (256, 16), (512, 16)]


def _heads(qkv: torch.Tensor) -> torch.Tensor:
    """q, k, v as strided ``[B, H, L, D]`` views of a fused projection's ``[B, L, 3 * H * D]`` output
    (as ComfyUI's Flux blocks take them)."""
    return qkv.view(qkv.shape[0], qkv.shape[1], 3, HEADS, -1).permute(2, 0, 3, 1, 4)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), w, EPS)


def single_eager(lin1: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
    qkv, _mlp = torch.split(lin1, [3 * HEADS * D, lin1.shape[-1] - 3 * HEADS * D], dim=-1)
    q, k, v = _heads(qkv)
    return torch_apply_rope(_rms(q, wq), pe), torch_apply_rope(_rms(k, wk), pe), v


def single_fused(lin1: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, pe: torch.Tensor,
                 config: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
    qkv = lin1[..., : 3 * HEADS * D]
    q, k, v = _heads(qkv)
    return triton_rms_norm_rope([q], [wq], pe, EPS, config), triton_rms_norm_rope([k], [wk], pe, EPS, config), v


def double_eager(img_qkv: torch.Tensor, txt_qkv: torch.Tensor, w: list[torch.Tensor], pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
    iq, ik, iv = _heads(img_qkv)
    tq, tk, tv = _heads(txt_qkv)
    q = torch.cat((_rms(tq, w[2]), _rms(iq, w[0])), dim=2)
    k = torch.cat((_rms(tk, w[3]), _rms(ik, w[1])), dim=2)
    return torch_apply_rope(q, pe), torch_apply_rope(k, pe), torch.cat((tv, iv), dim=2)


def double_fused(img_qkv: torch.Tensor, txt_qkv: torch.Tensor, w: list[torch.Tensor], pe: torch.Tensor,
                 config: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
    iq, ik, iv = _heads(img_qkv)
    tq, tk, tv = _heads(txt_qkv)
    q = triton_rms_norm_rope([tq, iq], [w[2], w[0]], pe, EPS, config)
    k = triton_rms_norm_rope([tk, ik], [w[3], w[1]], pe, EPS, config)
    return q, k, torch.cat((tv, iv), dim=2)


def _with_sdpa(fn: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., torch.Tensor]:
    def f(*args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v = fn(*args, **kwargs)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return f


def _inductor(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with persistent_rows(DEFAULT_LIMIT):
            return compile_fx(gm, example_inputs)

    return torch.compile(fn, backend=backend, dynamic=True)


def _compare(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> dict[str, float]:
    diffs = [(a.float() - b.float()).abs() for a, b in zip(out[:2], ref[:2], strict=True)]
    return {
        "max_abs_vs_inductor": round(max(float(d.max()) for d in diffs), 5),
        "differing_vs_inductor": round(sum(float((d > 0).float().mean()) for d in diffs) / 2, 5),
    }


def _qk_views(case: str, args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The strided q and k views the kernels read (the image stream's, in the double case)."""
    qkv = args[0][..., : 3 * HEADS * D] if case == "single" else args[0]
    q, k, _ = _heads(qkv)
    return q, k


def measure(case: str, iters: int, sdpa: bool, code_dir: Path | None, sweep: bool = True) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    length = IMG + TXT
    angle = torch.randn(1, 1, length, D // 2, device="cuda", generator=gen) * 3
    pe = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], -1).reshape(1, 1, length, D // 2, 2, 2)
    ws = [torch.rand(D, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5 for _ in range(4)]
    if case == "single":
        lin1 = torch.randn(1, length, 3 * HEADS * D + 4 * HEADS * D, device="cuda", dtype=torch.bfloat16, generator=gen)
        args: tuple[Any, ...] = (lin1, ws[0], ws[1], pe)
        eager, fused = single_eager, single_fused
    else:
        img = torch.randn(1, IMG, 3 * HEADS * D, device="cuda", dtype=torch.bfloat16, generator=gen)
        txt = torch.randn(1, TXT, 3 * HEADS * D, device="cuda", dtype=torch.bfloat16, generator=gen)
        args = (img, txt, ws, pe)
        eager, fused = double_eager, double_fused
    qk = 2 * HEADS * length * D * 2
    traffic = 2 * qk + pe.numel() * 4
    row: dict[str, Any] = {"case": case, "tokens": length, "traffic_MB": round(traffic / 1e6, 1)}

    def record(label: str, fn: Callable[[], Any]) -> Any:
        out = fn()
        seconds = metrics.time_op(fn, pe.device, iters, blocks=3, warmup=5) if EAGER_TIMING else metrics.time_graph(fn, iters)
        row[label] = {"us": round(seconds * 1e6, 2), "GB/s": round(traffic / seconds / 1e9, 1)}
        return out

    record("eager", lambda: eager(*args))
    # the floor for any kernel here: q and k copied from their strided views into [B, H, L, D]
    views = _qk_views(case, args)
    record("copy q,k (no math)", lambda: (views[0].contiguous(), views[1].contiguous()))
    torch._dynamo.reset()
    compiled = _inductor(eager)
    if code_dir is not None:
        from torch._inductor.utils import run_and_get_code

        _, codes = run_and_get_code(compiled, *args)
        code_dir.mkdir(parents=True, exist_ok=True)
        (code_dir / f"rope_inductor_{case}.py").write_text("\n\n# ----\n\n".join(codes))
    ref = record("inductor", lambda: compiled(*args))
    for config in [None, *(CONFIGS if sweep else [])]:
        label = "triton " + ("x".join(map(str, config)) if config else "default " + "x".join(map(str, DEFAULT_CONFIG)))
        out = record(label, lambda config=config: fused(*args, config=config))
        row[label].update(_compare(out, ref))
    if sdpa:
        torch._dynamo.reset()
        compiled_attn = _inductor(_with_sdpa(eager))
        record("inductor + sdpa", lambda: compiled_attn(*args))
        attn = _with_sdpa(fused)
        record("triton default + sdpa", lambda: attn(*args))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sdpa", action="store_true", help="also time each variant followed by attention")
    p.add_argument("--eager-timing", action="store_true", help="time eager calls (runs before 92 did)")
    p.add_argument("--output-json", type=Path)
    p.add_argument("--code-dir", type=Path, help="write Inductor's generated code here")
    p.add_argument("--no-sweep", action="store_true", help="only the default launch configuration")
    a = p.parse_args(argv)
    global EAGER_TIMING
    EAGER_TIMING = a.eager_timing
    if not torch.cuda.is_available():
        sys.stderr.write("rope_kernels needs a CUDA device\n")
        return 2
    metrics.run_kernel_cases(("single", "double"),
                             lambda case: measure(case, a.iters, a.sdpa, a.code_dir, sweep=not a.no_sweep), a.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
