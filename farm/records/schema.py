"""The records storage's tables, their migrations, and how a session or a record
becomes a row and back: the part of :mod:`farm.records.storage` that is about the shape
of the data, not about talking to the database.

A record row keeps the fields queries filter on in columns of their own and the whole
record as JSON (``payload``), so a newer farm's fields survive in an older database.
"""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    inspect,
    select,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, RowMapping

from farm.core.errors import ForeignStoreError
from farm.records.model import (
    STORAGE_COMPONENT,
    TUNED,
    CompilationBatchRecord,
    CompilationRecord,
    Record,
    Session,
    TuneRecord,
)

SCHEMA_VERSION = 1
"""Version of the tables below. Bump it with a new entry in ``MIGRATIONS``."""

COMPONENT = STORAGE_COMPONENT
"""Our row in ``schema_version``: what tells our database from someone else's."""



def _v1_metadata() -> MetaData:
    """The tables of schema version 1.

    Kept as a function of its own because the migration that creates version 1 must
    keep creating exactly these tables after later versions change them.
    """
    metadata = MetaData()
    Table(
        "schema_version",
        metadata,
        Column("component", String(64), primary_key=True),
        Column("version", Integer, nullable=False),
    )
    Table(
        "sessions",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=False),
        Column("started_at", DateTime(timezone=True), nullable=False),
        Column("farm_version", String(64), nullable=False),
        Column("label", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("os", String(64), nullable=False),
        Column("arch", String(64), nullable=False),
        Column("host", Text, nullable=False),
    )
    Table(
        "records",
        metadata,
        Column("session_id", BigInteger, primary_key=True, autoincrement=False),
        Column("seq", BigInteger, primary_key=True, autoincrement=False),
        Column("kind", String(64), nullable=False),
        Column("family", Text, nullable=True),
        Column("key", Text, nullable=True),
        Column("outcome", String(16), nullable=True),
        Column("work_s", Float, nullable=True),
        Column("worker", Text, nullable=True),
        Column("host", Text, nullable=True),
        Column("requested_session", BigInteger, nullable=True),
        Column("requested_batch", BigInteger, nullable=True),
        Column("payload", Text, nullable=False),
        Index("records_by_kind", "kind", "session_id", "seq"),
        Index("records_by_requester", "requested_session", "requested_batch"),
    )
    return metadata


# The tables of the current version, used by every query. When version 2 changes them,
# give them a definition of their own here and leave ``_v1_metadata`` as it is.
_METADATA = _v1_metadata()
VERSION_TABLE = _METADATA.tables["schema_version"]
SESSIONS_TABLE = _METADATA.tables["sessions"]
RECORDS_TABLE = _METADATA.tables["records"]
OUR_TABLES = frozenset(_METADATA.tables)


def _create_v1(conn: Connection) -> None:
    """Migration 0 -> 1: create the tables."""
    _v1_metadata().create_all(conn)


Migration = Callable[[Connection], None]

MIGRATIONS: list[Migration] = [_create_v1]
"""``MIGRATIONS[v]`` upgrades a store of version ``v`` to ``v + 1``, in one transaction."""

assert len(MIGRATIONS) == SCHEMA_VERSION, "one migration per schema version"

_PG_MIGRATION_LOCK = 0x6B66_7265_636F_7264  # "kfrecord": serializes concurrent migrate()


def migrate_in(conn: Connection, dialect: str, where: str) -> int:
    """In a write transaction: check the database is ours, bring it to
    ``SCHEMA_VERSION``; the version it was at. PostgreSQL serializes concurrent
    migrations on an advisory lock (SQLite's ``BEGIN IMMEDIATE`` already does)."""
    if dialect == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(_PG_MIGRATION_LOCK)))
    found = version_of(conn, dialect, where)
    upgrade(conn, found)
    return found


def upgrade(conn: Connection, found: int) -> None:
    """Run the migrations from version ``found`` to ``SCHEMA_VERSION`` and note it."""
    for version in range(found, SCHEMA_VERSION):
        MIGRATIONS[version](conn)
        if version == 0:
            conn.execute(VERSION_TABLE.insert().values(component=COMPONENT, version=version + 1))
        else:
            conn.execute(VERSION_TABLE.update().where(VERSION_TABLE.c.component == COMPONENT)
                         .values(version=version + 1))


