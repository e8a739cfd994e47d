"""``ClusterClient``: the one owner of a process's conversation with the cluster.

A build client (``farm build --cluster``) and a loader that asks the farm on a miss
(``on_miss="farm"``) talk to the cluster the same way, through one of these. It owns:

* the Redis client and the :class:`~farm.core.outage.Waiter` of its outages (every round
  trip waits out an outage shorter than ``FARM_OUTAGE_LIMIT``, with one line each way);
* the Celery app, made when the first chunk is sent (a build whose kernels are all
  stored never imports Celery), or, with ``ahead=True`` (the CLI's builds and tunes),
  on a thread of its own (:class:`AppAhead`) from the client's start, while the client
  asks Redis and the store which workers serve and which kernels are held: importing
  Celery and opening the broker's connection cost a client's first chunk 80 to 100 ms
  of its latency when made at the send (docs/BENCHMARKS.md, "Where the added latency
  goes"). A build whose kernels are all stored does not wait for it. Not in an
  application's process (a served program's miss, the loader's): a thread importing
  while the application forks is a risk the application did not take;
* the served check (:meth:`ClusterClient.served`): a build for a fingerprint no live
  worker serves fails fast, naming the fingerprints that are served;
* :meth:`ClusterClient.build`: obtain artifacts through the workers.

The build: every key is computed here (:func:`farm.compilation.obtain.store_key`, with
this process's build ids), the store is asked which it holds in one bulk listing, and
only the misses are sent, in chunks of ``FARM_CHUNK_SIZE``, to the fingerprint's queue
(:mod:`farm.cluster.gather` gathers the replies and re-sends a dead worker's chunks).
A stored key counts as Loaded only once read and checked here (its digest; its signature
with a verify key): a listing proves a name, not an artifact (issue 33). With a verify
key (``FARM_VERIFY_KEY``) the client counts only what it verified itself: held keys are
read from the cluster's own store, and every kernel a worker answered for is read back
after the reply (:meth:`ClusterClient.check_replies`); what this key refuses fails as
``untrusted``. Kernels the target
device cannot run (its limits are published by its workers) are counted unsupported
without being sent: they are never stored, so otherwise every build would send them
again.

Chunks: a task costs a few milliseconds of broker and result round trips, a compile
tens to hundreds of milliseconds, so a handful of kernels per task keeps the overhead
small while still spreading work over every worker process.

What stays with the callers: the CLI's fallback policy (compile locally, or queue for
workers to come) and its progress display; the loader's loads of what was stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from farm.cluster.gather import CHECK_INTERVAL_S, Gatherer, Progress
from farm.cluster.payloads import CompileRequest, KernelRequest
from farm.cluster.workers import WorkerInfo, served
from farm.compilation.batch import BatchReport, KernelResult
from farm.compilation.obtain import store_key
from farm.core.device import DeviceInfo
from farm.core.errors import ClusterError, FarmError, SettingsError, UnsupportedFeature
from farm.core.keys import Namespace
from farm.core.model import ArtifactId, KernelFailure
from farm.core.outage import Say, redis_client, redis_waiter
from farm.core.outcomes import Outcome
from farm.core.settings import Settings
from farm.families import Registry
from farm.records.model import RequestedBy
from farm.store import ArtifactStore

if TYPE_CHECKING:
    import redis
    from celery import Celery

    from farm.records import Recorder

log = logging.getLogger(__name__)

#: seconds a served check stays fresh for the build that follows it
SERVED_FRESH_S = 5.0


class BuildOptions(BaseModel):
    """What one cluster build asks for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the target device's fingerprint: its workers' queue and the store's namespace
    fingerprint: str
    #: what the build is, for its batch record (e.g. ``build qwen3-8b``)
    label: str = ""
    #: read every stored artifact back and verify its digest (a corrupt one is sent):
    #: always done since issue 33 (see ``_misses``); kept for ``--verify``'s callers
    verify: bool = False
    #: seconds to wait for the workers' replies before their kernels fail
    timeout_s: float = Field(default=3600.0, gt=0)
    #: queue the kernels even when no live worker serves the fingerprint now (a pool
    #: that scales from zero starts on its queue's length)
    wait_for_workers: bool = False


