"""``"background": true``: a cold compile in a child process while calls run eager (background.py).

What travels to the child (values of small tensors, metadata of large ones, stand-ins for local
functions), the reasons a call compiles in the foreground instead, a child that dies, a child
cancelled with its module, and - with real Inductor compiles in the child - the hand-over: the
parent runs the graphs the child committed without compiling anything, for a plain module and
for ComfyUI's UNet driven by ComfyUI's sampler through the node layer.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time
import types
from pathlib import Path

import procs
import pytest
import torch

import nexfort_engine
from nexfort_engine import background
from nexfort_engine.options import OptionsError, parse_options

#: a child compiling on this 2-core machine: Python and torch start, then Inductor
CHILD_TIMEOUT_S = 600


class Net(torch.nn.Module):
    """A 2 MiB weight (travels as metadata) and a small one (travels with its values)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(512, 1024)
        self.b = torch.nn.Linear(1024, 16)
        self.register_buffer("scale", torch.full((16,), 2.0))

    def forward(self, x: torch.Tensor, opts: dict | None = None) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x))) * self.scale


_LAMBDA = lambda x: x  # noqa: E731 - a module-level lambda: pickle cannot send it by name


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval().requires_grad_(False)


def _record(stats) -> dict:
    models = stats()["models"]
    assert len(models) == 1, models
    return next(iter(models.values()))


def _wait_done(cm: nexfort_engine.CompiledModule) -> float:
    """Wait for the child's exit; the seconds from its report to its exit (from the exit of one
    that died without a report: 0)."""
    job = cm._nx_job
    assert job is not None
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not (job.path / background.RESULT_FILE).exists() and not job.done():
        assert time.monotonic() < deadline, f"child still running; log: {job.path / background.LOG_FILE}"
        time.sleep(0.05)
    reported = time.monotonic()
    while not job.done():
        assert time.monotonic() < deadline, f"child still exiting; log: {job.path / background.LOG_FILE}"
        time.sleep(0.02)
    return time.monotonic() - reported


# -- what travels ---------------------------------------------------------------------------------


def test_tensors_travel_as_values_or_metadata():
    net = _net()
    with torch.inference_mode():
        inf = torch.arange(6.0).reshape(2, 3)
    big_t = torch.randn(64, 8192).t()  # 2 MiB, transposed strides
    outer = 3

    def local_fn(x):  # a closure: what ComfyUI's wrappers are
        return x + outer

    setattr(local_fn, background.CARRIED, True)  # carried by the inputs, not called by the model
    setattr(_LAMBDA, background.CARRIED, True)

    class Skipped:
        pass

    obj = {"net": net, "inf": inf, "big_t": big_t, "fn": local_fn, "skip": Skipped(), "lam": _LAMBDA}
    back = pickle.loads(background.dumps(obj, skip=(Skipped,)))

    a, b = back["net"].a.weight, back["net"].b.weight
    assert type(a) is torch.nn.Parameter and not a.requires_grad
    assert a.shape == net.a.weight.shape and a.dtype == net.a.weight.dtype
    assert torch.count_nonzero(a) == 0  # > COPY_BYTES: metadata only, zero-filled
    assert torch.equal(b, net.b.weight)  # small: its values
    assert torch.equal(back["net"].scale, net.scale)
    assert back["inf"].is_inference() and torch.equal(back["inf"], inf)
    assert back["big_t"].stride() == big_t.stride() and back["big_t"].shape == big_t.shape
    assert back["skip"] is None
    fn = back["fn"]  # same name and code (what saved guards compare), no closure values
    assert fn.__qualname__ == local_fn.__qualname__ and fn.__code__.co_code == local_fn.__code__.co_code
    with pytest.raises(NameError):
        fn(1)
    assert back["lam"].__qualname__ == "<lambda>" and back["lam"].__code__.co_code == _LAMBDA.__code__.co_code


