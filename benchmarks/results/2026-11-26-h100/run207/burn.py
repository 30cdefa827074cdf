"""Load beside a sampling process: `cpu N [first_core]` N niced busy loops (pinned to cores
first_core.. when given), `gpu` one niced process keeping the GPU about half busy."""

import multiprocessing as mp
import os
import sys
import time


def cpu(core):
    os.nice(10)
    if core is not None:
        os.sched_setaffinity(0, {core})
    x = 0
    while True:
        x += 1


def gpu():
    os.nice(10)
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
    while True:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()
        time.sleep(0.002)


if __name__ == "__main__":
    if sys.argv[1] == "cpu":
        n = int(sys.argv[2])
        first = int(sys.argv[3]) if len(sys.argv) > 3 else None
        ps = [mp.Process(target=cpu, args=(None if first is None else first + i,)) for i in range(n)]
    else:
        ps = [mp.Process(target=gpu)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
