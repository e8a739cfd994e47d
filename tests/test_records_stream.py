"""The Redis-stream records transport: what a producer puts in the streams, and when.

Unit tests (choice of transport, the envelope, the recorder's reserved batch seq and
autoflush) run without services; the rest use the session's real Redis, each test in a
flushed database of this module's own. Helpers shared by ``test_ingest.py`` and
``test_records_cli.py`` live here: starting ``farm ingest`` as a separate process, a
fresh PostgreSQL database, reading the streams.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from farm.core.errors import SettingsError
from farm.core.keys import RECORDS_GROUP, RECORDS_SESSIONS_STREAM, records_stream_for
from farm.core.outcomes import Outcome
from farm.core.settings import Settings
from farm.records import (
    CompilationBatchRecord,
    CompilationRecord,
    Record,
    Recorder,
    RecordsConfig,
    RequestedBy,
    Session,
    SessionStorage,
    Stamp,
    StorageSink,
)
from farm.records.ingest import record_streams
from farm.records.model import BatchCounts, Trip
from farm.records.open import open_recorder, records_transport
from farm.records.stream import (
    PACK_MAX_RECORDS,
    EntryError,
    RedisStreamSink,
    decode_record,
    decode_records,
    decode_session,
    encode_packs,
    encode_record,
    encode_session,
)

KEY = "0123456789abcdef.fedcba9876543210"
COMPILATION_STREAM = records_stream_for(CompilationRecord.KIND)
BATCH_STREAM = records_stream_for(CompilationBatchRecord.KIND)


# -- helpers shared with test_ingest.py and test_records_cli.py --------------------------


def farm_argv(command: str, *args: str) -> list[str]:
    """``python -m farm COMMAND ...`` once the ``farm`` command mounts COMMAND; until then
    the module's own entry point (``python -m farm.cli.COMMAND``), same code and options."""
    from farm.cli.main import app

    mounted = {c.name for c in app.registered_commands}
    mounted |= {g.name for g in app.registered_groups}
    if command in mounted:
        return [sys.executable, "-m", "farm", command, *args]
    return [sys.executable, "-m", f"farm.cli.{command}", *args]