class ClusterClient:
    """A process's conversation with the cluster (see the module doc). Use it as a
    context manager, or call :meth:`close`.

    ``registry`` computes the keys (default: the settings' families); ``store`` is
    asked which keys it holds (default: the settings' store, opened on first use and
    closed with the client); ``say`` gets the lines worth keeping (an outage waited
    for, a chunk re-sent; default: this module's log); ``ahead`` makes the Celery app
    on a thread from the start (see the module doc).
    """

    #: seconds between looks at who holds the chunks in flight (tests shorten it)
    check_interval_s: float = CHECK_INTERVAL_S

    def __init__(self, settings: Settings, *, registry: Registry | None = None,
                 store: ArtifactStore | None = None, say: Say | None = None,
                 ahead: bool = False) -> None:
        if not settings.redis_url:
            raise SettingsError("the cluster needs FARM_REDIS_URL")
        self.settings = settings
        self.registry = registry if registry is not None else \
            Registry.load(settings.family_modules)
        self._store = store
        self._owns_store = store is None
        self._say = say or (lambda line: log.warning("%s", line))
        self.waiter = redis_waiter(settings.redis_url, settings.outage_limit, say=self.say)
        self._redis: redis.Redis | None = None
        self._app: Celery | None = None
        self._ahead = AppAhead(self._make_app) if ahead else None
        self._served: tuple[str, list[WorkerInfo], float] | None = None
        self._checked: ArtifactStore | None = None

    # -- the connections -------------------------------------------------------------------
    def say(self, line: str) -> None:
        self._say(line)

    @property
    def redis(self) -> redis.Redis:
        """The Redis client (made on first use)."""
        if self._redis is None:
            self._redis = redis_client(self.settings.redis_url or "",
                                       self.settings.socket_timeout)
        return self._redis

    @property
    def app(self) -> Celery:
        """The Celery app (made on first use: a build of stored kernels sends nothing)."""
        if self._app is None:
            ahead, self._ahead = self._ahead, None
            made = ahead.take() if ahead is not None else None
            self._app = made if made is not None else self._make_app()
        return self._app

    def _make_app(self) -> Celery:
        from farm.cluster.celery_app import make_app

        return make_app(self.settings, client=True)

    def renew_app(self) -> None:
        """Drop the Celery app and its result channel; the next use makes them afresh."""
        old, self._app = self._app, None
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.abandon()
        if old is not None:
            _close_app(old)

    @property
    def store(self) -> ArtifactStore:
        if self._store is None:
            from farm.store.open import open_store

            self._store = open_store(self.settings)
        return self._store

    # -- the conversation --------------------------------------------------------------------
    def served(self, fingerprint: str) -> list[WorkerInfo]:
        """The live workers of ``fingerprint``, or a ClusterError naming those served."""
        grace = self.settings.dead_worker_grace
        workers = self.waiter.call(lambda: served(self.redis, grace))
        if fingerprint not in workers:
            known = ", ".join(sorted(workers)) or "none"
            raise ClusterError(f"no worker serves fingerprint {fingerprint}; fingerprints "
                               f"served: {known} (use --fallback-local to compile here)")
        self._served = (fingerprint, workers[fingerprint], time.monotonic())
        return workers[fingerprint]

    def build(self, artifacts: list[ArtifactId], options: BuildOptions, *,
              recorder: Recorder | None = None, progress: Progress | None = None,
              status: Say | None = None) -> BatchReport:
        """Obtain ``artifacts`` for ``options.fingerprint`` through the workers.

        ``recorder`` writes the build's batch record (its workers name it in theirs);
        ``progress`` gets each kernel's result as it is known, ``status`` the live line
        (chunks in flight per worker). Raises a ClusterError when no live worker serves
        the fingerprint (unless ``options.wait_for_workers``), an
        :class:`~farm.core.outage.OutageError` when Redis stays away past the limit.
        """
        start = time.perf_counter()
        notify = progress or (lambda r: None)
        fingerprint = options.fingerprint
        device = _device_of(self._workers(fingerprint, options.wait_for_workers))
        results = [KernelResult(artifact=a) for a in artifacts]
        misses = self._misses(results, options, device, notify)
        store_hits = sum(1 for r in results if r.outcome is Outcome.LOADED)  # before sending
        requested_by = None
        if recorder is not None:
            requested_by = RequestedBy(session=recorder.session.id,
                                       batch=recorder.reserve_seq())
            if misses:  # the workers' records will name this session (docs/RECORDS.md)
                recorder.referenced()
        gather = Gatherer(self, fingerprint, notify, status, self.check_interval_s)
        size = self.settings.chunk_size
        try:
            for i in range(0, len(misses), size):
                chunk = misses[i:i + size]
                payload = CompileRequest(fingerprint=fingerprint,
                                         kernels=[r for _, r in chunk],
                                         requested_by=requested_by, build=gather.build)
                gather.send(payload.model_dump(mode="json"), [res for res, _ in chunk])
            gather.run(options.timeout_s)
        finally:
            gather.close()
        if self.settings.verify_key:
            self.check_replies(Namespace.for_fingerprint(fingerprint),
                               [r for r, _ in misses])
        farms = sum(1 for r in results if r.failure is not None and r.failure.infrastructure)
        if farms:
            self.say(f"{farms} kernel(s) failed for the farm's reasons, not their own (see "
                     "docs/RELIABILITY.md): build again once the cluster is healthy")

        report = BatchReport(results=results, wall_s=time.perf_counter() - start,
                             parallelism=len({r.worker for r in results if r.worker}) or 1,
                             compiler_invocations=sum(
                                 1 for r in results if r.outcome is Outcome.COMPILED),
                             tasks_sent=gather.tasks_sent,
                             store_hits=store_hits)
        if recorder is not None:
            rec = recorder.batch(report.counts(), label=options.label,
                                 seq=requested_by.batch if requested_by else None)
            report.batch_seq = rec.stamp.seq if rec is not None else None
        return report

    def send(self, fingerprint: str,
             chunks: Sequence[tuple[CompileRequest, list[KernelResult]]],
             *, progress: Progress | None = None, status: Say | None = None,
             timeout_s: float = 3600.0) -> int:
        """Send ready-made chunks to ``fingerprint``'s workers and apply their replies to
        each chunk's results (an application's programs: ``farm.programs.prebuild``);
        returns the tasks sent, re-sends included."""
        gather = Gatherer(self, fingerprint, progress or (lambda r: None), status)
        try:
            for payload, results in chunks:
                payload = payload.model_copy(update={"build": gather.build})
                gather.send(payload.model_dump(mode="json"), results)
            gather.run(timeout_s)
        finally:
            gather.close()
        return gather.tasks_sent

    def close(self) -> None:
        """Close the connections (and the store, when the client opened it). While Redis
        is away (a build that gave up on it) the result channel is dropped, not closed:
        closing it talks to Redis, which a frozen Redis would make wait a socket
        timeout after the one line was already said."""
        if self.waiter.down:
            self._app = None
        self.renew_app()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        self._checked = None  # a view of the store: closed with it
        if self._owns_store and self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- steps -------------------------------------------------------------------------------
    def _workers(self, fingerprint: str, optional: bool) -> list[WorkerInfo]:
        """The live workers of ``fingerprint`` (a check made just before is reused)."""
        if self._served is not None:
            fp, workers, when = self._served
            if fp == fingerprint and time.monotonic() - when < SERVED_FRESH_S:
                return workers
        try:
            return self.served(fingerprint)
        except ClusterError:
            if optional:
                return []
            raise

    def _misses(self, results: list[KernelResult], options: BuildOptions,
                device: DeviceInfo | None, notify: Progress
                ) -> list[tuple[KernelResult, KernelRequest]]:
        """Key every kernel, count what the store holds (and what the device cannot run);
        the rest, with their requests, are the misses to send."""
        ns = Namespace.for_fingerprint(options.fingerprint)
        requests: list[tuple[KernelResult, KernelRequest]] = []
        for res in results:
            try:
                res.key = store_key(self.registry, res.artifact)
            except FarmError as exc:
                res.failure = KernelFailure(kind="validation", message=str(exc))
                notify(res)
                continue
            requests.append((res, KernelRequest(artifact=res.artifact,
                                                build_id=res.key.build_id)))
        held = self.store.existing(ns, [r.key for r, _ in requests if r.key])
        # A listing proves a name, not an artifact: every held artifact is read, its
        # digest checked (and, with a verify key, its signature, in the cluster's own
        # store) before it counts as Loaded; a damaged or replaced one (4 bytes over
        # 65 KB) is a miss, rebuilt.
        verify = options.verify or bool(self.settings.verify_key)
        checked = self.checked_store() if verify else self.store
        misses: list[tuple[KernelResult, KernelRequest]] = []
        for res, req in requests:
            t = time.perf_counter()
            if res.key in held and checked.get(ns, res.key) is not None:
                res.outcome = Outcome.LOADED
                res.add_part("fetch", time.perf_counter() - t)
                notify(res)
            elif device is not None and self._unsupported(res, device):
                res.add_part("lower", time.perf_counter() - t)
                notify(res)
            else:
                misses.append((res, req))
        return misses

    def checked_store(self) -> ArtifactStore:
        """Where a verified read asks: the cluster's own store (the shared tier of a
        tiered one) behind the same signature rules. So a good copy in this machine's
        local tier never stands for a tampered one in MinIO (which would then never be
        rebuilt), and checking a build fills no local tier with what it checked."""
        if self._checked is None:
            from farm.store.signing import SigningStore
            from farm.store.tiered import TieredStore

            store = self.store
            self._checked = store.reading(store.inner.shared) if isinstance(
                store, SigningStore) and isinstance(store.inner, TieredStore) else store
        return self._checked

    def check_replies(self, ns: Namespace, sent: list[KernelResult]) -> None:
        """A client with a verify key counts only what it verified itself: every kernel a
        worker answered for (Loaded, Rekeyed or Compiled: the worker verified it with
        its own key) is read back here; one this client refuses (another signing key,
        unsigned, damaged) fails as ``untrusted`` with the reason, and one line sums
        them up. No worker can give it a form this key accepts: they sign with theirs."""
        from farm.store.signing import SigningStore

        store = self.checked_store()
        refused: dict[str, int] = {}
        for res in sent:
            if res.outcome is None or res.key is None:
                continue
            t = time.perf_counter()
            if store.get(ns, res.key) is not None:
                res.add_part("fetch", time.perf_counter() - t)
                continue
            why = store.refusal(ns, res.key) if isinstance(store, SigningStore) else ""
            why = why or "not in the store, or damaged"
            refused[why] = refused.get(why, 0) + 1
            res.failure = KernelFailure(kind="untrusted", message=(
                f"a worker answered {res.outcome}, but this client refuses the stored "
                f"artifact: {why} (FARM_VERIFY_KEY: is it the public key of the "
                "cluster's FARM_SIGNING_KEY?)"))
            res.outcome = None
        if refused:
            reasons = "; ".join(f"{n} {why}" for why, n in sorted(refused.items()))
            self.say(f"{sum(refused.values())} kernel(s) the workers answered for are "
                     f"refused by this client's FARM_VERIFY_KEY ({reasons}): counted as "
                     "failed")

    def _unsupported(self, res: KernelResult, device: DeviceInfo) -> bool:
        """Lower for the target's limits; True (and the failure set) when it cannot run."""
        try:
            self.registry.get(res.artifact.kernel.family).lower_id(res.artifact, device)
        except UnsupportedFeature as exc:
            res.failure = KernelFailure(kind=UnsupportedFeature.kind, message=str(exc))
            return True
        except FarmError:
            return False  # the worker reports it, with its own device's view
        return False


