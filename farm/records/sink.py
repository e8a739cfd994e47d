"""Where a recorder sends what it records: the transport, behind one small protocol.

Embedded, records go straight into session storage (``StorageSink``). In a cluster a
sink appends them to Redis streams and the ingester writes them into storage. The
recorder does not know which: it only decides *what* to write and *when*; the sink
decides *how*.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from farm.records.model import Record, Session

if TYPE_CHECKING:
    from farm.records.storage import SessionStorage


@runtime_checkable
class RecordSink(Protocol):
    """The transport of one recorder's session and records.

    Contract, which every implementation keeps:

    - ``write_session`` is called once per session, before any of its records, and
      only when the session changed something. It is idempotent by session id. When
      ``keep_sessions`` is not None, the oldest stored sessions beyond that many are
      pruned with all their records, never this one (0 acts as 1); a sink that only
      transports passes the number on to whoever stores.
    - ``write_records`` is idempotent by (session, seq): the recorder retries a batch
      that raised, whole, so a sink may have stored part of it already. Records come in
      seq order within a call.
    - A failure raises (any exception); the recorder keeps the records and retries.
    - One recorder never calls its sink from two threads at once; several recorders may
      share a sink only if it is thread-safe (``StorageSink`` is).
    - ``close`` releases what the sink owns; writes after it are not expected.
    """

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        """Make a session durable (and prune old ones when ``keep_sessions`` is set)."""
        ...

    def write_records(self, records: Sequence[Record]) -> None:
        """Make records durable, idempotently by (session, seq)."""
        ...

    def close(self) -> None:
        """Release the sink's resources."""
        ...


class StorageSink:
    """The embedded transport: records go straight into a ``SessionStorage``.

    ``owns`` says whether ``close()`` closes the storage too: true when the sink made
    it (``StorageSink.open``), false when the caller shares a storage it keeps using.

    ``storage`` may be a function that opens it: the sink then opens it at the first
    write. Most processes only load, and a session is written only once it changes
    something, so most never write: they then never import SQLAlchemy or touch the
    records file (a tenth of a second and more of start-up, on every ``farm build``
    that finds everything stored).
    """

    def __init__(self, storage: SessionStorage | Callable[[], SessionStorage], *,
                 owns: bool = False) -> None:
        self._storage: SessionStorage | None = None
        self._open: Callable[[], SessionStorage] | None = None
        if callable(storage):  # an opener (a SessionStorage is not callable)
            self._open = storage
        else:
            self._storage = storage
        self._owns = owns
        self._lock = threading.Lock()

    @property
    def storage(self) -> SessionStorage:
        """The storage, opened (and migrated) now if it was not yet."""
        with self._lock:
            if self._storage is None:
                assert self._open is not None
                self._storage = self._open()
            return self._storage

    @classmethod
    def open(cls, url: str, *, lazy: bool = False) -> StorageSink:
        """A sink over a storage it opens (and migrates) itself, and closes with it;
        with ``lazy`` at its first write."""
        def opener() -> SessionStorage:
            from farm.records.storage import SessionStorage

            return SessionStorage(url)

        return cls(opener if lazy else opener(), owns=True)

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        """Insert the session, then prune beyond ``keep_sessions`` protecting it."""
        self.storage.write_session(session)
        if keep_sessions is not None:
            self.storage.prune(keep_sessions, protect=session.id)

    def write_records(self, records: Sequence[Record]) -> None:
        """Insert the records in one transaction (existing ones are left as they are)."""
        self.storage.write_records(records)

    def close(self) -> None:
        """Close the storage when this sink opened it (and it was ever opened)."""
        if self._owns and self._storage is not None:
            self._storage.close()

    def __repr__(self) -> str:
        return f"StorageSink({self._storage!r})" if self._storage is not None else \
            "StorageSink(not opened yet)"
