"""Session storage: where a record becomes durable, in SQLite or PostgreSQL.

One class, one code path for both databases (SQLAlchemy Core, no ORM), because the
embedded default and the cluster must behave the same: the embedded recorder writes
here directly, and in a cluster the ingester writes what it reads from Redis here.

Writes are idempotent: a session is keyed by its id and a record by (session, seq), and
inserting one that is already there does nothing. That is what lets a recorder retry a
failed write and an ingester re-deliver a message it could not acknowledge, without
duplicates and without reading first.

The tables, their versions and the rows are :mod:`farm.records.schema`'s; ``migrate()``
brings an older store up to date, and a store of a newer version or a database that is
not ours is refused with ``ForeignStoreError`` before anything is written to it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pydantic
from sqlalchemy import (
    Table,
    create_engine,
    delete,
    event,
    func,
    select,
    true,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.elements import ColumnElement

from farm.core.errors import ForeignStoreError, SettingsError, StoreError, one_line
from farm.core.sqlite_wal import enable_wal
from farm.records.model import RECORD_KINDS, CompilationBatchRecord, Record, Session, parse_record
from farm.records.schema import (
    MIGRATIONS,
    PG_INSERT_RECORDS,
    RECORD_COLUMNS,
    RECORDS_TABLE,
    SCHEMA_VERSION,
    SESSIONS_TABLE,
    SQLITE_INSERT_RECORDS,
    migrate_in,
    session_from_row,
    session_row,
    sorted_rows,
    version_of,
)

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 30.0
"""How long SQLite waits for another process's write lock before giving up."""


def _one_line(error: BaseException) -> str:
    """The driver's own message, first line only: SQLAlchemy's carries SQL and links."""
    original = getattr(error, "orig", None)
    message = str(original if original is not None else error).strip()
    return message.splitlines()[0] if message else type(error).__name__


