"""Records and sessions: the recorder's rules and the session storage contract.

``StorageContract`` holds every test that goes through real storage, written once
against a ``url`` fixture. ``TestSqliteContract`` runs it on SQLite files in tmp_path;
``tests/test_records_postgres.py`` runs the same class against a real PostgreSQL. The
module-level tests are about the model and about SQLite files (foreign files left
byte for byte as they were).
"""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from farm.core.errors import ForeignStoreError, StoreError
from farm.core.model import Key, Lowered
from farm.core.outcomes import Outcome
from farm.records import (
    SCHEMA_VERSION,
    CompilationBatchRecord,
    CompilationRecord,
    Effect,
    Record,
    Recorder,
    RecordLevel,
    RecordsConfig,
    RecordSink,
    RequestedBy,
    Session,
    SessionStorage,
    Stamp,
    StorageSink,
    parse_record,
)
from farm.records.model import BatchCounts, Trip

KEY = "0123456789abcdef.fedcba9876543210"


class FakeClock:
    """A clock that moves 1 ms (monotonic) and 1 s (wall) on every reading."""

    def __init__(self, wall_ns: int = 1_700_000_000_000_000_000) -> None:
        self._wall = wall_ns
        self._mono = 0

    def wall_ns(self) -> int:
        self._wall += 1_000_000_000
        return self._wall

    def monotonic_ns(self) -> int:
        self._mono += 1_000_000
        return self._mono


class FlakySink:
    """Wraps a sink and fails the next ``failures`` writes, like a locked database."""

    def __init__(self, inner: RecordSink, failures: int) -> None:
        self.inner = inner
        self.failures = failures
        self.calls = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise StoreError("records storage: database is locked")

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        self._maybe_fail()
        self.inner.write_session(session, keep_sessions=keep_sessions)

    def write_records(self, records: Sequence[Record]) -> None:
        self._maybe_fail()
        self.inner.write_records(records)

    def close(self) -> None:
        self.inner.close()


def load(recorder: Recorder, work_s: float = 0.002, lowered: Lowered | None = None,
         **extra: object) -> CompilationRecord:
    record = recorder.compilation(Trip(family="axpy", key=KEY, outcome=Outcome.LOADED,
                                       work_s=work_s, **extra),  # type: ignore[arg-type]
                                  lowered)
    assert record is not None
    return record


def compile_(recorder: Recorder, outcome: Outcome = Outcome.COMPILED,
             lowered: Lowered | None = None, **extra: object) -> CompilationRecord:
    record = recorder.compilation(Trip(family="axpy", key=KEY, outcome=outcome, work_s=0.08,
                                       **extra),  # type: ignore[arg-type]
                                  lowered)
    assert record is not None
    return record


def seqs(records: Sequence[Record]) -> list[int]:
    return [r.stamp.seq for r in records]


