"""Probe (CPU, not in the engine): a guard-free ahead-of-time artifact of a ComfyUI UNet, the
lever the sixteenth session left for the UNets' warm start (BENCHMARKS.md).

``save``: Dynamo traces the tiny SD1.5 UNet (``tests/tiny_models.py``, ComfyUI's own classes)
through ``aot_compile`` with every guard filtered out, checks it against eager, and saves it.
``load`` (a new process): loads the artifact, calls it at the traced shape and at another shape,
and prints the times and errors. torch 2.14 has ``torch.compile(...).aot_compile``; torch 2.11
(the device's) has ``torch._dynamo.aot_compile.aot_compile_fullgraph`` under it.

    python3 benchmarks/aot_warm_start_probe.py save /tmp/aot && python3 benchmarks/aot_warm_start_probe.py load /tmp/aot
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv: list[str]) -> int:
    mode, work = argv[0], Path(argv[1])
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    import tiny_models

    tiny_models.boot()
    import torch

    torch._dynamo.config.specialize_float = True  # aot_compile cannot restart a trace (float tensorification)
    unet = tiny_models.tiny_sd15().model.diffusion_model.eval()
    x, t, ctx = torch.randn(2, 4, 16, 16), torch.rand(2) * 999, torch.randn(2, 77, 64)
    artifact = work / "unet.aot"
    out: dict = {"torch": torch.__version__}
    with torch.no_grad():
        ref = unet(x, t, context=ctx)
        if mode == "save":
            compiled = torch.compile(type(unet).forward, fullgraph=True, dynamic=True, backend="inductor",
                                     options={"guard_filter_fn": lambda entries: [False for _ in entries]})
            t0 = time.perf_counter()
            fn = compiled.aot_compile(((unet, x, t), {"context": ctx}))
            out["compile_s"] = round(time.perf_counter() - t0, 2)
            out["err"] = float((fn(unet, x, t, context=ctx) - ref).abs().max())
            fn.save_compiled_function(str(artifact))
            out["bytes"] = artifact.stat().st_size
        else:
            t0 = time.perf_counter()
            with open(artifact, "rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            out["load_s"] = round(time.perf_counter() - t0, 2)
            y = fn(unet, x, t, context=ctx)
            out["first_call_s"] = round(time.perf_counter() - t0, 2)
            out["err"] = float((y - ref).abs().max())
            x2 = torch.randn(1, 4, 24, 16)  # not square: the trace gave H and W one symbol
            try:
                out["other_shape_err"] = float((fn(unet, x2, t[:1], context=ctx[:1])
                                                - unet(x2, t[:1], context=ctx[:1])).abs().max())
            except AssertionError as e:
                out["other_shape"] = f"AssertionError: {str(e).splitlines()[0][:200]}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
