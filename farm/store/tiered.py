"""Several stores in front of each other: e.g. memory, the local SQLite file, MinIO.

The last tier is the shared truth (the cluster's MinIO); the front tiers are caches of
it that make a warm load local. The rules:

* **get** asks the tiers front to back; a hit in a later tier is copied into every
  earlier tier, so a remote hit lands in the local tier and the next process on this
  machine loads it without the network. A corrupt front copy is a miss there (counted
  by that tier), falls through to the next tier, and the copy that comes back repairs it.
* **put** writes to the *last* tier first: its first-writer-wins decision is the answer.
  Then the front tiers get the value the shared tier now holds: ours when it was stored
  (or the same), the winner's when it refused ours. A front tier that holds yet another
  value (filled before the shared tier knew the key) has it replaced. So a front tier
  never keeps a value that disagrees with the shared one after a put.
* **existing** is the union, asking later tiers only about keys the earlier ones lack;
  **find_source** asks in order; **delete** removes from every tier, the shared one first
  (so a concurrent get cannot refill a front tier from it); **keys** and **namespaces**
  are unions; **rekey** is the interface's (get, put, delete through these rules).
* **stats** is a snapshot: the sum of the tiers' counters, so a summary counts every
  refused write and every corrupt copy wherever it happened. Each tier's own counters are
  at ``store.tiers[i].stats``.

**Read-only credentials** (a loader or build client given a reader's MinIO user, see
:mod:`farm.cluster.access`): a put or delete the shared tier refuses with
``AccessDenied`` goes to the front tiers only. What this process compiles stays in its
local tier, and it says so once (one warning per store, not one per kernel); reads are
unaffected.

Filling a front tier is a cache fill: when it fails (local disk full, a locked file)
the failure is logged and the read or write of the shared tier still stands. A shared
tier that cannot be reached raises :class:`~farm.core.errors.StoreError` from the calls that
need it; a front-tier hit never touches it.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from farm.core.errors import FarmError, StoreAccessDenied
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.store.base import ArtifactStore, PutResult, Quarantined, StoreStats
from farm.store.url import StoreURL

if TYPE_CHECKING:
    from farm.store.url import Opening

log = logging.getLogger(__name__)

#: what a failed cache fill may raise; anything else is a bug and propagates
_FILL_FAILURES = (FarmError, OSError, sqlite3.Error)


class TieredStore(ArtifactStore):
    """Tiers front first, the shared truth last (e.g. ``[SQLiteStore, MinioStore]``)."""

    def __init__(self, tiers: Sequence[ArtifactStore]) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers: list[ArtifactStore] = list(tiers)
        super().__init__()
        #: the shared tier refused a write for lack of permission (said once)
        self.read_only = False

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> TieredStore:
        """``tiered:<url>|<url>...``: each tier opened by its own backend, front first;
        tiers do not nest. A tier that cannot open closes those opened before it."""
        from farm.store.open import open_url, tier_urls

        tiers: list[ArtifactStore] = []
        try:
            for text in tier_urls(url):
                tier = StoreURL.parse(text)
                if tier.scheme == "tiered":
                    raise url.error("tiers do not nest")
                tiers.append(open_url(tier, opening))
        except BaseException:
            for opened in tiers:
                opened.close()
            raise
        return cls(tiers)

    @property
    def stats(self) -> StoreStats:
        """The sum of the tiers' counters, taken now (see the module doc)."""
        total = StoreStats()
        for tier in self.tiers:
            total.refused += tier.stats.refused
            total.corrupt += tier.stats.corrupt
            total.repaired += tier.stats.repaired
        return total

    @stats.setter
    def stats(self, value: StoreStats) -> None:
        """The interface's constructor assigns a counter; the tiers hold the real ones."""

    @property
    def location(self) -> str:
        return " -> ".join(t.location for t in self.tiers)

    def __repr__(self) -> str:
        return f"TieredStore({self.tiers!r})"

    @property
    def shared(self) -> ArtifactStore:
        """The last tier, whose first-writer-wins decisions are the farm's."""
        return self.tiers[-1]

    # -- reads -----------------------------------------------------------------------------
    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        for i, tier in enumerate(self.tiers):
            found = tier.get(ns, key)
            if found is not None:
                for front in self.tiers[:i]:
                    self._settle(front, ns, found)
                return found
        return None

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        missing = set(keys)
        found: set[Key] = set()
        for tier in self.tiers:
            if not missing:
                break
            held = tier.existing(ns, missing)
            found |= held
            missing -= held
        return found

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        for tier in self.tiers:
            key = tier.find_source(ns, source_hash)
            if key is not None:
                return key
        return None

    def keys(self, ns: Namespace) -> Iterator[Key]:
        every = {k for tier in self.tiers for k in tier.keys(ns)}
        return iter(sorted(every, key=lambda k: (k.id_hash, k.build_id)))

    def namespaces(self) -> list[Namespace]:
        return sorted({n for tier in self.tiers for n in tier.namespaces()}, key=str)

    # -- writes ----------------------------------------------------------------------------
    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        try:
            result = self.shared.put(ns, artifact, source=source)
        except StoreAccessDenied as exc:
            if len(self.tiers) == 1:
                raise
            self._read_only(exc)
            result = PutResult.STORED
            for front in self.tiers[:-1]:
                result = front.put(ns, artifact, source=source)
            return result
        value: Artifact | None = artifact
        if result is PutResult.REFUSED:
            value = self.shared.get(ns, artifact.meta.key)
        for front in self.tiers[:-1]:
            if value is None:  # the winner vanished or went corrupt since: hold nothing
                self._forget(front, ns, artifact.meta.key)
            else:
                # index the front copy only when it is ours (the winner's metadata is
                # not something we computed)
                self._settle(front, ns, value, source if value is artifact else None)
        return result

    def delete(self, ns: Namespace, key: Key) -> None:
        for tier in reversed(self.tiers):
            try:
                tier.delete(ns, key)
            except StoreAccessDenied as exc:
                if tier is not self.shared or len(self.tiers) == 1:
                    raise
                self._read_only(exc)

    def _read_only(self, exc: StoreAccessDenied) -> None:
        """Say once that the shared tier takes no writes from these credentials."""
        if not self.read_only:
            self.read_only = True
            log.warning("store %s: these credentials are read-only (AccessDenied on a "
                        "write); what this process compiles stays in %s",
                        self.shared.location, " and ".join(t.location for t in self.tiers[:-1]))

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        """Move the bad copy aside in every tier that holds it, the shared one first (so
        a front tier is not refilled from it). A tier that cannot (read-only
        credentials on the shared one) is logged; the others still move theirs."""
        moved = False
        for tier in reversed(self.tiers):
            try:
                moved = tier.quarantine(ns, key, digest, reason) or moved
            except _FILL_FAILURES as exc:
                log.warning("store %s: could not quarantine %s/%s (%s)", tier.location,
                            ns, key, exc)
        return moved

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        return sorted((q for tier in self.tiers for q in tier.quarantined(ns)),
                      key=lambda q: q.at)

    # -- blobs: the same walk as artifacts (front to back, a later hit copied forward) --
    def get_blob(self, digest: str) -> bytes | None:
        for i, tier in enumerate(self.tiers):
            data = tier.get_blob(digest)
            if data is not None:
                for front in self.tiers[:i]:
                    self._fill_blob(front, data)
                return data
        return None

    def put_blob(self, data: bytes) -> str:
        digest = self.shared.put_blob(data)
        for front in self.tiers[:-1]:
            self._fill_blob(front, data)
        return digest

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        missing = set(digests)
        found: set[str] = set()
        for tier in self.tiers:
            if not missing:
                break
            held = tier.existing_blobs(missing)
            found |= held
            missing -= held
        return found

    def _fill_blob(self, front: ArtifactStore, data: bytes) -> None:
        try:
            front.put_blob(data)
        except _FILL_FAILURES as exc:
            log.warning("store %s: could not keep a blob (%s)", front.location, exc)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # -- front tiers -------------------------------------------------------------------------
    def _settle(self, front: ArtifactStore, ns: Namespace, value: Artifact,
                source: Lowered | None = None) -> None:
        """Make ``front`` hold ``value`` (the shared tier's) under its key; index it
        there only with a ``source`` this process lowered."""
        try:
            if front.put(ns, value, source=source) is PutResult.REFUSED:
                log.info("store %s: local %s/%s disagreed with %s; replaced",
                         front.location, ns, value.meta.key, self.shared.location)
                front.delete(ns, value.meta.key)
                front.put(ns, value, source=source)
        except _FILL_FAILURES as exc:
            log.warning("store %s: could not fill %s/%s (%s); serving from %s",
                        front.location, ns, value.meta.key, exc, self.shared.location)

    def _forget(self, front: ArtifactStore, ns: Namespace, key: Key) -> None:
        try:
            front.delete(ns, key)
        except _FILL_FAILURES as exc:
            log.warning("store %s: could not drop %s/%s (%s)", front.location, ns, key, exc)
