"""Program sources and headers in the MinIO bucket: one object per blob, named by its
SHA-256 (:func:`farm.core.keys.blob_object`, ``blobs/<sha256>``).

A blob's name is its content's digest, so there is nothing to decide on a write: the
object is written with ``If-None-Match: *`` (a 412 means the name is taken, by the same
bytes unless they are corrupt), and every read checks the digest; a corrupt object is a
miss (counted) that the next ``put_blob`` replaces with ``If-Match`` on what it read.
Kept apart from :mod:`farm.store.minio`, whose requests and retries it uses through
:class:`~farm.store.minio_requests.BucketRequests`, so that each module stays about one
thing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from farm.core.hashing import sha256_hex
from farm.core.keys import BLOBS_PREFIX, blob_object, digest_from_blob_object
from farm.store.base import ArtifactStore, checked_blob
from farm.store.minio_requests import BucketRequests

#: conditional writes of one blob before giving up (a reader verifies whatever is there)
_MAX_ROUNDS = 4


class BlobObjects(ArtifactStore, BucketRequests):
    """``get_blob``, ``put_blob`` and ``existing_blobs`` over a bucket (a mixin)."""

    def get_blob(self, digest: str) -> bytes | None:
        obj = self._fetch(blob_object(digest))
        return checked_blob(self, digest, obj.data if obj is not None else None)

    def put_blob(self, data: bytes) -> str:
        digest = sha256_hex(data)
        name = blob_object(digest)
        condition = {"If-None-Match": "*"}
        for _ in range(_MAX_ROUNDS):
            if self._write_if(name, bytes(data), {}, condition):
                return digest
            obj = self._fetch(name)
            if obj is None:  # deleted since the 412
                condition = {"If-None-Match": "*"}
                continue
            if sha256_hex(obj.data) == digest:
                return digest
            condition = {"If-Match": obj.etag}  # corrupt: replace exactly what we read
        return digest

    def existing_blobs(self, digests: Iterable[str]) -> set[str]:
        """One listing (narrowed to the longest prefix the names share)."""
        wanted = set(digests)
        if not wanted:
            return set()
        prefix = os.path.commonprefix([blob_object(d) for d in wanted])  # noqa: RUF071
        listed = (digest_from_blob_object(n)
                  for n in self._list(prefix or BLOBS_PREFIX, recursive=True))
        return {d for d in listed if d is not None and d in wanted}