def _device_of(workers: list[WorkerInfo]) -> DeviceInfo | None:
    """The target device's limits, as its workers published them."""
    return next((w.device for w in workers if w.device), None)


class AppAhead:
    """A client's Celery app made on a daemon thread, so that its imports (Celery, kombu's
    transport, the result backend) and the broker's first connection happen while the
    client waits for Redis and the store rather than inside its first chunk's send.

    :meth:`take` waits for the app to be made, not for its connection: a Redis that does
    not answer then holds this thread only (a socket timeout), and the send meets the
    outage through the client's waiter as every round trip does. It hands the app over
    (``None`` when it could not be made: the caller makes it again and meets the error
    itself); :meth:`abandon` lets a client that never sent close without waiting: the
    thread closes the app when it is done.
    """

    def __init__(self, make: Callable[[], Celery]) -> None:
        self._lock = threading.Lock()
        self._made = threading.Event()
        self._app: Celery | None = None
        self._abandoned = False
        threading.Thread(target=self._run, args=(make,), name="farm-celery-ahead",
                         daemon=True).start()

    def _run(self, make: Callable[[], Celery]) -> None:
        app: Celery | None = None
        try:
            app = make()
            app.backend  # noqa: B018 - imports its modules (the instance is per thread)
        except Exception as exc:  # taken again by the caller, who meets it then
            log.debug("making the Celery app ahead: %s", exc)
        with self._lock:
            keep = not self._abandoned
            if keep:
                self._app = app
        self._made.set()
        if app is None:
            return
        if not keep:
            _close_app(app)
            return
        try:  # a broker connection into the app's pool, for the first send to take
            with app.producer_or_acquire() as producer:
                producer.connection.ensure_connection(max_retries=0)  # once, no sleep
        except Exception as exc:  # the send connects itself, through the waiter
            log.debug("connecting the Celery app ahead: %s", exc)

    def take(self) -> Celery | None:
        self._made.wait()
        with self._lock:
            app, self._app = self._app, None
        return app

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            app, self._app = self._app, None
        if app is not None:
            _close_app(app)


def _close_app(app: Celery) -> None:
    """Close an app's result channel and connections; best effort (Redis may be gone)."""
    try:
        app.backend.result_consumer.stop()
    except Exception as exc:  # the channel was already broken
        log.debug("closing the result channel: %s", exc)
    try:
        app.close()
    except Exception as exc:
        log.debug("closing the Celery app: %s", exc)

