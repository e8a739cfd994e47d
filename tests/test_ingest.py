"""The ingester for real: ``farm ingest`` processes against real Redis, SQLite and PostgreSQL.

Producers and ingesters are separate processes, as in a cluster; an ingester is killed
with SIGKILL (no clean-up at all) while records flow. What must hold: every record in
storage exactly once (by session and seq), nothing left pending, the work shared by
ingesters running at once, entries a dead ingester held claimed by another.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_records_stream import (
    KEY,
    IngesterProcess,
    drain,
    fresh_pg_database,
    pending_total,
    seqs,
    service_env,
)

from farm.core.keys import RECORDS_DEAD_STREAM, RECORDS_GROUP, records_stream_for
from farm.core.outcomes import Outcome
from farm.records import (
    CompilationRecord,
    Recorder,
    RecordsConfig,
    SessionStorage,
    Stamp,
)
from farm.records.ingest import Ingester, record_streams
from farm.records.model import Trip
from farm.records.stream import RedisStreamSink, encode_packs, encode_record

pytestmark = pytest.mark.integration

COMPILATION_STREAM = records_stream_for(CompilationRecord.KIND)

PRODUCER = r"""
import sys, time
from farm.core.outcomes import Outcome
from farm.records import Recorder, RecordsConfig
from farm.records.model import Trip
from farm.records.stream import RedisStreamSink

url, count, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
recorder = Recorder(RedisStreamSink.open(url), RecordsConfig(), "producer", flush_records=25)
print(recorder.session.id, flush=True)
for i in range(count):
    recorder.compilation(Trip(family="axpy", key=f"{i:016x}.{0:016x}", outcome=Outcome.COMPILED,
                              work_s=0.001))
    if pause and i % 25 == 24:
        time.sleep(pause)
