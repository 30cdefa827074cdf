"""Kernels a cold compile asked Triton for, against those it cached (duplicates across parts)."""
import hashlib
import re
import sys
from pathlib import Path

root = Path(sys.argv[1])
pat = re.compile(r"async_compile\.triton\('([^']+)', '''(.*?)'''", re.S)
total, srcs, files = 0, {}, 0
for p in root.rglob("*.py"):
    try:
        t = p.read_text(errors="ignore")
    except OSError:
        continue
    if "async_compile.triton(" not in t:
        continue
    files += 1
    for name, src in pat.findall(t):
        total += 1
        srcs.setdefault(hashlib.sha1(src.encode()).hexdigest(), name)
cubins = list(root.rglob("*.cubin"))
kinds = {}
for n in srcs.values():
    k = n.split("_")[1] if "_" in n else n
    kinds[k] = kinds.get(k, 0) + 1
print(f"kprobe {root.name}: output-code files {files}, triton kernels requested {total}, distinct sources {len(srcs)}, cubins {len(cubins)}, kinds {kinds}")