def test_a_patch_closure_among_the_inputs_does_not_travel():
    """A function the model calls (a patch another node put among the options) would be traced by
    the child without its closure values: the job is refused, naming it, and the compile stays in
    the caller's process."""
    sigma_end = 0.35

    def input_block_patch(h, options):
        return h if options["sigma"] < sigma_end else h * 2

    with pytest.raises(background.Unavailable, match="input_block_patch.*without its closure values"):
        background.dumps({"transformer_options": {"patches": {"input_block_patch": [input_block_patch]}}})
    with pytest.raises(background.Unavailable, match="<lambda>"):
        background.dumps({"f": lambda h: h * sigma_end})


def test_what_cannot_travel_is_named():
    with pytest.raises(background.Unavailable, match="lock"):
        background.dumps({"x": threading.Lock()})
    with pytest.raises(background.Unavailable, match="meta"):
        background.dumps(torch.empty(3, device="meta"))


def test_block_hook_travels():
    """The node layer's block hook is an engine class: the child rebuilds it without the pack."""
    from nexfort_engine.regions import DropKeys

    hook = pickle.loads(background.dumps(DropKeys("transformer_options", ("block", "block_index"), ("patches",))))
    to = {"block": ("input", 4), "block_index": 0, "cond_or_uncond": [0]}
    args, kwargs = hook((1,), {"transformer_options": to, "x": 2})
    assert args == (1,) and kwargs == {"transformer_options": {"cond_or_uncond": [0]}, "x": 2}
    assert to["block_index"] == 0  # the caller's dict is left as it was
    patched = {**to, "patches": {"attn1_patch": [print]}}
    assert hook((), {"transformer_options": patched})[1]["transformer_options"] is patched


def test_device_memory_for_the_childs_weights_is_checked():
    """The child allocates a copy of the weights: where the device has no room for it, the call
    compiles in the foreground (a child taking the memory the sampling needs would fail the run)."""
    net = _net()
    cpu, cuda0 = torch.device("cpu"), torch.device("cuda", 0)
    weights = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()])
    assert background.weight_bytes(net, cpu) == weights and background.weight_bytes(net, cuda0) == 0
    need = weights + background.CHILD_OVERHEAD_BYTES

    def free(n: int):
        return lambda _device: (n, 80 << 30)

    assert background.memory_shortfall(net, cpu, free(0)) is None  # host memory is not checked
    # the same tensors as seen on cuda:0 (this machine has no GPU)
    on_cuda = types.SimpleNamespace(
        parameters=lambda: [types.SimpleNamespace(device=cuda0, numel=t.numel, element_size=t.element_size)
                            for t in [*net.parameters(), *net.buffers()]],
        buffers=lambda: [])
    assert background.memory_shortfall(on_cuda, cuda0, free(need)) is None
    why = background.memory_shortfall(on_cuda, cuda0, free(need - 1))
    assert why is not None and "GiB free on cuda:0" in why and "copy of the weights" in why


def test_option_is_validated():
    assert parse_options({"background": True}).background is True
    assert parse_options({}).background is False
    with pytest.raises(OptionsError, match="'background' must be true or false"):
        parse_options({"background": "yes"})
    # where a compile runs is not part of what is compiled: one cache entry for both
    from nexfort_engine.settings import resolve

    on, off = parse_options({"background": True}), parse_options({})
    assert resolve(on, cuda=False).digest(on) == resolve(off, cuda=False).digest(off)


# -- when the call compiles in the foreground instead ---------------------------------------------


@pytest.mark.parametrize("case", ["no_cache", "freezing", "unpicklable"])
def test_foreground_when_background_cannot_help(case, tmp_path, fresh_stats, clean_dynamo):
    opts = {"backend": "eager", "background": True}
    kwargs: dict = {}
    cache_dir: Path | None = tmp_path
    if case == "no_cache":
        cache_dir = None
    elif case == "freezing":
        opts["mode"] = "O2:freezing"
    else:
        kwargs = {"opts": {"lock": threading.Lock()}}
    net = _net()
    cm = nexfort_engine.compile(net, opts, cache_dir=cache_dir)
    x = torch.randn(3, 512)
    out = cm(x, **kwargs)
    rec = _record(fresh_stats)
    assert cm._nx_job is None
    assert rec["state"] == "compiled" and rec["compiles"] == 1
    expected = {"no_cache": "no cache directory", "freezing": "freezing", "unpicklable": "cannot hand the model"}
    assert rec["background"].startswith("off: ") and expected[case] in rec["background"], rec["background"]
    torch.testing.assert_close(out, net(x))


