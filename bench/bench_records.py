"""Benchmark: records per second through the Redis streams into SQLite and PostgreSQL.

Starts its own Redis and PostgreSQL (``farm.devservices``, loopback, temporary folders)
and measures, for N compilation records of one session (level Basic, each naming the
build that asked for it, as a worker's do):

1. **producer alone**: a ``Recorder`` over a ``RedisStreamSink`` records N kernels and
   closes (pydantic models, JSON, MULTI/EXEC pipelines of XADD). Nothing reads.
2. **embedded**, for reference: the same recorder writing straight into the storage
   (``StorageSink``), as a farm without Redis does.
3. **end to end**, per storage: ``farm ingest`` runs as a separate process (started and
   ready before the clock starts: an ingester is a long-running service); a producer
   process (its imports done) records N kernels; the clock runs from its start to the
   N-th record committed in storage (polled every 20 ms). Producer -> Redis -> ingester
   -> storage.
4. **backlog drain**, per storage: N records are already in the streams (the ingester
   was down); an ingester starts; from the moment it is ready (storage open, about to
   read: its `->` line) to the N-th record committed. (Not from its first commit: one
   round of the ingester commits up to ``--batch`` entries of every stream at once,
   thousands of records.)

    .venv/bin/python bench/bench_records.py [--records 50000] [--batch 500]
        [--storage sqlite,postgresql] [--write-docs]

Prints a Markdown table and one JSON line (``{"bench": "records", ...}``);
``--write-docs`` puts the section into docs/BENCHMARKS.md (replacing this benchmark's
section, leaving every other section as it is).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cpu import cpu_model  # this folder

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "BENCHMARKS.md"
START = "<!-- bench_records:start -->"
END = "<!-- bench_records:end -->"


def produce(redis_url: str | None, storage_url: str | None, count: int) -> tuple[int, float]:
    """Record ``count`` kernels of one session to the streams (or straight to a storage);
    returns the session id and the seconds it took, close included."""
    from farm.core.outcomes import Outcome
    from farm.records import Recorder, RecordsConfig, RequestedBy, StorageSink, Trip
    from farm.records.stream import RedisStreamSink

    sink: Any
    if redis_url is not None:
        sink = RedisStreamSink.open(redis_url, maxlen=max(100_000, 2 * count))
    else:
        sink = StorageSink.open(storage_url or "sqlite://")
    recorder = Recorder(sink, RecordsConfig(), "bench worker")
    asked = RequestedBy(session=1_800_000_000_000_000_000, batch=1)
    start = time.perf_counter()
    for i in range(count):
        recorder.compilation(Trip(family="matmul", key=f"{i:032x}.{'ab' * 12}",
                                  outcome=Outcome.COMPILED, work_s=0.08, worker="bench:1",
                                  host="bench", requested_by=asked))
    recorder.close()
    return recorder.session.id, time.perf_counter() - start


def machine() -> str:
    """CPU model and cores, for the report."""
    return f"`nproc` = {os.cpu_count()}; CPU `{cpu_model()}`; Python {platform.python_version()}"


def version_of(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return "?"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) \
        else "?"


@contextlib.contextmanager
def fresh_postgres_database(server: Any) -> Iterator[str]:
    import sqlalchemy as sa

    admin_url = sa.make_url(server.url)
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield admin_url.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


class Ingester:
    """``farm ingest`` (or ``python -m farm.cli.ingest`` until it is mounted) as a process."""

    def __init__(self, redis_url: str, storage_url: str, batch: int, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
        env.update(FARM_REDIS_URL=redis_url, FARM_RECORDS_URL=storage_url,
                   FARM_HOME=str(log.parent))
        self.log = log
        with open(log, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "farm.cli.ingest", "--batch", str(batch), "--block-ms",
                 "50"], env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 60
        while " -> " not in log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"ingester did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.002)
        self.ready_at = time.perf_counter()  # within 2 ms of its "->" line

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def wait_count(storage: Any, count: int, timeout: float = 600.0) -> tuple[float, float]:
    """Poll until ``count`` records are stored; (time of the first, time of the last)."""
    first = 0.0
    deadline = time.monotonic() + timeout
    while True:
        stored = storage.count_records()
        now = time.perf_counter()
        if stored and not first:
            first = now
        if stored >= count:
            return first, now
        if time.monotonic() > deadline:
            sys.exit(f"only {stored} of {count} records stored in {timeout:.0f} s")
        time.sleep(0.02)


def run(records: int, batch: int, storages: list[str]) -> dict[str, Any]:
    import redis

    from farm.devservices import PostgresServer, RedisServer, ensure_postgres
    from farm.records import SessionStorage

    result: dict[str, Any] = {"bench": "records", "records": records, "batch": batch}
    work = Path(tempfile.mkdtemp(prefix="bench-records-"))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        client = redis.Redis.from_url(server.url)
        pg = stack.enter_context(PostgresServer()) if "postgresql" in storages else None
        result["redis"] = version_of(["redis-server", "--version"])
        if pg is not None:
            result["postgresql"] = version_of([str(ensure_postgres() / "postgres"),
                                               "--version"])

        _, took = produce(server.url, None, records)
        result["producer_alone_per_s"] = round(records / took)
        client.flushall()

        for kind in storages:
            with contextlib.ExitStack() as per:
                if kind == "sqlite":
                    url = f"sqlite:///{work / f'{kind}.sqlite'}"
                    embedded_url = f"sqlite:///{work / f'{kind}-embedded.sqlite'}"
                else:
                    assert pg is not None
                    url = per.enter_context(fresh_postgres_database(pg))
                    embedded_url = per.enter_context(fresh_postgres_database(pg))
                _, took = produce(None, embedded_url, records)
                result[f"embedded_{kind}_per_s"] = round(records / took)

                storage = per.enter_context(SessionStorage(url))
                ingester = Ingester(server.url, url, batch, work / f"{kind}-ingest.log")
                producer = subprocess.Popen(
                    [sys.executable, __file__, "--produce", server.url, str(records)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert producer.stdin is not None and producer.stdout is not None
                assert producer.stdout.readline().strip() == "ready"  # imports done
                start = time.perf_counter()
                producer.stdin.write("go\n")
                producer.stdin.flush()
                _, last = wait_count(storage, records)
                out, _ = producer.communicate(timeout=600)
                produced_s = json.loads(out)["seconds"]
                result[f"end_to_end_{kind}_per_s"] = round(records / (last - start))
                result[f"end_to_end_{kind}_producer_per_s"] = round(records / produced_s)
                ingester.stop()
                client.flushall()

                # Backlog: the streams hold N records before any ingester runs.
                produce(server.url, None, records)
                drain_url = url.replace(f"{kind}.sqlite", f"{kind}-drain.sqlite") \
                    if kind == "sqlite" else per.enter_context(fresh_postgres_database(pg))
                drain_storage = per.enter_context(SessionStorage(drain_url))
                ingester = Ingester(server.url, drain_url, batch, work / f"{kind}-drain.log")
                _, last = wait_count(drain_storage, records)
                result[f"drain_{kind}_per_s"] = round(records / (last - ingester.ready_at))
                ingester.stop()
                client.flushall()
        client.close()
    return result


def markdown(result: dict[str, Any], command: str, started: str, took_s: float) -> str:
    n = result["records"]
    rows = [
        ("producer alone (Recorder -> RedisStreamSink, nothing reads)",
         result["producer_alone_per_s"]),
    ]
    for kind in ("sqlite", "postgresql"):
        if f"end_to_end_{kind}_per_s" not in result:
            continue
        rows += [
            (f"embedded, straight into {kind} (StorageSink, no Redis)",
             result[f"embedded_{kind}_per_s"]),
            (f"end to end into {kind}: producer process -> Redis -> `farm ingest` -> "
             "committed", result[f"end_to_end_{kind}_per_s"]),
            ("  (the producer process of that run, alone)",
             result[f"end_to_end_{kind}_producer_per_s"]),
            (f"backlog drain into {kind} (records waiting in the streams, one ingester)",
             result[f"drain_{kind}_per_s"]),
        ]
    table = "\n".join(f"| {name} | {rate:,} |" for name, rate in rows)
    versions = f"Redis `{result.get('redis', '?')}`"
    if "postgresql" in result:
        versions += f", PostgreSQL `{result['postgresql']}`"
    return f"""{START}
