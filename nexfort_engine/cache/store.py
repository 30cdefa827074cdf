"""The persistent compile cache: one directory per (module structure, dtypes, device, versions, options).

Layout under the cache root::

    <root>/entries/<key>/meta.json       what the entry is for, hits, last use (atomic writes)
    <root>/entries/<key>/manifest.json   sha256 + size of every artifact file (atomic writes)
    <root>/entries/<key>/inductor/       TORCHINDUCTOR_CACHE_DIR (+ triton/) while we compile/run
    <root>/entries/<key>/.lock           inter-process lock (compile, verify, commit)

Why it is safe:

* The key hashes everything that makes an artifact valid: torch/Triton/Python versions, device
  type and GPU arch, the module's structure/parameter dtypes and the compile options. Another
  torch, Triton or GPU is a different key: a miss, never an error.
* Compiled artifacts are code. Before an entry is used, every file is checked against the
  manifest we wrote; a missing, truncated or altered file wipes the entry (it is rebuilt), and a
  file that the manifest does not list is deleted, so nothing we did not write or verify is
  loaded.
* The manifest is written last, atomically (temp file + fsync + rename): a crash or a full disk
  mid-write leaves the previous manifest, never a partial one.
* A file lock serialises verification, the first compile and manifest updates across processes.
* A size cap evicts least-recently-used entries.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
LOCK = ".lock"
ARTIFACTS = "inductor"
ENV_CACHE_DIR = "NEXFORT_CACHE_DIR"
ENV_MAX_BYTES = "NEXFORT_CACHE_MAX_BYTES"


_locks: dict[str, FileLock] = {}
_locks_guard = threading.Lock()


class CacheError(RuntimeError):
    """A cache operation that cannot be done (bad key, refused path, broken bundle)."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True, default=str).encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def environment_fingerprint(device: str = "cpu") -> dict[str, str]:
    """What, besides the module and options, decides whether an artifact is valid."""
    import torch

    env = {
        "format": str(FORMAT_VERSION),
        "torch": torch.__version__,
        "triton": _version("triton") if _version("triton") != "none" else _version("pytorch-triton"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "device": device.split(":")[0],
    }
    if env["device"] == "cuda" and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(idx)
        env["gpu"] = f"{torch.cuda.get_device_name(idx)} sm_{major}{minor}"
        env["cuda"] = str(torch.version.cuda)
    return env


def structure_digest(module: Any) -> str:
    """Hash of a module's class, architecture and parameter/buffer names, shapes and dtypes; for a
    tensor subclass also its class, layout and stored dtype (a host's quantized weights report the
    original dtype: an fp8 and an nvfp4 checkpoint of one model would otherwise share a key)."""
    h = hashlib.sha256()
    cls = type(module)
    h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    h.update(repr(module).encode())
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}{_subclass_desc(t)}".encode())
    return h.hexdigest()[:16]


def _subclass_desc(t: Any) -> str:
    """``""`` for a plain tensor (the digest of plain models is what it always was), else the
    subclass and, where it has them, its layout class and stored data's dtype (duck-typed: ComfyUI's
    ``QuantizedTensor`` keeps ``_layout_cls`` and ``_qdata``)."""
    import torch

    kind = type(t)
    if kind in (torch.Tensor, torch.nn.Parameter):
        return ""
    layout = getattr(t, "_layout_cls", None)
    qdata = getattr(t, "_qdata", None)
    return (f":{kind.__module__}.{kind.__qualname__}:{getattr(layout, '__qualname__', layout)}"
            f":{getattr(qdata, 'dtype', None)}")


