"""torch's AOTAutograd cache and linspace-specialised graphs: plain torch.compile(dynamic=True) on the
tiny Qwen-Image's process_img at 8x8, 8x12, 12x8 (max abs error of the position ids vs eager)."""
import json
import os
import sys

import torch

sys.path[:0] = ["tests", "."]
import tiny_models as tm  # noqa: E402

tm.boot()
dev = sys.argv[1]
mp = tm.tiny_qwen_image(seed=21)
dm = mp.model.diffusion_model.to(dev)
def f(x):
    return dm.process_img(x)[1]
c = torch.compile(f, backend="inductor", dynamic=True)
errs = {}
for (h, w) in [(8, 8), (8, 12), (12, 8)]:
    x = torch.randn(1, 16, 1, h, w, device=dev)
    errs[f"{h}x{w}"] = (c(x) - f(x)).abs().max().item()
print(json.dumps({"device": dev, "torch": torch.__version__, "autograd_cache": os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE", "default"), "max_abs_err": errs}))