## Records through Redis streams into session storage (`bench/bench_records.py`)

**Command** (from the repository root):

```sh
{command}
```

**Machine**: {machine()}; {versions}; all on loopback, SQLite on the local disk (WAL).
The machine was shared with other work, so take the rates as ±20 %.

**Date**: {started} (`date -u` at the start; the run took {took_s / 60:.1f} min).

**Result** ({n:,} compilation records of one session, level Basic, about 0.3 KB of JSON
each, sent in packs of up to 8 KB, a flush of 256 records at a time; ingester batch
{result['batch']} entries per stream per round, one commit each):

| path | records/s |
| --- | ---: |
{table}

JSON line of the run:

```json
{json.dumps(result)}
```

Reading: a worker compiles a kernel in tens of milliseconds at best (74 ms on an H200),
so one worker makes at most tens of records a second; one ingester takes tens of
thousands a second, so it keeps up with hundreds of workers, and the producer side
costs a build about 0.01 ms per kernel (against 74 ms or more to compile it). End to
end is below the producer's and the ingester's own rates because on 2 cores they share
the CPU with each other, with Redis and PostgreSQL, and with this benchmark's polling.
What a record costs, and why it is that low, is in docs/RECORDS.md ("Throughput"). Run
more ingesters when one falls behind (they share the work through the consumer group).
{END}
"""


def write_docs(section: str) -> None:
    """Replace this benchmark's section of docs/BENCHMARKS.md (or append it)."""
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END) + "\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOCS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--storage", default="sqlite,postgresql")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--produce", nargs=2, metavar=("REDIS_URL", "N"),
                        help=argparse.SUPPRESS)  # the producer process of step 3
    args = parser.parse_args()
    if args.produce:
        import farm.records.stream  # noqa: F401 - imports before the clock starts

        print("ready", flush=True)
        sys.stdin.readline()
        _, took = produce(args.produce[0], None, int(args.produce[1]))
        print(json.dumps({"seconds": took}))
        return
    storages = [s.strip() for s in args.storage.split(",") if s.strip()]
    unknown = set(storages) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"--storage: unknown {', '.join(sorted(unknown))}")
    started = dt.datetime.now(dt.UTC).strftime("%a %b %d %H:%M:%S UTC %Y")
    t0 = time.perf_counter()
    result = run(args.records, args.batch, storages)
    command = ".venv/bin/python bench/bench_records.py " + " ".join(
        a for a in sys.argv[1:] if a != "--write-docs")
    section = markdown(result, command.strip(), started, time.perf_counter() - t0)
    print(section)
    if args.write_docs:
        write_docs(section)
        print(f"wrote the section into {DOCS}")


if __name__ == "__main__":
    main()
