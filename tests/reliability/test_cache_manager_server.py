"""The Cache Manager node through the real server: confined bundle paths, an export/import round
trip, and a tampered bundle that is refused whole.

* ``bundle_path`` with ``..``, an absolute path, and a symbolic link inside ``output/`` that points
  outside are refused with a clear error (the prompt fails with it), and nothing is written outside.
* export -> clear the entry -> import gives back the same files, the entry verifies, and a new
  server process compiles from it with cache hits and no misses.
* a bundle with one flipped byte inside an artifact, re-tarred with the original ``bundle.json``,
  is refused, and nothing of it is installed.
"""

from __future__ import annotations

import io
import tarfile

import pytest
from reliability_helpers import comfy_server, engine, lora_graph, next_seed, one_record, run_ok, tree_digest

from nexfort_engine.cache import CacheStore

pytestmark = pytest.mark.integration


def _manager(action: str, key: str = "", bundle_path: str = "nexfort-cache.tar.gz") -> dict:
    return {"1": {"class_type": "NexfortCacheManager",
                  "inputs": {"action": action, "key": key, "bundle_path": bundle_path}}}


def _refused(srv, graph: dict) -> str:
    with pytest.raises(comfy_server.ComfyServerError) as exc:
        srv.run(graph, timeout=120)
    return str(exc.value)


@pytest.fixture
def entry_key(srv, nexfort_cache_dir):
    run_ok(srv, lora_graph(seed=next_seed(), prefix="nx_manager"))
    _, rec = one_record(srv, "2")
    assert CacheStore(nexfort_cache_dir).entry(rec["cache_key"]).verify() == "hit"
    return rec["cache_key"]


def test_bundle_paths_outside_comfyui_are_refused(srv, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "bundle.tar.gz").write_bytes(b"not a bundle")
    link_dir = srv.output_dir / "nx_link_dir"
    link_file = srv.output_dir / "nx_link.tar.gz"
    for link, target in ((link_dir, outside), (link_file, outside / "bundle.tar.gz")):
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target)
    try:
        cases = [
            (_manager("export_bundle", bundle_path="../escape.tar.gz"), "refused"),
            (_manager("import_bundle", bundle_path="../../escape.tar.gz"), "refused"),
            (_manager("export_bundle", bundle_path=str(outside / "abs.tar.gz")), "refused"),
            (_manager("import_bundle", bundle_path=str(outside / "bundle.tar.gz")), "refused"),
            (_manager("export_bundle", bundle_path="nx_link_dir/b.tar.gz"), "symbolic link"),
            (_manager("import_bundle", bundle_path="nx_link.tar.gz"), "symbolic link"),
        ]
        for graph, needle in cases:
            msg = _refused(srv, graph)
            assert needle in msg and "bundle_path" in msg, f"{graph['1']['inputs']}: {msg[:1500]}"
        assert sorted(p.name for p in outside.iterdir()) == ["bundle.tar.gz"], "something was written outside"
        assert not (srv.output_dir.parent / "escape.tar.gz").exists()
    finally:
        link_dir.unlink()
        link_file.unlink()


def _tampered(src: bytes) -> bytes:
    """The bundle with one byte flipped in its largest artifact, re-tarred with the original index."""
    with tarfile.open(fileobj=io.BytesIO(src), mode="r:gz") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    victim = max((m for m, _ in members if "/inductor/" in m.name), key=lambda m: m.size)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as out:
        for m, data in members:
            if m is victim:
                data = bytearray(data)
                data[len(data) // 2] ^= 0x01
                data = bytes(data)
            m.size = len(data)
            out.addfile(m, io.BytesIO(data))
    return buf.getvalue()


def test_export_import_round_trip_and_tampered_bundle(srv, entry_key, nexfort_cache_dir):
    store = CacheStore(nexfort_cache_dir)
    entry = store.entry(entry_key)
    original = tree_digest(entry.path)

    run_ok(srv, _manager("export_bundle", key=entry_key[:12], bundle_path="nx_roundtrip.tar.gz"))
    bundle = srv.output_dir / "nx_roundtrip.tar.gz"
    assert bundle.is_file()
    (srv.output_dir.parent / "input" / "nx_tampered.tar.gz").write_bytes(_tampered(bundle.read_bytes()))

    run_ok(srv, _manager("clear_model", key=entry_key[:12]))
    assert entry_key not in store.keys()

    msg = _refused(srv, _manager("import_bundle", bundle_path="nx_tampered.tar.gz"))
    assert "bundle refused" in msg and "does not match its hash" in msg, msg[:1500]
    assert entry_key not in store.keys() or not tree_digest(entry.path), "a refused bundle left files behind"

    run_ok(srv, _manager("import_bundle", bundle_path="nx_roundtrip.tar.gz"))
    assert tree_digest(entry.path) == original, "the imported entry differs from the exported one"
    with entry.lock(timeout=60):
        assert entry.verify() == "hit"

    srv.restart()  # a new process must compile from the imported entry
    run_ok(srv, lora_graph(seed=next_seed(), prefix="nx_manager_after"))
    stats = engine(srv)
    assert stats["fallbacks"] == 0, stats["fallback_reasons"]
    assert stats["cache_hits"] > 0 and stats["cache_misses"] == 0, stats
