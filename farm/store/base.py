"""The artifact store interface every backend implements.

Rules every backend keeps (see docs/ARCHITECTURE.md, "The artifact store"):

* **First writer wins.** ``put`` of a key that holds a *different* valid value is
  refused and counted (:attr:`StoreStats.refused`), never raised: another worker simply
  compiled it first. The same value again is fine. A stored value that fails its digest
  is not a value: ``put`` repairs it.
* **Integrity.** ``get`` verifies size and SHA-256 before returning; a mismatch is
  counted (:attr:`StoreStats.corrupt`) and answered as a miss, never raised.
* **Upgrade, not replace.** The same bytes again with a stronger origin (an
  ``"imported"`` artifact, then ``"validated"`` or ``"compiled"`` on this fingerprint) are
  written, so a store learns that its copy was validated here (see below).
* **Quarantine.** An artifact proven bad on its own device (the device refused it, or a
  child process loading it died) is moved aside by :meth:`ArtifactStore.quarantine`,
  with why and when, and its bytes kept as evidence; the key is then free for the
  repair that first-writer-wins would otherwise refuse for ever (docs/SECURITY.md).
* **Blobs.** Programs (``farm.programs``) keep their sources and headers as
  content-addressed blobs beside the artifacts: ``put_blob`` stores bytes under their
  SHA-256 (idempotent: the same name always holds the same bytes), ``get_blob`` verifies
  the digest and answers a mismatch as a miss (counted corrupt), like ``get``. Blobs
  belong to no namespace: a source is not device-specific.
* **Source index.** An artifact is indexed by the hash of its source only when the
  writer passes the :class:`~farm.core.model.Lowered` source it compiled (or rekeyed) it from,
  so a key that misses can be served by rekeying an artifact of the same source. The
  index never takes a source hash from an artifact's metadata: metadata comes from
  bundles and other machines, and a lying ``meta.source_hash`` would otherwise repoint
  another kernel's index entry at this binary (docs/SECURITY.md).
"""

from __future__ import annotations

import datetime as dt
import logging
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from farm.core.errors import FarmError, StoreError
from farm.core.hashing import sha256_hex
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.core.outcomes import Fate

if TYPE_CHECKING:
    from farm.store.url import Opening, StoreURL

log = logging.getLogger(__name__)

#: the source hash :meth:`ArtifactStore.probe` reads: no source hashes to it
PROBE_SOURCE_HASH = "0" * 64


class PutResult(StrEnum):
    STORED = "stored"
    SAME = "same"
    REFUSED = "refused"


@dataclass
class StoreStats:
    """Counters a store keeps for summaries and tests (thread-safe increments)."""

    refused: int = 0
    corrupt: int = 0
    repaired: int = 0
    #: reads refused for a missing or wrong signature (see ``farm.store.signing``)
    unsigned: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


#: how sure a store can be that a binary loads on the namespace's device, weakest first:
#: bytes from a bundle, bytes a child process loaded on this fingerprint, bytes a writer
#: compiled and loaded on this fingerprint
_ORIGIN_RANK = {"imported": 0, "validated": 1, Fate.COMPILED: 2}

#: the longest reason a quarantine keeps (the evidence is the bytes, not the text)
MAX_REASON = 2000


@dataclass(frozen=True)
class Quarantined:
    """An artifact moved aside as proven bad on its own device: its bytes and why."""

    key: Key
    artifact: Artifact
    reason: str
    at: dt.datetime


