"""Prometheus metrics of workers, the ingester and ``farm build`` (prometheus-client).

Where each number comes from:

* **Workers** count per kernel (outcome, compile and load seconds), per task (status),
  per store request (tier, hit or miss, bytes) and per lease wait. Celery runs tasks in
  forked pool processes, so a worker uses prometheus-client's multiprocess mode: the
  main process points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder *before* anything
  imports prometheus-client (:func:`prepare_multiprocess`), the pool processes write
  their samples there, and the main process serves them all on ``FARM_METRICS_PORT``.
* **Queue depth, chunks in flight and live workers** per fingerprint are read from
  Redis at scrape time (:class:`ClusterCollector`, see ``farm.cluster.queues``): the broker is
  the truth, so they need no bookkeeping and are right after any restart.
* **The ingester** exports its running totals and, per stream, the entries the consumer
  group has not read yet (lag) and has read but not acknowledged (pending).
* **``farm build``** is short-lived: it pushes a summary to a Pushgateway
  (``FARM_METRICS_PUSHGATEWAY``) and/or writes it as a text file for node-exporter's
  textfile collector (``--metrics-file``).

The worker's metric objects are made once per process (:func:`worker_metrics`), which
is what prometheus-client requires (a name registers once per registry).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.cluster.lease import Leases
from farm.core.keys import RECORDS_GROUP, Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.core.outcomes import Fate, Outcome, fate_of
from farm.store.base import ArtifactStore, PutResult, WrappedStore

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    import redis
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from farm.cluster.payloads import CompileReply
    from farm.records.ingest import Ingester

#: seconds: kernels compile in tens of ms (NVIDIA) to seconds (PoCL on a small CPU)
COMPILE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: seconds: a stored kernel loads in under a millisecond (cubin) to tens of ms (PTX JIT)
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
#: seconds: waiting for another worker's compile of the same source
LEASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: what became of a chunk (``farm_tasks_total{status}``): built with every kernel obtained
#: (or unsupported), built with a failed kernel, given back to the queue, the task raised,
#: the time limit, its client gone, avoided by its client
TASK_STATUSES = ("success", "kernel_failed", "returned", "failure", "timeout", "dropped",
                 "avoided")


# -- workers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerMetrics:
    tasks: Counter
    kernels: Counter
    compile_seconds: Histogram
    load_seconds: Histogram
    store_requests: Counter
    store_bytes: Counter
    lease_wait_seconds: Histogram
    _seen: set[str] = field(default_factory=set)

    def reply(self, fingerprint: str, reply: CompileReply) -> None:
        """Count one chunk's kernels by outcome (and a failure's kind: compile, crashed,
        load, store, ...), with their compile or load seconds."""
        self._first(fingerprint)
        for k in reply.results:
            kind = k.failure.kind if k.failure else None
            self.kernels.labels(fingerprint=fingerprint, outcome=fate_of(k.outcome, kind),
                                kind=kind or "").inc()
            if k.outcome is Outcome.COMPILED:
                self.compile_seconds.labels(fingerprint=fingerprint).observe(k.work_s)
            elif k.outcome is Outcome.LOADED:
                self.load_seconds.labels(fingerprint=fingerprint).observe(k.work_s)

    def task(self, fingerprint: str, status: str) -> None:
        self._first(fingerprint)
        self.tasks.labels(fingerprint=fingerprint, status=status).inc()

    def _first(self, fingerprint: str) -> None:
        """Every series of ``fingerprint`` from 0, at its first chunk in this process: a
        series that appears with its first count shows no increase (no rate, no quantile)
        in Prometheus, so the first failure or load would be lost on the dashboard."""
        if fingerprint in self._seen:
            return
        self._seen.add(fingerprint)
        for status in TASK_STATUSES:
            self.tasks.labels(fingerprint=fingerprint, status=status).inc(0)
        for outcome in Outcome:
            self.kernels.labels(fingerprint=fingerprint, outcome=outcome.fate, kind="").inc(0)
        for histogram in (self.compile_seconds, self.load_seconds, self.lease_wait_seconds):
            histogram.labels(fingerprint=fingerprint)

    def timed_out(self, fingerprint: str, kernels: int) -> None:
        """A chunk stopped by the compile time limit: its kernels failed, kind timeout."""
        self.task(fingerprint, "timeout")
        self.kernels.labels(fingerprint=fingerprint, outcome=Fate.FAILED,
                            kind="timeout").inc(kernels)


_MADE = threading.Lock()


def worker_metrics() -> WorkerMetrics:
    """This process's worker metrics, in the default registry (multiprocess-aware);
    made once, whichever thread asks first (a chunk's store requests run on threads)."""
    with _MADE:
        return _worker_metrics()


@cache
def _worker_metrics() -> WorkerMetrics:
    from prometheus_client import Counter, Histogram

    return WorkerMetrics(
        tasks=Counter("farm_tasks", "Compile tasks (chunks) run by workers, by status",
                      ["fingerprint", "status"]),
        kernels=Counter("farm_kernels", "Kernels obtained by workers, by outcome; a "
                        "failure by kind (compile, crashed, load, store, timeout, ...)",
                        ["fingerprint", "outcome", "kind"]),
        compile_seconds=Histogram("farm_compile_seconds",
                                  "Work seconds of a compiled kernel (lower, finalize, "
                                  "load, store)", ["fingerprint"], buckets=COMPILE_BUCKETS),
        load_seconds=Histogram("farm_load_seconds",
                               "Work seconds of a kernel loaded from the store (read, "
                               "verify, load)", ["fingerprint"], buckets=LOAD_BUCKETS),
        store_requests=Counter("farm_store_requests",
                               "Artifact store reads (hit, miss) and writes (stored, "
                               "same, refused), by tier", ["tier", "result"]),
        store_bytes=Counter("farm_store_bytes", "Artifact bytes read from and written to "
                            "the store, by tier", ["tier", "direction"]),
        lease_wait_seconds=Histogram("farm_lease_wait_seconds",
                                     "Seconds a worker waited for another worker's compile "
                                     "of the same source", ["fingerprint"],
                                     buckets=LEASE_BUCKETS),
    )


class InstrumentedStore(WrappedStore):
    """An artifact store that counts hits, misses, writes and bytes for one tier."""

    def __init__(self, inner: ArtifactStore, tier: str) -> None:
        super().__init__(inner)
        self.tier = tier

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        art = self.inner.get(ns, key)
        m = worker_metrics()
        m.store_requests.labels(tier=self.tier, result="hit" if art else "miss").inc()
        if art is not None:
            m.store_bytes.labels(tier=self.tier, direction="read").inc(len(art.binary))
        return art

    def put(self, ns: Namespace, artifact: Artifact, *,
            source: Lowered | None = None) -> PutResult:
        result = self.inner.put(ns, artifact, source=source)
        m = worker_metrics()
        m.store_requests.labels(tier=self.tier, result=result.value).inc()
        if result is PutResult.STORED:
            m.store_bytes.labels(tier=self.tier, direction="write").inc(len(artifact.binary))
        return result

    def claim_source(self, ns: Namespace, source_hash: str, key: Key
                     ) -> tuple[Key | None, bool]:
        """A claim that found the source unindexed is the kernel's look that missed
        (what ``get`` counted before the claim replaced it): one miss a kernel asked
        for. One that found an entry counts nothing: the reads that follow do."""
        held, written = self.inner.claim_source(ns, source_hash, key)
        if written:
            worker_metrics().store_requests.labels(tier=self.tier, result="miss").inc()
        return held, written

    def rekey(self, ns: Namespace, src: Key, dst: Key, *, move: bool,
              source: Lowered | None = None) -> Artifact | None:
        return self.inner.rekey(ns, src, dst, move=move, source=source)  # the inner's way


class TimedLeases(Leases):
    """Compile leases whose waits for another worker's compile are timed."""

    def wait_released(self, ns: Namespace, source_hash: str, timeout_s: float,
                      poll_s: float = 0.05) -> bool:
        start = time.monotonic()
        try:
            return super().wait_released(ns, source_hash, timeout_s, poll_s)
        finally:
            worker_metrics().lease_wait_seconds.labels(fingerprint=ns.fingerprint).observe(
                time.monotonic() - start)


# -- serving ---------------------------------------------------------------------------


def prepare_multiprocess(folder: Path) -> None:
    """Make ``folder`` (emptied) the multiprocess folder of this process and its children.

    Call before anything imports prometheus-client: it picks its value store at import.
    """
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[MULTIPROC_ENV] = str(folder)


@dataclass(frozen=True)
class Served:
    """A running ``/metrics`` listener: its registry and its server."""

    registry: CollectorRegistry
    server: WSGIServer

    def close_inherited(self) -> None:
        """In a forked child (a Celery pool process): close this process's copy of the
        listening socket. A fork copies every descriptor, and a child holding the
        listener keeps the port taken after the worker that serves it is gone."""
        self.server.socket.close()


def serve(port: int, collectors: Iterable[Any] = (), *, multiprocess: bool = False,
          addr: str = "127.0.0.1") -> Served:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread (``FARM_METRICS_ADDRESS``:
    loopback unless the deployment says otherwise)."""
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    registry = REGISTRY
    if multiprocess:
        from prometheus_client import multiprocess as mp

        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)
    for collector in collectors:
        registry.register(collector)
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return Served(registry=registry, server=server)


class ClusterCollector:
    """Queue depth, chunks in flight and live workers per fingerprint, read at scrape."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def describe(self) -> list[Any]:
        return []  # read at scrape time only: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from farm.cluster.queues import queue_stats

        families = {
            "depth": GaugeMetricFamily("farm_queue_depth", "Chunks waiting in a "
                                       "fingerprint's queue", labels=["fingerprint"]),
            "in_flight": GaugeMetricFamily("farm_in_flight_chunks", "Chunks taken by a "
                                           "worker and not yet done", labels=["fingerprint"]),
            "workers": GaugeMetricFamily("farm_workers", "Live workers serving a fingerprint",
                                         labels=["fingerprint"]),
            "processes": GaugeMetricFamily("farm_worker_processes", "Compile processes of "
                                           "the live workers", labels=["fingerprint"]),
        }
        up = GaugeMetricFamily("farm_broker_up", "1 when the broker answered this scrape")
        try:
            stats = queue_stats(self.client)
        except Exception:  # Redis away: say so instead of failing the whole scrape
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        for fp, s in stats.items():
            for name, family in families.items():
                family.add_metric([fp], getattr(s, name))
        yield up
        yield from families.values()


# -- ingester --------------------------------------------------------------------------


class IngestCollector:
    """An ingester's totals, and per stream the group's lag and pending entries."""

    COUNTERS = ("batches", "sessions", "records", "claimed", "dead", "deferred", "lost",
                "pruned", "late", "failures")

    def __init__(self, ingester: Ingester, client: redis.Redis) -> None:
        self.ingester = ingester
        self.client = client

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.ingester.stats
        for name in self.COUNTERS:
            yield CounterMetricFamily(f"farm_ingest_{name}", f"Ingester total: {name}",
                                      value=getattr(stats, name))
        lag = GaugeMetricFamily("farm_ingest_lag_entries", "Stream entries the ingesters' "
                                "group has not read yet", labels=["stream"])
        pending = GaugeMetricFamily("farm_ingest_pending_entries", "Stream entries read "
                                    "but not yet written and acknowledged", labels=["stream"])
        try:
            for stream in self.ingester.streams:
                for group in self.client.xinfo_groups(stream):
                    raw = group.get("name")
                    name = raw.decode() if isinstance(raw, bytes) else str(raw)
                    if name != RECORDS_GROUP:
                        continue
                    lag.add_metric([stream], float(group.get("lag") or 0))
                    pending.add_metric([stream], float(group.get("pending") or 0))
        except Exception:  # Redis away or the stream not made yet: totals only
            pass
        yield lag
        yield pending


# -- farm build --------------------------------------------------------------------------


def build_registry(summary: dict[str, Any], *, manifest: str, fingerprint: str,
                   cluster: bool) -> CollectorRegistry:
    """One build's summary as gauges (a push replaces the previous build's)."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    labels = {"manifest": manifest, "fingerprint": fingerprint,
              "mode": "cluster" if cluster else "local"}
    kernels = Gauge("farm_build_kernels", "Kernels of the last build, by outcome",
                    [*labels, "outcome"], registry=registry)
    for fate in Fate:
        kernels.labels(**labels, outcome=fate).set(summary[fate])
    for name, key, what in (("farm_build_wall_seconds", "wall_s", "Wall seconds"),
                            ("farm_build_work_seconds", "work_s",
                             "Work seconds (summed over kernels)")):
        Gauge(name, f"{what} of the last build", list(labels),
              registry=registry).labels(**labels).set(summary[key])
    Gauge("farm_build_store_hits", "Kernels of the last build its client found in the "
          "store itself, before asking any worker", list(labels), registry=registry
          ).labels(**labels).set(summary.get("store_hits", 0))
    Gauge("farm_build_tasks_sent", "Chunks the last build sent to the workers",
          list(labels), registry=registry).labels(**labels).set(summary.get("tasks_sent", 0))
    Gauge("farm_build_last_timestamp_seconds", "When the last build ended (Unix time)",
          list(labels), registry=registry).labels(**labels).set(time.time())
    return registry


def publish_build(registry: CollectorRegistry, *, manifest: str, gateway: str | None,
                  textfile: Path | None) -> None:
    """Push to the Pushgateway and/or write the text file (atomically)."""
    from prometheus_client import push_to_gateway, write_to_textfile

    if textfile is not None:
        write_to_textfile(str(textfile), registry)
    if gateway:
        push_to_gateway(gateway, job="farm_build", registry=registry,
                        grouping_key={"manifest": manifest})
