"""Orphans and the records of a build that only loaded (docs/RELIABILITY.md).

Real Redis, MinIO, a worker, an ingester and clients as separate processes. To line
chunks up deterministically the worker is paused (SIGSTOP on its process group) while
clients queue their chunks (``--wait-for-workers``), then let go (SIGCONT):

* a client killed after queueing: its chunks are dropped by the worker (its build's
  heartbeat key expired), not compiled, and a rerun is not stuck behind them;
* two clients of one manifest queued one after the other: the second's chunks are all
  Loaded by the worker (the first compiled them); its session is written all the same,
  so ``farm records summary`` and ``farm records sessions`` agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import farm, minio_store, namespace, next_redis_db, write_manifest

from farm.cluster.queues import queue_depth
from farm.core.outage import redis_client
from farm.devservices import MinioServer, RedisServer
from farm.devservices.cluster import LocalCluster, WorkerProcess, local_cluster, paused

pytestmark = pytest.mark.integration

GRACE_S = 3.0
ENV = {"FARM_CHUNK_SIZE": "1", "FARM_HEARTBEAT_INTERVAL": "0.5",
       "FARM_DEAD_WORKER_GRACE": f"{GRACE_S:g}", "FARM_SOCKET_TIMEOUT": "2",
       "FARM_LEASE_TTL": "5", "FARM_OUTAGE_LIMIT": "30"}


@pytest.fixture(scope="module")
def cluster(redis_server: RedisServer, minio_server: MinioServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("orphans"), redis=redis_server,
                       minio=minio_server, bucket=f"t-{uuid.uuid4().hex[:12]}",
                       redis_db=next_redis_db(), **ENV) as c:
        records_url = f"sqlite:///{c.workdir / 'records.sqlite'}"
        c.extra_env["FARM_RECORDS_URL"] = records_url
        c.start_ingester(records_url)
        c.start_worker()
        c.wait_ready()
        yield c


@pytest.fixture(scope="module")
def fingerprint(cluster: LocalCluster) -> str:
    return str(next(iter(json.loads(farm(cluster.env(), "workers", "--json").stdout))))


def _queue(c: LocalCluster, manifest: Path, home: Path, fp: str) -> Any:
    return subprocess.Popen([sys.executable, "-m", "farm", "build", str(manifest),
                             "--cluster", "--json", "--wait-for-workers", "--fingerprint", fp],
                            env=c.env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_depth(c: LocalCluster, fp: str, depth: int, sender: Any) -> None:
    """Until ``sender``'s chunks are queued: all but one (the paused worker's BRPOP, sent
    before it was paused, takes the first chunk off the queue into its socket, where it
    waits for the worker), and a second more for the last sends of the burst."""
    client = redis_client(c.redis_url)
    deadline = time.monotonic() + 60
    while queue_depth(client, fp) < depth - 1:
        if sender.poll() is not None or time.monotonic() > deadline:
            sender.kill()
            _, err = sender.communicate()
            raise AssertionError(f"the queue never held {depth} chunks; the client: {err}")
        time.sleep(0.05)
    time.sleep(1.0)


def _count(worker: WorkerProcess, text: str, at_least: int, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = worker.log.read_text(errors="replace")
        if log.count(text) >= at_least:
            return log
        assert time.monotonic() < deadline, log[-3000:]
        time.sleep(0.1)


def test_chunks_of_a_dead_client_are_dropped_not_compiled(
        cluster: LocalCluster, fingerprint: str, tmp_path: Path) -> None:
    worker = cluster.workers[0]
    dropped_before = worker.log.read_text(errors="replace").count(": dropped ")
    orphaned = write_manifest(tmp_path / "orphaned.toml", salt=81, count=6)
    with paused(worker):
        client = _queue(cluster, orphaned, tmp_path / "dead", fingerprint)
        _wait_depth(cluster, fingerprint, 6, client)
        client.kill()  # SIGKILL: no goodbye, its heartbeat key just stops being renewed
        client.wait(timeout=30)
        time.sleep(GRACE_S + 0.5)
    log = _count(worker, ": dropped ", dropped_before + 6)
    assert "is gone" in log
    store = minio_store(cluster)
    from test_faults import _keys  # the manifests' keys, computed as the client does

    for key in _keys(orphaned):  # nothing was compiled for nobody
        assert store.get(namespace(fingerprint), key) is None
    rerun = write_manifest(tmp_path / "rerun.toml", salt=82, count=2)
    proc = farm(cluster.env(tmp_path / "rerun"), "build", str(rerun), "--cluster", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["compiled"] == 2


def test_summary_and_sessions_agree_for_a_build_that_only_loaded(
        cluster: LocalCluster, fingerprint: str, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", salt=83, count=3)
    worker = cluster.workers[0]
    with paused(worker):
        first = _queue(cluster, manifest, tmp_path / "first", fingerprint)
        _wait_depth(cluster, fingerprint, 3, first)
        second = _queue(cluster, manifest, tmp_path / "second", fingerprint)
        _wait_depth(cluster, fingerprint, 6, second)
    reports = []
    for client in (first, second):
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        reports.append(json.loads(out)["summary"])
    assert reports[0]["compiled"] == 3
    assert reports[1]["compiled"] == 0 and reports[1]["loaded"] == 3  # all by the worker

    deadline = time.monotonic() + 60
    while True:  # the ingester catches up
        sessions = json.loads(farm(cluster.env(), "records", "sessions", "--json").stdout)
        ids = {s["id"] for s in sessions}
        labelled = [s for s in sessions if s["label"] == "build salted-83"]
        summary = json.loads(farm(cluster.env(), "records", "summary", "--json").stdout)
        built = {int(ref.split(":")[0]) for ref in summary["builds"]}
        if len(labelled) == 2 and built <= ids:
            break
        assert time.monotonic() < deadline, (labelled, sorted(built - ids))
        time.sleep(0.5)
    for s in labelled:  # each build reads back whole
        proc = farm(cluster.env(), "records", "summary", "--build", str(s["id"]), "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["kernels"] == 3
