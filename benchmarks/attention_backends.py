"""Time each SDPA backend at the attention shapes our benchmark models run (one process, GPU).

    python benchmarks/attention_backends.py [--output-json out.json]

For each (model, shape, dtype): milliseconds per call of ``scaled_dot_product_attention`` pinned to
one backend with ``torch.nn.attention.sdpa_kernel`` (flash, memory-efficient, cuDNN), plus the
default choice, and the max abs difference of each against the math backend in fp32. A backend
that refuses the shape is recorded as unsupported. Decides which backend ``attention`` picks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import metrics  # noqa: E402

#: model -> (batch, heads, query length, key length, head dim, dtype): the largest self-attention
#: of each model at its benchmark size (batch 2 = cond + uncond)
SHAPES: dict[str, tuple[int, int, int, int, int, torch.dtype]] = {
    "sd21_768": (2, 5, 9216, 9216, 64, torch.float16),
    "sdxl_1024": (2, 10, 4096, 4096, 64, torch.float16),
    "pixart_1024": (2, 16, 4096, 4096, 72, torch.float16),
    "pixart_cross": (2, 16, 4096, 120, 72, torch.float16),
    "flux_1024": (1, 24, 4608, 4608, 128, torch.bfloat16),
    "wan_480p": (2, 12, 14040, 14040, 128, torch.float16),
}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def measure(name: str, pad_to: int | None = None) -> dict:
    """One shape through every backend; with ``pad_to`` the head dimension is zero-padded to that
    width (queries, keys and values; the softmax scale stays the unpadded one, so the result is
    the same attention: zero columns add nothing to q·k, and the padded value columns come out
    zero and are sliced off before the error is taken)."""
    b, h, lq, lk, d, dtype = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, lq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, h, lk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, h, lk, d, device="cuda", dtype=dtype, generator=gen)
    ref = F.scaled_dot_product_attention(q.float()[:1, :2], k.float()[:1, :2], v.float()[:1, :2])
    flops = 4 * b * h * lq * lk * d
    row: dict = {"shape": [b, h, lq, lk, d], "dtype": str(dtype).replace("torch.", "")}
    scale = None
    if pad_to is not None and pad_to > d:
        scale = d**-0.5
        q, k, v = (F.pad(t, (0, pad_to - d)) for t in (q, k, v))
        row["padded_to"] = pad_to
    for label, backend in [("default", None), *BACKENDS.items()]:
        try:
            if backend is None:
                def call():
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
            else:
                def call(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, scale=scale)
            out = call()[..., :d]
            ms = 1000.0 * metrics.time_op(call, q.device, iters=20)
            err = float((out[:1, :2].float() - ref).abs().max())
            row[label] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "max_err_vs_fp32": err}
        except Exception as e:  # noqa: BLE001 - an unsupported shape is a result
            row[label] = {"unsupported": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--pad-to", nargs="*", type=int, default=[],
                   help="also time each model's shape with the head dim zero-padded to these widths")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("attention_backends needs a CUDA device\n")
        return 2
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "rows": {name: measure(name) for name in a.models},
    }
    for width in a.pad_to:
        for name in a.models:
            if SHAPES[name][4] < width:
                result["rows"][f"{name}@pad{width}"] = measure(name, width)
    text = json.dumps(result, indent=1)
    sys.stdout.write(text + "\n")
    if a.output_json:
        a.output_json.parent.mkdir(parents=True, exist_ok=True)
        a.output_json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