def test_child_that_dies_leaves_the_compile_to_the_parent(tmp_path, fresh_stats, clean_dynamo):
    net = _net()
    cm = nexfort_engine.compile(net, {"backend": "eager", "background": True}, cache_dir=tmp_path)
    cm._nx_child_globals = (("nexfort_no_such_module", "x", 1),)  # the child's import fails
    x = torch.randn(3, 512)
    torch.testing.assert_close(cm(x), net(x))  # eager, while the child starts
    assert _record(fresh_stats)["state"] == "background"
    _wait_done(cm)
    out = cm(x)
    rec = _record(fresh_stats)
    assert rec["background"].startswith("failed: exit code 1") and "nexfort_no_such_module" in rec["background"]
    assert rec["state"] == "compiled" and rec["compiles"] == 1 and rec["fallbacks"] == 0
    torch.testing.assert_close(out, net(x))


@pytest.mark.parametrize("option", [None, 1, 3])
def test_the_child_gets_the_compile_workers_option(option, tmp_path, fresh_stats, clean_dynamo, monkeypatch):
    """The child compiles as a foreground compile would: with compile workers, auto unless set
    (SDXL's child 51.6 s with auto against 145.0 s with one process, run221)."""
    seen: list = []

    def start(**kw):
        seen.append(kw["config"])
        raise background.Unavailable("not started in this test")

    monkeypatch.setattr(background, "start", start)
    net = _net()
    opts = {"backend": "eager", "background": True, "compile_workers": option}
    cm = nexfort_engine.compile(net, opts, cache_dir=tmp_path)
    x = torch.randn(3, 512)
    torch.testing.assert_close(cm(x), net(x))  # no child: compiled here
    [config] = seen
    assert config.compile_workers == option and config.background is False and config.static_first is False
    assert _record(fresh_stats)["background"].startswith("off: cannot hand the model to a child process")


def test_child_is_cancelled_with_its_module(tmp_path, fresh_stats, clean_dynamo):
    cm = nexfort_engine.compile(_net(), {"mode": "O1", "background": True}, cache_dir=tmp_path)
    cm(torch.randn(3, 512))
    job = cm._nx_job
    assert job is not None and not job.done()
    del cm
    gc.collect()
    job.proc.wait(timeout=30)  # terminated, not left compiling
    assert job.proc.returncode != 0


def _processes() -> list[tuple[int, bytes]]:
    """(pid, command line) of the processes running here."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out.append((int(p.name), (p / "cmdline").read_bytes().replace(b"\0", b" ")))
            except OSError:
                pass
    return out


_EXIT_CHILD = """
import subprocess, sys, time
from pathlib import Path
from nexfort_engine import background
kids = [subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
        for _ in range(2)]
deadline = time.monotonic() + 60
while len(found := background.descendants(background.os.getpid())) < 4 and time.monotonic() < deadline:
    time.sleep(0.05)  # each child starts Python, then its own child
Path(sys.argv[1]).write_text(" ".join(map(str, found)))
print("flushed at exit", end="")
background.exit_now(7)
"""


def test_child_exits_at_once_with_its_children(tmp_path):
    """:func:`background.exit_now`: the exit code given, stdout flushed, and every process below
    it (two children and a grandchild each, as Inductor's compile pool has) killed, not orphaned."""
    import subprocess
    import sys

    listed = tmp_path / "descendants"
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(listed)], capture_output=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 7, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode() == "flushed at exit"
    pids = [int(p) for p in listed.read_text().split()]
    assert len(pids) == 4, pids
    deadline = time.monotonic() + 10
    while alive := [p for p in pids if procs.alive(p)]:
        assert time.monotonic() < deadline, f"still running: {alive}"
        time.sleep(0.05)


