"""Switching a SQLite file to WAL when several processes may open it at once.

Changing the journal mode needs the file to itself for a moment, and SQLite answers
``database is locked`` at once instead of waiting on its busy timeout when another
process holds it (seen when a build's processes open a new records file together). The
mode is stored in the file, so retrying briefly is all it takes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Protocol

from tenacity import retry, retry_if_exception, stop_after_delay, wait_exponential


class _Rows(Protocol):
    def fetchone(self) -> Sequence[object] | None: ...


class _Executes(Protocol):
    """A DB-API sqlite3 cursor or connection (what SQLAlchemy hands out, or sqlite3's)."""

    def execute(self, statement: str, /) -> _Rows: ...


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower()


@retry(retry=retry_if_exception(_locked), stop=stop_after_delay(30),
       wait=wait_exponential(multiplier=0.01, max=0.5), reraise=True)
def enable_wal(cursor: _Executes) -> str:
    """Set WAL on a DB-API sqlite3 cursor or connection; returns the mode now in force."""
    row = cursor.execute("PRAGMA journal_mode=WAL").fetchone()
    return str(row[0]).lower() if row else ""
