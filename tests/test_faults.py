"""Cluster faults, one test per row of docs/RELIABILITY.md's fault table.

Real Redis, MinIO, workers and clients as separate processes. Redis and MinIO are this
module's own (not the session's), because the tests stop and restart them on the same
port. Limits are short (outage limit, dead-worker grace, heartbeat) so that each fault
shows within seconds; the kernels are cheap ``reduce`` and ``fault`` kernels whose sources
are unique to each test. The fault-injection family lives in ``tests/faults``
(``faultfam``), armed in every process of the cluster by ``FARM_FAULT_INJECT=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import farm, minio_store, namespace, next_redis_db, write_manifest

from farm.core.keys import CRASHES_STATUS, DEAD_LETTERS, queue_name, source_object
from farm.core.model import Key
from farm.devservices import MinioServer, RedisServer
from farm.devservices.cluster import LocalCluster, local_cluster
from farm.devservices.server import LocalServer
from farm.families import Registry
from farm.manifest import expand, load_manifest

pytestmark = pytest.mark.integration

FAULTS = Path(__file__).parent / "faults"

ENV = {"FARM_COMPILE_SOFT_TIME_LIMIT": "20", "FARM_COMPILE_HARD_TIME_LIMIT": "25",
       "FARM_VISIBILITY_TIMEOUT": "300", "FARM_LEASE_TTL": "5", "FARM_CHUNK_SIZE": "1",
       "FARM_OUTAGE_LIMIT": "40", "FARM_CRASH_LIMIT": "2", "FARM_DEAD_WORKER_GRACE": "3",
       "FARM_HEARTBEAT_INTERVAL": "0.5", "FARM_SOCKET_TIMEOUT": "2",
       "PYTHONPATH": str(FAULTS), "FARM_FAULT_INJECT": "1",
       "FARM_FAMILY_MODULES": '["faultfam"]'}

#: how a service fails: frozen (SIGSTOP, a hung host), killed (SIGKILL) or stopped
#: cleanly (SIGTERM); each with how it comes back on the same port, with its data
FAULTS_OF = {"sigstop": (LocalServer.freeze, LocalServer.thaw),
             "sigkill": (LocalServer.kill, LocalServer.resume),
             "sigterm": (LocalServer.halt, LocalServer.resume)}
OUTAGE_S = 5.0


def _fail(server: LocalServer, fault: str) -> None:
    FAULTS_OF[fault][0](server)


def _heal(server: LocalServer, fault: str) -> None:
    FAULTS_OF[fault][1](server)


def _back_after(err: str) -> float:
    """The outage length the client reported ("... is back after 5.1 s")."""
    found = re.search(r"is back after ([0-9.]+) s", err)
    assert found, err
    return float(found.group(1))


@pytest.fixture(scope="module")
def redis_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def minio_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    with MinioServer(tmp_path_factory.mktemp("minio")) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(redis_own: RedisServer, minio_own: MinioServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("faults"), redis=redis_own, minio=minio_own,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       **ENV) as c:
        records_url = f"sqlite:///{c.workdir / 'records.sqlite'}"
        c.extra_env["FARM_RECORDS_URL"] = records_url
        c.start_ingester(records_url)
        c.start_worker()
        c.wait_ready()
        yield c


def _redis(c: LocalCluster) -> Any:
    import redis

    return redis.Redis.from_url(c.redis_url)


def _fingerprint(c: LocalCluster, timeout: float = 60) -> str:
    """The fingerprint the cluster's worker serves. Polled: after an earlier test
    restarted Redis, the worker is listed again only from its next heartbeat."""
    deadline = time.monotonic() + timeout
    while True:
        served = json.loads(farm(c.env(), "workers", "--json").stdout)
        if served:
            return str(next(iter(served)))
        assert time.monotonic() < deadline, "no worker listed by `farm workers`"
        time.sleep(0.5)


def _keys(manifest: Path) -> list[Key]:
    registry = Registry.load([])  # the manifests checked here use built-in families
    return [Key(id_hash=e.artifact.id_hash, build_id=registry.get(e.family).build_id)
            for e in expand(load_manifest(manifest), registry)]


def _start_build(c: LocalCluster, manifest: Path, home: Path, **env: str) -> Any:
    return subprocess.Popen([sys.executable, "-m", "farm", "build", str(manifest),
                             "--cluster", "--json"], env=c.env(home, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


#: the worker's one line per chunk it finished (worker/app.py), counted to know one did
CHUNK_DONE = "chunk "
#: the worker's line when it stops consuming (worker/readiness.py)
NOT_CONSUMING = "not consuming farm."


def _wait_for(path: Path, text: str, count: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while path.read_text(errors="replace").count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.05)


def _assert_stored_once(c: LocalCluster, fingerprint: str, manifest: Path) -> None:
    store = minio_store(c)
    ns = namespace(fingerprint)
    stored = list(store.keys(ns))
    assert len(stored) == len(set(stored))
    for key in _keys(manifest):
        art = store.get(ns, key)
        assert art is not None, f"{key} not stored"
        assert store.find_source(ns, art.meta.source_hash) is not None, f"{key} unindexed"


def _workers_alive(c: LocalCluster) -> None:
    for w in c.workers:
        assert w.process.poll() is None, f"worker {w.pid} died"
        log = w.log.read_text(errors="replace")
        assert "Unrecoverable error" not in log, log[-3000:]


def _records_complete(c: LocalCluster, label: str, kernels: int) -> None:
    """The build labelled ``label`` reached records storage whole: its batch record
    counts ``kernels`` and no stored kernel lacks its record (``missing``)."""
    deadline = time.monotonic() + 60
    found: dict[str, Any] = {}
    while time.monotonic() < deadline:  # the ingester catches up
        sessions = json.loads(farm(c.env(), "records", "sessions", "--json").stdout or "[]")
        ids = [s["id"] for s in sessions if s["label"] == label]
        if ids:
            proc = farm(c.env(), "records", "summary", "--build", str(ids[0]), "--json")
            found = json.loads(proc.stdout) if proc.returncode == 0 else {}
            if found.get("kernels") == kernels:
                break
        time.sleep(0.5)
    assert found.get("kernels") == kernels, found
    assert found["missing"] == 0, found


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# -- poison messages ---------------------------------------------------------------------
def _publish_poison(c: LocalCluster, queue: str) -> int:
    from kombu import Connection

    good_kernel = {"artifact": {"kernel": {"family": "reduce", "params": {"cols": 5}}},
                   "build_id": "0123456789abcdef"}
    payload = {"fingerprint": queue.removeprefix("farm."), "kernels": [good_kernel]}

    def headers(**extra: Any) -> dict[str, Any]:
        return {"task": "farm.compile", "id": str(uuid.uuid4()), "lang": "py", **extra}

    cases: list[tuple[Any, dict[str, Any], str]] = [
        ({}, headers(), "json"), ({"a": 1}, headers(), "json"), (5, headers(), "json"),
        (None, headers(), "json"), ([1, 2, 3, 4], headers(), "json"),
        ([[payload], {}, {}], headers(timelimit=["a", "b"]), "json"),
        ([[payload], {}, {}], {"task": "farm.compile"}, "json"),  # no id
        ([[payload], {}, {}], headers(task="farm.other"), "json"),
        ([[{"fingerprint": "x", "kernels": []}], {}, {}], headers(), "json"),
        (b"{not json", headers(), "raw-json"),
        (b"\x80\x04K\x05.", headers(), "pickle"),
    ]
    with Connection(c.redis_url) as conn:
        producer = conn.Producer()
        for body, hdrs, kind in cases:
            if kind == "json":
                producer.publish(body, routing_key=queue, exchange="", serializer="json",
                                 headers=hdrs)
            else:
                producer.publish(body, routing_key=queue, exchange="", headers=hdrs,
                                 content_type="application/json" if kind == "raw-json"
                                 else "application/x-python-serialize",
                                 content_encoding="binary" if kind == "pickle" else "utf-8")
    return len(cases)


def test_poison_messages_are_dead_lettered_and_the_worker_serves_the_next(
        cluster: LocalCluster, tmp_path: Path) -> None:
    fp = _fingerprint(cluster)
    client = _redis(cluster)
    before = client.llen(DEAD_LETTERS)
    sent = _publish_poison(cluster, queue_name(fp))
    deadline = time.monotonic() + 60
    while client.llen(DEAD_LETTERS) - before < sent:
        assert time.monotonic() < deadline, client.lrange(DEAD_LETTERS, 0, -1)
        time.sleep(0.1)
    assert client.llen(queue_name(fp)) == 0  # nothing came back
    reasons = [json.loads(e)["reason"] for e in client.lrange(DEAD_LETTERS, 0, sent - 1)]
    assert any("body is not [args, kwargs, embed]" in r for r in reasons), reasons
    assert any("timelimit" in r for r in reasons), reasons
    assert any("header id" in r for r in reasons), reasons
    assert any("farm.other" in r for r in reasons), reasons
    assert any("payload does not validate" in r for r in reasons), reasons
    assert any("content type" in r for r in reasons), reasons

    manifest = write_manifest(tmp_path / "m.toml", salt=31, count=2)
    proc = farm(cluster.env(tmp_path / "client"), "build", str(manifest), "--cluster", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["compiled"] == 2
    _workers_alive(cluster)


# -- crash loops ------------------------------------------------------------------------
def test_a_kernel_that_kills_its_compiler_fails_as_crashed_and_the_rest_build(
        cluster: LocalCluster, tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\nname = "crashy"\n' + "".join(
        f'\n[[kernels]]\nfamily = "fault"\nparams = {{ mode = "{mode}", salt = {salt} }}\n'
        for mode, salt in (("none", 3201), ("abort", 3202), ("none", 3203))))
    start = time.monotonic()
    proc = farm(cluster.env(tmp_path / "client", FARM_CHUNK_SIZE="3"), "build", str(manifest),
                "--cluster", "--json")
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    s = report["summary"]  # the kernel before the bad one was compiled in a delivery
    assert s["compiled"] >= 1 and s["compiled"] + s["loaded"] == 2, s  # that crashed
    [failure] = report["failures"]
    assert failure["kind"] == "crashed"
    assert "SIGABRT" in failure["message"] and "2 time(s)" in failure["message"]
    deliveries = [int(_redis(cluster).get(k)) for k in _redis(cluster).scan_iter(
        "farm:task:*:deliveries")]
    assert max(deliveries) == 3  # two crashes, then the delivery that gave up on it
    _workers_alive(cluster)
    print(f"crash loop settled in {took:.1f} s")


def test_a_pool_process_killed_is_named_as_the_cause_not_redis(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Issue 33 item 5: after a pool process was SIGKILLed the client said the worker
    "lost it while Redis was away", though Redis never was. The kernel kills its own
    pool process (SIGKILL, as the OOM killer would): the worker notes the exit status on
    the task (the crash note the client's line reads), Celery puts the chunk back, and
    the build ends with the killing kernel failed and the rest built.

    Whether the client re-sends that chunk depends on how long it waits in the queue
    (more than the grace, 3 s: on a fast or idle machine it is taken again sooner), so
    the line's wording is tested on its seam, deterministically
    (``tests/test_chunk_path.py``, the three causes); here every re-send line that
    does appear must name the pool process, never Redis."""
    manifest = tmp_path / "m.toml"
    modes = [("kill", 3401)] + [("none", 3402 + i) for i in range(30)]
    manifest.write_text('format = 1\nname = "pool-kill"\n' + "".join(
        f'\n[[kernels]]\nfamily = "fault"\nparams = {{ mode = "{mode}", salt = {salt} }}\n'
        for mode, salt in modes))
    r = _redis(cluster)
    before = set(r.scan_iter("farm:task:*:crashes"))
    proc = farm(cluster.env(tmp_path / "client"), "build", str(manifest), "--cluster",
                "--json")
    assert proc.returncode == 1, proc.stderr  # the killing kernel fails, in the end
    report = json.loads(proc.stdout)
    assert report["summary"]["compiled"] + report["summary"]["loaded"] == 30, report
    notes = [r.hget(k, CRASHES_STATUS) for k in set(r.scan_iter("farm:task:*:crashes")) - before]
    assert b"signal 9 (SIGKILL)" in notes, notes  # the real cause, noted on the task
    resent = [line for line in proc.stderr.splitlines() if line.startswith("re-sent a chunk")]
    assert not any("Redis" in line for line in resent), resent
    assert all("pool process of worker" in line and "signal 9 (SIGKILL)" in line
               for line in resent), resent
    assert "waiting for Redis" not in proc.stderr
    _workers_alive(cluster)