class ArtifactStore(ABC):
    """Keys -> artifacts, per namespace. Implementations must be thread-safe."""

    def __init__(self) -> None:
        self.stats = StoreStats()

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> ArtifactStore:
        """The store ``url`` names (its scheme is this backend's in
        :data:`farm.store.open.BACKENDS`); the one way a process makes a store is
        :func:`farm.store.open.open_store`, which calls this."""
        raise url.error(f"{cls.__name__} is not opened from a URL")

    def probe(self, ns: Namespace) -> None:
        """One cheap read in ``ns`` (a source-index entry nobody writes): raises
        :class:`~farm.core.errors.StoreError` when the store is unreachable, refuses
        the credentials, or does not let them read the namespace. A worker's
        readiness check."""
        self.find_source(ns, PROBE_SOURCE_HASH)

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the store is, for messages (no credentials)."""

    @abstractmethod
    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        """The verified artifact, or ``None`` (missing or corrupt)."""

    @abstractmethod
    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        """Insert under ``artifact.meta.key`` with first-writer-wins. With ``source`` (the
        lowered source this process compiled or rekeyed it from) also point the source
        index at it; without, the index is left alone (imports, cache fills)."""

    @abstractmethod
    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        """Which of ``keys`` the store holds, in bulk (no verification)."""

    @abstractmethod
    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        """The key indexed for ``source_hash``, if any."""

    def claim_source(self, ns: Namespace, source_hash: str, key: Key
                     ) -> tuple[Key | None, bool]:
        """Look up ``source_hash`` in the source index, pointing it at ``key`` when it
        holds nothing, in one step where the store can: (the key it held, or ``None``;
        whether this call pointed it at ``key``). A worker's look under the compile
        lease (``farm.compilation.obtain``): when it pointed the index, neither the
        source nor (by the order every writer keeps, index first) the key was stored,
        and the ``put`` that follows with the same source writes no entry again. This
        default only looks (``find_source``); the MinIO store writes the entry with a
        conditional write, one request for what were a read that missed and a write."""
        return self.find_source(ns, source_hash), False

    def unclaim_source(self, ns: Namespace, source_hash: str, key: Key) -> None:  # noqa: B027
        """Take back what :meth:`claim_source` wrote for a kernel that then failed
        (best effort: an entry whose key is not stored is harmless, readers verify)."""

    @abstractmethod
    def delete(self, ns: Namespace, key: Key) -> None:
        """Remove an artifact and its source-index entry (if it points at ``key``)."""

    @abstractmethod
    def keys(self, ns: Namespace) -> Iterator[Key]:
        """Every key of a namespace."""

    @abstractmethod
    def namespaces(self) -> list[Namespace]:
        """Every namespace holding at least one artifact."""

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        """Move the artifact of ``key`` aside if it still is the one of ``digest``: it
        leaves the key (which a repair may then take) and is kept with ``reason`` and
        the time, for a person to look at. ``False`` when the key holds something else
        by now (nothing is moved), or the store keeps no quarantine."""
        log.warning("store %s keeps no quarantine; %s/%s left in place", self.location,
                    ns, key)
        return False

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        """What :meth:`quarantine` moved aside in ``ns``, oldest first."""
        return []

    def rekey(self, ns: Namespace, src: Key, dst: Key, *, move: bool,
              source: Lowered | None = None) -> Artifact | None:
        """Keep the artifact stored under ``src`` under ``dst`` too; with ``move`` the old
        key and its index entry go; with ``source`` (as lowered here) the index points
        at ``dst``. ``None`` when ``src`` is gone or corrupt."""
        old = self.get(ns, src)
        if old is None:
            return None
        update: dict[str, object] = {"key": dst}
        if source is not None:
            update["source_hash"] = source.source_hash
        new = Artifact(meta=old.meta.model_copy(update=update), binary=old.binary)
        result = self.put(ns, new, source=source)
        if result is PutResult.REFUSED:
            current = self.get(ns, dst)
            if current is None:
                return None
            new = current
        if move and src != dst:
            self.delete(ns, src)
        return new

    # -- blobs (program sources and headers) -------------------------------------------------
    def get_blob(self, digest: str) -> bytes | None:
        """The bytes whose SHA-256 is ``digest``, verified; ``None`` when absent or corrupt.
        A store that keeps no blobs answers ``None``."""
        return None

    def put_blob(self, data: bytes) -> str:
        """Keep ``data`` under its SHA-256, which is returned; the same bytes again change
        nothing."""
        raise StoreError(f"store {self.location} keeps no program sources")

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        """Which of ``digests`` the store holds, in bulk (no verification)."""
        return set()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class WrappedStore(ArtifactStore):
    """A store in front of another that passes every call through to it; subclasses
    override what they add to (signatures, metrics). The wrapped store's counters are
    the wrapper's, so a wrapped store reports like the one it wraps."""

    def __init__(self, inner: ArtifactStore) -> None:
        super().__init__()
        self.inner = inner
        self.stats = inner.stats

    @property
    def location(self) -> str:
        return self.inner.location

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        return self.inner.get(ns, key)

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        return self.inner.put(ns, artifact, source=source)

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        return self.inner.existing(ns, keys)

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        return self.inner.find_source(ns, source_hash)

    def claim_source(self, ns: Namespace, source_hash: str, key: Key
                     ) -> tuple[Key | None, bool]:
        return self.inner.claim_source(ns, source_hash, key)

    def unclaim_source(self, ns: Namespace, source_hash: str, key: Key) -> None:
        self.inner.unclaim_source(ns, source_hash, key)

    def delete(self, ns: Namespace, key: Key) -> None:
        self.inner.delete(ns, key)

    def keys(self, ns: Namespace) -> Iterator[Key]:
        return self.inner.keys(ns)

    def namespaces(self) -> list[Namespace]:
        return self.inner.namespaces()

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        return self.inner.quarantine(ns, key, digest, reason)

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        return self.inner.quarantined(ns)

    def get_blob(self, digest: str) -> bytes | None:
        return self.inner.get_blob(digest)

    def put_blob(self, data: bytes) -> str:
        return self.inner.put_blob(data)

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        return self.inner.existing_blobs(digests)

    def close(self) -> None:
        self.inner.close()


