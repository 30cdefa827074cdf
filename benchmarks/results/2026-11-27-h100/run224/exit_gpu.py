"""Seconds from a background child's report to its exit, on the GPU: the old exit (sys.exit) vs exit_now."""
import json
import sys
import tempfile
import time

import torch

from nexfort_engine import background
from nexfort_engine import compile as nxc

OLD = "import sys; from nexfort_engine.background import child_main; sys.exit(child_main(sys.argv[1]))"
which = sys.argv[1]
if which == "old":
    background._CHILD = OLD
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Conv2d(64, 64, 3, padding=1) for _ in range(6)]).cuda().half().eval()
d = tempfile.mkdtemp()
cm = nxc(m, {"mode": "O2", "background": True, "static_first": False}, cache_dir=d)
x = torch.randn(1, 64, 128, 128, device="cuda", dtype=torch.half)
with torch.inference_mode():
    t_start = time.monotonic()
    cm(x)
    job = cm._nx_job
    res = job.path / background.RESULT_FILE
    while not res.exists():
        time.sleep(0.01)
    t_res = time.monotonic()
    while job.proc.poll() is None:
        time.sleep(0.01)
    t_exit = time.monotonic()
    print(json.dumps({"which": which, "report_s": round(t_res - t_start, 2), "exit_after_report_s": round(t_exit - t_res, 3),
                      "result": json.loads(res.read_text())}))
