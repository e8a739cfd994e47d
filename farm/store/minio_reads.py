"""MinIO for a process that mostly reads (a served application): artifacts and blobs
read with a signed GET (:mod:`farm.store.s3_get`), everything else through
:class:`~farm.store.minio.MinioStore`, whose SDK is imported at its first use.

An application that finds every program it builds in the store never needs the SDK
(0.1 to 0.3 s of imports, see :mod:`farm.store.s3_get`); one that misses compiles,
which costs far more than the import. A read the signed GET cannot answer (an answer it
does not expect: another region, refused credentials) is read again through the SDK,
which says what is wrong. Outages of the reads are waited out by the ``waiter`` given
(an application's: :func:`farm.programs.quick.app_waiter`), past which a read raises
:class:`~farm.core.errors.StoreError`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace

from farm.core.errors import StoreError
from farm.core.keys import Namespace, artifact_object, blob_object
from farm.core.model import Artifact, Key, Lowered
from farm.core.outage import OutageError, Waiter
from farm.store.base import ArtifactStore, PutResult, Quarantined, checked, checked_blob
from farm.store.frames import decode_artifact
from farm.store.s3_get import S3Declined, S3Reader

#: typing.TYPE_CHECKING, without importing typing for it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from farm.store.url import Opening, StoreURL


class MinioReads(ArtifactStore):
    """See the module docstring. Thread-safe."""

    def __init__(self, url: StoreURL, opening: Opening, waiter: Waiter) -> None:
        super().__init__()
        self._url, self._opening = url, replace(opening, reads=None)
        endpoint, bucket, secure = url.bucket()
        settings = opening.settings
        access, secret = settings.minio_access_key, settings.minio_secret_key
        self._reader = S3Reader(endpoint, secure, access.get_secret_value() if access else "",
                                secret.get_secret_value() if secret else "",
                                bucket, settings.socket_timeout, settings.minio_region)
        self._where = f"minio://{endpoint}/{bucket}"
        self._waiter = waiter
        self._lock = threading.Lock()
        self._store: ArtifactStore | None = None

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> MinioReads:
        """As :meth:`farm.store.minio.MinioStore.from_url`, reads waited out by
        ``opening.reads``."""
        assert opening.reads is not None, "a reader's opening names its waiter"
        return cls(url, opening, opening.reads)

    @property
    def location(self) -> str:
        return self._where

    @property
    def sdk(self) -> ArtifactStore:
        """The SDK's store, opened (and its bucket made) at first use."""
        with self._lock:
            if self._store is None:
                from farm.store.open import open_url

                # reads=None: farm.store.minio.MinioStore, the SDK's
                self._store = open_url(self._url, self._opening)
                self._store.stats = self.stats
            return self._store

    def _read(self, name: str) -> bytes | None:
        """The object's bytes; :class:`S3Declined` for an answer left to the SDK."""
        try:
            return self._waiter.call(lambda: self._reader.get(name))
        except OutageError as exc:
            raise StoreError(str(exc)) from None

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        try:
            data = self._read(artifact_object(ns, key))
        except S3Declined:
            return self.sdk.get(ns, key)
        if data is None:
            return None
        return checked(self, ns, key, decode_artifact(data))

    def get_blob(self, digest: str) -> bytes | None:
        try:
            data = self._read(blob_object(digest))
        except S3Declined:
            return self.sdk.get_blob(digest)
        return checked_blob(self, digest, data)

    # -- the rest: the SDK's --------------------------------------------------------------------
    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        return self.sdk.put(ns, artifact, source=source)

    def existing(self, ns: Namespace, keys: Iterable[Key]) -> set[Key]:
        return self.sdk.existing(ns, keys)

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        return self.sdk.find_source(ns, source_hash)

    def delete(self, ns: Namespace, key: Key) -> None:
        self.sdk.delete(ns, key)

    def keys(self, ns: Namespace) -> Iterator[Key]:
        return self.sdk.keys(ns)

    def namespaces(self) -> list[Namespace]:
        return self.sdk.namespaces()

    def quarantine(self, ns: Namespace, key: Key, digest: str, reason: str) -> bool:
        return self.sdk.quarantine(ns, key, digest, reason)

    def quarantined(self, ns: Namespace) -> list[Quarantined]:
        return self.sdk.quarantined(ns)

    def put_blob(self, data: bytes) -> str:
        return self.sdk.put_blob(data)

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        return self.sdk.existing_blobs(digests)

    def close(self) -> None:
        self._reader.close()
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()
