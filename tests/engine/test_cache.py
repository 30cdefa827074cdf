"""The persistent cache: verified entries, corruption handling, eviction, atomic manifests, bundles, CLI.

No compiles here except two with ``backend: eager`` (seconds): entries are filled with synthetic
artifact files, which is all the store looks at.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import nexfort_engine
from nexfort_engine.cache import CacheError, CacheStore, environment_fingerprint, export_bundle, import_bundle
from nexfort_engine.cache import store as store_mod
from nexfort_engine.cache.store import MANIFEST, META

ENV = {"format": "1", "torch": "2.14.1", "triton": "3.6.0", "python": "3.11", "machine": "x86_64", "device": "cpu"}
FILES = {"fxgraph/ab/cd.bin": b"graph" * 100, "cpp/kernel.so": b"\x7fELF" + b"k" * 300, "aotautograd/x": b"aot"}


def make_entry(store: CacheStore, key: str, files: dict[str, bytes] | None = None, env=None, **meta):
    e = store.entry(key)
    for rel, data in (FILES if files is None else files).items():
        p = e.artifacts / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    with e.lock():
        e.commit(ENV if env is None else env, {"label": "tiny", **meta})
    return e


def no_tmp_files(root: Path) -> bool:
    return not [p for p in root.rglob("*.tmp")]


@pytest.fixture
def store(tmp_path) -> CacheStore:
    return CacheStore(tmp_path / "cache")


# -- entries -------------------------------------------------------------------------------------

def test_commit_then_hit(store):
    e = make_entry(store, "abc123")
    manifest = json.loads((e.path / MANIFEST).read_text())
    assert set(manifest["files"]) == set(FILES) and manifest["env"] == ENV
    assert manifest["files"]["cpp/kernel.so"]["sha256"] == hashlib.sha256(FILES["cpp/kernel.so"]).hexdigest()
    with e.lock():
        assert e.verify(ENV) == "hit"
        assert e.verify() == "hit"
    [row] = store.list()
    assert row["key"] == "abc123" and row["committed"] and row["size_bytes"] == sum(map(len, FILES.values()))
    assert row["label"] == "tiny"


def test_recommit_after_a_warm_call_hashes_only_what_changed(store, monkeypatch):
    make_entry(store, "abc123")
    hashed = []
    real = store_mod._sha256_file
    monkeypatch.setattr(store_mod, "_sha256_file", lambda p: hashed.append(p.name) or real(p))
    e = store.entry("abc123")  # a new process's object: verify hashes everything
    with e.lock():
        assert e.verify(ENV) == "hit" and len(hashed) == len(FILES)
        hashed.clear()
        e.commit(ENV)  # a warm call wrote nothing: no file is hashed again
        assert hashed == []
        (e.artifacts / "aotautograd" / "x").write_bytes(b"changed")  # a recompile rewrote one
        (e.artifacts / "triton" / "new.cubin").parent.mkdir(parents=True)
        (e.artifacts / "triton" / "new.cubin").write_bytes(b"cubin")
        e.commit(ENV)
        assert sorted(hashed) == ["new.cubin", "x"]
    manifest = json.loads((e.path / MANIFEST).read_text())
    assert manifest["files"]["aotautograd/x"]["sha256"] == hashlib.sha256(b"changed").hexdigest()
    assert manifest["files"]["cpp/kernel.so"]["sha256"] == hashlib.sha256(FILES["cpp/kernel.so"]).hexdigest()
    # altered behind the manifest's back (same size): a later verify still hashes and catches it
    (e.artifacts / "cpp" / "kernel.so").write_bytes(b"\x7fELF" + b"x" * 300)
    with e.lock():
        assert store.entry("abc123").verify(ENV) == "corrupt"


def test_fresh_entry_is_a_miss(store):
    e = store.entry("aa")
    with e.lock():
        assert e.verify(ENV) == "miss"


def test_uncommitted_artifacts_are_not_trusted(store):
    e = store.entry("aa")
    (e.artifacts / "fxgraph").mkdir(parents=True)
    (e.artifacts / "fxgraph" / "x").write_bytes(b"left by a crashed process")
    with e.lock():
        assert e.verify(ENV) == "miss"
    assert not (e.artifacts / "fxgraph" / "x").exists()


def _truncate(e):
    p = e.artifacts / "cpp/kernel.so"
    p.write_bytes(p.read_bytes()[:-10])


def _alter_byte(e):
    p = e.artifacts / "fxgraph/ab/cd.bin"
    data = bytearray(p.read_bytes())
    data[17] ^= 0x01  # same size, different content
    p.write_bytes(bytes(data))


def _remove(e):
    (e.artifacts / "aotautograd/x").unlink()


def _garble_manifest(e):
    (e.path / MANIFEST).write_bytes(b'{"format": 1, "files": {')


@pytest.mark.parametrize("damage", [_truncate, _alter_byte, _remove, _garble_manifest],
                         ids=["truncated", "altered-byte", "missing-file", "unreadable-manifest"])
def test_corrupt_entry_is_wiped_and_rebuilt(store, damage):
    e = make_entry(store, "c0ffee")
    damage(e)
    with e.lock():
        assert e.verify(ENV) == "corrupt"
    assert not e.artifacts.exists() or not any(e.artifacts.rglob("*"))
    assert not (e.path / MANIFEST).exists()
    with e.lock():
        assert e.verify(ENV) == "miss"  # nothing left to trust: rebuilt from scratch
    make_entry(store, "c0ffee")
    with e.lock():
        assert e.verify(ENV) == "hit"


def test_unlisted_file_is_deleted(store):
    e = make_entry(store, "beef")
    foreign = e.artifacts / "fxgraph" / "planted.py"
    foreign.write_text("import os  # not ours")
    with e.lock():
        assert e.verify(ENV) == "hit"
    assert not foreign.exists()
    assert all((e.artifacts / rel).exists() for rel in FILES)


@pytest.mark.parametrize("field, value", [("torch", "2.11.0"), ("triton", "3.5.0"), ("gpu", "NVIDIA H200 sm_90")])
def test_entry_from_another_environment_is_a_miss_not_an_error(store, field, value):
    e = make_entry(store, "d00d", env={**ENV, field: value})
    with e.lock():
        assert e.verify(ENV) == "miss"
    assert not (e.path / MANIFEST).exists()


def test_other_format_version_is_a_miss(store):
    e = make_entry(store, "d00d")
    m = json.loads((e.path / MANIFEST).read_text())
    m["format"] = 999
    (e.path / MANIFEST).write_text(json.dumps(m))
    with e.lock():
        assert e.verify(ENV) == "miss"


def test_environment_fingerprint_names_versions():
    env = environment_fingerprint("cpu")
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and "triton" in env and "python" in env
    assert environment_fingerprint("cuda:1")["device"] == "cuda"


def test_bad_keys_refused(store):
    for key in ("", "../x", "ABC", "g00"):
        with pytest.raises(CacheError, match="invalid cache key"):
            store.entry(key)


def test_lru_eviction_with_max_bytes(tmp_path):
    store = CacheStore(tmp_path / "c", max_bytes=2500)
    blob = {"a.bin": b"x" * 1000}
    for i, key in enumerate(["aa01", "aa02", "aa03"]):
        e = make_entry(store, key, files=blob)
        meta = json.loads((e.path / META).read_text())
        meta["last_used"] = 1000.0 + i  # aa01 oldest
        (e.path / META).write_text(json.dumps(meta))
    # the oldest is "kept" by the caller: the next-oldest goes instead
    assert store.evict(keep="aa01") == ["aa02"]
    assert store.keys() == ["aa01", "aa03"] and store.total_bytes() == 2000
    store.max_bytes = 1500
    assert store.evict() == ["aa01"]
    assert store.keys() == ["aa03"]
    assert CacheStore(tmp_path / "c").evict() == []  # no cap: nothing evicted


def test_max_bytes_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NEXFORT_CACHE_MAX_BYTES", "1234")
    assert CacheStore(tmp_path).max_bytes == 1234


def test_clear_by_prefix_and_all(store):
    for key in ("aa01", "aa02", "bb01"):
        make_entry(store, key)
    assert store.clear("aa") == ["aa01", "aa02"]
    with pytest.raises(CacheError, match="no cache entry matches 'zz'.*bb01"):
        store.clear("zz")
    assert store.clear() == ["bb01"] and store.keys() == []


# -- atomic manifest under a full disk -----------------------------------------------------------

def _disk_full(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_on_first_commit_leaves_no_manifest_nor_tmp(store, monkeypatch):
    e = store.entry("f00d")
    (e.artifacts).mkdir(parents=True)
    (e.artifacts / "a").write_bytes(b"a")
    monkeypatch.setattr(store_mod.os, "fsync", _disk_full)
    with pytest.raises(OSError) as ei, e.lock():
        e.commit(ENV)
    assert ei.value.errno == errno.ENOSPC
    assert not (e.path / MANIFEST).exists() and no_tmp_files(store.root)
    monkeypatch.undo()
    with e.lock():
        assert e.verify(ENV) == "miss"


def test_disk_full_on_recommit_keeps_previous_manifest(store, monkeypatch):
    e = make_entry(store, "f00d")
    before = (e.path / MANIFEST).read_bytes()
    (e.artifacts / "new.bin").write_bytes(b"new")

    real_fdopen = os.fdopen

    class HalfFull:  # the write itself runs out of space half way
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "fdopen", lambda fd, mode: HalfFull(real_fdopen(fd, mode)))
    with pytest.raises(OSError), e.lock():
        e.commit(ENV)
    monkeypatch.undo()
    assert (e.path / MANIFEST).read_bytes() == before and no_tmp_files(store.root)
    with e.lock():
        assert e.verify(ENV) == "hit"  # the previous manifest is whole; new.bin was unlisted
    assert not (e.artifacts / "new.bin").exists()


# -- corruption seen by the engine is counted and rebuilt -----------------------------------------

class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


def test_engine_counts_corrupt_entry_and_rebuilds(tmp_path, fresh_stats):
    root = tmp_path / "cache"
    mod = _Small()
    x = torch.randn(2, 4)
    cm = nexfort_engine.compile(mod, {"backend": "eager"}, cache_dir=root)
    torch.testing.assert_close(cm(x), mod(x))
    entry = cm.cache_entry
    assert entry is not None and (entry.path / MANIFEST).exists()
    # plant an artifact, commit it, then damage it
    (entry.artifacts / "k.bin").write_bytes(b"kernel")
    with entry.lock():
        entry.commit(environment_fingerprint("cpu"))
    (entry.artifacts / "k.bin").write_bytes(b"kernEl")
    cm2 = nexfort_engine.compile(mod, {"backend": "eager"}, cache_dir=root)
    torch.testing.assert_close(cm2(x), mod(x))
    s = fresh_stats()
    assert s["corrupt_entries"] == 1 and s["fallbacks"] == 0
    assert cm2.cache_entry.key == entry.key
    assert not (entry.artifacts / "k.bin").exists() and (entry.path / MANIFEST).exists()  # rebuilt + recommitted


# -- bundles -------------------------------------------------------------------------------------

def test_bundle_round_trip(tmp_path):
    src = CacheStore(tmp_path / "src")
    make_entry(src, "aa01")
    make_entry(src, "bb02", files={"x/y.bin": b"y" * 50})
    bundle = tmp_path / "b.tar.gz"
    index = export_bundle(src, bundle)
    assert sorted(index["entries"]) == ["aa01", "bb02"]
    dst = CacheStore(tmp_path / "dst")
    assert import_bundle(dst, bundle) == ["aa01", "bb02"]
    for key in ("aa01", "bb02"):
        e = dst.entry(key)
        with e.lock():
            assert e.verify(ENV) == "hit"
    assert (dst.entry("aa01").artifacts / "cpp/kernel.so").read_bytes() == FILES["cpp/kernel.so"]
    assert not list(dst.root.rglob(".import-*"))
    # export by prefix
    assert export_bundle(src, tmp_path / "one.tar.gz", ["bb"])["entries"] == ["bb02"]


def _rewrite(bundle: Path, out: Path, edit) -> None:
    """Copy a bundle member by member, letting ``edit(name, data) -> [(TarInfo, bytes|None)]`` change it."""
    with tarfile.open(bundle, "r:gz") as tin, tarfile.open(out, "w:gz") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            for info, payload in edit(m, data):
                if payload is None:
                    tout.addfile(info)
                else:
                    info.size = len(payload)
                    tout.addfile(info, io.BytesIO(payload))


@pytest.fixture
def bundle(tmp_path) -> Path:
    src = CacheStore(tmp_path / "src")
    make_entry(src, "aa01")
    b = tmp_path / "good.tar.gz"
    export_bundle(src, b)
    return b


def _refused(tmp_path, bundle_path, match):
    dst = CacheStore(tmp_path / "dst")
    with pytest.raises(CacheError, match=match):
        import_bundle(dst, bundle_path)
    installed = [p for p in dst.root.rglob("*") if p.is_file() and p.name != ".lock"] if dst.root.exists() else []
    assert installed == [], f"refused bundle installed {installed}"


def test_tampered_bundle_refused(tmp_path, bundle):
    def flip(m, data):
        if m.name.endswith("kernel.so"):
            data = data[:-1] + b"X"
        return [(m, data)]

    out = tmp_path / "bad.tar.gz"
    _rewrite(bundle, out, flip)
    _refused(tmp_path, out, "does not match its hash")


def test_tampered_bundle_with_consistent_index_still_fails_entry_manifest(tmp_path, bundle):
    def flip(m, data):
        if m.name.endswith("kernel.so"):
            data = data[:-1] + b"X"
        if m.name == "bundle.json":
            idx = json.loads(data)
            for name, info in idx["files"].items():
                if name.endswith("kernel.so"):
                    new = FILES["cpp/kernel.so"][:-1] + b"X"
                    info.update(size=len(new), sha256=hashlib.sha256(new).hexdigest())
            data = json.dumps(idx).encode()
        return [(m, data)]

    out = tmp_path / "bad.tar.gz"
    _rewrite(bundle, out, flip)
    _refused(tmp_path, out, "fails its manifest")


@pytest.mark.parametrize("evil", ["entries/aa01/../../../escape.txt", "/tmp/abs_escape.txt", "../escape.txt",
                                  "entries/AA01/x", "other/aa01/x"])
def test_unsafe_member_names_refused(tmp_path, bundle, evil):
    def add_evil(m, data):
        out = [(m, data)]
        if m.name == "bundle.json":
            info = tarfile.TarInfo(evil)
            out.append((info, b"pwned"))
        return out

    out = tmp_path / "evil.tar.gz"
    _rewrite(bundle, out, add_evil)
    _refused(tmp_path, out, "unsafe member path|bad entry key")
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_link_members_refused(tmp_path, bundle, kind):
    def add_link(m, data):
        out = [(m, data)]
        if m.name == "bundle.json":
            info = tarfile.TarInfo("entries/aa01/inductor/link")
            info.type = kind
            info.linkname = "/etc/passwd"
            out.append((info, None))
        return out

    out = tmp_path / "link.tar.gz"
    _rewrite(bundle, out, add_link)
    _refused(tmp_path, out, "not a regular file")


def test_not_a_bundle_refused(tmp_path):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"not gzip")
    _refused(tmp_path, p, "not a readable")


# -- CLI -----------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nexfort_engine.cache", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_ls_export_import_clear(tmp_path):
    src = CacheStore(tmp_path / "src")
    make_entry(src, "aa01")
    make_entry(src, "bb02")
    r = _cli("--dir", str(src.root), "ls")
    assert r.returncode == 0, r.stderr
    assert "aa01" in r.stdout and "bb02" in r.stdout and "2 entries" in r.stdout
    b = tmp_path / "b.tar.gz"
    r = _cli("--dir", str(src.root), "export", str(b), "aa")
    assert r.returncode == 0 and "exported 1 entries" in r.stdout, r.stderr
    dst = tmp_path / "dst"
    r = _cli("--dir", str(dst), "import", str(b))
    assert r.returncode == 0 and "imported 1 entries: aa01" in r.stdout, r.stderr
    assert CacheStore(dst).keys() == ["aa01"]
    r = _cli("--dir", str(src.root), "clear", "bb")
    assert r.returncode == 0 and "removed 1 entries: bb02" in r.stdout
    r = _cli("--dir", str(src.root), "clear", "zz")
    assert r.returncode == 2 and "no cache entry matches" in r.stderr
    r = _cli("--dir", str(src.root), "clear")
    assert r.returncode == 0 and CacheStore(src.root).keys() == []
    r = _cli("--dir", str(tmp_path / "empty"), "export", str(tmp_path / "e.tar.gz"))
    assert r.returncode == 2 and "nothing to export" in r.stderr


def test_cli_needs_a_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NEXFORT_CACHE_DIR"}
    r = subprocess.run([sys.executable, "-m", "nexfort_engine.cache", "ls"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "NEXFORT_CACHE_DIR" in r.stderr


def test_structure_digest_tells_quantized_layouts_apart():
    """A host's quantized weights (ComfyUI's ``QuantizedTensor``) report the original dtype: the
    digest also reads the subclass, its layout class and its stored dtype, so an fp8 and an nvfp4
    checkpoint of one model get different cache entries. Plain models keep their old digest."""
    from nexfort_engine.cache.store import structure_digest

    class Quantized(torch.Tensor):  # the attributes ComfyUI's QuantizedTensor keeps
        pass

    class Fp8Layout:
        pass

    class Nvfp4Layout:
        pass

    def model(layout=None, stored=torch.float8_e4m3fn):
        lin = torch.nn.Linear(16, 16, dtype=torch.bfloat16)
        if layout is not None:
            lin.weight = torch.nn.Parameter(torch.Tensor._make_subclass(Quantized, lin.weight.detach()),
                                            requires_grad=False)
            lin.weight._layout_cls, lin.weight._qdata = layout, torch.zeros(16, 16, dtype=stored)
            assert type(lin.weight) is Quantized and lin.weight.dtype == torch.bfloat16
        return torch.nn.Sequential(lin)

    plain = model()
    h = hashlib.sha256()
    h.update(b"torch.nn.modules.container.Sequential")
    h.update(repr(plain).encode())
    for name, t in plain.named_parameters():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    assert structure_digest(plain) == h.hexdigest()[:16]  # unchanged for plain tensors: warm caches stay warm
    digests = {structure_digest(m) for m in (plain, model(Fp8Layout), model(Nvfp4Layout),
                                             model(Fp8Layout, torch.float8_e5m2))}
    assert len(digests) == 4
    assert structure_digest(model(Fp8Layout)) == structure_digest(model(Fp8Layout))