def checked(store: ArtifactStore, ns: Namespace, key: Key,
            found: Artifact | None) -> Artifact | None:
    """``found`` if it is intact and stored under ``key``; else count it corrupt, log it,
    and answer a miss (the integrity rule every backend's ``get`` applies)."""
    if found is not None and found.verify() and found.meta.key == key:
        return found
    store.stats.bump("corrupt")
    log.warning("store %s: artifact %s/%s fails its digest; treated as a miss",
                store.location, ns, key)
    return None


def checked_blob(store: ArtifactStore, digest: str, data: bytes | None) -> bytes | None:
    """``data`` if its SHA-256 is ``digest``; else count it corrupt and answer a miss."""
    if data is None or sha256_hex(data) == digest:
        return data
    store.stats.bump("corrupt")
    log.warning("store %s: blob %s fails its digest; treated as a miss", store.location,
                digest)
    return None


def decide_put(existing: Artifact | None, new: Artifact) -> PutResult | None:
    """First-writer-wins decision shared by backends: ``None`` means write it."""
    if existing is None:
        return None
    if not existing.verify():
        return None  # a corrupt entry is not a value: repair it
    if existing.meta.digest == new.meta.digest:
        if _ORIGIN_RANK[new.meta.origin] > _ORIGIN_RANK[existing.meta.origin]:
            return None  # the same bytes, now known to load here: upgrade
        return PutResult.SAME
    return PutResult.REFUSED


def quarantine_reason(reason: str) -> str:
    """``reason`` on one line, bounded (it comes from drivers and from input)."""
    return " ".join(reason.split())[:MAX_REASON] or "no reason given"


def index_hash(artifact: Artifact, source: Lowered | None) -> str | None:
    """The source hash to index ``artifact`` under: computed here from ``source``, never
    read from the artifact's metadata. ``None``: do not index."""
    if source is None:
        return None
    computed = source.source_hash
    if artifact.meta.source_hash != computed:
        raise ValueError(f"artifact {artifact.meta.key} records source hash "
                         f"{artifact.meta.source_hash}, but is indexed by {computed}")
    return computed


#: what a best-effort write (an upgrade, a quarantine) may raise; it is logged, and the
#: read that prompted it still stands
BEST_EFFORT_FAILURES = (FarmError, OSError, sqlite3.Error)


def set_aside(store: ArtifactStore, ns: Namespace, artifact: Artifact, reason: str) -> bool:
    """Quarantine ``artifact`` (proven bad on its own device) in ``store``, logging
    instead of raising when the store will not (read-only credentials): the caller
    then compiles the kernel and keeps it where it can."""
    try:
        return store.quarantine(ns, artifact.meta.key, artifact.meta.digest, reason)
    except BEST_EFFORT_FAILURES as exc:
        log.warning("store %s: could not quarantine %s/%s (%s); it stays, and is refused "
                    "again at each load", store.location, ns, artifact.meta.key, exc)
        return False


def mark_validated(store: ArtifactStore, ns: Namespace, artifact: Artifact) -> Artifact:
    """``artifact`` (imported) as validated on this fingerprint, written back to
    ``store`` where it can be (an upgrade: the same bytes), so that no other process
    validates it again."""
    validated = Artifact(meta=artifact.meta.model_copy(update={"origin": "validated"}),
                         binary=artifact.binary)
    try:
        store.put(ns, validated)
    except BEST_EFFORT_FAILURES as exc:
        log.info("store %s: could not note %s/%s as validated (%s)", store.location, ns,
                 artifact.meta.key, exc)
    return validated


def log_refused(store: ArtifactStore, ns: Namespace, key: Key) -> None:
    store.stats.bump("refused")
    log.info("store %s: %s/%s already holds another value; first writer wins",
             store.location, ns, key)


def iter_chunks(items: list[Key], size: int) -> Iterator[list[Key]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
