import collections
import sys


def load(p):
    inner = collections.Counter()
    tot = 0
    for line in open(p):
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n)
        fr = stack.split(";")
        if not any("Runner.run" in f for f in fr):
            continue
        tot += n
        py = [f for f in fr if ".py:" in f]
        nat = fr[fr.index(py[-1]) + 1 :] if py else fr
        key = (py[-1].split(" (")[0] if py else "-") + " | " + (nat[-1].split(" (")[0][:60] if nat else "")
        inner[key] += n
    return tot, inner


for p in sys.argv[1:]:
    tot, inner = load(p)
    print(p.split("/")[-1], "samples in sampling", tot)
    for k, v in inner.most_common(18):
        print(f"{v:5d} {100 * v / tot:5.1f}% {k[:170]}")
