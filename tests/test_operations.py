"""What an operator watches, against a real local cluster (Redis, MinIO, a Celery worker).

Celery's own command line and Flower see the workers and their tasks through the
module-level app (``celery -A worker``); a Prometheus scrape of a worker after a build
shows the kernels it compiled; ``farm workers`` shows queue depth and chunks in flight;
``farm build --metrics-file`` writes the build's summary; the health files the chart's
probes read are there and fresh.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import build_json, farm, next_redis_db, write_manifest
from prometheus_client.parser import text_string_to_metric_families

from farm.cluster.celery_app import make_app
from farm.cluster.queues import in_flight, queue_depth, queue_stats
from farm.core.keys import TASK_NAME, queue_name
from farm.core.settings import Settings
from farm.devservices.cluster import LocalCluster, local_cluster
from farm.devservices.ports import free_port, log_tail
from worker.startup import celery_argv

pytestmark = pytest.mark.integration

NOWHERE = "pocl-nowhere-0123456789ab"


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return str(reply.read().decode())


def _wait_http(url: str, process: subprocess.Popen[bytes] | None, log: Path | None,
               timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _get(url)
        except OSError:
            if process is not None and process.poll() is not None:
                pytest.fail(f"{url}: the server exited:\n{log_tail(log) if log else ''}")
            if time.monotonic() > deadline:
                pytest.fail(f"{url} did not answer in {timeout:.0f} s:\n"
                            f"{log_tail(log) if log else ''}")
            time.sleep(0.2)


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[tuple[str, dict[str, str], float]], name: str,
           **labels: str) -> float:
    found = [v for n, ls, v in samples
             if n == name and all(ls.get(k) == want for k, want in labels.items())]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def _celery(env: dict[str, str], *args: str, timeout: float = 60) -> \
        subprocess.CompletedProcess[str]:
    celery = str(Path(sys.executable).with_name("celery"))
    return subprocess.run([celery, "-A", "worker", *args], env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


class Ops:
    """The cluster of this module, with its worker's metrics port and health folder."""

    def __init__(self, cluster: LocalCluster, metrics_port: int, health: Path,
                 flower_port: int, ingester_port: int) -> None:
        self.cluster = cluster
        self.metrics_port = metrics_port
        self.health = health
        self.flower_port = flower_port
        self.ingester_port = ingester_port

    def metrics(self, port: int | None = None) -> list[tuple[str, dict[str, str], float]]:
        return _samples(_get(f"http://127.0.0.1:{port or self.metrics_port}/metrics"))