def set_schema_version(url: str, version: int) -> None:
    """Pretend a newer farm migrated this store."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE schema_version SET version = :v"), {"v": version})
    finally:
        engine.dispose()


def _open_and_record(url: str) -> int:
    """In a child process: open the storage (migrating it along with others) and record."""
    with SessionStorage(url) as storage:
        recorder = Recorder(StorageSink(storage), RecordsConfig(), "concurrent")
        compile_(recorder)
        recorder.close()
        return recorder.session.id


class StorageContract:
    """What records storage does, whatever the database. Subclasses give ``url``."""

    @pytest.fixture
    def url(self) -> str:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    @pytest.fixture
    def storage(self, url: str) -> Iterator[SessionStorage]:
        store = SessionStorage(url)
        yield store
        store.close()

    def recorder(self, storage: SessionStorage, config: RecordsConfig | None = None,
                 label: str = "test", **kwargs: object) -> Recorder:
        return Recorder(StorageSink(storage), config, label, **kwargs)  # type: ignore[arg-type]

    # -- schema ---------------------------------------------------------------------------

    def test_migrate_creates_then_is_idempotent(self, url: str) -> None:
        with SessionStorage(url) as first:
            assert first.schema_version() == SCHEMA_VERSION
            assert first.migrate() == SCHEMA_VERSION  # nothing left to do
        with SessionStorage(url) as again:
            assert again.schema_version() == SCHEMA_VERSION
            assert again.count_sessions() == 0

    def test_newer_schema_version_is_refused_in_one_line(self, url: str) -> None:
        SessionStorage(url).close()
        set_schema_version(url, SCHEMA_VERSION + 1)
        with pytest.raises(ForeignStoreError) as caught:
            SessionStorage(url)
        message = str(caught.value)
        assert "\n" not in message
        assert f"schema version {SCHEMA_VERSION + 1}" in message
        assert "upgrade kernel-farm" in message

    def test_processes_opening_a_new_store_at_once(self, url: str) -> None:
        # Every process of a build opens the store on start: one creates it, none fails.
        with multiprocessing.get_context("spawn").Pool(6) as pool:
            ids = pool.map(_open_and_record, [url] * 6)
        with SessionStorage(url) as storage:
            assert storage.schema_version() == SCHEMA_VERSION
            assert sorted(s.id for s in storage.sessions()) == sorted(ids)
            assert storage.count_records() == 6

    # -- held observed records ----------------------------------------------------------

    def test_observed_records_are_held_until_a_change_then_written_in_order(
        self, storage: SessionStorage
    ) -> None:
        recorder = self.recorder(storage)
        held = [load(recorder) for _ in range(3)]
        assert storage.count_sessions() == 0 and storage.count_records() == 0
        assert recorder.held == 3 and not recorder.written

        changed = compile_(recorder)
        # The change makes the session durable at once, with everything held before it.
        assert storage.sessions() == [recorder.session]
        stored = storage.records(recorder.session.id)
        assert stored == [*held, changed]
        assert seqs(stored) == [1, 2, 3, 4]
        recorder.close()

    def test_observe_only_session_never_reaches_storage(self, storage: SessionStorage) -> None:
        recorder = self.recorder(storage)
        for _ in range(5):
            load(recorder)
        batch = recorder.batch(BatchCounts(kernels=5, loaded=5, wall_s=0.01, work_s=0.01))
        assert batch is not None and batch.effect is Effect.OBSERVES
        recorder.flush()
        recorder.close()
        assert storage.count_sessions() == 0
        assert storage.count_records() == 0

    def test_max_held_drops_the_oldest_and_counts_them(self, storage: SessionStorage) -> None:
        recorder = self.recorder(storage, RecordsConfig(max_held=3))
        loads = [load(recorder) for _ in range(5)]
        assert recorder.held == 3 and recorder.dropped == 2
        changed = compile_(recorder)
        assert storage.records(recorder.session.id) == [*loads[2:], changed]
        recorder.close()

    def test_records_after_the_first_change_are_written_all_by_close(
        self, storage: SessionStorage
    ) -> None:
        recorder = self.recorder(storage, flush_records=10, flush_interval_s=3600.0)
        compile_(recorder)
        for _ in range(14):
            load(recorder)
        # 1 written with the session, then one batch of 10; 4 wait for the next send.
        assert storage.count_records() == 11
        recorder.flush()
        assert storage.count_records() == 15
        for _ in range(3):
            load(recorder)
        recorder.close()
        assert seqs(storage.records(recorder.session.id)) == list(range(1, 19))

    def test_a_batch_record_sends_what_waits(self, storage: SessionStorage) -> None:
        recorder = self.recorder(storage, flush_records=1000, flush_interval_s=3600.0)
        compile_(recorder)
        load(recorder)
        load(recorder)
        assert storage.count_records() == 1
        recorder.batch(BatchCounts(kernels=3, loaded=2, compiled=1, parallelism=4, wall_s=0.2,
                                   work_s=0.3))
        assert storage.count_records() == 4
        recorder.close()

    def test_a_failing_sink_does_not_fail_recording_and_is_retried(
        self, storage: SessionStorage
    ) -> None:
        sink = FlakySink(StorageSink(storage), failures=2)
        recorder = Recorder(sink, RecordsConfig(), "flaky", flush_records=1)
        load(recorder)
        compile_(recorder)  # session write fails: kept, no exception
        compile_(recorder)  # fails again
        assert storage.count_sessions() == 0 and recorder.held == 3
        compile_(recorder)  # now it goes through, everything in order
        assert seqs(storage.records(recorder.session.id)) == [1, 2, 3, 4]
        # flush() and close(), unlike recording, say when records cannot be written.
        sink.failures = 2
        compile_(recorder)  # fails quietly, kept
        with pytest.raises(StoreError):
            recorder.flush()
        assert recorder.held == 1
        recorder.close()
        assert seqs(storage.records(recorder.session.id)) == [1, 2, 3, 4, 5]

    # -- levels ---------------------------------------------------------------------------

    def test_level_off_records_nothing(self, storage: SessionStorage) -> None:
        recorder = self.recorder(storage, RecordsConfig(level=RecordLevel.OFF))
        code = Lowered(source="kernel void k() {}", kernel_names=("k",))
        assert recorder.compilation(Trip(family="axpy", key=KEY, outcome=Outcome.COMPILED,
                                         work_s=0.1), code) is None
        assert recorder.batch(BatchCounts(kernels=1, compiled=1, wall_s=0.1)) is None
        recorder.close()
        assert storage.count_sessions() == 0 and storage.count_records() == 0

    @pytest.mark.parametrize("level", [RecordLevel.BASIC, RecordLevel.FULL])
    def test_levels_basic_and_full(self, storage: SessionStorage, level: RecordLevel) -> None:
        recorder = self.recorder(storage, RecordsConfig(level=level))
        code = Lowered(source="kernel void k() {}", options=("-cl-fast-relaxed-math",),
                       kernel_names=("k",))
        loaded = load(recorder, lowered=code)
        compiled = compile_(recorder, lowered=code)
        rekeyed = compile_(recorder, Outcome.REKEYED, lowered=code)
        recorder.close()
        stored = storage.records(recorder.session.id)
        assert stored == [loaded, compiled, rekeyed]
        by_outcome = {r.outcome: r for r in stored if isinstance(r, CompilationRecord)}
        assert by_outcome[Outcome.LOADED].source is None  # never, at any level
        assert by_outcome[Outcome.LOADED].options is None
        for outcome in (Outcome.COMPILED, Outcome.REKEYED):
            if level is RecordLevel.FULL:
                assert by_outcome[outcome].source == code.source
                assert by_outcome[outcome].options == list(code.options)
            else:
                assert by_outcome[outcome].source is None
                assert by_outcome[outcome].options is None

    # -- keep_sessions --------------------------------------------------------------------

    def _session_with_records(self, storage: SessionStorage, config: RecordsConfig,
                              n: int = 3) -> Recorder:
        recorder = self.recorder(storage, config)
        for _ in range(n - 1):
            load(recorder)
        compile_(recorder)
        recorder.close()
        return recorder

    def test_keep_sessions_prunes_the_oldest_with_all_their_records(
        self, storage: SessionStorage
    ) -> None:
        unlimited = RecordsConfig()
        old = [self._session_with_records(storage, unlimited) for _ in range(3)]
        assert storage.count_sessions() == 3 and storage.count_records() == 9

        kept = self._session_with_records(storage, RecordsConfig(keep_sessions=2))
        assert [s.id for s in storage.sessions()] == [kept.session.id, old[2].session.id]
        assert storage.count_records() == 6
        for gone in old[:2]:
            assert storage.records(gone.session.id) == []
            assert storage.session(gone.session.id) is None
        assert len(storage.records(kept.session.id)) == 3

    def test_keep_sessions_zero_acts_as_one(self, storage: SessionStorage) -> None:
        for _ in range(3):
            self._session_with_records(storage, RecordsConfig())
        kept = self._session_with_records(storage, RecordsConfig(keep_sessions=0))
        assert storage.sessions() == [kept.session]
        assert storage.count_records() == storage.count_records(kept.session.id) == 3

    def test_keep_sessions_unset_keeps_everything(self, storage: SessionStorage) -> None:
        made = [self._session_with_records(storage, RecordsConfig()) for _ in range(6)]
        assert storage.count_sessions() == 6
        assert [s.id for s in storage.sessions()] == [r.session.id for r in reversed(made)]
        assert [s.id for s in storage.sessions(limit=2)] == [r.session.id for r in made[:-3:-1]]

    def test_the_session_being_kept_survives_even_when_older(
        self, storage: SessionStorage
    ) -> None:
        # A long observing process starts first but changes something last.
        first = self._session_with_records(storage, RecordsConfig())
        early = self.recorder(storage, RecordsConfig(keep_sessions=1))
        load(early)
        later = [self._session_with_records(storage, RecordsConfig()) for _ in range(2)]
        assert early.session.id < later[0].session.id
        compile_(early)
        early.close()
        # it survives; the older session goes; the sessions that started after it are
        # never pruned on its account (issue 9: an old id must not wipe newer sessions)
        assert [s.id for s in storage.sessions()] == [
            later[1].session.id, later[0].session.id, early.session.id]
        assert storage.session(first.session.id) is None
        assert seqs(storage.records(early.session.id)) == [1, 2]

    def test_prune_directly(self, storage: SessionStorage) -> None:
        made = [self._session_with_records(storage, RecordsConfig(), n=2) for _ in range(4)]
        assert storage.prune(10) == 0
        assert storage.prune(1, protect=made[0].session.id) == 0  # never the newer ones
        assert storage.prune(2, protect=made[2].session.id) == 2
        assert [s.id for s in storage.sessions()] == [made[3].session.id, made[2].session.id]
        assert storage.prune(0) == 1
        assert [s.id for s in storage.sessions()] == [made[3].session.id]
        assert storage.count_records() == 2

    # -- idempotence, old records, queries ------------------------------------------------

    def test_rewrites_are_idempotent(self, storage: SessionStorage) -> None:
        recorder = self.recorder(storage)
        records: list[Record] = [load(recorder), compile_(recorder)]
        batch = recorder.batch(BatchCounts(kernels=2, loaded=1, compiled=1, wall_s=0.1, work_s=0.1))
        assert batch is not None
        records.append(batch)
        recorder.close()
        # An ingester re-delivering everything, twice, in one call and one by one.
        storage.write_session(recorder.session)
        storage.write_session(recorder.session)
        storage.write_records(records)
        storage.write_records(records + records)
        for record in records:
            storage.write_records([record])
        assert storage.sessions() == [recorder.session]
        assert storage.records(recorder.session.id) == records
        assert storage.count_records() == 3

    def test_a_record_that_names_work_time_duration_still_reads(
        self, storage: SessionStorage, url: str
    ) -> None:
        session = Session.start("old")
        storage.write_session(session)
        payload = {"stamp": {"session": session.id, "seq": 1, "offset_s": 0.5},
                   "family": "axpy", "key": KEY, "outcome": "Compiled", "duration": 0.25}
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text("INSERT INTO records (session_id, seq, kind, payload) "
                            "VALUES (:s, 1, :k, :p)"),
                    {"s": session.id, "k": CompilationRecord.KIND, "p": json.dumps(payload)},
                )
        finally:
            engine.dispose()
        [record] = storage.records(session.id)
        assert isinstance(record, CompilationRecord)
        assert record.work_s == 0.25 and record.outcome is Outcome.COMPILED

    def test_all_records_by_kind_and_by_requesting_session(
        self, storage: SessionStorage
    ) -> None:
        client = self.recorder(storage, label="build qwen")
        client_batch = 7
        worker = self.recorder(storage, label="worker")
        asked = RequestedBy(session=client.session.id, batch=client_batch)
        for_client = [compile_(worker, requested_by=asked), compile_(worker, requested_by=asked)]
        compile_(worker)  # someone else's
        worker_batch = worker.batch(BatchCounts(kernels=3, compiled=3, wall_s=0.3, work_s=0.24))
        client.batch(BatchCounts(kernels=2, compiled=2, wall_s=0.4, work_s=0.16))
        worker.close()
        client.close()
        assert storage.all_records(requested_by_session=client.session.id) == for_client
        batches = storage.all_records(kind=CompilationBatchRecord.KIND)
        assert len(batches) == 2 and worker_batch in batches
        assert all(isinstance(b, CompilationBatchRecord) for b in batches)
        assert len(storage.all_records(kind=CompilationRecord.KIND)) == 3
        assert len(storage.all_records()) == 5

    def test_seq_is_shared_across_kinds_and_increasing_under_threads(
        self, storage: SessionStorage
    ) -> None:
        recorder = self.recorder(storage, flush_records=50)
        threads_n, each = 8, 150
        seen: dict[int, list[int]] = {}
        start = threading.Barrier(threads_n)

        def work(index: int) -> None:
            mine: list[int] = []
            start.wait()
            for i in range(each):
                if i % 5 == 4:
                    record: Record | None = recorder.batch(
                        BatchCounts(kernels=1, compiled=1, wall_s=0.1))
                else:
                    record = recorder.compilation(Trip(family="axpy", key=KEY,
                                                       outcome=Outcome.COMPILED, work_s=0.01))
                assert record is not None
                mine.append(record.stamp.seq)
            seen[index] = mine

        threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        recorder.close()

        total = threads_n * each
        for mine in seen.values():
            assert mine == sorted(mine) and len(set(mine)) == len(mine)
        assert sorted(s for mine in seen.values() for s in mine) == list(range(1, total + 1))
        stored = storage.records(recorder.session.id)
        assert seqs(stored) == list(range(1, total + 1))
        offsets = [r.stamp.offset_s for r in stored]
        assert offsets == sorted(offsets)
        assert {r.KIND for r in stored} == {CompilationRecord.KIND, CompilationBatchRecord.KIND}


class TestSqliteContract(StorageContract):
    """The storage contract on a SQLite file."""

    @pytest.fixture
    def url(self, tmp_path: Path) -> str:
        return f"sqlite:///{tmp_path / 'env' / 'records.sqlite'}"


# -- SQLite files ---------------------------------------------------------------------------


def test_sqlite_file_is_created_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "records.sqlite"
    with SessionStorage(f"sqlite:///{path}") as storage:
        assert storage.dialect == "sqlite"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT component, version FROM schema_version").fetchall() == [
            ("kernel-farm records", SCHEMA_VERSION)
        ]


def test_in_memory_sqlite_works_across_threads() -> None:
    with SessionStorage("sqlite://") as storage:
        recorder = Recorder(StorageSink(storage), label="memory")
        compile_(recorder)
        thread = threading.Thread(target=lambda: compile_(recorder))
        thread.start()
        thread.join()
        recorder.close()
        assert storage.count_records() == 2


def _assert_refused_untouched(path: Path, *expected: str) -> None:
    before = path.read_bytes()
    siblings = sorted(p.name for p in path.parent.iterdir())
    with pytest.raises(ForeignStoreError) as caught:
        SessionStorage(f"sqlite:///{path}")
    message = str(caught.value)
    assert "\n" not in message, message
    assert str(path) in message
    for fragment in expected:
        assert fragment in message
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == siblings


def test_a_file_that_is_not_a_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "records.sqlite"
    path.write_bytes(b"this is a text file, not a database\n" * 200)
    _assert_refused_untouched(path, "not a kernel-farm records database")


def test_another_programs_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "records.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    conn.close()
    _assert_refused_untouched(path, "invoices")


def test_a_newer_schema_version_is_refused_and_the_file_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "records.sqlite"
    url = f"sqlite:///{path}"
    with SessionStorage(url) as storage:
        recorder = Recorder(StorageSink(storage), label="old")
        compile_(recorder)
        recorder.close()
    set_schema_version(url, SCHEMA_VERSION + 1)
    _assert_refused_untouched(path, f"schema version {SCHEMA_VERSION + 1}", "upgrade")


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ForeignStoreError, match="folder"):
        SessionStorage(f"sqlite:///{tmp_path}")


# -- the model ---------------------------------------------------------------------------------


def test_duration_is_read_as_work_s() -> None:
    stamp = {"session": 1, "seq": 1, "offset_s": 0.0}
    old = CompilationRecord.model_validate(
        {"stamp": stamp, "family": "f", "key": KEY, "outcome": "Loaded", "duration": 1.5}
    )
    assert old.work_s == 1.5
    assert "duration" not in old.model_dump()
    batch = parse_record(CompilationBatchRecord.KIND, json.dumps(
        {"stamp": stamp, "kernels": 3, "wall_s": 2.0, "duration": 4.0, "added_later": True}
    ))
    assert isinstance(batch, CompilationBatchRecord) and batch.work_s == 4.0


def test_a_record_round_trips_through_json() -> None:
    record = CompilationRecord(
        stamp=Stamp(session=5, seq=2, offset_s=0.25), family="axpy",
        key=Key.parse(KEY), outcome=Outcome.REKEYED, work_s=0.0, source="src",
        options=["-O2"], requested_by=RequestedBy(session=3, batch=1),
    )
    assert record.key == KEY
    assert parse_record(record.KIND, record.model_dump_json()) == record


def test_loaded_never_carries_code_and_work_is_not_negative() -> None:
    stamp = Stamp(session=1, seq=1, offset_s=0.0)
    loaded = CompilationRecord(stamp=stamp, family="f", key=KEY, outcome=Outcome.LOADED,
                               work_s=0.0, source="x", options=["-O"])
    assert loaded.source is None and loaded.options is None
    with pytest.raises(ValidationError):
        CompilationRecord(stamp=stamp, family="f", key=KEY, outcome=Outcome.COMPILED,
                          work_s=-1.0)


def test_effects() -> None:
    stamp = Stamp(session=1, seq=1, offset_s=0.0)

    def one(outcome: Outcome) -> Effect:
        return CompilationRecord(stamp=stamp, family="f", key=KEY, outcome=outcome,
                                 work_s=0.0).effect

    assert one(Outcome.LOADED) is Effect.OBSERVES
    assert one(Outcome.COMPILED) is Effect.CHANGES
    assert one(Outcome.REKEYED) is Effect.CHANGES

    def batch(**counts: int) -> CompilationBatchRecord:
        return CompilationBatchRecord(stamp=stamp, kernels=4, wall_s=1.0, **counts)

    assert batch(loaded=3, failed=1).effect is Effect.OBSERVES
    assert batch(loaded=3, rekeyed=1).effect is Effect.CHANGES
    assert batch(compiled=4).changes


def test_sessions_have_unique_increasing_ids_and_describe_the_process() -> None:
    clock = FakeClock()
    sessions = [Session.start("same tick", clock) for _ in range(3)]
    sessions += [Session.start("now") for _ in range(100)]
    ids = [s.id for s in sessions]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    first = sessions[0]
    assert first.started_at.tzinfo is not None and first.label == "same tick"
    assert first.pid > 0 and first.host and first.os and first.arch and first.farm_version


def test_stamps_measure_offsets_on_the_monotonic_clock(tmp_path: Path) -> None:
    with SessionStorage(f"sqlite:///{tmp_path / 'r.sqlite'}") as storage:
        recorder = Recorder(StorageSink(storage), RecordsConfig(), "clock", clock=FakeClock())
        first = compile_(recorder)
        second = compile_(recorder)
        recorder.close()
    assert first.stamp.offset_s > 0
    assert second.stamp.offset_s > first.stamp.offset_s


def test_recording_after_close_is_ignored(tmp_path: Path) -> None:
    with SessionStorage(f"sqlite:///{tmp_path / 'r.sqlite'}") as storage:
        recorder = Recorder(StorageSink(storage), label="closed")
        compile_(recorder)
        recorder.close()
        recorder.close()  # idempotent
        assert recorder.compilation(Trip(family="f", key=KEY, outcome=Outcome.COMPILED,
                                         work_s=0.1)) is None
        assert recorder.batch(BatchCounts(kernels=1, compiled=1, wall_s=0.1)) is None
        assert storage.count_records() == 1


def test_an_owning_sink_closes_its_storage(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    sink = StorageSink.open(f"sqlite:///{path}")
    assert isinstance(sink, RecordSink)  # the embedded transport keeps the protocol
    with Recorder(sink, label="owned") as recorder:
        compile_(recorder)
    assert recorder.closed
    with SessionStorage(f"sqlite:///{path}") as storage:
        assert storage.count_records() == 1


def test_an_interrupt_in_the_first_write_stays_the_error_shown(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """CI, stop 38: SIGTERM reached ``farm build`` while its first records write was
    importing SQLAlchemy; the write at close then failed on the half-imported module and
    that ``AttributeError`` replaced the interrupt, traceback and all."""
    opened: list[int] = []

    def interrupted_then_broken() -> SessionStorage:
        opened.append(1)
        if len(opened) == 1:
            raise KeyboardInterrupt("SIGTERM")
        raise AttributeError("module 'sqlalchemy' has no attribute 'dialects'")

    recorder = Recorder(StorageSink(interrupted_then_broken), label="interrupted")
    with pytest.raises(KeyboardInterrupt), caplog.at_level("WARNING"), recorder:
        compile_(recorder)  # the first change writes the session: interrupted here
    assert recorder.closed and len(opened) == 2  # close tried once more, and only warned
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"records: the last records of session {recorder.session.id} were "
                      "not written (module 'sqlalchemy' has no attribute 'dialects')"]
    # leaving the block without an error, records that cannot be written are still one
    broken = Recorder(FlakySink(StorageSink.open(f"sqlite:///{tmp_path / 'r.sqlite'}"),
                                failures=5), label="broken")
    with pytest.raises(StoreError), broken:
        compile_(broken)
    assert broken.closed
