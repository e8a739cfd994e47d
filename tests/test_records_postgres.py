"""The records storage contract against a real PostgreSQL (the cluster's session storage).

The very tests of ``StorageContract`` (tests/test_records.py) that run on SQLite, each in
a database of its own on the session's PostgreSQL server, plus what only PostgreSQL
allows: other tables beside ours in one database.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from test_records import StorageContract
from test_records_stream import fresh_pg_database

from farm.core.errors import ForeignStoreError
from farm.records import SCHEMA_VERSION, SessionStorage

pytestmark = pytest.mark.integration


@pytest.fixture
def fresh_database(postgres_server: Any) -> Iterator[str]:
    """A new, empty database on the session's server; its URL. Dropped afterwards."""
    with fresh_pg_database(postgres_server) as url:
        yield url


class TestPostgresContract(StorageContract):
    """The storage contract on PostgreSQL."""

    @pytest.fixture
    def url(self, fresh_database: str) -> str:
        return fresh_database


def test_the_url_is_postgresql(fresh_database: str) -> None:
    with SessionStorage(fresh_database) as storage:
        assert storage.dialect == "postgresql"
        assert "farm@" in storage.where


def test_other_tables_beside_ours_are_fine(fresh_database: str) -> None:
    engine = sa.create_engine(fresh_database)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE dashboards (id serial PRIMARY KEY, name text)"))
    engine.dispose()
    with SessionStorage(fresh_database) as storage:
        assert storage.schema_version() == SCHEMA_VERSION


def test_tables_of_our_names_that_are_not_ours_are_refused(fresh_database: str) -> None:
    engine = sa.create_engine(fresh_database)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE sessions (who text, since date)"))
    try:
        with pytest.raises(ForeignStoreError) as caught:
            SessionStorage(fresh_database)
        assert "\n" not in str(caught.value) and "sessions" in str(caught.value)
        with engine.connect() as conn:  # untouched: no table of ours was added
            names = sa.inspect(conn).get_table_names()
        assert sorted(names) == ["sessions"]
    finally:
        engine.dispose()


def test_record_rows_read_back_the_same_through_either_insert(fresh_database: str) -> None:
    """Record rows go to psycopg as one array per column; another driver gets
    SQLAlchemy's executemany. Both store the same rows: every column, NULLs included
    (a batch record has no family; a compilation record may name no build)."""
    from farm.core.outcomes import Outcome
    from farm.records import CompilationBatchRecord, CompilationRecord, RequestedBy, Stamp

    def batch(session: int) -> list[Any]:
        return [
            CompilationRecord(stamp=Stamp(session=session, seq=1, offset_s=0.5),
                              family="axpy", key="k", outcome=Outcome.COMPILED, work_s=0.25,
                              worker="w:1", host="h", requested_by=RequestedBy(session=9,
                                                                              batch=2)),
            CompilationRecord(stamp=Stamp(session=session, seq=2, offset_s=0.5),
                              family="axpy", key="k", outcome=Outcome.LOADED, work_s=0.0),
            CompilationBatchRecord(stamp=Stamp(session=session, seq=3, offset_s=1.0),
                                   kernels=2, compiled=1, loaded=1, wall_s=1.0, label="b"),
        ]

    with SessionStorage(fresh_database) as storage:
        storage.write_records(batch(1))  # arrays
        storage._engine.dialect.driver = "another"  # as if another PostgreSQL driver
        storage.write_records(batch(2))  # SQLAlchemy's executemany
        storage.write_records(batch(2))  # idempotent on this path too
        with storage._engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT * FROM records ORDER BY session_id, seq")
                                ).mappings().all()
    assert len(rows) == 6
    for first, second in zip(rows[:3], rows[3:], strict=True):
        assert {**first, "session_id": 2, "payload": None} == \
            {**second, "payload": None}
    assert rows[0]["requested_session"] == 9 and rows[2]["family"] is None