def test_embedded_pool_survives_a_kernel_that_kills_its_process(tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\nname = "crashy-local"\n' + "".join(
        f'\n[[kernels]]\nfamily = "fault"\nparams = {{ mode = "{mode}", salt = {salt} }}\n'
        for mode, salt in (("kill", 3301), ("none", 3302), ("none", 3303))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), **{k: ENV[k] for k in (
        "PYTHONPATH", "FARM_FAULT_INJECT", "FARM_FAMILY_MODULES", "FARM_CRASH_LIMIT")})
    proc = farm(env, "build", str(manifest), "--local", "--workers", "1", "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["summary"]["compiled"] == 2  # the innocent kernels after the crash
    [failure] = report["failures"]
    assert failure["kind"] == "crashed" and "SIGKILL" in failure["message"]


# -- outages ----------------------------------------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS_OF))
def test_redis_outage_mid_build_is_waited_out(cluster: LocalCluster, redis_own: RedisServer,
                                              tmp_path: Path, fault: str) -> None:
    """Frozen, killed or stopped for 5 s: waited out, and the client reports the
    outage's real length (its clock starts when the first failed attempt began)."""
    salt = {"sigterm": 34, "sigstop": 134, "sigkill": 234}[fault]
    fp = _fingerprint(cluster)
    manifest = write_manifest(tmp_path / "m.toml", salt=salt, count=6)
    worker_log = cluster.workers[0].log
    done_before = worker_log.read_text(errors="replace").count(CHUNK_DONE)
    client = _start_build(cluster, manifest, tmp_path / "client")
    _wait_for(worker_log, CHUNK_DONE, done_before + 1)
    _fail(redis_own, fault)
    time.sleep(OUTAGE_S)
    _heal(redis_own, fault)
    out, err = client.communicate(timeout=240)
    assert client.returncode == 0, err
    report = json.loads(out)
    summary = report["summary"]
    assert summary["failed"] == 0, report["failures"]
    # a killed Redis loses up to a second of writes (append-only file, fsync every
    # second): a reply it lost is built again, and then loaded
    assert summary["compiled"] + summary["loaded"] == 6, summary
    assert summary["compiled"] == 6 or fault == "sigkill", (summary, err)
    assert "waiting for Redis at" in err
    # the outage as long as it was, not less by a socket timeout; the client notices it
    # at its next round trip (it looks at holders once a second; a wait on its reply
    # channel sends nothing), so it may start counting up to a second late
    assert _back_after(err) >= OUTAGE_S - 1.5, err
    _assert_stored_once(cluster, fp, manifest)
    _records_complete(cluster, f"build salted-{salt}", 6)
    _workers_alive(cluster)


def test_redis_down_past_the_limit_is_one_line_and_exit_1(
        cluster: LocalCluster, redis_own: RedisServer, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", salt=35, count=2)
    redis_own.halt()
    try:
        build = farm(cluster.env(tmp_path / "c", FARM_OUTAGE_LIMIT="2"), "build",
                     str(manifest), "--cluster", "--json")
        listing = farm(cluster.env(), "workers")
        worker = farm(cluster.env(tmp_path / "w", FARM_OUTAGE_LIMIT="2"), "worker",
                      "--concurrency=1")
    finally:
        redis_own.resume()
    for proc in (build, listing, worker):
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        [line] = _error_lines(proc.stderr)
        assert "Redis at 127.0.0.1" in line and "unreachable" in line
    assert "more than 2 s" in _error_lines(build.stderr)[0]
    assert "more than 2 s" in _error_lines(worker.stderr)[0]
    # a rerun, Redis back, builds exactly what is missing
    again = farm(cluster.env(tmp_path / "c"), "build", str(manifest), "--cluster", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["summary"]["compiled"] == 2
    _workers_alive(cluster)


@pytest.mark.parametrize("fault", list(FAULTS_OF))
def test_minio_outage_mid_build_is_waited_out(cluster: LocalCluster, minio_own: MinioServer,
                                              tmp_path: Path, fault: str) -> None:
    """Frozen, killed or stopped for 5 s: waited out; the worker says so within a few
    seconds (a frozen MinIO too: every request times out after FARM_SOCKET_TIMEOUT) and
    stops consuming until MinIO answers again."""
    salt = {"sigterm": 36, "sigstop": 136, "sigkill": 236}[fault]
    fp = _fingerprint(cluster)
    manifest = write_manifest(tmp_path / "m.toml", salt=salt, count=6)
    worker_log = cluster.workers[0].log
    text = worker_log.read_text(errors="replace")
    done_before, said_before = text.count(CHUNK_DONE), text.count(NOT_CONSUMING)
    client = _start_build(cluster, manifest, tmp_path / "client")
    _wait_for(worker_log, CHUNK_DONE, done_before + 1)
    _fail(minio_own, fault)
    try:  # the readiness probe notices within a socket timeout and a look or two
        _wait_for(worker_log, NOT_CONSUMING, said_before + 1, timeout=OUTAGE_S)
    finally:
        time.sleep(max(0.0, OUTAGE_S - 1))
        _heal(minio_own, fault)
    out, err = client.communicate(timeout=240)
    assert client.returncode == 0, err
    report = json.loads(out)
    assert report["summary"]["failed"] == 0, report["failures"]
    assert report["summary"]["compiled"] == 6
    _assert_stored_once(cluster, fp, manifest)
    _records_complete(cluster, f"build salted-{salt}", 6)
    _workers_alive(cluster)
    if fault != "sigterm":
        return

    # MinIO down past the limit: one line, exit 1
    minio_own.halt()
    try:
        proc = farm(cluster.env(tmp_path / "c2", FARM_OUTAGE_LIMIT="2"), "build",
                    str(manifest), "--cluster", "--json")
    finally:
        minio_own.resume()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    [line] = _error_lines(proc.stderr)
    assert "MinIO at" in line and "more than 2 s" in line


def test_a_lost_put_reply_never_leaves_an_artifact_unindexed(cluster: LocalCluster,
                                                             tmp_path: Path) -> None:
    """The index entry is written first; a put that finds its own artifact (its reply
    was lost) or one whose entry went missing leaves the entry in place."""
    fp = _fingerprint(cluster)
    manifest = write_manifest(tmp_path / "m.toml", salt=37, count=1)
    assert farm(cluster.env(tmp_path / "c"), "build", str(manifest), "--cluster").returncode == 0
    store = minio_store(cluster)
    ns = namespace(fp)
    [key] = _keys(manifest)
    art = store.get(ns, key)
    assert art is not None
    from minio import Minio

    raw = Minio(cluster.minio_endpoint, access_key=cluster.minio_access_key,
                secret_key=cluster.minio_secret_key, secure=False)
    raw.remove_object(cluster.bucket, source_object(ns, art.meta.source_hash))
    assert store.find_source(ns, art.meta.source_hash) is None
    # the retry of a put whose reply was lost (SAME), with the source the worker lowered:
    # the index is written from that source (never from the artifact's own metadata)
    from farm.core.device import probe_devices, select_device

    registry = Registry.load([])
    [entry] = expand(load_manifest(manifest), registry)
    lowered = registry.get(entry.family).lower_id(entry.artifact,
                                                  select_device(probe_devices(), fp))
    store.put(ns, art, source=lowered)
    assert store.find_source(ns, art.meta.source_hash) == key


# -- dead workers and records ---------------------------------------------------------------
def test_killed_worker_chunk_is_resent_fast_and_records_are_complete(
        redis_own: RedisServer, minio_own: MinioServer, tmp_path: Path) -> None:
    with local_cluster(tmp_path, redis=redis_own, minio=minio_own,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       **ENV) as c:
        records_url = f"sqlite:///{tmp_path / 'records.sqlite'}"
        c.extra_env["FARM_RECORDS_URL"] = records_url
        c.start_ingester(records_url)
        victim = c.start_worker()
        c.start_worker()
        c.wait_ready()
        manifest = write_manifest(tmp_path / "m.toml", salt=38, count=6)
        start = time.monotonic()
        client = _start_build(c, manifest, tmp_path / "client")
        holds = _redis(c)
        deadline = time.monotonic() + 120
        while not any(v.decode().endswith(f":{victim.pid}")  # it holds a chunk in flight
                      for v in holds.mget(list(holds.scan_iter("farm:task:*:holder")) or [
                          "none"]) if v):
            assert time.monotonic() < deadline, "the victim never held a task"
            time.sleep(0.02)
        victim.kill_all()  # SIGKILL main process and pool: the machine is gone
        out, err = client.communicate(timeout=200)  # far less than the 300 s timeout
        took = time.monotonic() - start
        assert client.returncode == 0, err
        report = json.loads(out)
        assert report["summary"]["failed"] == 0, report["failures"]
        assert "re-sent a chunk" in err
        _assert_stored_once(c, report["fingerprint"], manifest)
        summary: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the ingester catches up
            proc = farm(c.env(), "records", "summary", "--json")
            summary = json.loads(proc.stdout) if proc.returncode == 0 else {}
            if summary.get("kernels") == 6:
                break
            time.sleep(0.5)
        assert summary.get("kernels") == 6, summary
        assert summary["missing"] == 0
        compiled = {line["key"] for line in summary["slowest"]
                    if line["outcome"] in ("Compiled", "Rekeyed")}
        # the victim's compile was recorded before it stored; the re-sent chunk loaded it
        assert len(compiled) >= report["summary"]["compiled"] + report["summary"]["rekeyed"]
        assert c.workers[1].process.poll() is None
        # the victim's message waits in the broker for its visibility timeout (300 s
        # here): `farm workers` shows it stale, not in flight, once the victim is dead
        listed = json.loads(farm(c.env(), "workers", "--json").stdout)[report["fingerprint"]]
        assert listed["in_flight"] == 0 and listed["stale"] >= 1, listed
        print(f"build with a killed worker took {took:.1f} s")