recorder.close()
"""


class Producer:
    """A process appending ``count`` records of one session, ``pause`` s every 25."""

    def __init__(self, redis_url: str, count: int, pause: float) -> None:
        self.count = count
        self.process = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, redis_url, str(count), str(pause)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.session = int(self.process.stdout.readline())

    def finish(self, timeout: float = 120.0) -> None:
        _, err = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, err


@pytest.fixture(params=["sqlite", "postgresql"])
def records_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The same tests on both storages: one code path, two databases."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'records.sqlite'}"
    else:
        with fresh_pg_database(request.getfixturevalue("postgres_server")) as url:
            yield url


@pytest.fixture
def ingesters() -> Iterator[list[IngesterProcess]]:
    """Ingesters a test starts; any still running at the end are killed."""
    started: list[IngesterProcess] = []
    yield started
    for ingester in started:
        ingester.ensure_gone()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def count_in(url: str, session: int | None = None) -> int:
    with SessionStorage(url) as storage:
        return storage.count_records(session)


def consumer_pending(client: Any, consumer: str) -> int:
    """Entries pending under one consumer, over every stream."""
    total = 0
    for stream in record_streams():
        for row in client.xinfo_consumers(stream, RECORDS_GROUP):
            if row["name"].decode() == consumer:
                total += int(row["pending"])
    return total


def test_an_ingester_killed_mid_flow_loses_nothing_and_duplicates_nothing(
    client: Any, redis_url: str, records_url: str, tmp_path: Path,
    ingesters: list[IngesterProcess],
) -> None:
    env = service_env(redis_url, records_url, tmp_path)
    first = IngesterProcess(env, tmp_path / "first.log", "--batch", "20", "--block-ms", "100")
    ingesters.append(first)
    first.wait_started()
    producer = Producer(redis_url, count=3000, pause=0.02)  # about 2.5 s of records

    wait_for(lambda: count_in(records_url) >= 400, 60, "the first ingester to write")
    # Kill it in the middle of a batch if we can catch one (read, not yet acknowledged).
    deadline = time.monotonic() + 5
    while consumer_pending(client, first.consumer) == 0 and time.monotonic() < deadline:
        pass
    first.kill()  # SIGKILL while records flow: its read, unacknowledged entries stay pending
    held_by_dead = consumer_pending(client, first.consumer)
    written_before = count_in(records_url)
    assert written_before < 3000, "the flow ended before the kill: nothing was tested"

    second = IngesterProcess(env, tmp_path / "second.log", "--batch", "200", "--block-ms",
                             "100", "--claim-idle-ms", "500")
    ingesters.append(second)
    producer.finish()
    wait_for(lambda: count_in(records_url) >= 3000, 90, "every record in storage")
    wait_for(lambda: pending_total(client) == 0, 30, "nothing left pending")
    counts = second.terminate()

    with SessionStorage(records_url) as storage:
        stored = storage.records(producer.session)
        assert seqs(stored) == list(range(1, 3001))  # each once, none missing
        assert storage.count_records() == 3000
        assert [s.id for s in storage.sessions()] == [producer.session]
    assert consumer_pending(client, first.consumer) == 0
    print(f"pending under the killed ingester: {held_by_dead}; claimed: {counts['claimed']}")
    if held_by_dead:  # what the dead one held was taken over, not waited for for ever
        assert counts["claimed"] >= held_by_dead
    assert counts["lost"] == counts["dead"] == counts["failures"] == 0
    assert "stopped" in second.text()


def test_two_ingesters_at_once_share_the_work_without_duplicates(
    client: Any, redis_url: str, records_url: str, tmp_path: Path,
    ingesters: list[IngesterProcess],
) -> None:
    env = service_env(redis_url, records_url, tmp_path)
    for name in ("a", "b"):
        ingesters.append(IngesterProcess(env, tmp_path / f"{name}.log", "--batch", "25",
                                         "--block-ms", "100"))
    for ingester in ingesters:
        ingester.wait_started()
    producers = [Producer(redis_url, count=1500, pause=0.01) for _ in range(2)]
    for producer in producers:
        producer.finish()
    wait_for(lambda: count_in(records_url) >= 3000, 90, "every record in storage")
    wait_for(lambda: pending_total(client) == 0, 30, "nothing left pending")
    counts = [ingester.terminate() for ingester in ingesters]

    with SessionStorage(records_url) as storage:
        for producer in producers:
            assert seqs(storage.records(producer.session)) == list(range(1, 1501))
        assert storage.count_records() == 3000
    # The group gave each entry to one of them: together they read each record once.
    assert sum(c["records"] for c in counts) == 3000
    assert sum(c["sessions"] for c in counts) == 2
    assert all(c["records"] > 0 for c in counts), counts


def test_entries_a_dead_ingester_held_are_claimed(
    client: Any, redis_url: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    recorder = Recorder(RedisStreamSink.open(redis_url), label="build", flush_records=10)
    for i in range(40):
        recorder.compilation(Trip(family="axpy", key=f"{i:032x}", outcome=Outcome.COMPILED,
                                  work_s=0.01))
    recorder.close()
    # An ingester that read everything and died before writing (as if SIGKILLed).
    with SessionStorage("sqlite://") as scratch:
        Ingester(client, scratch, consumer="dead-one").ensure_groups()
    got = client.xreadgroup(RECORDS_GROUP, "dead-one",
                            {COMPILATION_STREAM: ">", "farm:records:sessions": ">"})
    # the session, then packs: the first change alone, then one per 10 records
    assert sum(len(messages) for _, messages in got) == 1 + 5
    time.sleep(0.3)

    counts = drain(service_env(redis_url, url, tmp_path), tmp_path / "ingest.log",
                   "--claim-idle-ms", "200")
    assert counts["claimed"] == 1 + 5
    assert (counts["records"], counts["sessions"]) == (40, 1)
    assert pending_total(client) == 0
    with SessionStorage(url) as storage:
        assert seqs(storage.records(recorder.session.id)) == list(range(1, 41))


def test_a_restart_under_the_same_name_rereads_its_own_pending_entries_at_once(
    client: Any, redis_url: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    recorder = Recorder(RedisStreamSink.open(redis_url), label="build")
    for i in range(5):
        recorder.compilation(Trip(family="axpy", key=f"{i:032x}", outcome=Outcome.COMPILED,
                                  work_s=0.01))
    recorder.close()
    with SessionStorage("sqlite://") as scratch:
        Ingester(client, scratch, consumer="ingester-0").ensure_groups()
    client.xreadgroup(RECORDS_GROUP, "ingester-0",
                      {COMPILATION_STREAM: ">", "farm:records:sessions": ">"})
    # No idle wait (claims would need a minute): its own pending entries come first.
    counts = drain(service_env(redis_url, url, tmp_path), tmp_path / "ingest.log",
                   "--name", "ingester-0")
    assert counts["claimed"] == 0 and counts["records"] == 5
    assert pending_total(client) == 0


def test_keep_sessions_is_applied_by_the_ingester(
    client: Any, redis_url: str, records_url: str, tmp_path: Path
) -> None:
    ids = []
    for n in range(4):
        recorder = Recorder(RedisStreamSink.open(redis_url), RecordsConfig(keep_sessions=2),
                            label=f"build {n}")
        for _ in range(3):
            recorder.compilation(Trip(family="axpy", key=KEY, outcome=Outcome.COMPILED,
                                      work_s=0.01))
        recorder.close()
        ids.append(recorder.session.id)
    # A session that carries no keep_sessions: the ingester's own applies (here 3).
    other = Recorder(RedisStreamSink.open(redis_url), RecordsConfig(), label="no keep")
    other.compilation(Trip(family="axpy", key=KEY, outcome=Outcome.COMPILED, work_s=0.01))
    other.close()

    counts = drain(service_env(redis_url, records_url, tmp_path), tmp_path / "ingest.log",
                   "--batch", "1", "--keep-sessions", "3")
    assert counts["pruned"] >= 2
    with SessionStorage(records_url) as storage:
        kept = [s.id for s in storage.sessions()]
        assert kept == [other.session.id, ids[3], ids[2]]
        assert storage.count_records() == 3 + 3 + 1  # pruned with all their records
        for gone in ids[:2]:
            assert storage.count_records(gone) == 0


def test_bad_and_newer_entries_are_set_aside_never_left_pending(
    client: Any, redis_url: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    record = CompilationRecord(stamp=Stamp(session=1, seq=1, offset_s=0.1), family="axpy",
                               key=KEY, outcome=Outcome.COMPILED, work_s=0.01)
    good = encode_record(record)
    client.xadd(COMPILATION_STREAM, {**good, "record": "{not json"})
    client.xadd(COMPILATION_STREAM, good)
    client.xadd(COMPILATION_STREAM, {**good, "kind": "records/v9/compilation"})

    counts = drain(service_env(redis_url, url, tmp_path), tmp_path / "ingest.log")
    assert (counts["records"], counts["dead"], counts["deferred"]) == (1, 1, 1)
    dead, newer = client.xrange(RECORDS_DEAD_STREAM)
    assert b"does not validate" in dead[1][b"dead:error"]
    assert dead[1][b"dead:stream"] == COMPILATION_STREAM.encode()
    assert b"dead:newer" not in dead[1]
    assert newer[1][b"dead:newer"] == b"1" and newer[1][b"kind"] == b"records/v9/compilation"
    assert pending_total(client) == 0  # nothing waits for ever
    with SessionStorage(url) as storage:
        assert storage.records(1) == [record]  # the bad one blocked nothing


def test_old_and_packed_entries_mix_and_a_bad_record_costs_only_itself(
    client: Any, redis_url: str, records_url: str, tmp_path: Path
) -> None:
    """One stream holding what producers of both versions send: one-record entries
    (version 1) and packs (version 2), one pack with a bad record in the middle and one
    pack that is not a pack at all. Every good record is stored, once; the bad record
    alone and the malformed pack whole go to the dead stream; nothing stays pending."""
    records = [CompilationRecord(stamp=Stamp(session=1, seq=seq, offset_s=0.1),
                                 family="axpy", key=KEY, outcome=Outcome.COMPILED,
                                 work_s=0.01) for seq in range(1, 9)]
    client.xadd(COMPILATION_STREAM, encode_record(records[0]))  # an old producer's
    ((_, pack),) = encode_packs(records[1:4])
    client.xadd(COMPILATION_STREAM, pack)
    client.xadd(COMPILATION_STREAM, encode_record(records[4]))
    members = [json.loads(r.model_dump_json()) for r in records[5:8]]
    members.insert(1, {**members[0], "stamp": {"session": 1, "seq": 2**63, "offset_s": 0}})
    client.xadd(COMPILATION_STREAM, {**pack, "records": json.dumps(members)})
    client.xadd(COMPILATION_STREAM, {**pack, "records": '{"not": "a pack"}'})
    client.xadd(COMPILATION_STREAM, pack)  # sent twice (a retry): stored once

    counts = drain(service_env(redis_url, records_url, tmp_path), tmp_path / "ingest.log")
    assert (counts["records"], counts["dead"], counts["deferred"]) == (3 + 1 + 1 + 3 + 3,
                                                                      2, 0)
    assert pending_total(client) == 0
    with SessionStorage(records_url) as storage:
        assert storage.records(1) == records
    bad, malformed = client.xrange(RECORDS_DEAD_STREAM)
    # the bad record alone, as a one-record entry that could be sent again by itself
    assert (bad[1][b"v"], bad[1][b"dead:index"]) == (b"1", b"1")
    assert json.loads(bad[1][b"record"]) == members[1]
    assert b"record 1 of a pack of 4" in bad[1][b"dead:error"]
    assert b"stamp.seq" in bad[1][b"dead:error"]
    # the malformed pack whole, with its fields as they came
    assert malformed[1][b"v"] == b"2" and malformed[1][b"records"] == b'{"not": "a pack"}'
    assert b"malformed" in malformed[1][b"dead:error"]
    log = (tmp_path / "ingest.log").read_text()
    assert "1 record(s) of pack" in log and "the others written" in log


def test_sigterm_stops_an_idle_ingester_at_once(
    redis_url: str, tmp_path: Path, ingesters: list[IngesterProcess]
) -> None:
    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    ingester = IngesterProcess(service_env(redis_url, url, tmp_path), tmp_path / "i.log",
                               "--block-ms", "2000")
    ingesters.append(ingester)
    ingester.wait_started()
    time.sleep(0.5)  # inside a blocking read
    started = time.monotonic()
    counts = ingester.terminate()
    assert time.monotonic() - started < 5
    assert counts["failures"] == 0
    assert "SIGTERM" in ingester.text()


def test_ingest_without_redis_is_one_line(tmp_path: Path) -> None:
    from test_records_stream import farm_argv

    env = service_env("", f"sqlite:///{tmp_path / 'r.sqlite'}", tmp_path)
    env.pop("FARM_REDIS_URL")
    proc = subprocess.run(farm_argv("ingest"), env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "FARM_REDIS_URL" in proc.stderr
    with contextlib.suppress(FileNotFoundError):
        assert not (tmp_path / "r.sqlite").exists()


# -- Redis away: the outage limit, as workers and clients keep it --------------------------

OUTAGE_LIMIT_S = 3


def test_redis_killed_past_the_outage_limit_ends_the_ingester_with_one_line(
    tmp_path: Path, ingesters: list[IngesterProcess]
) -> None:
    """Issue 33 item 4: it logged "Redis unreachable ...; retrying" every 5 s for ever."""
    from farm.devservices import RedisServer

    with RedisServer(tmp_path / "redis") as redis_own:
        url = f"sqlite:///{tmp_path / 'records.sqlite'}"
        ingester = IngesterProcess(
            service_env(redis_own.url, url, tmp_path, FARM_OUTAGE_LIMIT=str(OUTAGE_LIMIT_S),
                        FARM_SOCKET_TIMEOUT="1"), tmp_path / "i.log", "--block-ms", "200")
        ingesters.append(ingester)
        ingester.wait_started()
        redis_own.kill()
        killed = time.monotonic()
        code = ingester.process.wait(timeout=120)
        took = time.monotonic() - killed
    text = ingester.text()
    assert code == 1, text
    assert "Traceback" not in text, text
    [line] = [x for x in text.splitlines() if x.startswith("error:")]
    assert "Redis at 127.0.0.1" in line and "unreachable" in line, line
    assert f"more than {OUTAGE_LIMIT_S} s (FARM_OUTAGE_LIMIT)" in line, line
    assert text.count("waiting for Redis at") == 1, text  # said once, not every retry
    assert "retrying" not in text, text
    # not before the limit; generously after it (a socket timeout, a loaded machine)
    assert OUTAGE_LIMIT_S - 0.5 <= took < OUTAGE_LIMIT_S + 30, (took, text)


def test_redis_back_within_the_outage_limit_the_ingester_goes_on(
    tmp_path: Path, ingesters: list[IngesterProcess]
) -> None:
    from farm.devservices import RedisServer

    with RedisServer(tmp_path / "redis") as redis_own:
        url = f"sqlite:///{tmp_path / 'records.sqlite'}"
        ingester = IngesterProcess(
            service_env(redis_own.url, url, tmp_path, FARM_OUTAGE_LIMIT="60",
                        FARM_SOCKET_TIMEOUT="1"), tmp_path / "i.log", "--block-ms", "200")
        ingesters.append(ingester)
        ingester.wait_started()
        redis_own.kill()
        wait_for(lambda: "waiting for Redis at" in ingester.text(), 60, "the outage line")
        redis_own.resume()
        producer = Producer(redis_own.url, 30, 0)
        producer.finish()
        wait_for(lambda: count_in(url, producer.session) == 30, 60, "the records")
        assert ingester.process.poll() is None, ingester.text()
        counts = ingester.terminate()
    text = ingester.text()
    assert "is back after" in text and "error:" not in text, text
    assert counts["records"] == 30 and counts["failures"] >= 1, counts


# -- the whole path: a real cluster build --------------------------------------------------

CLUSTER_LIMITS = {"FARM_COMPILE_SOFT_TIME_LIMIT": "60", "FARM_COMPILE_HARD_TIME_LIMIT": "90",
                  "FARM_VISIBILITY_TIMEOUT": "120", "FARM_CHUNK_SIZE": "1"}


def test_a_cluster_build_is_recorded_whole(
    redis_server: Any, minio_server: Any, postgres_server: Any, tmp_path: Path,
    ingesters: list[IngesterProcess],
) -> None:
    """Two workers, an ingester and a client, all separate processes: the records of the
    client and of both workers reach PostgreSQL, and the build's summary counts each of
    its kernels once and names both workers."""
    import json
    import uuid

    from cluster_helpers import next_redis_db
    from test_records_stream import farm_argv

    from farm.devservices.cluster import local_cluster

    with fresh_pg_database(postgres_server) as pg_url, local_cluster(
        tmp_path, redis=redis_server, minio=minio_server, bucket=f"rec-{uuid.uuid4().hex[:12]}",
        redis_db=next_redis_db(), FARM_RECORDS_URL=pg_url, **CLUSTER_LIMITS,
    ) as cluster:
        cluster.start_worker(concurrency=1)
        cluster.start_worker(concurrency=1)
        cluster.wait_ready()
        ingester = IngesterProcess(cluster.env(tmp_path / "ingester"), tmp_path / "ingest.log",
                                   "--block-ms", "200")
        ingesters.append(ingester)
        ingester.wait_started()

        client_env = cluster.env(tmp_path / "client")
        built = subprocess.run([sys.executable, "-m", "farm", "build", "tiny", "--cluster",
                                "--json"], env=client_env, capture_output=True, text=True,
                               timeout=600, check=False)
        assert built.returncode == 0, built.stderr[-3000:]
        report = json.loads(built.stdout)
        assert report["cluster"] and report["summary"]["kernels"] == 20
        build_workers = sorted(report["workers"])
        assert len(build_workers) == 2, report["workers"]

        def everything_ingested() -> bool:
            with SessionStorage(pg_url) as storage:
                labels = [s.label for s in storage.sessions()]
                asked = [r for r in storage.all_records(kind=CompilationRecord.KIND)
                         if isinstance(r, CompilationRecord) and r.requested_by is not None]
            return "build tiny" in labels and len(asked) >= 20
        # Workers are still running: their autoflush sends idle records within a second.
        wait_for(everything_ingested, 60, "the client's and the workers' records in PostgreSQL")

        with SessionStorage(pg_url) as storage:
            sessions = storage.sessions()
            (client,) = [s for s in sessions if s.label == "build tiny"]
            workers = [s for s in sessions if s.label.startswith("worker ")]
            assert len(workers) == 2
            worker_ids = {w.id for w in workers}
            for record in storage.all_records(requested_by_session=client.id):
                assert isinstance(record, CompilationRecord)
                assert record.stamp.session in worker_ids
                assert record.worker in build_workers

        records_env = dict(client_env, FARM_RECORDS_URL=pg_url)
        shown = subprocess.run(farm_argv("records", "summary", "--build", str(client.id),
                                         "--json"), env=records_env, capture_output=True,
                               text=True, timeout=120, check=False)
        assert shown.returncode == 0, shown.stderr
        summary = json.loads(shown.stdout)
        assert summary["kernels"] == 20
        o = summary["outcomes"]
        assert o["loaded"] + o["rekeyed"] + o["compiled"] == 20 and o["failed"] == 0
        assert sum(w["kernels"] for w in summary["by_worker"]) == 20  # each kernel once
        assert summary["unattributed"] == 0
        assert summary["workers"] == build_workers  # both workers, by name
        assert summary["sessions"] == 3

        picture = tmp_path / "timeline.html"
        drawn = subprocess.run(farm_argv("records", "timeline", str(client.id), "-o",
                                         str(picture), "--json"), env=records_env,
                               capture_output=True, text=True, timeout=120, check=False)
        assert drawn.returncode == 0, drawn.stderr
        assert sorted(json.loads(drawn.stdout)["lanes"]) == build_workers
        assert picture.read_text().count('class="lane"') == 2

        counts = ingester.terminate()
        assert counts["lost"] == counts["dead"] == counts["failures"] == 0
