"""Host (CPU) time per call of what a host call runs eagerly between CUDA-graph pieces: SDPA under
ComfyUI's backend orders, at the shapes of SDXL's cross-attention (an IPAdapter-like patch makes two
per layer), and ``nexfort::host_call``'s own dispatch. GPU only.

Host time: N calls queued back to back without a sync (the GPU keeps up: these kernels are short),
best of 5; GPU time: CUDA events around the same N calls. Prints one JSON object.

    python -m benchmarks.host_costs [--calls 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: how ComfyUI calls SDPA: on Linux 0.3.75 with no context (``None``: torch's default order; it
#: sets its order on Windows only, comfy/ops.py, cuDNN inserted first), and inside
#: ``sdpa_kernel(order, set_priority=True)`` as its wrapper does there, cuDNN-, flash- and
#: efficient-first
ORDERS: dict[str, list[SDPBackend] | None] = {
    "default_no_context": None,
    "cudnn_first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash_first": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "efficient_first": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
}

#: (name, batch, heads, query tokens, key tokens, head dim): SDXL 1024² with CFG (batch 2), its two
#: attention levels, the prompt's 77 keys and 16 extra (image-prompt) keys
SHAPES = [("l1_text", 2, 10, 4096, 77, 64), ("l1_ip16", 2, 10, 4096, 16, 64),
          ("l2_text", 2, 20, 1024, 77, 64), ("l2_ip16", 2, 20, 1024, 16, 64)]


def host_and_gpu_us(fn: Callable[[], Any], calls: int) -> dict[str, float]:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return {"host_us": round(1e6 * min(host) / calls, 2), "gpu_us": round(1e3 * start.elapsed_time(end) / calls, 2)}


def sdpa_rows(calls: int) -> list[dict[str, Any]]:
    rows = []
    for name, b, h, n, m, d in SHAPES:
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, h, m, d, device="cuda", dtype=torch.float16)
        v = torch.randn(b, h, m, d, device="cuda", dtype=torch.float16)
        for order_name, order in ORDERS.items():
            def fn(order: list | None = order, q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> Any:
                with sdpa_kernel(order, set_priority=True) if order is not None else contextlib.nullcontext():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v)

            try:
                row: dict[str, Any] = host_and_gpu_us(fn, calls)
            except RuntimeError as e:
                rows.append({"shape": name, "order": order_name, "error": str(e)[:200]})
                continue
            # the backend the order picks: the kernel names the profiler sees
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            row["kernels"] = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            rows.append({"shape": name, "order": order_name, **row})
    return rows


def host_call_rows(calls: int) -> list[dict[str, Any]]:
    from nexfort_engine import host_call

    host_call.register("bench.add", lambda t, i, s: t[0] + 1)
    x = torch.randn(2, 4096, 640, device="cuda", dtype=torch.float16)
    ints: list[Any] = []
    text = host_call.spec("attn2", {"block": ("input", 4), "block_index": 0, "transformer_index": 1,
                                    "original_shape": [2, 4, 128, 128], "n_heads": 10, "dim_head": 64}, ints)
    # the same body as a torch.library.custom_op (how nexfort::host_call was registered until the
    # fifty-first session): its autograd wrapper, redispatch and aliasing check in Python
    @torch.library.custom_op("nexfort_bench::host_call_custom_op", mutates_args=())
    def as_custom_op(tensors: list[torch.Tensor], resolver: str, ints: list[int], spec: str) -> torch.Tensor:
        return host_call.run(tensors, resolver, ints, spec)

    rows = []
    with torch.inference_mode():
        rows.append({"what": "x + 1 (eager)", **host_and_gpu_us(lambda: x + 1, calls)})
        rows.append({"what": "host_call(x + 1)", **host_and_gpu_us(lambda: host_call.call([x], "bench.add", ints, text), calls)})
        rows.append({"what": "the same as a custom_op",
                     **host_and_gpu_us(lambda: as_custom_op([x], "bench.add", ints, text), calls)})
        rows.append({"what": "host_call.decode", **host_and_gpu_us(lambda: host_call.decode(text, ints), calls)})
        sig = torch.tensor([14.6, 0.0], device="cuda")
        rows.append({"what": "host_copied(sigmas)", **host_and_gpu_us(lambda: host_call.host_copied(sig), calls)})
        wrapped = host_call.host_copied(sig)
        rows.append({"what": "HostCopied .detach().cpu()[0].item()",
                     **host_and_gpu_us(lambda: wrapped.detach().cpu()[0].item(), calls)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "cudnn": torch.backends.cudnn.version(), "sdpa": sdpa_rows(args.calls),
           "host_call": host_call_rows(args.calls)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
