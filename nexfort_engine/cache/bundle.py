"""Cache bundles: export entries to one ``.tar.gz``, import them elsewhere — verified.

A bundle holds ``bundle.json`` (format, environment and the sha256 + size of every file) and the
entries' ``meta.json``, ``manifest.json`` and artifacts. Importing is all-or-nothing: every member
name must be a plain relative path inside ``entries/<hex key>/`` (no ``..``, absolute paths,
links or devices) and every file must match both the bundle's hash list and its entry's
manifest, checked *before* anything is written to the cache. Compiled artifacts are code; a bundle
that does not verify is refused whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

from .store import MANIFEST, CacheError, CacheStore, atomic_write_bytes

BUNDLE_FORMAT = 1
INDEX = "bundle.json"


def _safe_member(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] != "entries" or len(p.parts) < 3:
        raise CacheError(f"bundle refused: unsafe member path {name!r}")
    if not all(c in "0123456789abcdef" for c in p.parts[1]):
        raise CacheError(f"bundle refused: bad entry key in {name!r}")
    return p


def export_bundle(store: CacheStore, dest: str | os.PathLike[str], keys: list[str] | None = None) -> dict:
    """Write committed entries (all, or ``keys`` prefixes) to ``dest`` (.tar.gz). Returns the index."""
    chosen = store.keys() if not keys else sorted({k for p in keys for k in store.resolve_prefix(p)})
    files: dict[str, dict] = {}
    blobs: list[tuple[str, Path]] = []
    for key in chosen:
        e = store.entry(key)
        with e.lock():
            if e.verify() != "hit":
                continue
            for p in sorted(e.path.rglob("*")):
                if not p.is_file() or p.is_symlink() or p.name == ".lock":
                    continue
                rel = f"entries/{key}/{p.relative_to(e.path).as_posix()}"
                data = p.read_bytes()
                files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                blobs.append((rel, p))
    if not files:
        raise CacheError("nothing to export: no committed cache entries match")
    index = {"format": BUNDLE_FORMAT, "created": time.time(), "entries": chosen, "files": files}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        raw = json.dumps(index, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(INDEX)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        for rel, p in blobs:
            tar.add(str(p), arcname=rel, recursive=False)
    atomic_write_bytes(Path(dest), buf.getvalue())
    return index


def import_bundle(store: CacheStore, src: str | os.PathLike[str]) -> list[str]:
    """Verify a bundle completely, then install its entries. Returns the imported keys."""
    try:
        tar = tarfile.open(src, mode="r:gz")
    except (OSError, tarfile.TarError) as e:
        raise CacheError(f"bundle refused: {src} is not a readable .tar.gz ({e})") from e
    with tar:
        members = tar.getmembers()
        by_name = {}
        for m in members:
            if m.name == INDEX:
                continue
            if not m.isfile():
                raise CacheError(f"bundle refused: {m.name!r} is not a regular file")
            _safe_member(m.name)
            by_name[m.name] = m
        try:
            index = json.loads(tar.extractfile(INDEX).read())  # type: ignore[union-attr]
        except (KeyError, AttributeError, ValueError) as e:
            raise CacheError("bundle refused: missing or unreadable bundle.json") from e
        listed = index.get("files", {})
        if index.get("format") != BUNDLE_FORMAT or set(listed) != set(by_name):
            raise CacheError("bundle refused: its file list does not match bundle.json")
        contents: dict[str, bytes] = {}
        for name, m in by_name.items():
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            info = listed[name]
            if len(data) != info.get("size") or hashlib.sha256(data).hexdigest() != info.get("sha256"):
                raise CacheError(f"bundle refused: {name!r} does not match its hash in bundle.json")
            contents[name] = data
    # every entry's own manifest must vouch for its artifacts too
    keys = sorted({PurePosixPath(n).parts[1] for n in contents})
    for key in keys:
        mf = contents.get(f"entries/{key}/{MANIFEST}")
        if mf is None:
            raise CacheError(f"bundle refused: entry {key} has no manifest")
        manifest = json.loads(mf)
        for rel, info in manifest.get("files", {}).items():
            data = contents.get(f"entries/{key}/inductor/{rel}")
            if data is None or hashlib.sha256(data).hexdigest() != info.get("sha256"):
                raise CacheError(f"bundle refused: entry {key} artifact {rel!r} fails its manifest")
    # all verified: install each entry via a temp dir + rename
    for key in keys:
        e = store.entry(key)
        with e.lock():
            staging = Path(tempfile.mkdtemp(prefix=f".import-{key}-", dir=e.path))
            try:
                for name, data in contents.items():
                    parts = PurePosixPath(name).parts
                    if parts[1] != key:
                        continue
                    out = staging.joinpath(*parts[2:])
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data)
                shutil.rmtree(e.artifacts, ignore_errors=True)
                if (staging / "inductor").exists():
                    os.replace(staging / "inductor", e.artifacts)
                for meta in ("meta.json", MANIFEST):  # manifest last
                    if (staging / meta).exists():
                        os.replace(staging / meta, e.path / meta)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return keys