def service_env(redis_url: str, records_url: str, home: Path, **extra: str) -> dict[str, str]:
    """Environment of a farm process using these Redis and records storage."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update({"FARM_REDIS_URL": redis_url, "FARM_RECORDS_URL": records_url,
                "FARM_HOME": str(home)})
    env.update(extra)
    return env


class IngesterProcess:
    """A ``farm ingest`` running as a separate process, its stderr in a file."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        self._stdout = log.with_suffix(".json")
        with open(log, "wb") as err, open(self._stdout, "wb") as out:
            self.process = subprocess.Popen(
                farm_argv("ingest", "--json", *args), env=env, stdout=out, stderr=err,
                stdin=subprocess.DEVNULL)

    @property
    def consumer(self) -> str:
        """The consumer name it uses (host:pid unless --name was given)."""
        import socket

        return f"{socket.gethostname()}:{self.process.pid}"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_started(self, timeout: float = 30.0) -> None:
        """Until it has opened storage and is about to read."""
        deadline = time.monotonic() + timeout
        while " -> " not in self.text():
            assert self.process.poll() is None, f"ingester exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"ingester not started:\n{self.text()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for it to exit by itself (``--drain``); its final counts."""
        code = self.process.wait(timeout=timeout)
        assert code == 0, f"ingester exit {code}:\n{self.text()}"
        return dict(json.loads(self._stdout.read_text()))

    def terminate(self, timeout: float = 30.0) -> dict[str, Any]:
        """SIGTERM, then its final counts; it must stop cleanly (exit 0)."""
        self.process.terminate()
        return self.finish(timeout)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        self.process.kill()
        self.process.wait(timeout=30)

    def ensure_gone(self) -> None:
        if self.process.poll() is None:
            self.kill()


def drain(env: dict[str, str], log: Path, *args: str) -> dict[str, Any]:
    """Run ``farm ingest --drain`` to the end; its final counts."""
    return IngesterProcess(env, log, "--drain", "--block-ms", "100", *args).finish()


@contextlib.contextmanager
def fresh_pg_database(postgres_server: Any) -> Iterator[str]:
    """A new, empty database on the session's PostgreSQL server; its URL; dropped after."""
    admin_url = sa.make_url(postgres_server.url)
    name = f"records_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield admin_url.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def entries(client: Any, stream: str) -> list[tuple[str, dict[str, str]]]:
    """Every entry of a stream, as text."""
    return [(i.decode(), {k.decode(): v.decode() for k, v in fields.items()})
            for i, fields in client.xrange(stream)]


def pending_total(client: Any) -> int:
    """Entries read by some ingester and not acknowledged, over every records stream."""
    total = 0
    for stream in record_streams():
        if client.exists(stream):
            with contextlib.suppress(redis.ResponseError):  # no group yet
                total += int(client.xpending(stream, RECORDS_GROUP)["pending"])
    return total


def seqs(records: Sequence[Record]) -> list[int]:
    return [r.stamp.seq for r in records]


def stream_records(client: Any, stream: str) -> list[Record]:
    """Every record of a stream, in order, whether its entries are packs or single."""
    found: list[Record] = []
    for _, fields in entries(client, stream):
        decoded = decode_records(fields)
        assert not decoded.bad
        found.extend(decoded.records)
    return found


# -- fixtures ---------------------------------------------------------------------------




def _compile(recorder: Recorder, outcome: Outcome = Outcome.COMPILED, **extra: Any) -> None:
    assert recorder.compilation(Trip(family="axpy", key=KEY, outcome=outcome, work_s=0.05,
                                     **extra)) is not None


# -- choosing the transport (no services) -----------------------------------------------


def test_the_transport_follows_the_settings(tmp_path: Path) -> None:
    embedded = Settings(home=tmp_path, redis_url=None)
    assert records_transport(embedded) == "storage"
    recorder = open_recorder(embedded, "embedded")
    assert isinstance(recorder._sink, StorageSink)
    recorder.close()

    cluster = Settings(home=tmp_path, redis_url="redis://127.0.0.1:1/0")
    assert records_transport(cluster) == "stream"
    recorder = open_recorder(cluster, "worker")
    assert isinstance(recorder._sink, RedisStreamSink)
    assert recorder._flusher is not None  # a cluster process sends idle records by itself
    recorder.close()  # nothing changed: nothing is sent, so no Redis is needed

    forced = Settings(home=tmp_path, redis_url="redis://127.0.0.1:1/0",
                      records_transport="storage")
    assert records_transport(forced) == "storage"
    with pytest.raises(SettingsError, match="FARM_REDIS_URL"):
        records_transport(Settings(home=tmp_path, redis_url=None, records_transport="stream"))


def test_entries_round_trip_and_refusals() -> None:
    session = Session.start("round trip")
    back = decode_session(encode_session(session, 3))
    assert back.session == session and back.keep_sessions == 3
    assert decode_session(encode_session(session, None)).keep_sessions is None

    recorder = Recorder(StorageSink(SessionStorage("sqlite://")), label="x")
    _compile(recorder, requested_by=RequestedBy(session=7, batch=2))
    recorder.flush()
    (record,) = recorder._sink.storage.records(recorder.session.id)  # type: ignore[attr-defined]
    fields = {k.encode(): v.encode() for k, v in encode_record(record).items()}  # as Redis gives
    assert decode_record(fields) == record

    with pytest.raises(EntryError) as bad:
        decode_record({**encode_record(record), "record": '{"stamp": {}}'})
    assert not bad.value.retry_later  # malformed: set aside, never retried
    with pytest.raises(EntryError) as newer_kind:
        decode_record({**encode_record(record), "kind": "records/v2/compilation"})
    assert newer_kind.value.retry_later  # a newer ingester can read it
    with pytest.raises(EntryError) as newer_envelope:
        decode_session({**encode_session(session, None), "v": "2"})
    assert newer_envelope.value.retry_later
    recorder.close()


def _records(count: int, session: int = 5) -> list[CompilationRecord]:
    return [CompilationRecord(stamp=Stamp(session=session, seq=seq, offset_s=0.01 * seq),
                              family="axpy", key=f"{seq:032x}.{'ab' * 12}",
                              outcome=Outcome.COMPILED, work_s=0.01)
            for seq in range(1, count + 1)]


def test_a_send_travels_as_packs_per_kind_split_by_size() -> None:
    compiled = _records(60)
    batch = CompilationBatchRecord(stamp=Stamp(session=5, seq=61, offset_s=1.0), kernels=60,
                                   compiled=60, wall_s=1.0)
    big = compiled[0].model_copy(update={"stamp": Stamp(session=5, seq=62, offset_s=1.0),
                                         "source": "x" * 5000})
    packs = encode_packs([*compiled, batch, big], max_bytes=4096)
    assert {stream for stream, _ in packs} == {COMPILATION_STREAM, BATCH_STREAM}
    for _, fields in packs:
        assert fields["v"] == "2" and fields["kind"] in (CompilationRecord.KIND,
                                                         CompilationBatchRecord.KIND)
        assert len(fields["records"]) <= 4096 or fields["records"].count('"stamp"') == 1
    back = [decode_records(fields) for _, fields in packs]
    assert all(not d.bad for d in back)
    by_stream = {s: [r for (stream, _), d in zip(packs, back, strict=True) if stream == s
                     for r in d.records] for s in (COMPILATION_STREAM, BATCH_STREAM)}
    assert by_stream[COMPILATION_STREAM] == [*compiled, big]  # in order, nothing lost
    assert by_stream[BATCH_STREAM] == [batch]
    assert len(packs) > 3  # 60 records of ~0.3 KB do not fit one 4 KB pack
    big_pack = next(f for _, f in packs if '"xxxxx' in f["records"])
    assert decode_records(big_pack).records == [big]  # over the limit: alone


def test_one_record_entries_still_decode() -> None:
    """Entries of producers before packs (version 1) read as a pack of one."""
    (record,) = _records(1)
    fields = {k.encode(): v.encode() for k, v in encode_record(record).items()}
    decoded = decode_records(fields)
    assert decoded.records == [record] and not decoded.bad
    with pytest.raises(EntryError, match="does not validate"):  # a bad one: whole entry
        decode_records({**encode_record(record), "record": '{"stamp": {}}'})


def test_a_bad_record_in_a_pack_costs_only_itself() -> None:
    good = [json.loads(r.model_dump_json()) for r in _records(4)]
    hostile = [good[0], {**good[1], "stamp": {**good[1]["stamp"], "seq": 2**63}}, good[2],
               5, {**good[3], "work_s": "Infinity"}, {"stamp": {}}]
    fields = {"v": "2", "kind": CompilationRecord.KIND, "records": json.dumps(hostile)}
    decoded = decode_records(fields)
    assert decoded.records == [CompilationRecord.model_validate(good[i]) for i in (0, 2)]
    assert [b.index for b in decoded.bad] == [1, 3, 4, 5]
    for bad in decoded.bad:
        assert bad.fields["v"] == "1" and bad.fields["kind"] == CompilationRecord.KIND
        assert json.loads(bad.fields["record"]) == hostile[bad.index]  # kept as it came
        assert f"record {bad.index} of a pack of 6" in str(bad.error)
        assert "\n" not in str(bad.error) and not bad.error.retry_later
        with pytest.raises(EntryError):  # sent again alone, it is refused alone
            decode_record(bad.fields)
    assert "stamp.seq" in str(decoded.bad[0].error)


@pytest.mark.parametrize(("records", "reason"), [
    ("{not json", "malformed"),
    ('{"stamp": {}}', "malformed"),  # an object, not an array
    ("[]", "malformed"),  # a pack holds at least one record
    ("[" + ",".join(["{}"] * (PACK_MAX_RECORDS + 1)) + "]", "malformed"),
    (None, "malformed"),  # no records field at all
])
def test_a_malformed_pack_is_refused_whole(records: str | None, reason: str) -> None:
    fields = {"v": "2", "kind": CompilationRecord.KIND}
    if records is not None:
        fields["records"] = records
    with pytest.raises(EntryError, match=reason) as refused:
        decode_records(fields)
    assert "\n" not in str(refused.value) and not refused.value.retry_later


def test_packs_of_a_newer_kind_or_envelope_wait_for_a_newer_ingester() -> None:
    pack = encode_packs(_records(2))[0][1]
    with pytest.raises(EntryError) as kind:
        decode_records({**pack, "kind": "records/v2/compilation"})
    assert kind.value.retry_later
    with pytest.raises(EntryError) as envelope:
        decode_records({**pack, "v": "3"})
    assert envelope.value.retry_later


# -- recorder additions the cluster relies on (no services) ------------------------------


def test_a_batch_record_takes_its_reserved_seq_and_records_reach_the_sink_in_order() -> None:
    storage = SessionStorage("sqlite://")
    recorder = Recorder(StorageSink(storage), label="client")
    reserved = recorder.reserve_seq()
    _compile(recorder)  # seq 2, sent at once (the first change)
    _compile(recorder, Outcome.LOADED)  # seq 3, held
    batch = recorder.batch(BatchCounts(kernels=2, compiled=1, loaded=1, wall_s=0.2), seq=reserved)
    assert batch is not None and batch.stamp.seq == reserved == 1
    assert batch.stamp.offset_s > 0  # stamped when the batch ended, not when reserved
    with pytest.raises(ValueError, match="not reserved"):
        recorder.batch(BatchCounts(kernels=0, wall_s=0.0), seq=reserved)  # each reserved seq once
    with pytest.raises(ValueError, match="not reserved"):
        recorder.batch(BatchCounts(kernels=0, wall_s=0.0), seq=3)
    recorder.close()
    assert seqs(storage.records(recorder.session.id)) == [1, 2, 3]


class ListSink:
    """Keeps what it is given, for counting."""

    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self.records: list[Record] = []

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        self.sessions.append(session)

    def write_records(self, records: Sequence[Record]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("autoflush", [True, False])
def test_autoflush_sends_records_of_an_idle_process(autoflush: bool) -> None:
    sink = ListSink()
    recorder = Recorder(sink, label="worker", flush_interval_s=0.05, autoflush=autoflush)
    _compile(recorder)  # the first change goes at once
    _compile(recorder)  # then records wait for the next send
    assert len(sink.records) == 1
    time.sleep(0.4)  # the worker is idle: no record comes to trigger a send
    assert len(sink.records) == (2 if autoflush else 1)
    recorder.close()
    assert len(sink.records) == 2


# -- the sink against a real Redis ---------------------------------------------------------

@pytest.mark.integration
def test_an_observe_only_session_never_reaches_the_streams_nor_storage(
    client: Any, redis_url: str, tmp_path: Path
) -> None:
    recorder = Recorder(RedisStreamSink.open(redis_url), label="loader")
    for _ in range(5):
        _compile(recorder, Outcome.LOADED)
    # a batch that only loaded observes too
    recorder.batch(BatchCounts(kernels=5, loaded=5, wall_s=0.01))
    recorder.close()
    assert not recorder.written
    assert client.keys("farm:records:*") == []

    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    counts = drain(service_env(redis_url, url, tmp_path), tmp_path / "ingest.log")
    assert counts["records"] == counts["sessions"] == 0
    with SessionStorage(url) as storage:
        assert storage.count_sessions() == storage.count_records() == 0


@pytest.mark.integration
def test_a_changing_session_goes_first_then_its_held_records_in_order(
    client: Any, redis_url: str, tmp_path: Path
) -> None:
    calls: list[str] = []

    class Spy(RedisStreamSink):
        def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
            calls.append("session")
            super().write_session(session, keep_sessions=keep_sessions)

        def write_records(self, records: Sequence[Record]) -> None:
            calls.append(f"records {len(records)}")
            super().write_records(records)

    sink = Spy(redis.Redis.from_url(redis_url), owns=True)
    recorder = Recorder(sink, RecordsConfig(keep_sessions=4), label="build tiny")
    for _ in range(3):
        _compile(recorder, Outcome.LOADED)  # held: nothing in Redis yet
    assert client.keys("farm:records:*") == []
    _compile(recorder)  # the first change: session, then the held loads and it
    recorder.batch(BatchCounts(kernels=4, loaded=3, compiled=1, wall_s=0.3))
    recorder.close()

    (session_entry,) = entries(client, RECORDS_SESSIONS_STREAM)
    decoded = decode_session(session_entry[1])
    assert decoded.session.id == recorder.session.id and decoded.keep_sessions == 4
    compiled = entries(client, COMPILATION_STREAM)
    assert len(compiled) == 1  # the four records of one send travel as one pack
    records = stream_records(client, COMPILATION_STREAM)
    assert seqs(records) == [1, 2, 3, 4]
    assert [r.outcome for r in records] == [Outcome.LOADED] * 3 + [  # type: ignore[union-attr]
        Outcome.COMPILED]
    (batch_entry,) = entries(client, BATCH_STREAM)
    assert seqs(decode_records(batch_entry[1]).records) == [5]

    # The session went to Redis first, then the held records with the change, together.
    assert calls == ["session", "records 4", "records 1"]

    def entry_id(text: str) -> tuple[int, int]:
        ms, seq = text.split("-")
        return int(ms), int(seq)

    # Ids of different streams count separately: within one millisecond they may be equal.
    assert entry_id(session_entry[0]) <= min(entry_id(i) for i, _ in compiled)

    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    counts = drain(service_env(redis_url, url, tmp_path), tmp_path / "ingest.log")
    assert (counts["sessions"], counts["records"]) == (1, 5)
    with SessionStorage(url) as storage:
        assert [s.id for s in storage.sessions()] == [recorder.session.id]
        assert seqs(storage.records(recorder.session.id)) == [1, 2, 3, 4, 5]


@pytest.mark.integration
def test_the_cap_trims_approximately(client: Any, redis_url: str) -> None:
    sink = RedisStreamSink.open(redis_url, maxlen=100)
    recorder = Recorder(sink, label="many", flush_records=1)  # one record per entry
    for _ in range(1000):
        _compile(recorder)
    recorder.close()
    length = client.xlen(COMPILATION_STREAM)
    node = int(client.config_get("stream-node-max-entries")["stream-node-max-entries"])
    # The cap counts entries: at least the cap is kept; whole nodes go, so up to about
    # a node more stays.
    assert 100 <= length <= 100 + 2 * node, length
    assert length < 1000
    newest = stream_records(client, COMPILATION_STREAM)
    assert newest[-1].stamp.seq == 1000  # the oldest go, never the newest
    assert seqs(newest) == list(range(1001 - length, 1001))


def test_a_producer_without_redis_keeps_its_records_and_does_not_fail() -> None:
    recorder = Recorder(RedisStreamSink.open("redis://127.0.0.1:1/0"), label="offline")
    _compile(recorder)  # the sink raises inside: recording goes on, the record is kept
    _compile(recorder)
    assert recorder.held == 2 and not recorder.written
    with pytest.raises(redis.ConnectionError):
        recorder.close()  # the end of a build reports what could not be written
