"""Per-thread CPU over an interval: python3 threads.py PID SECONDS"""

import os
import sys
import time

pid, dt = int(sys.argv[1]), float(sys.argv[2])


def snap():
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{t}/stat").read()
            comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            f = st.rsplit(")", 1)[1].split()
            out[int(t)] = (comm, int(f[11]) + int(f[12]), f[0])
        except OSError:
            pass
    return out


a = snap()
time.sleep(dt)
b = snap()
hz = os.sysconf("SC_CLK_TCK")
rows = sorted(((b[t][1] - a[t][1]) / hz / dt * 100, t, b[t][0], b[t][2]) for t in b if t in a)
print(f"pid {pid}: {len(b)} threads, total {sum(r[0] for r in rows):.0f}%")
for r in rows[::-1][:20]:
    print(f"  tid {r[1]} {r[2]!r} state {r[3]} cpu {r[0]:.0f}%")