class SessionStorage:
    """Sessions and their records in one SQL database (SQLite file or PostgreSQL).

    ``url`` is a SQLAlchemy URL: ``sqlite:///path/to/records.sqlite`` (``sqlite://`` for
    memory), or ``postgresql+psycopg://user@host:port/db``. Opening checks that the
    database is ours and migrates it; ``migrate=False`` connects lazily and leaves both
    to the caller (``schema_version()``, ``migrate()``). Safe to use from many threads;
    SQLite files also from many processes (WAL mode, busy timeout).

    A SQLite file holds our tables and nothing else: a file with other tables is
    refused rather than written into. A PostgreSQL database may hold other tables; it is
    refused only when tables of our names are there without our version row.
    """

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        try:
            parsed = make_url(url)
        except sa_exc.ArgumentError as exc:
            raise SettingsError(f"records storage URL {url!r} cannot be parsed") from exc
        self._dialect = parsed.get_backend_name()
        self._path: Path | None = None
        if self._dialect == "sqlite":
            database = parsed.database or ""
            if database in ("", ":memory:"):
                self.where = "in-memory SQLite"
                engine = create_engine("sqlite://", poolclass=StaticPool,
                                       connect_args={"check_same_thread": False})
            else:
                self._path = Path(database)
                self.where = str(self._path)
                if self._path.is_dir():
                    raise ForeignStoreError(f"{self._path} is a folder, not a records database")
                self._path.parent.mkdir(parents=True, exist_ok=True)
                engine = create_engine(parsed, connect_args={"check_same_thread": False,
                                                             "timeout": BUSY_TIMEOUT_S})
            _take_over_sqlite_transactions(engine)
        elif self._dialect == "postgresql":
            self.where = parsed.render_as_string(hide_password=True)
            engine = create_engine(parsed, pool_pre_ping=True)
        else:
            raise SettingsError(
                f"records storage URL {parsed.render_as_string(hide_password=True)!r}: "
                "use sqlite:///<file> or postgresql+psycopg://..."
            )
        self._engine: Engine = engine
        self._wal_checked = False
        if migrate:
            try:
                self.migrate()
            except BaseException:
                self._engine.dispose()
                raise

    # -- life cycle ---------------------------------------------------------------------

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._dialect

    def close(self) -> None:
        """Close every pooled connection (SQLite checkpoints its WAL on the last one)."""
        self._engine.dispose()

    def __enter__(self) -> SessionStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SessionStorage({self.where!r})"

    # -- schema -------------------------------------------------------------------------

    def schema_version(self) -> int:
        """The version the store is at (0: empty, none of our tables yet)."""
        with self._transaction(write=False, doing="reading the schema version") as conn:
            return version_of(conn, self._dialect, self.where)

    def migrate(self) -> int:
        """Create the tables or upgrade them to ``SCHEMA_VERSION``; return the old version.

        Idempotent, and safe when several processes open one store at once: the whole
        check-and-upgrade runs in one write transaction (SQLite ``BEGIN IMMEDIATE``,
        PostgreSQL an advisory lock), so a second process waits and then finds the store
        current. Nothing is written to a store that is refused.
        """
        with self._transaction(write=True, doing="migrating the schema") as conn:
            found = migrate_in(conn, self._dialect, self.where)
            if found < SCHEMA_VERSION:
                log.info("records storage %s: schema %d -> %d", self.where, found,
                         SCHEMA_VERSION)
        self._use_wal()
        return found

    def _use_wal(self) -> None:
        """Switch a SQLite file to WAL once it is known to be ours.

        Not in the connect hook: turning WAL on rewrites the file header, and a file we
        refuse must be left byte for byte as it was. WAL lets readers (``farm`` commands)
        run while a build writes. The mode is stored in the file, so once is enough.
        """
        if self._path is None or self._wal_checked:
            return
        with self._errors("switching to WAL mode"), self._engine.connect() as conn:
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                mode = enable_wal(cursor)
            finally:
                cursor.close()
        if mode != "wal":
            log.warning("records storage %s: WAL mode refused (%s)", self.where, mode)
        self._wal_checked = True

    # -- writes -------------------------------------------------------------------------

    def write_session(self, session: Session) -> None:
        """Insert a session; one already there (same id) is left as it is."""
        values = session_row(session)
        with self._transaction(write=True, doing="writing a session") as conn:
            conn.execute(self._insert_ignore(SESSIONS_TABLE).values(**values))

    def write_records(self, records: Iterable[Record]) -> int:
        """Insert records; those already there (same session and seq) are left as they are.

        Returns how many were given (not how many were new: drivers do not all report
        that for a batch). One transaction, so a batch is durable entirely or not at all.
        """
        rows = sorted_rows(records)
        if not rows:
            return 0
        with self._transaction(write=True, doing="writing records") as conn:
            self._insert_records(conn, rows)
        return len(rows)

    def write_batch(self, sessions: Iterable[Session], records: Iterable[Record]) -> int:
        """Insert sessions and records in ONE transaction (the ingester's unit of work).

        One commit for a whole batch read from the streams is what makes the ingester
        fast, and what lets it acknowledge the batch once, after the commit. Rows go in
        (session, seq) order so that two ingesters inserting overlapping batches into
        PostgreSQL take their row locks in the same order and cannot deadlock. Existing
        rows are left as they are; returns how many records were given.
        """
        session_rows = sorted((session_row(s) for s in sessions), key=lambda r: r["id"])
        rows = sorted_rows(records)
        if not rows and not session_rows:
            return 0
        with self._transaction(write=True, doing="writing a batch of records") as conn:
            if session_rows:
                conn.execute(self._insert_ignore(SESSIONS_TABLE), session_rows)
            if rows:
                self._insert_records(conn, rows)
        return len(rows)

    def prune(self, keep: int, protect: int | None = None) -> int:
        """Delete the oldest sessions beyond ``keep``, with all their records.

        ``protect`` (the session just written) always survives and counts as one of the
        kept; the rest are the newest others. Why protect and not just "newest": a long
        observing process writes its session only when it first changes something, so
        the session being kept may be older than others already stored. Sessions newer
        than ``protect`` are never deleted by its prune: a session entry that arrives
        late (or carries an old id) must not wipe out the sessions that started after
        it. ``keep`` 0 acts as 1. Returns the number of sessions deleted.

        Records whose session row is not there are left alone when they may belong to a
        session still on its way (an ingester may store records before their session),
        that is when they are newer than the oldest kept session. Those older than every
        kept session belong to sessions pruned before their last records arrived (an
        ingester catching up reads the short sessions stream far ahead of the records):
        they go too, so late records never outlive their session for long.
        """
        keep = max(keep, 1)
        ids = SESSIONS_TABLE.c.id
        deleted = 0
        with self._transaction(write=True, doing="pruning sessions") as conn:
            others_kept = keep
            if protect is not None:
                if conn.execute(select(ids).where(ids == protect)).first() is not None:
                    others_kept -= 1
            others = select(ids).order_by(ids.desc())
            if protect is not None:
                others = others.where(ids != protect)
            doomed: ColumnElement[bool] | None = true()
            if others_kept > 0:
                row = conn.execute(others.offset(others_kept - 1).limit(1)).first()
                doomed = None if row is None else ids < row[0]
            if doomed is not None:
                if protect is not None:
                    doomed = doomed & (ids < protect)
                conn.execute(
                    delete(RECORDS_TABLE).where(
                        RECORDS_TABLE.c.session_id.in_(select(ids).where(doomed).scalar_subquery())
                    )
                )
                deleted = conn.execute(delete(SESSIONS_TABLE).where(doomed)).rowcount
            oldest_kept = conn.execute(select(func.min(ids))).scalar()
            if oldest_kept is not None:
                conn.execute(delete(RECORDS_TABLE).where(RECORDS_TABLE.c.session_id < oldest_kept))
        if deleted:
            log.info("records storage %s: pruned %d session(s)", self.where, deleted)
        return int(deleted)

    def oldest_session_id(self) -> int | None:
        """The id of the oldest stored session (None when there is none)."""
        with self._transaction(write=False, doing="reading sessions") as conn:
            found = conn.execute(select(func.min(SESSIONS_TABLE.c.id))).scalar()
        return None if found is None else int(found)

    # -- reads --------------------------------------------------------------------------

    def sessions(self, limit: int | None = None) -> list[Session]:
        """Stored sessions, newest first."""
        query = select(SESSIONS_TABLE).order_by(SESSIONS_TABLE.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        with self._transaction(write=False, doing="reading sessions") as conn:
            rows = conn.execute(query).mappings().all()
        return [session_from_row(row) for row in rows]

    def session(self, session_id: int) -> Session | None:
        """One stored session, or None."""
        query = select(SESSIONS_TABLE).where(SESSIONS_TABLE.c.id == session_id)
        with self._transaction(write=False, doing="reading a session") as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else session_from_row(row)

    def records(self, session_id: int) -> list[Record]:
        """The records of one session, in sequence order."""
        return self._read_records(RECORDS_TABLE.c.session_id == session_id)

    def all_records(
        self, kind: str | None = None, requested_by_session: int | None = None
    ) -> list[Record]:
        """Records of every session (by session, then seq), optionally of one kind or
        asked for by one session (a worker's records that a client's build caused)."""
        condition: ColumnElement[bool] = true()
        if kind is not None:
            condition = condition & (RECORDS_TABLE.c.kind == kind)
        if requested_by_session is not None:
            condition = condition & (RECORDS_TABLE.c.requested_session == requested_by_session)
        return self._read_records(condition)

    def sessions_by_id(self, session_ids: Iterable[int]) -> dict[int, Session]:
        """The stored sessions among ``session_ids`` (absent ones are left out)."""
        wanted = sorted(set(session_ids))
        if not wanted:
            return {}
        query = select(SESSIONS_TABLE).where(SESSIONS_TABLE.c.id.in_(wanted))
        with self._transaction(write=False, doing="reading sessions") as conn:
            rows = conn.execute(query).mappings().all()
        return {session.id: session for session in map(session_from_row, rows)}

    def build_records(self, session_id: int, batch: int | None = None) -> list[Record]:
        """One build seen whole: the records of the session that asked for it, and every
        record made on its behalf by other sessions (workers), by session then seq.

        ``batch`` narrows the others' records to those that name that batch; the asking
        session's own records all come (the caller picks its batch record among them).
        """
        asked: ColumnElement[bool] = RECORDS_TABLE.c.requested_session == session_id
        if batch is not None:
            asked = asked & (RECORDS_TABLE.c.requested_batch == batch)
        return self._read_records((RECORDS_TABLE.c.session_id == session_id) | asked)

    def session_counts(self, session_ids: Iterable[int]) -> dict[int, dict[str, int]]:
        """Per session, counted in the database (``farm records sessions``): ``records``,
        ``max_seq``, ``batches`` and one count per compilation outcome (``Compiled``...).

        ``max_seq - records`` is how many sequence numbers have no stored record: records
        still in flight, dropped over ``max_held``, or lost on the way (see RECORDS.md).
        """
        wanted = sorted(set(session_ids))
        if not wanted:
            return {}
        sid = RECORDS_TABLE.c.session_id
        what = func.coalesce(RECORDS_TABLE.c.outcome, RECORDS_TABLE.c.kind)
        by_what = select(sid, what, func.count()).where(sid.in_(wanted)).group_by(sid, what)
        totals = (select(sid, func.count(), func.max(RECORDS_TABLE.c.seq))
                  .where(sid.in_(wanted)).group_by(sid))
        with self._transaction(write=False, doing="counting records") as conn:
            rows = conn.execute(by_what).all()
            total_rows = conn.execute(totals).all()
        counts: dict[int, dict[str, int]] = {
            session_id: {"records": 0, "max_seq": 0, "batches": 0} for session_id in wanted}
        for session_id, label, count in rows:
            name = "batches" if label == CompilationBatchRecord.KIND else str(label)
            counts[int(session_id)][name] = int(count)
        for session_id, count, max_seq in total_rows:
            counts[int(session_id)].update(records=int(count), max_seq=int(max_seq or 0))
        return counts

    def count_records(self, session_id: int | None = None) -> int:
        """How many records are stored (of one session, or in all)."""
        query = select(func.count()).select_from(RECORDS_TABLE)
        if session_id is not None:
            query = query.where(RECORDS_TABLE.c.session_id == session_id)
        with self._transaction(write=False, doing="counting records") as conn:
            return int(conn.execute(query).scalar_one())

    def count_sessions(self) -> int:
        """How many sessions are stored."""
        with self._transaction(write=False, doing="counting sessions") as conn:
            return int(conn.execute(select(func.count()).select_from(SESSIONS_TABLE)).scalar_one())

    def _read_records(self, condition: ColumnElement[bool]) -> list[Record]:
        query = (
            select(RECORDS_TABLE.c.session_id, RECORDS_TABLE.c.seq, RECORDS_TABLE.c.kind,
                   RECORDS_TABLE.c.payload)
            .where(condition)
            .order_by(RECORDS_TABLE.c.session_id, RECORDS_TABLE.c.seq)
        )
        with self._transaction(write=False, doing="reading records") as conn:
            rows = conn.execute(query).all()
        found: list[Record] = []
        for session_id, seq, kind, payload in rows:
            if kind not in RECORD_KINDS:
                # A newer farm version wrote a kind this one does not know: not ours to read.
                log.debug("records storage %s: skipping %s record (%s, %s)", self.where, kind,
                          session_id, seq)
                continue
            try:
                found.append(parse_record(kind, payload))
            except pydantic.ValidationError as exc:
                raise StoreError(
                    f"records storage {self.where}: record ({session_id}, {seq}) of kind "
                    f"{kind} does not validate: {one_line(exc)}"
                ) from exc
        return found

    # -- plumbing -----------------------------------------------------------------------

    def _insert_ignore(self, table: Table) -> pg_dialect.Insert | sqlite_dialect.Insert:
        """An INSERT that skips rows whose primary key is already there (both dialects)."""
        if self._dialect == "postgresql":
            return pg_dialect.insert(table).on_conflict_do_nothing()
        return sqlite_dialect.insert(table).on_conflict_do_nothing()

    def _insert_records(self, conn: Connection, rows: list[tuple[Any, ...]]) -> None:
        """Insert record rows (tuples in ``RECORD_COLUMNS`` order), skipping those there.

        The statement is rendered once, and the rows go to the driver as they are: an
        ingester inserts tens of thousands of rows a second, and SQLAlchemy's own
        executemany spends more per row (building and processing a dict of parameters)
        than SQLite spends inserting it. SQLite takes them in one ``executemany`` (a C
        loop over one prepared statement). PostgreSQL through psycopg 3 takes them as
        one statement whose rows are unnested from one array per column, sent in
        binary: one plan and one round trip for the whole batch instead of a statement
        per row (and psycopg's text arrays escape each string with a regular expression
        in Python, 30 us a row). Another PostgreSQL driver gets SQLAlchemy's executemany.
        """
        if self._dialect != "postgresql":
            conn.exec_driver_sql(SQLITE_INSERT_RECORDS, rows)
        elif self._engine.dialect.driver == "psycopg":
            conn.exec_driver_sql(PG_INSERT_RECORDS, tuple(map(list, zip(*rows, strict=True))))
        else:
            conn.execute(self._insert_ignore(RECORDS_TABLE),
                         [dict(zip(RECORD_COLUMNS, row, strict=True)) for row in rows])

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Turn a database failure into a one-line StoreError that names the storage.

        SQLite's "file is not a database" (a DatabaseError that is not an operational
        one: locked, unreachable) means the file is not ours: ForeignStoreError.
        """
        try:
            yield
        except sa_exc.OperationalError as exc:
            raise StoreError(f"records storage {self.where}: {doing} failed: "
                             f"{_one_line(exc)}") from exc
        except sa_exc.DatabaseError as exc:
            if self._dialect == "sqlite":
                raise ForeignStoreError(
                    f"{self.where} is not a kernel-farm records database ({_one_line(exc)})"
                ) from exc
            raise StoreError(f"records storage {self.where}: {doing} failed: "
                             f"{_one_line(exc)}") from exc
        except sa_exc.SQLAlchemyError as exc:
            raise StoreError(f"records storage {self.where}: {doing} failed: "
                             f"{_one_line(exc)}") from exc
        except OverflowError as exc:  # an integer no column holds (models bound them)
            raise StoreError(f"records storage {self.where}: {doing} failed: "
                             f"{_one_line(exc)}") from exc

    @contextmanager
    def _transaction(self, *, write: bool, doing: str) -> Iterator[Connection]:
        """One transaction; ``write`` takes SQLite's write lock up front (BEGIN IMMEDIATE),
        so that two writers queue on the busy timeout instead of failing mid-way."""
        with self._errors(doing), self._engine.connect() as conn:
            if write:
                conn.execution_options(farm_write=True)
            with conn.begin():
                yield conn


def _take_over_sqlite_transactions(engine: Engine) -> None:
    """Let us, not the sqlite3 module, say when a SQLite transaction begins.

    The sqlite3 module opens transactions lazily and only before data changes, which
    puts DDL (migrations) outside them and makes every writer a deferred one that can
    fail with "database is locked" half-way. SQLAlchemy's documented recipe: disable
    the module's handling and emit BEGIN ourselves.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, _record: object) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("farm_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


__all__ = [
    "BUSY_TIMEOUT_S",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "SessionStorage",
]
