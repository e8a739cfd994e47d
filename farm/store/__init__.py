"""Artifact stores: the interface, the embedded SQLite store, an in-memory tier, the
tiered store, and :func:`open_store`, which picks them from settings.

``MinioStore`` needs the ``minio`` SDK (the ``cluster`` extra), so it is imported from
:mod:`farm.store.minio` where it is wanted rather than here. The names below are imported
on first use (:mod:`farm.core.lazy`): a reader that needs no models
(:mod:`farm.store.sqlite_file`, :mod:`farm.store.s3_get`, what a served application's
quick path reads with) imports this package without pydantic.
"""

from __future__ import annotations

from farm.core.lazy import lazy_exports

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from farm.store.base import ArtifactStore, PutResult, StoreStats
    from farm.store.memory import MemoryStore
    from farm.store.open import open_store
    from farm.store.sqlite import SQLiteStore
    from farm.store.tiered import TieredStore

_WHERE = {
    **dict.fromkeys(("ArtifactStore", "PutResult", "StoreStats"), "farm.store.base"),
    "MemoryStore": "farm.store.memory",
    "open_store": "farm.store.open",
    "SQLiteStore": "farm.store.sqlite",
    "TieredStore": "farm.store.tiered",
}

__getattr__ = lazy_exports(__name__, _WHERE)

__all__ = [
    "ArtifactStore",
    "MemoryStore",
    "PutResult",
    "SQLiteStore",
    "StoreStats",
    "TieredStore",
    "open_store",
]
