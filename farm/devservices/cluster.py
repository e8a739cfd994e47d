"""A local cluster of separate processes: Redis, MinIO and N ``farm worker`` processes.

Used by ``farm cluster up`` (to try the distributed mode on one machine), by the
integration tests and by the benchmarks, so that all three run the real thing the same
way. Workers are started in their own process sessions: killing a worker's whole
process group (its main process and pool) is how tests simulate a dead machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from farm.cluster.workers import READY_LINE
from farm.core.keys import DEFAULT_BUCKET
from farm.devservices.minio import MinioServer
from farm.devservices.ports import ServiceError, log_tail, stop_process
from farm.devservices.redis import RedisServer
from farm.devservices.server import LocalServer


@dataclass
class WorkerProcess:
    """One ``farm worker`` and its log."""

    process: subprocess.Popen[bytes]
    log: Path
    home: Path
    concurrency: int = 1

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill_all(self) -> None:
        """SIGKILL the worker's main process and its pool: the whole worker dies."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@contextlib.contextmanager
def paused(*workers: WorkerProcess) -> Iterator[None]:
    """The workers' whole process groups stopped (SIGSTOP) for the block, then continued
    (also when it raises): each keeps its connections and answers nothing, as a hung
    machine would, and a BRPOP it had pending may still take a message."""
    for w in workers:
        os.killpg(w.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for w in workers:
            os.killpg(w.pid, signal.SIGCONT)


@dataclass
class LocalCluster:
    """Settings for clients, and workers started on demand against one Redis and MinIO."""

    redis_url: str
    minio_endpoint: str
    minio_access_key: str
    minio_secret_key: str
    bucket: str
    workdir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    workers: list[WorkerProcess] = field(default_factory=list)
    ingesters: list[WorkerProcess] = field(default_factory=list)

    def shared(self) -> dict[str, str]:
        """What every node of this cluster shares (``farm cluster up``'s ``cluster.env``):
        the broker, the store and its keys, and the settings the cluster was started with
        (its records URL, its limits). Never a node's own: not ``FARM_HOME`` (each node's
        local tier), nor anything else of the environment it was started from."""
        return {
            "FARM_REDIS_URL": self.redis_url,
            "FARM_MINIO_ENDPOINT": self.minio_endpoint,
            "FARM_MINIO_ACCESS_KEY": self.minio_access_key,
            "FARM_MINIO_SECRET_KEY": self.minio_secret_key,
            "FARM_MINIO_BUCKET": self.bucket,
            "FARM_MINIO_SECURE": "false",
            **{k: v for k, v in self.extra_env.items()
               if k.startswith("FARM_") and k != "FARM_HOME"},
        }

    def env(self, home: Path | None = None, **extra: str) -> dict[str, str]:
        """Environment for a farm process of this cluster (client or worker)."""
        env = dict(os.environ)
        env.update({"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0"})
        env.update(self.extra_env)
        env.update(self.shared())
        if home is not None:
            env["FARM_HOME"] = str(home)
        env.update(extra)
        return env

    def start_worker(self, concurrency: int = 1, args: tuple[str, ...] = (),
                     **extra_env: str) -> WorkerProcess:
        """A ``farm worker``; ``args`` are more of its command line (``--`` and Celery's
        own options among them)."""
        index = len(self.workers)
        home = self.workdir / f"worker-{index}"
        home.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"worker-{index}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "farm", "worker", f"--concurrency={concurrency}",
                 *args],
                env=self.env(home, **extra_env), stdout=fh, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        worker = WorkerProcess(process=proc, log=log, home=home, concurrency=concurrency)
        self.workers.append(worker)
        return worker

    def start_ingester(self, records_url: str) -> WorkerProcess:
        """A ``farm ingest`` moving the streams' records into ``records_url``."""
        log = self.workdir / f"ingester-{len(self.ingesters)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "farm", "ingest"],
                env=self.env(self.workdir / "ingester", FARM_RECORDS_URL=records_url),
                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        ingester = WorkerProcess(process=proc, log=log, home=self.workdir / "ingester")
        self.ingesters.append(ingester)
        return ingester

    def wait_ready(self, timeout: float = 120.0,
                   workers: list[WorkerProcess] | None = None) -> None:
        """Wait until every started worker (or each of ``workers``) has all its pool
        processes up and consumes its queues (its readiness checks passed)."""
        deadline = time.monotonic() + timeout
        for w in self.workers if workers is None else workers:
            while True:
                text = w.log.read_text(errors="replace") if w.log.exists() else ""
                if READY_LINE in text and text.count(" opened ") >= w.concurrency:
                    break
                if "Traceback" in text:
                    raise ServiceError(f"worker failed to start:\n{log_tail(w.log)}")
                if w.process.poll() is not None:
                    raise ServiceError(f"worker exited with {w.process.returncode}:\n"
                                       f"{log_tail(w.log)}")
                if time.monotonic() > deadline:
                    raise ServiceError(f"worker not ready in {timeout:.0f} s:\n"
                                       f"{log_tail(w.log)}")
                time.sleep(0.1)

    def stop_workers(self) -> None:
        """SIGTERM every worker and ingester at once (a warm shutdown each), then wait for
        each; one still running after 30 s is killed with its pool."""
        running = [w for w in self.workers + self.ingesters if w.process.poll() is None]
        for w in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for w in running:
            try:
                w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill_all()
        self.workers.clear()
        self.ingesters.clear()


@contextlib.contextmanager
def local_cluster(workdir: Path, *, redis: RedisServer | None = None,
                  minio: MinioServer | None = None, bucket: str = DEFAULT_BUCKET,
                  redis_db: int = 0, **extra_env: str) -> Iterator[LocalCluster]:
    """Start (or reuse the given) Redis and MinIO; yield a LocalCluster; stop it all.

    Clusters sharing one Redis stay apart through ``redis_db`` (queues, leases and the
    worker registry live in the database) and through their MinIO ``bucket``."""
    own: list[LocalServer] = []
    try:
        if redis is None:
            redis = RedisServer().start()
            own.append(redis)
        if minio is None:
            minio = MinioServer().start()
            own.append(minio)
        redis_url = redis.url.rsplit("/", 1)[0] + f"/{redis_db}"
        cluster = LocalCluster(redis_url=redis_url, minio_endpoint=minio.endpoint,
                               minio_access_key=minio.access_key,
                               minio_secret_key=minio.secret_key, bucket=bucket,
                               workdir=workdir, extra_env=dict(extra_env))
        try:
            yield cluster
        finally:
            cluster.stop_workers()
    finally:
        for service in reversed(own):
            stop_process_safe(service)


def stop_process_safe(service: LocalServer) -> None:
    with contextlib.suppress(Exception):
        service.stop()


__all__ = ["LocalCluster", "WorkerProcess", "local_cluster", "stop_process"]
