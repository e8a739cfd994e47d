"""Artifact stores: the interface, the embedded SQLite store, an in-memory tier, the
tiered store, and :func:`open_store`, the one way a process opens one (by the scheme
of its URL: :mod:`farm.store.open`).

``MinioStore`` needs the ``minio`` SDK (the ``cluster`` extra), so it is imported from
:mod:`farm.store.minio` only when a URL names it, rather than here. The names below are
imported on first use (:mod:`farm.core.lazy`): a reader that needs no models
(:mod:`farm.store.sqlite_file`, :mod:`farm.store.s3_get`, what a served application's
quick path reads with) imports this package without pydantic.
"""

# ruff: noqa: F401 - the TYPE_CHECKING block is the list of public names (farm.core.lazy)
from __future__ import annotations

from farm.core.lazy import public_names

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (farm run)
if TYPE_CHECKING:
    from farm.store.base import ArtifactStore, PutResult, StoreStats
    from farm.store.memory import MemoryStore
    from farm.store.open import open_store
    from farm.store.sqlite import SQLiteStore
    from farm.store.tiered import TieredStore

__getattr__, __dir__ = public_names(__name__)
