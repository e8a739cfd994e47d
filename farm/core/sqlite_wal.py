"""Switching a SQLite file to WAL when several processes may open it at once.

Changing the journal mode needs the file to itself for a moment, and SQLite answers
``database is locked`` at once instead of waiting on its busy timeout when another
process holds it (seen when a build's processes open a new records file together). The
mode is stored in the file, so retrying briefly is all it takes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import Protocol


class _Rows(Protocol):
    def fetchone(self) -> Sequence[object] | None: ...


class _Executes(Protocol):
    """A DB-API sqlite3 cursor or connection (what SQLAlchemy hands out, or sqlite3's)."""

    def execute(self, statement: str, /) -> _Rows: ...


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower()


#: seconds the switch is retried while the file is locked; the first wait after a locked
#: attempt (doubling, up to the cap)
_RETRY_S, _FIRST_WAIT_S, _MAX_WAIT_S = 30.0, 0.01, 0.5


def enable_wal(cursor: _Executes) -> str:
    """Set WAL on a DB-API sqlite3 cursor or connection; returns the mode now in force.

    The first attempt is a plain call: tenacity (which imports asyncio, and tornado
    where it is installed) loads only when the file is locked, not in every process
    that opens a store."""
    started = time.monotonic()
    try:
        return _switch(cursor)
    except sqlite3.OperationalError as exc:
        if not _locked(exc):
            raise
    from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

    time.sleep(_FIRST_WAIT_S)
    retrying = Retrying(retry=retry_if_exception(_locked),
                        stop=stop_after_delay(max(0.0, _RETRY_S - (time.monotonic() - started))),
                        wait=wait_exponential(multiplier=2 * _FIRST_WAIT_S, max=_MAX_WAIT_S),
                        reraise=True)
    return retrying(_switch, cursor)


def _switch(cursor: _Executes) -> str:
    row = cursor.execute("PRAGMA journal_mode=WAL").fetchone()
    return str(row[0]).lower() if row else ""