def version_of(conn: Connection, dialect: str, where: str) -> int:
    """Our schema version in this database (0: none of our tables yet), or
    ForeignStoreError when it is not ours. ``where`` names the database in errors."""
    tables = set(inspect(conn).get_table_names())
    if "schema_version" not in tables:
        clash = tables & OUR_TABLES if dialect == "postgresql" else tables
        if clash:
            raise ForeignStoreError(
                f"{where} is not a kernel-farm records database "
                f"(it holds other tables: {', '.join(sorted(clash)[:5])})"
            )
        return 0
    columns = {column["name"] for column in inspect(conn).get_columns("schema_version")}
    if not {"component", "version"} <= columns:
        raise ForeignStoreError(
            f"{where} is not a kernel-farm records database "
            "(its schema_version table is not ours)"
        )
    row = conn.execute(
        select(VERSION_TABLE.c.version).where(VERSION_TABLE.c.component == COMPONENT)
    ).first()
    if row is None:
        raise ForeignStoreError(
            f"{where} is not a kernel-farm records database "
            "(its schema_version table has no records row)"
        )
    version = int(row[0])
    if version > SCHEMA_VERSION:
        raise ForeignStoreError(
            f"{where} is a records database of schema version {version}; this "
            f"kernel-farm reads up to version {SCHEMA_VERSION}: upgrade kernel-farm"
        )
    return version


RECORD_COLUMNS = ("session_id", "seq", "kind", "family", "key", "outcome", "work_s",
                   "worker", "host", "requested_session", "requested_batch", "payload")
"""The columns of a record row, in the order ``record_row`` gives them."""

assert set(RECORD_COLUMNS) == set(RECORDS_TABLE.columns.keys()), "a record row names every column"


def _insert_records_sql() -> tuple[str, str]:
    """The two dialects' INSERTs of record rows, rendered from the table definition once:
    SQLite's for ``executemany`` (one ``?`` per column), psycopg's from one array per
    column, each a binary parameter (``unnest(%b::bigint[], ...)``). Both skip rows
    whose key is there. Text goes as ``text[]``, never ``varchar(n)[]``: a cast to
    ``varchar(n)`` would cut a value that the column itself refuses."""
    array_type = {int: "bigint[]", float: "double precision[]", str: "text[]"}
    sqlite = sqlite_dialect.dialect().identifier_preparer
    pg = pg_dialect.psycopg.dialect().identifier_preparer
    columns = [RECORDS_TABLE.c[name] for name in RECORD_COLUMNS]
    sqlite_sql = (f"INSERT INTO {sqlite.format_table(RECORDS_TABLE)} "
                  f"({', '.join(sqlite.format_column(c) for c in columns)}) "
                  f"VALUES ({', '.join('?' for _ in columns)}) ON CONFLICT DO NOTHING")
    arrays = ", ".join(f"%b::{array_type[c.type.python_type]}" for c in columns)
    pg_sql = (f"INSERT INTO {pg.format_table(RECORDS_TABLE)} "
              f"({', '.join(pg.format_column(c) for c in columns)}) "
              f"SELECT * FROM unnest({arrays}) ON CONFLICT DO NOTHING")
    return sqlite_sql, pg_sql


SQLITE_INSERT_RECORDS, PG_INSERT_RECORDS = _insert_records_sql()


def record_row(record: Record) -> tuple[Any, ...]:
    """The columns of a record (``RECORD_COLUMNS``): the indexed fields, and the whole
    record as JSON."""
    # the model's serializer itself: model_dump_json() adds a Python call per record
    payload = record.__pydantic_serializer__.to_json(record).decode()
    stamp = record.stamp
    if isinstance(record, CompilationRecord):
        asked = record.requested_by
        return (stamp.session, stamp.seq, record.KIND, record.family, record.key,
                record.outcome.value, record.work_s, record.worker, record.host,
                None if asked is None else asked.session,
                None if asked is None else asked.batch, payload)
    if isinstance(record, CompilationBatchRecord):
        return (stamp.session, stamp.seq, record.KIND, None, None, None, record.work_s,
                None, None, None, None, payload)
    if isinstance(record, TuneRecord):
        asked = record.requested_by
        return (stamp.session, stamp.seq, record.KIND, record.family, record.key, TUNED,
                record.work_s, record.worker, record.host,
                None if asked is None else asked.session,
                None if asked is None else asked.batch, payload)
    raise TypeError(f"not a record: {type(record).__name__}")


def sorted_rows(records: Iterable[Record]) -> list[tuple[Any, ...]]:
    """Record rows in (session, seq) order: one lock order for every writer."""
    return sorted(map(record_row, records), key=SESSION_SEQ)


SESSION_SEQ = operator.itemgetter(0, 1)


def session_row(session: Session) -> dict[str, Any]:
    """The columns of a session. SQLite keeps no zone: every start is stored in UTC so
    both backends read the same."""
    values = session.model_dump(mode="python")
    values["started_at"] = session.started_at.astimezone(dt.UTC)
    return values


def session_from_row(row: RowMapping) -> Session:
    """A stored session; SQLite returns datetimes without zone, and we store UTC."""
    values = dict(row)
    started_at = values["started_at"]
    if isinstance(started_at, dt.datetime) and started_at.tzinfo is None:
        values["started_at"] = started_at.replace(tzinfo=dt.UTC)
    return Session.model_validate(values)
