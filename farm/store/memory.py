"""An in-memory artifact store: the front tier of a :class:`~farm.store.tiered.TieredStore`
for one process, and a stand-in store for tests.

It keeps every rule of the interface (first writer wins, digest verified on every read,
source index), so a tier made of it behaves like the others. ``max_bytes`` bounds the
binaries it holds, evicting the least recently used; unbounded when ``None``. It holds no
environment generation of its own: the loader's caches do that, and a store belongs to
one environment.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from farm.core.hashing import sha256_hex
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.store.base import (
    ArtifactStore,
    PutResult,
    Quarantined,
    checked,
    checked_blob,
    decide_put,
    index_hash,
    log_refused,
    quarantine_reason,
)

if TYPE_CHECKING:
    from farm.store.url import Opening, StoreURL

log = logging.getLogger(__name__)


class MemoryStore(ArtifactStore):
    """Artifacts in a dict, guarded by one lock; optionally bounded by total binary size."""

    def __init__(self, max_bytes: int | None = None, name: str = "memory") -> None:
        super().__init__()
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._name = name
        self._lock = threading.RLock()
        self._items: OrderedDict[tuple[Namespace, Key], Artifact] = OrderedDict()
        self._sources: dict[tuple[Namespace, str], Key] = {}
        #: (ns, key) -> the source hash it is indexed under, to drop the entry with it
        self._indexed: dict[tuple[Namespace, Key], str] = {}
        #: program sources and headers by SHA-256 (never evicted: small, and a program's
        #: artifact is useless to a cluster without them)
        self._blobs: dict[str, bytes] = {}
        self._bytes = 0
        self._quarantine: list[tuple[Namespace, Quarantined]] = []

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> MemoryStore:
        """``memory://`` (a new, empty store each time), ``?max_bytes=N`` to bound it."""
        raw = url.query("max_bytes")
        if url.parts.netloc or url.parts.path not in ("", "/") or \
                (raw is not None and not raw.isdigit()):
            raise url.error("not memory:// or memory://?max_bytes=<bytes>")
        return cls(max_bytes=int(raw) if raw is not None else None)

    @property
    def location(self) -> str:
        return f"{self._name}://{id(self):x}"

    def __repr__(self) -> str:
        return f"MemoryStore(items={len(self._items)}, max_bytes={self.max_bytes})"

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        with self._lock:
            found = self._items.get((ns, key))
            if found is not None:
                self._items.move_to_end((ns, key))
        if found is None:
            return None
        return checked(self, ns, key, found)

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        with self._lock:
            return {k for k in keys if (ns, k) in self._items}

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        with self._lock:
            return self._sources.get((ns, source_hash))

    def keys(self, ns: Namespace) -> Iterator[Key]:
        with self._lock:
            found = [k for (n, k) in self._items if n == ns]
        return iter(sorted(found, key=lambda k: (k.id_hash, k.build_id)))

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return sorted({n for (n, _) in self._items}, key=str)

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        key = artifact.meta.key
        source_hash = index_hash(artifact, source)
        with self._lock:
            existing = self._items.get((ns, key))
            decision = decide_put(existing, artifact)
            if decision is None:
                if existing is not None:
                    self.stats.bump("repaired")
                    self._drop(ns, key)
                self._items[(ns, key)] = artifact
                self._bytes += len(artifact.binary)
            if source_hash is not None and decision in (None, PutResult.SAME):
                self._sources[(ns, source_hash)] = key
                self._indexed[(ns, key)] = source_hash
            if decision is None:
                self._evict()
        if decision is PutResult.REFUSED:
            log_refused(self, ns, key)
            return decision
        return decision or PutResult.STORED

    def delete(self, ns: Namespace, key: Key) -> None:
        with self._lock:
            self._drop(ns, key)

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        with self._lock:
            found = self._items.get((ns, key))
            if found is None or found.meta.digest != digest:
                return False
            self._drop(ns, key)
            self._quarantine.append((ns, Quarantined(
                key=key, artifact=found, reason=quarantine_reason(reason),
                at=dt.datetime.now(dt.UTC))))
        log.warning("store %s: %s/%s quarantined: %s", self.location, ns, key, reason)
        return True

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        with self._lock:
            return [q for n, q in self._quarantine if n == ns]

    def get_blob(self, digest: str) -> bytes | None:
        with self._lock:
            data = self._blobs.get(digest)
        return checked_blob(self, digest, data)

    def put_blob(self, data: bytes) -> str:
        digest = sha256_hex(data)
        with self._lock:
            self._blobs[digest] = bytes(data)
        return digest

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        with self._lock:
            return {d for d in digests if d in self._blobs}

    def _drop(self, ns: Namespace, key: Key) -> None:
        """Remove one entry and the index entry that points at it (lock held)."""
        old = self._items.pop((ns, key), None)
        if old is None:
            return
        self._bytes -= len(old.binary)
        source_hash = self._indexed.pop((ns, key), None)
        if source_hash is not None and self._sources.get((ns, source_hash)) == key:
            del self._sources[(ns, source_hash)]

    def _evict(self) -> None:
        """Drop least recently used entries until the bound holds (lock held)."""
        if self.max_bytes is None:
            return
        while self._bytes > self.max_bytes and self._items:
            (ns, key) = next(iter(self._items))
            self._drop(ns, key)

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._sources.clear()
            self._indexed.clear()
            self._quarantine.clear()
            self._blobs.clear()
            self._bytes = 0
