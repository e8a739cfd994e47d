"""A broken worker never fails a kernel (docs/RELIABILITY.md, "Broken workers").

Real Redis, MinIO and worker processes. Next to a good worker, workers that cannot
serve: one with a wrong MinIO secret, one whose pool process cannot open its state (a
family module that does not exist), one started while MinIO is down (it serves once
MinIO is back), and one whose MinIO user may read but not write (its probe passes, its
stores fail: it gives its chunks back and pauses, and the client's circuit breaker
sends it no more of the build, in one line). The build succeeds on the good workers
with no kernel failed, and each broken worker says why, once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import farm, minio_store, namespace, read_only_user, write_manifest

from farm.cluster.workers import READY_LINE
from farm.devservices import MinioServer, RedisServer
from farm.devservices.cluster import LocalCluster, WorkerProcess, local_cluster, paused
from worker.readiness import INFRA_STREAK

pytestmark = pytest.mark.integration

ENV = {"FARM_OUTAGE_LIMIT": "30", "FARM_SOCKET_TIMEOUT": "2", "FARM_CHUNK_SIZE": "1",
       "FARM_HEARTBEAT_INTERVAL": "0.5", "FARM_DEAD_WORKER_GRACE": "3",
       "FARM_LEASE_TTL": "5", "FARM_COMPILE_SOFT_TIME_LIMIT": "20",
       "FARM_COMPILE_HARD_TIME_LIMIT": "25", "FARM_VISIBILITY_TIMEOUT": "300"}
NOT_CONSUMING = "not consuming farm."


def _said_once_per_change(log: str) -> None:
    """A worker says "not consuming" when it stops (or, not ready from the start, once),
    never again until it has consumed since: between two such lines there is a "ready:
    consuming" line. How many stops a worker sees depends on the machine's load (a store
    probe that times out on a busy machine is a stop), so their number is not the check;
    that a reason is never repeated while nothing changed is."""
    said = [READY_LINE if READY_LINE in line else NOT_CONSUMING for line in log.splitlines()
            if READY_LINE in line or NOT_CONSUMING in line]
    repeated = [i for i in range(1, len(said)) if said[i] == said[i - 1] == NOT_CONSUMING]
    assert not repeated, log[-3000:]


def _wait_for(worker: WorkerProcess, text: str, timeout: float = 90, count: int = 1) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = worker.log.read_text(errors="replace")
        if log.count(text) >= count:
            return log
        assert worker.process.poll() is None, f"worker {worker.pid} exited:\n{log[-3000:]}"
        assert time.monotonic() < deadline, f"{text!r} never in {worker.log}:\n{log[-3000:]}"
        time.sleep(0.1)


def _listed(c: LocalCluster) -> dict[int, dict[str, Any]]:
    served = json.loads(farm(c.env(), "workers", "--json").stdout)
    return {w["pid"]: w for fp in served.values() for w in fp["workers"]}


def test_broken_workers_take_no_chunk_and_the_build_fails_no_kernel(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis, MinioServer(tmp_path / "minio") as minio, \
            local_cluster(tmp_path, redis=redis, minio=minio,
                          bucket=f"t-{uuid.uuid4().hex[:12]}", **ENV) as c:
        good = c.start_worker()
        wrong = c.start_worker(FARM_MINIO_SECRET_KEY="not-the-secret-of-this-minio")
        broken = c.start_worker(FARM_FAMILY_MODULES='["no_such_family_module"]')
        access, secret = read_only_user(c)
        reader = c.start_worker(FARM_MINIO_ACCESS_KEY=access, FARM_MINIO_SECRET_KEY=secret)
        c.wait_ready(workers=[good, reader])
        said = _wait_for(wrong, NOT_CONSUMING)
        assert "SignatureDoesNotMatch" in said and secret not in said
        assert "could not open its state" in _wait_for(broken, NOT_CONSUMING)

        minio.halt()  # a worker started while MinIO is down waits, then serves
        late = c.start_worker()
        assert "Connection refused" in _wait_for(late, NOT_CONSUMING)
        minio.resume()
        c.wait_ready(workers=[late])

        deadline = time.monotonic() + 30
        while True:  # the others consume again once their next look finds MinIO back
            listed = _listed(c)
            if all(listed[w.pid]["ready"] for w in (good, late, reader)):
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)
        assert not listed[wrong.pid]["ready"]
        assert "SignatureDoesNotMatch" in listed[wrong.pid]["why"]
        assert not listed[broken.pid]["ready"]
        assert "is not consuming" in farm(c.env(), "workers").stdout

        # the reader alone takes chunks first (the others paused): it compiles, cannot
        # store, gives each back; after three it pauses, and the client, once another
        # worker built some, sends it no more of this build
        manifest = write_manifest(tmp_path / "m.toml", salt=51, count=8)
        with paused(good, late):
            client = subprocess.Popen(
                [sys.executable, "-m", "farm", "build", str(manifest), "--cluster", "--json"],
                env=c.env(tmp_path / "client"), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
            _wait_for(reader, "goes back to its queue", count=INFRA_STREAK)
        out, err = client.communicate(timeout=240)
        assert client.returncode == 0, err
        report = json.loads(out)
        assert report["summary"]["failed"] == 0, report["failures"]
        assert report["summary"]["compiled"] == 8, (report["summary"], err)
        store = minio_store(c)
        assert len(list(store.keys(namespace(report["fingerprint"])))) == 8
        breakers = [line for line in err.splitlines() if "sending no more" in line]
        assert len(breakers) == 1, err
        [breaker] = breakers
        assert f"worker {listed[reader.pid]['host']}:{reader.pid}" in breaker, breaker
        assert "AccessDenied" in breaker

        for w in (good, wrong, broken, reader, late):
            log = w.log.read_text(errors="replace")
            assert w.process.poll() is None, log[-3000:]
            assert "KeyError" not in log and "Traceback" not in log, log[-3000:]
            _said_once_per_change(log)
        for w in (wrong, broken):  # they never took a chunk, and said why once
            log = w.log.read_text(errors="replace")
            assert " received" not in log and log.count(NOT_CONSUMING) == 1, log[-3000:]
        reader_log = reader.log.read_text(errors="replace")
        assert "AccessDenied" in reader_log and "paused for" in reader_log
