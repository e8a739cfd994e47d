"""Deleting from a write-once bucket: what a pool may not delete, it empties.

A pool's credentials may create objects in their namespace and delete nothing
(:mod:`farm.cluster.access`): no object, and no version of one, a pool wrote is ever
removed by a pool. The store still has deletes of its own (a quarantine, a move of a
rekeyed artifact, a tuning result replaced, an unsigned artifact replaced by a signed
one). With credentials that may not delete, each of them is a conditional write of an
empty object (a *tombstone*) over exactly the object read (``If-Match`` on its etag),
which every read takes for absent: a ``get`` misses (uncounted: nothing is corrupt),
listings skip it, and the next ``put`` of the key writes over it. On a versioned bucket
(the set-up turns versioning on) what was there stays as an older version, for a person
or ``farm gc`` to look at.

The first delete tries a real one; refused (``AccessDenied``), the store remembers and
writes tombstones from then on, so root or administrator credentials (tests, an embedded
MinIO) delete as before. With the repair role's credentials
(``FARM_MINIO_REPAIR_ACCESS_KEY``/``_SECRET_KEY``: ``farm gc``, an operator) a delete
removes the object and every version of it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar

from farm.core.errors import StoreAccessDenied
from farm.store.minio_requests import BucketRequests

if TYPE_CHECKING:
    from minio import Minio

log = logging.getLogger(__name__)

T = TypeVar("T")

#: what a delete without the right to delete leaves: an empty object
TOMBSTONE = b""
#: conditional writes of a tombstone before leaving the object to whoever changes it
_MAX_ROUNDS = 4


def is_tombstone(data: bytes) -> bool:
    """Whether an object's bytes are a deleted key's (no artifact, entry or blob is empty
    but a blob of no bytes, whose digest still verifies)."""
    return not data


class Removal(BucketRequests):
    """``_remove`` of a bucket's store (a mixin of :class:`~farm.store.minio.MinioStore`)."""

    bucket: str
    _client: Minio

    def _init_removal(self, repair: Minio | None) -> None:
        self._repair = repair
        self._may_delete = True

    def _remove(self, name: str) -> None:
        """Delete ``name``: every version with the repair role, else the object, else
        (credentials that may not delete) a tombstone over it."""
        if self._repair is not None:
            self._call(f"delete {name}", lambda: self._purge(name))
            return
        if self._may_delete:
            try:
                self._call(f"delete {name}",
                           lambda: self._client.remove_object(self.bucket, name))
                return
            except StoreAccessDenied:
                self._may_delete = False
                log.info("store %s: these credentials may not delete; a delete empties "
                         "the object instead (a write-once bucket)", self.location)
        self._tombstone(name)

    def _purge(self, name: str) -> None:
        """Remove every version of ``name`` (the repair role's delete)."""
        repair = self._repair
        assert repair is not None
        versions = [o.version_id for o in repair.list_objects(
            self.bucket, prefix=name, include_version=True) if o.object_name == name]
        for version in versions or [None]:
            repair.remove_object(self.bucket, name, version_id=version)

    def _tombstone(self, name: str) -> None:
        """Write an empty object over exactly what is there (nothing to do when the name
        holds nothing, or a tombstone already)."""
        for _ in range(_MAX_ROUNDS):
            obj = self._fetch(name)
            if obj is None or is_tombstone(obj.data):
                return
            if self._write_if(name, TOMBSTONE, {}, {"If-Match": obj.etag}):
                return
        log.info("store %s: %s kept changing; left to its last writer", self.location, name)
