"""Where a recorder sends what it records: the transport, behind one small protocol.

Embedded, records go straight into session storage (``StorageSink``). In a cluster a
sink appends them to Redis streams and the ingester writes them into storage. The
recorder does not know which: it only decides *what* to write and *when*; the sink
decides *how*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from farm.records.model import Record, Session
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
    """

    def __init__(self, storage: SessionStorage, *, owns: bool = False) -> None:
        self.storage = storage
        self._owns = owns

    @classmethod
    def open(cls, url: str) -> StorageSink:
        """A sink over a storage it opens (and migrates) itself, and closes with it."""
        return cls(SessionStorage(url), owns=True)

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        """Insert the session, then prune beyond ``keep_sessions`` protecting it."""
        self.storage.write_session(session)
        if keep_sessions is not None:
            self.storage.prune(keep_sessions, protect=session.id)

    def write_records(self, records: Sequence[Record]) -> None:
        """Insert the records in one transaction (existing ones are left as they are)."""
        self.storage.write_records(records)

    def close(self) -> None:
        """Close the storage when this sink opened it."""
        if self._owns:
            self.storage.close()

    def __repr__(self) -> str:
        return f"StorageSink({self.storage!r})"