# -- the hand-over, with real Inductor compiles in the child --------------------------------------


@pytest.mark.inductor
def test_parent_runs_what_the_child_compiled(tmp_path, fresh_stats, clean_dynamo):
    net = _net()
    x = torch.randn(3, 512)
    ref = net(x)
    cm = nexfort_engine.compile(net, {"mode": "O1", "background": True}, cache_dir=tmp_path)
    with torch.no_grad():
        out = cm(x, opts={"k": 1})
        assert _record(fresh_stats)["state"] == "background"
        torch.testing.assert_close(out, ref)  # eager meanwhile
        pid, log_file = cm._nx_job.proc.pid, cm._nx_job.path / background.LOG_FILE
        # it exits as it reports (background.exit_now), whatever it started killed with it: a normal
        # interpreter exit tears torch down first, 1.3-1.9 s here and once 10 s
        assert _wait_done(cm) < 3.0
        assert "nexfort: exiting with code 0 (" in log_file.read_text()
        assert not [p for p in _processes() if f"--parent={pid}".encode() in p[1]]
        out = cm(x, opts={"k": 1})
    rec = _record(fresh_stats)
    assert rec["state"] == "compiled" and rec["background"].startswith("done in ")
    assert rec["compiles"] == 0 and rec["cache_hits"] == 1 and rec["precompiled_graphs"] == 1  # nothing traced here
    assert rec["background_seconds"] > 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    entry = cm.cache_entry
    assert entry is not None and entry.committed()
    assert not (tmp_path / background.JOBS / entry.key / background.JOB_FILE).exists()  # consumed

    # a warm entry loads in the foreground at the first call, even with the option on
    nexfort_engine.reset_stats()
    cm2 = nexfort_engine.compile(_net(), {"mode": "O1", "background": True}, cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(cm2(x, opts={"k": 1}), ref, rtol=1e-4, atol=1e-5)
    rec = _record(fresh_stats)
    assert rec["background"] == "off: the cache entry is warm"
    assert rec["compiles"] == 0 and rec["cache_hits"] == 1


@pytest.mark.inductor
@pytest.mark.parametrize("family", ["sd15", "pixart"])
def test_comfy_model_compiles_in_the_background(family, patcher, tmp_path, monkeypatch, fresh_stats, clean_dynamo):
    """ComfyUI's model, its sampler's ``transformer_options`` (the node layer's wrapper closure
    included), ComfyUI's parsed command line and the node layer's block hook travel to the child;
    ComfyUI samples eager meanwhile and then runs what the child compiled. SD1.5's UNet: one
    precompiled graph, loaded (nothing compiled here); PixArt's blocks (regional, through
    ``torch.compile``): re-traced here, Inductor's cache hit."""
    import tiny_models

    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    mp = tiny_models.tiny_sd15() if family == "sd15" else tiny_models.tiny_pixart(depth=5)
    h, w = tiny_models.RESOLUTIONS[family][1]
    ref = tiny_models.sample(mp, h, w, steps=2)
    m = patcher.compile_model_patcher(mp, parse_options({"mode": "O1", "background": True}))
    out = tiny_models.sample(m, h, w, steps=2)
    torch.testing.assert_close(out, ref)
    rec = _record(fresh_stats)
    assert rec["state"] == "background", rec["background"]
    cm = next(iter(mp.model.diffusion_model.__dict__[patcher._ATTR].values()))
    _wait_done(cm)
    out = tiny_models.sample(m, h, w, steps=2)
    rec = _record(fresh_stats)
    assert rec["state"] == "compiled" and rec["background"].startswith("done in "), rec
    assert rec["recompiles"] == 0 and rec["cache_hits"] == 1 and rec["cache_misses"] == 0, str(rec)
    if family == "sd15":
        assert rec["compiles"] == 0 and rec["precompiled_graphs"] == 1
    else:
        assert rec["regions"] == ["blocks[PixArtMSBlockx5]"]
    assert tiny_models.rel_err(out, ref) <= 1e-3
