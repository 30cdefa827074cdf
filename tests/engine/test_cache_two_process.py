"""Two real processes share one cache dir (real Inductor): the second is served from the cache.

The child compiles a small conv+attention module with ``mode: O1`` into ``--dir`` and prints
``nexfort_engine.stats()`` as JSON. No ComfyUI: a plain torch module keeps each child cheap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from nexfort_engine.cache import CacheStore

pytestmark = pytest.mark.inductor

CHILD = textwrap.dedent('''
    import json, sys
    import torch
    import nexfort_engine

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 16, 3, padding=1)
            self.norm = torch.nn.GroupNorm(4, 16)
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = torch.nn.functional.silu(self.norm(self.conv(x)))
            t = h.flatten(2).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(t, t, t)
            return self.proj(a).transpose(1, 2).reshape(h.shape)

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    net = Net().eval()
    cm = nexfort_engine.compile(net, {"mode": "O1"}, cache_dir=sys.argv[1], label="net")
    for shape in [(1, 4, 8, 8), (2, 4, 8, 12)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(cm(x), net(x), rtol=1e-3, atol=1e-3)
    s = nexfort_engine.stats()
    s["entry"] = cm.cache_entry.key
    print("STATS " + json.dumps(s))
''')


def _start(script, cache_dir, tmp_path, name):
    env_dir = tmp_path / f"inductor-default-{name}"  # nothing may come from Inductor's default cache
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(env_dir), "NEXFORT_CACHE_DIR": ""}
    return subprocess.Popen([sys.executable, str(script), str(cache_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    [line] = [ln for ln in out.splitlines() if ln.startswith("STATS ")]
    return json.loads(line[len("STATS "):])


@pytest.fixture
def child(tmp_path):
    p = tmp_path / "child.py"
    p.write_text(CHILD)
    return p


def _valid(cache_dir, key) -> bool:
    e = CacheStore(cache_dir).entry(key)
    with e.lock():
        return e.verify() == "hit"


def test_second_process_hits(child, tmp_path):
    cache = tmp_path / "shared"
    first = _finish(_start(child, cache, tmp_path, "a"))
    assert first["cache_misses"] > 0 and first["fallbacks"] == 0 and first["compiles"] >= 1
    assert _valid(cache, first["entry"])
    second = _finish(_start(child, cache, tmp_path, "b"))
    assert second["entry"] == first["entry"]
    assert second["cache_hits"] > 0 and second["cache_misses"] == 0, second
    # the first run's graphs (batch 1 -> 2 recompiles with Inductor: see test_compile_inductor) are
    # loaded, not traced again (nexfort_engine/precompile.py)
    assert second["compiles"] == 0 and second["cache_hits"] == first["compiles"], second
    assert second["corrupt_entries"] == 0


def test_two_processes_compile_into_one_empty_dir_at_once(child, tmp_path):
    cache = tmp_path / "race"
    a = _start(child, cache, tmp_path, "a")
    b = _start(child, cache, tmp_path, "b")
    sa, sb = _finish(a), _finish(b)
    assert sa["entry"] == sb["entry"] and sa["fallbacks"] == sb["fallbacks"] == 0
    assert sa["corrupt_entries"] == sb["corrupt_entries"] == 0
    assert _valid(cache, sa["entry"])
    third = _finish(_start(child, cache, tmp_path, "c"))
    assert third["cache_hits"] > 0 and third["cache_misses"] == 0, third
