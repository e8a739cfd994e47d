"""The source index in the MinIO bucket: one small object per source hash
(:func:`farm.core.keys.source_object`), whose text is the key that holds that source.

Last writer wins for the entry itself (as in SQLite: any key that holds the source is a
valid answer), with one exception that saves a worker two requests a compiled kernel: a
*claim* (:meth:`SourceIndex.claim_source`) writes the entry only where there is none
(``If-None-Match: *``), and so is both the kernel's look-up and its index write. The
store remembers the entries it claimed until the put of their artifact, which then
writes the artifact alone (:mod:`farm.store.minio`, "A worker's look").

Kept apart from :mod:`farm.store.minio`, whose requests and retries it uses through the
methods declared below, so that each module stays about one thing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TypeVar

from farm.core.errors import StoreError
from farm.core.keys import Namespace, source_object
from farm.core.model import Key
from farm.store.minio_requests import BucketRequests

log = logging.getLogger(__name__)

T = TypeVar("T")

#: claimed index entries remembered until their put (a worker's chunk holds a few)
MAX_CLAIMED = 4096


class SourceIndex(BucketRequests):
    """``find_source``, ``claim_source`` and the index writes of a bucket (a mixin)."""

    def _init_index(self) -> None:
        #: (namespace, source hash) -> key: entries claimed whose put is still to come
        self._claimed: OrderedDict[tuple[str, str], Key] = OrderedDict()
        self._claimed_lock = threading.Lock()

    def find_source(self, ns: Namespace, source_hash: str) -> Key | None:
        obj = self._fetch(source_object(ns, source_hash))
        if obj is None or not obj.data:  # none, or deleted (farm.store.minio_removal)
            return None
        try:
            return Key.parse(obj.data.decode("utf-8").strip())
        except (UnicodeDecodeError, ValueError):
            log.warning("store %s: source index entry %s/%s is unreadable; ignored",
                        self.location, ns, source_hash)
            return None

    def claim_source(self, ns: Namespace, source_hash: str, key: Key
                     ) -> tuple[Key | None, bool]:
        """One conditional write of the entry; when refused, the entry as read."""
        if self._write_if(source_object(ns, source_hash), str(key).encode("ascii"),
                          {"Content-Type": "text/plain"}, {"If-None-Match": "*"}):
            with self._claimed_lock:
                self._claimed[(str(ns), source_hash)] = key
                while len(self._claimed) > MAX_CLAIMED:
                    self._claimed.popitem(last=False)
            return None, True
        return self.find_source(ns, source_hash), False

    def unclaim_source(self, ns: Namespace, source_hash: str, key: Key) -> None:
        """Delete the entry claimed for ``key`` if it still points there (best effort)."""
        with self._claimed_lock:
            self._claimed.pop((str(ns), source_hash), None)
        name = source_object(ns, source_hash)
        try:
            if self.find_source(ns, source_hash) == key:
                self._remove(name)
        except StoreError as exc:
            log.info("store %s: index entry %s left (%s)", self.location, name, exc)

    def _claimed_for(self, ns: Namespace, source_hash: str, key: Key) -> bool:
        """Whether this store claimed ``source_hash``'s entry for ``key`` and its put has
        not come yet (it comes now: the entry is not written again)."""
        with self._claimed_lock:
            if self._claimed.get((str(ns), source_hash)) != key:
                return False
            del self._claimed[(str(ns), source_hash)]
            return True

    def _index(self, ns: Namespace, key: Key, source_hash: str | None) -> None:
        """Point the source index at this key (last writer wins). ``source_hash`` is one
        the writer computed from the source (``index_hash``); ``None`` writes nothing,
        nor does an entry this store claimed for ``key`` (its put is now)."""
        if source_hash is None or self._claimed_for(ns, source_hash, key):
            return
        self._write_if(source_object(ns, source_hash), str(key).encode("ascii"),
                       {"Content-Type": "text/plain"}, {})
