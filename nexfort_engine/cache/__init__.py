"""Persistent compile cache (see :mod:`.store`) and verified bundles (see :mod:`.bundle`)."""

from .bundle import export_bundle, import_bundle
from .store import (
    ENV_CACHE_DIR,
    CacheEntry,
    CacheError,
    CacheStore,
    entry_key,
    environment_fingerprint,
    structure_digest,
)

__all__ = [
    "ENV_CACHE_DIR",
    "CacheEntry",
    "CacheError",
    "CacheStore",
    "entry_key",
    "environment_fingerprint",
    "export_bundle",
    "import_bundle",
    "structure_digest",
]