def entry_key(structure: str, options_digest: str, env: dict[str, str]) -> str:
    blob = json.dumps({"s": structure, "o": options_digest, "e": env}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


class _EnvSet:
    """Sets environment variables on entry and puts the old values back on exit."""

    __slots__ = ("_new", "_old")

    def __init__(self, new: dict[str, str]) -> None:
        self._new = new
        self._old: dict[str, str | None] = {}

    def __enter__(self) -> None:
        environ = os.environ
        self._old = {k: environ.get(k) for k, v in self._new.items() if environ.get(k) != v}
        for k in self._old:
            environ[k] = self._new[k]

    def __exit__(self, *exc: Any) -> None:
        for k, v in self._old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class CacheEntry:
    """One compiled model's artifacts. Use :meth:`prepare`, :meth:`activate`, :meth:`commit`."""

    root: Path
    key: str
    #: (size, mtime_ns, sha256) of each artifact this object verified or committed: a commit
    #: after a warm call re-hashes only files that changed since (a UNet entry has thousands)
    _known: dict[str, tuple[int, int, str]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def path(self) -> Path:
        return self.root / "entries" / self.key

    @property
    def artifacts(self) -> Path:
        return self.path / ARTIFACTS

    def lock(self, timeout: float = 3600.0) -> FileLock:
        """The entry's inter-process lock; re-entrant within a process (one object per path)."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = str(self.path / LOCK)
        with _locks_guard:
            lock = _locks.get(path)
            if lock is None:
                lock = _locks[path] = FileLock(path, timeout=timeout, thread_local=False)
        return lock

    def _files(self) -> list[Path]:
        if not self.artifacts.exists():
            return []
        return sorted(p for p in self.artifacts.rglob("*") if p.is_file() and not p.is_symlink())

    def _relative(self) -> Any:
        """``p`` -> its path under the artifacts dir, POSIX style (string slicing: pathlib's
        ``relative_to`` per file cost a UNet entry's thousands of files 0.9 s, profiled)."""
        prefix = len(str(self.artifacts)) + 1
        if os.sep == "/":
            return lambda p: str(p)[prefix:]
        return lambda p: str(p)[prefix:].replace(os.sep, "/")

    def verify(self, env: dict[str, str] | None = None) -> str:
        """Check artifacts against the manifest. Returns 'hit', 'miss' or 'corrupt'.

        Caller holds the lock. 'corrupt' entries are wiped here (the caller rebuilds); files the
        manifest does not list are deleted.
        """
        manifest = _read_json(self.path / MANIFEST)
        files = self._files()
        if manifest is None:
            if (self.path / MANIFEST).exists():
                self.wipe("manifest unreadable")
                return "corrupt"
            if files:  # written by a process that never committed: not trusted
                shutil.rmtree(self.artifacts, ignore_errors=True)
            return "miss"
        if manifest.get("format") != FORMAT_VERSION or (env is not None and manifest.get("env") != env):
            self.wipe("written by another torch/Triton/GPU or cache format")
            return "miss"
        listed: dict[str, dict[str, Any]] = manifest.get("files", {})
        rel_of = self._relative()
        present = {rel_of(p): p for p in files}
        self._known.clear()
        for rel, info in listed.items():
            p = present.get(rel)
            st = p.stat() if p is not None else None
            if st is None or st.st_size != info.get("size") or _sha256_file(p) != info.get("sha256"):
                self._known.clear()
                self.wipe(f"artifact {rel!r} missing or altered")
                return "corrupt"
            self._known[rel] = (st.st_size, st.st_mtime_ns, info["sha256"])
        for rel, p in present.items():
            if rel not in listed:
                log.info("nexfort cache: removing unlisted file %s", p)
                with contextlib.suppress(OSError):
                    p.unlink()
        return "hit" if listed else "miss"

    def committed(self, env: dict[str, str] | None = None) -> bool:
        """Whether a manifest for this environment lists files: the entry was committed and
        :meth:`verify` will check it (cheap: no file is hashed here)."""
        manifest = _read_json(self.path / MANIFEST)
        if manifest is None or manifest.get("format") != FORMAT_VERSION:
            return False
        return (env is None or manifest.get("env") == env) and bool(manifest.get("files"))

    def wipe(self, why: str) -> None:
        self._known.clear()
        log.warning("nexfort cache: discarding entry %s (%s); it will be rebuilt", self.key, why)
        shutil.rmtree(self.artifacts, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.path / MANIFEST).unlink()

    def commit(self, env: dict[str, str], meta: dict[str, Any] | None = None) -> int:
        """Hash every artifact and write the manifest atomically. Caller holds the lock. A file
        this object verified or committed before, unchanged since (size and mtime), keeps its hash."""
        files = {}
        total = 0
        rel_of = self._relative()
        known: dict[str, tuple[int, int, str]] = {}
        for p in self._files():
            if p.name.endswith(".tmp") or p.parent.name == "locks":
                continue
            st = p.stat()
            rel = rel_of(p)
            seen = self._known.get(rel)
            sha = seen[2] if seen is not None and seen[:2] == (st.st_size, st.st_mtime_ns) else _sha256_file(p)
            files[rel] = {"size": st.st_size, "sha256": sha}
            known[rel] = (st.st_size, st.st_mtime_ns, sha)
            total += st.st_size
        self._known = known
        atomic_write_json(
            self.path / MANIFEST,
            {"format": FORMAT_VERSION, "env": env, "files": files, "written": time.time()},
        )
        self.update_meta(size_bytes=total, **(meta or {}))
        return total

    def read_meta(self) -> dict[str, Any]:
        return _read_json(self.path / META) or {}

    def update_meta(self, **fields: Any) -> None:
        meta = self.read_meta()
        meta.update(fields)
        meta["last_used"] = time.time()
        meta.setdefault("created", meta["last_used"])
        atomic_write_json(self.path / META, meta)

    def activate(self) -> contextlib.AbstractContextManager[None]:
        """Point Inductor's and Triton's caches at this entry for the duration of a call (entered
        around every compiled call: the paths are built once, the folder made when missing)."""
        env = self.__dict__.get("_env")
        if env is None:
            artifacts = str(self.artifacts)
            env = self.__dict__["_env"] = {"TORCHINDUCTOR_CACHE_DIR": artifacts,
                                           "TRITON_CACHE_DIR": os.path.join(artifacts, "triton")}
        if not os.path.isdir(env["TORCHINDUCTOR_CACHE_DIR"]):
            os.makedirs(env["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
        return _EnvSet(env)


class CacheStore:
    """The cache root: entries, listing, clearing, LRU eviction, bundles."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        if max_bytes is None and os.environ.get(ENV_MAX_BYTES):
            max_bytes = int(os.environ[ENV_MAX_BYTES])
        self.max_bytes = max_bytes

    def entry(self, key: str) -> CacheEntry:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise CacheError(f"invalid cache key {key!r}: expected a hex digest")
        return CacheEntry(self.root, key)

    def keys(self) -> list[str]:
        d = self.root / "entries"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.exists() else []

    def list(self) -> list[dict[str, Any]]:
        out = []
        for key in self.keys():
            e = CacheEntry(self.root, key)
            meta = e.read_meta()
            size = sum(p.stat().st_size for p in e._files())
            out.append(
                {
                    "key": key,
                    "label": meta.get("label", ""),
                    "size_bytes": size,
                    "hits": int(meta.get("hits", 0)),
                    "last_used": meta.get("last_used", 0.0),
                    "created": meta.get("created", 0.0),
                    "committed": (e.path / MANIFEST).exists(),
                    "options": meta.get("options", ""),
                }
            )
        return out

    def total_bytes(self) -> int:
        return sum(e["size_bytes"] for e in self.list())

    def resolve_prefix(self, prefix: str) -> list[str]:
        matches = [k for k in self.keys() if k.startswith(prefix.strip())]
        if prefix.strip() == "" or not matches:
            raise CacheError(f"no cache entry matches {prefix!r}; entries: {', '.join(self.keys()) or '(none)'}")
        return matches

    def clear(self, key_prefix: str | None = None) -> list[str]:
        """Remove all entries, or those whose key starts with ``key_prefix``. Returns removed keys."""
        keys = self.keys() if key_prefix is None else self.resolve_prefix(key_prefix)
        for key in keys:
            e = CacheEntry(self.root, key)
            with e.lock():
                shutil.rmtree(e.artifacts, ignore_errors=True)
                for name in (MANIFEST, META):
                    with contextlib.suppress(OSError):
                        (e.path / name).unlink()
            shutil.rmtree(e.path, ignore_errors=True)
        return keys

    def evict(self, keep: str | None = None) -> list[str]:
        """Drop least-recently-used entries until the store fits ``max_bytes``."""
        if not self.max_bytes:
            return []
        entries = sorted(self.list(), key=lambda e: e["last_used"])
        total = sum(e["size_bytes"] for e in entries)
        removed = []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e["key"] == keep:
                continue
            self.clear(e["key"])
            total -= e["size_bytes"]
            removed.append(e["key"])
            log.info("nexfort cache: evicted %s (%d bytes) to stay under %d bytes", e["key"], e["size_bytes"], self.max_bytes)
        return removed
