"""Two ComfyUI processes compile the same model into the same cache dir at the same moment.

Both servers (different ports, own base dirs, one ``NEXFORT_CACHE_DIR``) get the same compiled
prompt at once. The entry's file lock lets one compile while the other waits, then verifies and
reuses what the first committed. Afterwards the entry verifies against its manifest, and a third
process compiles from it with cache hits and no misses.

The cache dir is the session's shared one when nothing is in it yet (a full run: this module is
the first to compile, so the race is cold and the entry it leaves serves every later test), else a
fresh one, so the race is always a cold compile.
"""

from __future__ import annotations

import threading

import pytest
from reliability_helpers import (
    assert_same_output,
    comfy_server,
    engine,
    lora_graph,
    next_seed,
    one_record,
    run_ok,
)

from nexfort_engine.cache import CacheStore

pytestmark = [pytest.mark.integration, pytest.mark.inductor]


@pytest.fixture(scope="module")
def race_cache(nexfort_cache_dir, tmp_path_factory):
    if not CacheStore(nexfort_cache_dir).keys():
        return nexfort_cache_dir
    return tmp_path_factory.mktemp("race_cache")


@pytest.fixture(scope="module")
def two_servers(comfy_host, tiny_ckpt, lora_name, comfy_base, race_cache, tmp_path_factory):
    lora = comfy_base / "models" / "loras" / lora_name
    servers = []
    for name in ("a", "b"):
        base = comfy_server.make_base_dir(tmp_path_factory.mktemp(f"race_base_{name}"), [tiny_ckpt])
        (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
        (base / "models" / "loras" / lora_name).symlink_to(lora)
        servers.append(comfy_server.ComfyServer(comfy_host, base_dir=base, log_path=base / "comfyui.log",
                                                env={"NEXFORT_CACHE_DIR": str(race_cache)}))
    errors: list[BaseException] = []

    def start(s):
        try:
            s.start()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    [t.start() for t in threads]
    [t.join() for t in threads]
    try:
        assert not errors, errors
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_two_processes_compile_same_model_at_once(two_servers, race_cache):
    a, b = two_servers
    seed = next_seed()
    graph = lora_graph(seed=seed, prefix="race")
    ids = [s.submit(graph) for s in (a, b)]  # both queued before either starts compiling
    results = [s.wait(pid, timeout=1200) for s, pid in zip((a, b), ids, strict=True)]
    assert all(r["status"]["status_str"] == "success" for r in results)

    stats = [engine(s) for s in (a, b)]
    for s, st in zip((a, b), stats, strict=True):
        assert st["fallbacks"] == 0, (s.url, st["fallback_reasons"])
        # one traced and saved the graph; the other waited on the lock and loaded it
        assert st["compiles"] + st["cache_hits"] >= 1, (s.url, st)
    label_a, rec_a = one_record(a, "2")
    label_b, rec_b = one_record(b, "2")
    assert rec_a["cache_key"] == rec_b["cache_key"], "same model and options must map to one entry"
    # only one process can have compiled cold; the other waited on the lock and reused its work
    assert min(rec_a["cache_misses"], rec_b["cache_misses"]) == 0, (rec_a, rec_b)

    store = CacheStore(race_cache)
    entry = store.entry(rec_a["cache_key"])
    with entry.lock(timeout=60):
        assert entry.verify() == "hit", f"entry {entry.key} does not verify after the race"
    listed = {e["key"]: e for e in store.list()}
    assert listed[entry.key]["committed"] and listed[entry.key]["size_bytes"] > 0, listed

    # both images are the same compiled model's output for the same seed
    pa = comfy_server.PromptResult(ids[0], results[0], a.output_dir)
    pb = comfy_server.PromptResult(ids[1], results[1], b.output_dir)
    assert_same_output(pa, pb, "server A vs server B")

    # a third process: everything from the cache
    b.stop()
    a.restart()
    assert engine(a)["compiles"] == 0
    run_ok(a, lora_graph(seed=next_seed(), prefix="race3"))
    third = engine(a)
    assert third["fallbacks"] == 0, third["fallback_reasons"]
    assert third["cache_hits"] > 0 and third["cache_misses"] == 0, third
