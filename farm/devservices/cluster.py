"""A local cluster of separate processes: Redis, MinIO and N ``farm worker`` processes.

Used by ``farm cluster up`` (to try the distributed mode on one machine), by the
integration tests and by the benchmarks, so that all three run the real thing the same
way. Workers are started in their own process sessions: killing a worker's whole
process group (its main process and pool) is how tests simulate a dead machine.

A cluster whose access is set (:meth:`LocalCluster.set_access`, what ``farm cluster up``
does) runs as the chart does: the MinIO root user only makes the bucket, the users and
the policies (:mod:`farm.cluster.access`); each worker gets its pool's credentials and
the signing key through its own environment; clients (``cluster.env``) get a build
client's credentials and the verify key, never the signing key, the root user or the
repair role (which ``repair.env`` holds for ``farm gc``).
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

from farm.cluster.access import Grant, apply
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


#: what only a worker (or the repair role) holds: never in a client's settings
PRIVATE_SETTINGS = ("FARM_SIGNING_KEY", "FARM_MINIO_REPAIR_ACCESS_KEY",
                    "FARM_MINIO_REPAIR_SECRET_KEY")


@dataclass(frozen=True)
class ClusterAccess:
    """The users :meth:`LocalCluster.set_access` made, and the signing keys (base64)."""

    fingerprint: str
    pool: tuple[str, str] = field(repr=False)
    client: tuple[str, str] = field(repr=False)
    repair: tuple[str, str] = field(repr=False)
    signing_key: str = field(repr=False)
    verify_key: str = ""


def _credentials(role: str) -> tuple[str, str]:
    import secrets

    return f"farm-{role}-{secrets.token_hex(4)}", secrets.token_urlsafe(24)


def local_fingerprint() -> str:
    """The fingerprint a ``farm worker`` here serves by default (found in a child
    process, as the worker does: this process forks nothing OpenCL)."""
    from farm.compilation.backend import device_probes, discover
    from farm.core.device import select_device
    from farm.core.settings import load_settings

    settings = load_settings()
    found = discover(settings)
    return select_device(found, None, device_probes(settings, found)).fingerprint


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
    #: the users and keys of a cluster run as the chart runs (:meth:`set_access`)
    access: ClusterAccess | None = None

    def set_access(self, fingerprint: str) -> ClusterAccess:
        """Make (with the root user, its only use) a pool user for ``fingerprint``, a
        build client and the repair role, and a signing key pair: from now on workers
        run with the pool's credentials and sign, clients read with the client's and
        verify (see the module docstring)."""
        from minio import Minio
        from minio.credentials import StaticProvider
        from minio.minioadmin import MinioAdmin

        from farm.store.signing import generate_keypair

        pool, client, repair = (_credentials(r) for r in ("pool", "client", "repair"))
        admin = MinioAdmin(endpoint=self.minio_endpoint, secure=False,
                           credentials=StaticProvider(self.minio_access_key,
                                                      self.minio_secret_key))
        root = Minio(self.minio_endpoint, access_key=self.minio_access_key,
                     secret_key=self.minio_secret_key, secure=False)
        apply(admin, root, self.bucket, [
            Grant(access_key=pool[0], secret_key=pool[1], fingerprint=fingerprint),
            Grant(access_key=client[0], secret_key=client[1], client=True),
            Grant(access_key=repair[0], secret_key=repair[1], repair=True)])
        signing, verify = generate_keypair()
        self.access = ClusterAccess(fingerprint=fingerprint, pool=pool, client=client,
                                    repair=repair, signing_key=signing, verify_key=verify)
        return self.access

    def shared(self) -> dict[str, str]:
        """What every node of this cluster shares (``farm cluster up``'s ``cluster.env``):
        the broker, the store and a client's credentials (the verify key, with access
        set), and the settings the cluster was started with (its records URL, its
        limits). Never a node's own: not ``FARM_HOME`` (each node's local tier), nor
        anything else of the environment it was started from, nor what only a worker
        holds (:data:`PRIVATE_SETTINGS`)."""
        access, secret = (self.minio_access_key, self.minio_secret_key) \
            if self.access is None else self.access.client
        keys = {} if self.access is None else {"FARM_VERIFY_KEY": self.access.verify_key}
        return {
            "FARM_REDIS_URL": self.redis_url,
            "FARM_MINIO_ENDPOINT": self.minio_endpoint,
            "FARM_MINIO_ACCESS_KEY": access,
            "FARM_MINIO_SECRET_KEY": secret,
            "FARM_MINIO_BUCKET": self.bucket,
            "FARM_MINIO_SECURE": "false",
            **keys,
            **{k: v for k, v in self.extra_env.items()
               if k.startswith("FARM_") and k != "FARM_HOME" and k not in PRIVATE_SETTINGS},
        }

    def repair_settings(self) -> dict[str, str]:
        """The repair role's settings (``repair.env``: ``farm gc``), with access set."""
        if self.access is None:
            return {}
        return {"FARM_MINIO_REPAIR_ACCESS_KEY": self.access.repair[0],
                "FARM_MINIO_REPAIR_SECRET_KEY": self.access.repair[1]}

    def worker_env(self, home: Path, **extra: str) -> dict[str, str]:
        """A worker's environment: a client's, and with access set its pool's
        credentials and the signing key, which no client has."""
        env = self.env(home)
        if self.access is not None:
            env.update(FARM_MINIO_ACCESS_KEY=self.access.pool[0],
                       FARM_MINIO_SECRET_KEY=self.access.pool[1],
                       FARM_SIGNING_KEY=self.access.signing_key)
        env.update(extra)
        return env

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
        if self.access is not None and not any(a.startswith("--fingerprint") for a in args):
            args = (f"--fingerprint={self.access.fingerprint}", *args)  # its pool's
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "farm", "worker", f"--concurrency={concurrency}",
                 *args],
                env=self.worker_env(home, **extra_env), stdout=fh, stderr=subprocess.STDOUT,
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


__all__ = ["ClusterAccess", "LocalCluster", "WorkerProcess", "local_cluster",
           "local_fingerprint", "stop_process"]
