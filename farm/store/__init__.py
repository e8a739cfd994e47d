"""Artifact stores: the interface, the embedded SQLite store, an in-memory tier, the
tiered store, and :func:`open_store`, the one way a process opens one (by the scheme
of its URL: :mod:`farm.store.open`).

``MinioStore`` needs the ``minio`` SDK (the ``cluster`` extra), so it is imported from
:mod:`farm.store.minio` only when a URL names it, rather than here.
"""

from farm.store.base import ArtifactStore, PutResult, StoreStats
from farm.store.memory import MemoryStore
from farm.store.open import open_store
from farm.store.sqlite import SQLiteStore
from farm.store.tiered import TieredStore

__all__ = [
    "ArtifactStore",
    "MemoryStore",
    "PutResult",
    "SQLiteStore",
    "StoreStats",
    "TieredStore",
    "open_store",
]