@pytest.fixture(scope="module")
def ops(redis_server: Any, minio_server: Any,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    work = tmp_path_factory.mktemp("ops")
    health = work / "health"
    metrics_port, flower_port, ingester_port = free_port(), free_port(), free_port()
    with local_cluster(work, redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db()) as c:
        c.start_worker(args=("--metrics-port", str(metrics_port), "--",
                             "--max-tasks-per-child=50"),
                       FARM_HEALTH_DIR=str(health))
        # The ingester's own metrics port and health folder (set for it alone).
        ingester_env = {"FARM_METRICS_PORT": str(ingester_port),
                        "FARM_HEALTH_DIR": str(work / "ingester-health")}
        c.extra_env.update(ingester_env)
        c.start_ingester(f"sqlite:///{work / 'records.sqlite'}")
        for key in ingester_env:
            del c.extra_env[key]
        c.wait_ready()
        log = work / "flower.log"
        with open(log, "wb") as fh:
            flower = subprocess.Popen(
                [str(Path(sys.executable).with_name("celery")), "-A", "worker", "flower",
                 f"--port={flower_port}", "--address=127.0.0.1"],
                env=c.env(FLOWER_UNAUTHENTICATED_API="true"), stdout=fh,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{flower_port}/healthcheck", flower, log)
            yield Ops(c, metrics_port, health, flower_port, ingester_port)
        finally:
            flower.terminate()
            try:
                flower.wait(timeout=20)
            except subprocess.TimeoutExpired:
                flower.kill()
                flower.wait(timeout=20)


@pytest.fixture(scope="module")
def built(ops: Ops, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One build of six fresh kernels through the worker, with its metrics file."""
    tmp = tmp_path_factory.mktemp("build")
    manifest = write_manifest(tmp / "ops.toml", salt=31, count=6)
    metrics_file = tmp / "build.prom"
    summary = build_json(ops.cluster.env(tmp / "client"), str(manifest),
                         "--metrics-file", str(metrics_file))
    assert summary["summary"]["compiled"] == 6, summary
    return {**summary, "metrics_file": metrics_file}


def test_celery_command_line_reaches_the_workers(ops: Ops) -> None:
    env = ops.cluster.env()
    ping = _celery(env, "inspect", "ping", "--timeout=10")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert "pong" in ping.stdout and "farm-" in ping.stdout
    # `farm worker -- OPTIONS` reached Celery's own worker.
    stats = _celery(env, "inspect", "stats", "--json", "--timeout=10")
    assert stats.returncode == 0, stats.stderr
    (worker_stats,) = json.loads(stats.stdout).values()
    assert worker_stats["pool"]["max-tasks-per-child"] == 50


def test_celery_without_a_redis_url_is_one_line(ops: Ops) -> None:
    env = {k: v for k, v in ops.cluster.env().items() if k != "FARM_REDIS_URL"}
    proc = _celery(env, "inspect", "ping")
    assert proc.returncode != 0
    assert "FARM_REDIS_URL" in proc.stderr + proc.stdout


def test_flower_lists_the_worker_and_its_tasks(ops: Ops, built: dict[str, Any]) -> None:
    base = f"http://127.0.0.1:{ops.flower_port}"
    deadline = time.monotonic() + 30
    while True:
        workers = json.loads(_get(f"{base}/api/workers?status=true"))
        tasks = json.loads(_get(f"{base}/api/tasks"))
        ours = [t for t in tasks.values() if t.get("name") == TASK_NAME]
        done = [t for t in ours if t.get("state") == "SUCCESS"]
        if any(name.startswith("farm-") and up for name, up in workers.items()) \
                and len(done) >= built["summary"]["tasks_sent"]:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"Flower: workers {workers}, our tasks {ours}")
        time.sleep(0.5)
    # Task-sent events come from the client: Flower knows each task's queue.
    assert {t.get("routing_key") for t in done} == {queue_name(built["fingerprint"])}


def test_worker_metrics_show_the_kernels_compiled(ops: Ops, built: dict[str, Any]) -> None:
    fp = built["fingerprint"]
    samples = ops.metrics()
    compiled = built["summary"]["compiled"]
    assert _value(samples, "farm_kernels_total", fingerprint=fp, outcome="compiled") \
        == compiled
    assert _value(samples, "farm_compile_seconds_count", fingerprint=fp) == compiled
    assert _value(samples, "farm_compile_seconds_sum", fingerprint=fp) > 0
    assert _value(samples, "farm_tasks_total", fingerprint=fp, status="success") \
        == built["summary"]["tasks_sent"]
    assert _value(samples, "farm_store_requests_total", tier="minio", result="stored") \
        == compiled
    assert _value(samples, "farm_store_bytes_total", tier="minio", direction="write") > 0
    # Read from Redis at scrape time: nothing waits now, and the worker is live.
    assert _value(samples, "farm_queue_depth", fingerprint=fp) == 0
    assert _value(samples, "farm_workers", fingerprint=fp) == 1
    assert _value(samples, "farm_broker_up") == 1

    # A second build loads everything from the store: the client skips them all, so the
    # worker's counts do not move (nothing was sent).
    again = build_json(ops.cluster.env(), str(Path(built["manifest"])))
    assert again["summary"]["loaded"] == again["summary"]["kernels"]
    assert _value(ops.metrics(), "farm_kernels_total", fingerprint=fp,
                  outcome="compiled") == compiled


def test_worker_logs_a_line_per_chunk_not_the_reply(ops: Ops, built: dict[str, Any]) -> None:
    text = ops.cluster.workers[0].log.read_text(errors="replace")
    chunks = re.findall(r"chunk [0-9a-f-]{36}: (\d+) compiled", text)
    assert sum(int(n) for n in chunks) >= built["summary"]["compiled"]
    assert "succeeded in" not in text  # Celery's line with the whole reply: DEBUG only
    assert '"results"' not in text


def test_ingester_metrics_and_health(ops: Ops, built: dict[str, Any]) -> None:
    """The ingester wrote the build's records (its totals say so), is caught up (no lag),
    sees the same queues as the workers, and keeps its health files fresh."""
    url = f"http://127.0.0.1:{ops.ingester_port}/metrics"
    _wait_http(url, ops.cluster.ingesters[0].process, ops.cluster.ingesters[0].log)
    deadline = time.monotonic() + 30
    while True:
        samples = ops.metrics(ops.ingester_port)
        lag = [v for n, _, v in samples if n == "farm_ingest_lag_entries"]
        # the build's 6 compilation records, its batch record and its session at least
        if _value(samples, "farm_ingest_records_total") >= 7 and lag and not any(lag):
            break
        assert time.monotonic() < deadline, samples
        time.sleep(0.5)
    assert _value(samples, "farm_ingest_sessions_total") >= 1
    assert _value(samples, "farm_ingest_lost_total") == 0
    streams = {ls["stream"] for n, ls, _ in samples if n == "farm_ingest_lag_entries"}
    assert "farm:records:compilation" in streams
    assert _value(samples, "farm_workers", fingerprint=built["fingerprint"]) == 1
    health = ops.cluster.workdir / "ingester-health"
    assert (health / "ready").exists()
    assert time.time() - (health / "alive").stat().st_mtime < 10


def test_build_writes_its_summary_as_metrics(built: dict[str, Any]) -> None:
    samples = _samples(built["metrics_file"].read_text())
    labels = {"manifest": "salted-31", "fingerprint": built["fingerprint"],
              "mode": "cluster"}
    assert _value(samples, "farm_build_kernels", outcome="compiled", **labels) == 6
    assert _value(samples, "farm_build_kernels", outcome="failed", **labels) == 0
    assert _value(samples, "farm_build_wall_seconds", **labels) > 0


def test_build_metrics_file_in_a_missing_folder_is_one_line(ops: Ops, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.toml", salt=3101, count=1)
    proc = farm(ops.cluster.env(tmp_path / "c"), "build", str(manifest), "--cluster",
                "--metrics-file", str(tmp_path / "no" / "such" / "dir" / "b.prom"))
    assert proc.returncode == 2  # bad input
    assert "--metrics-file" in proc.stderr and "Traceback" not in proc.stderr
    assert "building" not in proc.stderr  # said before any work: nothing built


def test_health_files_for_the_probes(ops: Ops) -> None:
    ready, alive = ops.health / "ready", ops.health / "alive"
    assert ready.exists()
    first = alive.stat().st_mtime
    time.sleep(4.5)  # Celery's worker heartbeat: every 2 s
    assert alive.stat().st_mtime > first
    assert time.time() - alive.stat().st_mtime < 10


def test_farm_workers_shows_queue_depth_and_chunks_in_flight(ops: Ops,
                                                             built: dict[str, Any]) -> None:
    """Chunks for a fingerprint nobody serves wait in its queue; one taken and not yet
    acknowledged is in flight."""
    env = ops.cluster.env()
    settings = Settings(redis_url=ops.cluster.redis_url)
    app = make_app(settings)
    for _ in range(3):
        app.send_task(TASK_NAME, args=[{}], queue=queue_name(NOWHERE))
    import redis
    from kombu import Connection

    client: Any = redis.Redis.from_url(ops.cluster.redis_url)
    try:
        assert queue_depth(client, NOWHERE) == 3
        with Connection(ops.cluster.redis_url) as conn:
            queue = conn.SimpleQueue(queue_name(NOWHERE), no_ack=False)
            message = queue.get(timeout=10)  # taken, not acknowledged: in flight
            assert in_flight(client).get(NOWHERE) == 1
            stats = queue_stats(client)
            assert stats[NOWHERE].depth == 2 and stats[NOWHERE].in_flight == 1
            assert stats[NOWHERE].workers == 0
            proc = farm(env, "workers", "--json")
            assert proc.returncode == 0, proc.stderr
            listed = json.loads(proc.stdout)
            assert listed[NOWHERE] == {"workers": [], "depth": 2, "in_flight": 1, "stale": 0}
            assert len(listed[built["fingerprint"]]["workers"]) == 1
            table = farm(env, "workers")
            assert "2 chunk(s) waiting, 1 in flight" in table.stdout and NOWHERE in table.stdout
            scraped = ops.metrics()
            assert _value(scraped, "farm_queue_depth", fingerprint=NOWHERE) == 2
            assert _value(scraped, "farm_in_flight_chunks", fingerprint=NOWHERE) == 1
            message.ack()
            queue.close()
        assert in_flight(client).get(NOWHERE, 0) == 0
    finally:
        client.delete(queue_name(NOWHERE))
        client.close()


def test_celery_argv_passes_operator_options_last() -> None:
    argv = celery_argv(concurrency=2, queues=["farm.a"], loglevel="INFO", hostname="h",
                       events=True, heartbeat=True, extra=["--max-tasks-per-child=9"])
    assert "--task-events" in argv and "--without-heartbeat" not in argv
    assert argv[-1] == "--max-tasks-per-child=9"
    quiet = celery_argv(concurrency=2, queues=["farm.a"], loglevel="INFO", hostname="h",
                        events=False, heartbeat=False)
    assert "--task-events" not in quiet and "--without-heartbeat" in quiet


def test_events_and_heartbeats_follow_the_settings() -> None:
    on = make_app(Settings(redis_url="redis://127.0.0.1:1/0"))
    assert on.conf.worker_send_task_events and on.conf.task_send_sent_event
    off = make_app(Settings(redis_url="redis://127.0.0.1:1/0", worker_events=False))
    assert not off.conf.worker_send_task_events and not off.conf.task_send_sent_event


def test_module_level_app_reads_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARM_REDIS_URL", "redis://127.0.0.1:1/7")
    monkeypatch.setenv("FARM_WORKER_EVENTS", "false")
    code = ("import worker.celery as m; "
            "print(m.app.conf.broker_url, m.app.conf.worker_send_task_events)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["redis://127.0.0.1:1/7", "False"]



def test_build_waits_for_a_pool_scaled_to_zero(redis_server: Any, minio_server: Any,
                                               built: dict[str, Any], tmp_path: Path) -> None:
    """With --wait-for-workers a build queues its chunks although no worker serves the
    fingerprint yet (KEDA starts the pool on the queue's length); a worker that starts
    later takes them and the build completes."""
    import redis

    fp = built["fingerprint"]
    manifest = write_manifest(tmp_path / "z.toml", salt=32, count=2)
    with local_cluster(tmp_path / "zero", redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db()) as c:
        env = c.env(tmp_path / "client")
        refused = farm(env, "build", str(manifest), "--cluster", "--wait-for-workers")
        assert refused.returncode == 2 and "--fingerprint" in refused.stderr
        build = subprocess.Popen(
            [sys.executable, "-m", "farm", "build", str(manifest), "--cluster", "--json",
             "--fingerprint", fp, "--wait-for-workers"], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        client: Any = redis.Redis.from_url(c.redis_url)
        try:
            deadline = time.monotonic() + 60
            while queue_depth(client, fp) == 0:
                assert build.poll() is None, build.communicate()
                assert time.monotonic() < deadline, "nothing was queued"
                time.sleep(0.2)
            c.start_worker()
            stdout, stderr = build.communicate(timeout=240)
        finally:
            if build.poll() is None:
                build.kill()
            client.close()
        assert build.returncode == 0, stderr
        assert "queueing for the workers to come" in stderr
        assert json.loads(stdout)["summary"]["compiled"] == 2


def test_cluster_up_says_where_its_logs_are_and_keeps_them(tmp_path: Path) -> None:
    import signal

    work = tmp_path / "work"
    # the starting shell's own settings: its local tier and device are not the cluster's
    shell = {**os.environ, "FARM_HOME": str(tmp_path / "shell-home"),
             "FARM_DEVICE": "pocl", "FARM_WORKERS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "farm", "cluster", "up", "--workers", "1",
                             "--workdir", str(work)], stdout=subprocess.PIPE, env=shell,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (work / "cluster.env").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "farm cluster up did not get ready"
            time.sleep(0.5)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, output
    assert f"# logs: {work}/worker-*.log" in output
    assert f"logs and records kept in {work}" in output
    assert " ready." in (work / "worker-0.log").read_text()
    assert (work / "ingester-0.log").exists()
    assert (work / "cluster.env").stat().st_mode & 0o077 == 0
    # what every node shares, and nothing of the shell that started it
    names = {line.split("=", 1)[0].removeprefix("export ")
             for line in (work / "cluster.env").read_text().splitlines()}
    assert {"FARM_REDIS_URL", "FARM_MINIO_ENDPOINT", "FARM_MINIO_ACCESS_KEY",
            "FARM_MINIO_SECRET_KEY", "FARM_MINIO_BUCKET", "FARM_RECORDS_URL"} <= names
    assert not names & {"FARM_HOME", "FARM_DEVICE", "FARM_WORKERS"}, names


def _script(name: str) -> Any:
    """A module of scripts/ (not a package), loaded by path."""
    import importlib

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


def test_the_dashboard_s_promql_is_evaluated_like_prometheus() -> None:
    """scripts/promql.py, which the picture draws with: histogram_quantile over rate
    windows against a hand computation (10 observations in (0.1, 0.25], 10 in (0.25,
    0.5]), rate, a ratio of two aggregations, a filter, label_replace."""
    promql = _script("promql")

    def buckets(counts: dict[str, float]) -> dict[Any, float]:
        return {("farm_compile_seconds_bucket", (("fingerprint", "f"), ("le", le))): v
                for le, v in counts.items()}

    series = [(0.0, buckets({"0.1": 0, "0.25": 0, "0.5": 0, "+Inf": 0})),
              (5.0, buckets({"0.1": 0, "0.25": 10, "0.5": 20, "+Inf": 20}))]
    quantile = ("histogram_quantile({q}, sum by (le, fingerprint) "
                "(rate(farm_compile_seconds_bucket{{fingerprint=~\"$fingerprint\"}}"
                "[$__rate_interval])))")
    for q, want in ((0.5, 0.25), (0.75, 0.375)):
        found = promql.evaluate(quantile.format(q=q), series, rate_interval=10,
                                variables={"fingerprint": ".*"})
        assert found == {(("fingerprint", "f"),): [(5.0, pytest.approx(want))]}
    counter = [(0.0, {("c_total", (("outcome", "compiled"),)): 0.0,
                      ("c_total", (("outcome", "loaded"),)): 0.0}),
               (2.0, {("c_total", (("outcome", "compiled"),)): 8.0,
                      ("c_total", (("outcome", "loaded"),)): 2.0})]
    rate = promql.evaluate("sum by (outcome) (rate(c_total[4s]))", counter, rate_interval=4)
    assert rate == {(("outcome", "compiled"),): [(2.0, 4.0)],
                    (("outcome", "loaded"),): [(2.0, 1.0)]}  # one sample: no rate yet
    ratio = promql.evaluate('sum(c_total{outcome="loaded"}) / sum(c_total) > 0', counter,
                            rate_interval=4)
    assert ratio == {(): [(2.0, 0.2)]}  # 0/0 at the start is no point, as in Prometheus
    long = "pocl-pthread-skylake-avx512-intel-r-xeon-r-pr-2da00bdc490f"
    named = promql.evaluate('label_replace(g, "device", "$1…$2", "fingerprint", '
                            '"(.{16}).{2,}(.{6})")',
                            [(0.0, {("g", (("fingerprint", long),)): 1.0})], rate_interval=4)
    assert dict(next(iter(named)))["device"] == "pocl-pthread-sky…dc490f"
    with pytest.raises(promql.PromQLError, match="topk"):
        promql.evaluate("topk(3, g)", counter, rate_interval=4)


def test_every_panel_of_the_dashboard_is_read_by_the_picture_s_evaluator() -> None:
    """A construct the evaluator does not read fails here, not in a docs picture."""
    promql = _script("promql")
    board = json.loads((Path(__file__).resolve().parent.parent / "helm" / "kernel-farm" /
                        "dashboards" / "kernel-farm.json").read_text())
    for panel in board["panels"]:
        for target in panel["targets"]:
            promql.parse(target["expr"], {"fingerprint": ".*", "__rate_interval": "4s"})
            assert "{{fingerprint}}" not in target.get("legendFormat", ""), \
                f"panel {panel['id']}: a short fingerprint ({{{{device}}}}) in the legend"


def test_dashboard_picture_draws_every_panel_with_its_title_and_units() -> None:
    """docs/dashboard.svg (and any drawing of the script) has each of the dashboard's
    panels under its own title and no panel without data; panel 9 keeps seconds for
    lease waits and a rate for refused writes, on an axis of its own; counts get whole
    ticks; kernels are counted in kernels/s."""
    import html
    import xml.etree.ElementTree as ET

    root = Path(__file__).resolve().parent.parent
    board = json.loads((root / "helm" / "kernel-farm" / "dashboards" /
                        "kernel-farm.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == 14
    (nine,) = [p for p in board["panels"] if p["id"] == 9]
    assert nine["fieldConfig"]["defaults"]["unit"] == "s"
    (override,) = nine["fieldConfig"]["overrides"]
    refused = [t for t in nine["targets"] if "refused" in t["expr"]]
    assert override["matcher"] == {"id": "byFrameRefID", "options": refused[0]["refId"]}
    assert {"id": "unit", "value": "suffix: writes/s"} in override["properties"]

    picture = _script("dashboard_picture")
    sample = {("farm_store_requests_total", (("result", "refused"), ("tier", "minio"))): 0.0,
              ("farm_lease_wait_seconds_bucket", (("fingerprint", "f"), ("le", "+Inf"))): 0.0,
              ("farm_queue_depth", (("fingerprint", "f" * 40),)): 3.0,
              ("farm_kernels_total", (("fingerprint", "f"), ("outcome", "compiled"))): 0.0}
    later = {k: 4.0 for k in sample} | {("farm_queue_depth", (("fingerprint", "f" * 40),)): 7}
    drawn = picture.draw([(0.0, sample), (2.0, later)])
    for svg_text in (drawn, (root / "docs" / "dashboard.svg").read_text()):
        svg = ET.fromstring(svg_text)
        texts = [t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text")]
        for title in titles:
            assert html.unescape(title) in texts, title
        assert not any("ops/s" in t for t in texts)
    assert "refused writes minio (right axis)" in drawn
    assert "2 writes/s" in drawn and "750 ms" in drawn  # both units, each on its axis
    assert "2 kernels/s" in drawn
    svg = ET.fromstring(drawn)
    texts = [t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "ffffffffffffffff…ffffff" in texts  # a short fingerprint in the legend
    # the queue depth's axis: whole numbers in even steps (0, 2, 4, 6, 8)
    assert {"0", "2", "4", "6", "8"} <= set(texts)
    assert not any(re.fullmatch(r"\d+\.\d+", t) for t in texts if t)
    document = (root / "docs" / "dashboard.svg").read_text()
    assert "No data" not in document


def test_nice_axis_scales() -> None:
    picture = _script("dashboard_picture")
    assert picture.nice_scale(14.9, "short", 0) == (15.0, 5.0)
    assert picture.nice_scale(2.3, "short", 0) == (3.0, 1.0)
    assert picture.nice_scale(0.3, "short", 0) == (1.0, 1.0)
    assert picture.nice_scale(0.74, "s", None) == (0.8, 0.2)
    assert picture.nice_scale(0.9, "percentunit", None) == (1.0, 0.25)
