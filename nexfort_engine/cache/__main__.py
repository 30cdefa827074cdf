"""``python -m nexfort_engine.cache``: list, clear, export and import compile-cache entries.

    python -m nexfort_engine.cache [--dir DIR] ls
    python -m nexfort_engine.cache [--dir DIR] clear [KEY_PREFIX ...]
    python -m nexfort_engine.cache [--dir DIR] export BUNDLE.tar.gz [KEY_PREFIX ...]
    python -m nexfort_engine.cache [--dir DIR] import BUNDLE.tar.gz

DIR defaults to $NEXFORT_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import ENV_CACHE_DIR, CacheError, CacheStore, export_bundle, import_bundle


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nexfort_engine.cache", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.environ.get(ENV_CACHE_DIR), help="cache root (default $NEXFORT_CACHE_DIR)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list entries with sizes")
    c = sub.add_parser("clear", help="remove all entries, or those matching key prefixes")
    c.add_argument("keys", nargs="*")
    e = sub.add_parser("export", help="write entries to a verified .tar.gz bundle")
    e.add_argument("bundle")
    e.add_argument("keys", nargs="*")
    i = sub.add_parser("import", help="verify a bundle and install its entries")
    i.add_argument("bundle")
    args = ap.parse_args(argv)
    if not args.dir:
        ap.error(f"no cache dir: pass --dir or set {ENV_CACHE_DIR}")
    store = CacheStore(args.dir)
    try:
        if args.cmd == "ls":
            entries = store.list()
            print(f"cache root: {store.root}")
            for ent in entries:
                used = time.strftime("%Y-%m-%d %H:%M", time.localtime(ent["last_used"])) if ent["last_used"] else "-"
                state = "" if ent["committed"] else "  (uncommitted)"
                print(f"{ent['key']}  {_human(ent['size_bytes']):>10}  hits={ent['hits']:<4} used={used}  {ent['label']}{state}")
            print(f"{len(entries)} entries, {_human(sum(x['size_bytes'] for x in entries))}")
        elif args.cmd == "clear":
            removed = store.clear() if not args.keys else [k for p in args.keys for k in store.clear(p)]
            print(f"removed {len(removed)} entries" + (": " + ", ".join(removed) if removed else ""))
        elif args.cmd == "export":
            index = export_bundle(store, args.bundle, args.keys or None)
            print(f"exported {len(index['entries'])} entries ({len(index['files'])} files) to {args.bundle}")
        elif args.cmd == "import":
            keys = import_bundle(store, args.bundle)
            print(f"imported {len(keys)} entries: {', '.join(keys)}")
    except CacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
