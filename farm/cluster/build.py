"""A build against the cluster: bulk look-up, misses sent to the fingerprint's queue.

The client expands the manifest and computes every key itself (with its own build ids),
asks the store which keys it holds in one bulk listing, and sends only the misses, in
chunks, to the queue of the target fingerprint. Workers do the rest (see
``worker.execute``); the client gathers their replies as they arrive.

Faults (docs/RELIABILITY.md): every Redis round trip of the client goes through a
:class:`~farm.core.outage.Waiter`, so an outage shorter than ``FARM_OUTAGE_LIMIT`` only
pauses the build (one line says what is waited for). Each worker notes which tasks it
holds (``farm:task:<id>:holder``); a chunk whose holder has not heartbeaten for
``FARM_DEAD_WORKER_GRACE`` seconds is sent again as a new task (first writer wins makes
a duplicate compile harmless), instead of waiting for the broker's visibility timeout.

Chunks: a task costs a few milliseconds of broker and result round trips, a compile
tens to hundreds of milliseconds, so a handful of kernels per task keeps the overhead
small while still spreading work over every worker process (``FARM_CHUNK_SIZE``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from farm.cluster.lease import release_lease
from farm.cluster.payloads import CompileReply, CompileRequest, KernelRequest
from farm.cluster.workers import WorkerInfo, served
from farm.compilation.batch import BatchReport, KernelResult
from farm.core.device import DeviceInfo
from farm.core.errors import ClusterError, FarmError, UnsupportedFeature
from farm.core.keys import (
    TASK_NAME,
    Namespace,
    queue_name,
    task_holder_key,
    task_lease_key,
    workers_key,
)
from farm.core.model import ArtifactId, KernelFailure, Key, Outcome
from farm.core.outage import Say, Waiter, redis_waiter
from farm.core.settings import Settings
from farm.families import Registry
from farm.records import Recorder
from farm.records.model import RequestedBy
from farm.store import ArtifactStore

Progress = Callable[[KernelResult], None]


def check_served(client: Any, fingerprint: str,
                 stale_s: float | None = None) -> list[WorkerInfo]:
    """The live workers of ``fingerprint``, or a ClusterError naming those served."""
    workers = served(client) if stale_s is None else served(client, stale_s)
    if fingerprint not in workers:
        known = ", ".join(sorted(workers)) or "none"
        raise ClusterError(f"no worker serves fingerprint {fingerprint}; fingerprints "
                           f"served: {known} (use --fallback-local to compile here)")
    return workers[fingerprint]


def cluster_build(settings: Settings, *, app: Any | Callable[[], Any],
                  registry: Registry, store: ArtifactStore,
                  fingerprint: str, artifacts: list[ArtifactId], recorder: Recorder | None,
                  label: str = "", progress: Progress | None = None, verify: bool = False,
                  device: DeviceInfo | None = None, timeout_s: float = 3600.0,
                  say: Say | None = None, status: Say | None = None,
                  waiter: Waiter | None = None) -> BatchReport:
    """Obtain ``artifacts`` for ``fingerprint`` through the workers.

    ``app`` is the Celery app, or a function that makes it: then it is made only when a
    chunk is sent (a build whose kernels are all stored never imports Celery).

    ``device`` (the target's limits, published by its workers) lets the client count
    kernels that device cannot run as unsupported without sending them: they are never
    stored, so otherwise every build would send them again.

    ``say`` gets the lines worth keeping (an outage waited for, a chunk re-sent),
    ``status`` the live line (chunks in flight per worker); ``waiter`` waits out Redis
    outages (one is made from the settings when not given). A Redis outage longer than
    ``FARM_OUTAGE_LIMIT`` raises :class:`~farm.core.outage.OutageError`.
    """
    start = time.perf_counter()
    notify = progress or (lambda r: None)
    ns = Namespace.for_fingerprint(fingerprint)
    results = [KernelResult(artifact=a) for a in artifacts]
    requests: list[tuple[KernelResult, KernelRequest]] = []
    for res in results:
        try:
            family = registry.get(res.artifact.kernel.family)
        except FarmError as exc:
            res.failure = KernelFailure(kind="validation", message=str(exc))
            notify(res)
            continue
        res.key = Key(id_hash=res.artifact.id_hash, build_id=family.build_id)
        requests.append((res, KernelRequest(artifact=res.artifact, build_id=family.build_id)))

    held = store.existing(ns, [r.key for r, _ in requests if r.key])
    misses: list[tuple[KernelResult, KernelRequest]] = []
    for res, req in requests:
        t = time.perf_counter()
        if res.key in held and (not verify or store.get(ns, res.key) is not None):
            res.outcome = Outcome.LOADED
            res.add_part("fetch", time.perf_counter() - t)
            notify(res)
        elif device is not None and _unsupported(res, registry, device):
            res.add_part("lower", time.perf_counter() - t)
            notify(res)
        else:
            misses.append((res, req))

    requested_by = None
    if recorder is not None:
        requested_by = RequestedBy(session=recorder.session.id, batch=recorder.reserve_seq())
    gather = Gatherer(settings, app=app, fingerprint=fingerprint, notify=notify,
                       say=say, status=status, waiter=waiter)
    size = settings.chunk_size
    try:
        for i in range(0, len(misses), size):
            chunk = misses[i:i + size]
            payload = CompileRequest(fingerprint=fingerprint, kernels=[r for _, r in chunk],
                                     requested_by=requested_by)
            gather.send(payload.model_dump(mode="json"), [res for res, _ in chunk])
        gather.run(timeout_s)
    finally:
        gather.close()
    tasks_sent = gather.tasks_sent

    wall = time.perf_counter() - start
    report = BatchReport(results=results, wall_s=wall,
                         parallelism=0, compiler_invocations=sum(
                             1 for r in results if r.outcome is Outcome.COMPILED))
    report.parallelism = len({r.worker for r in results if r.worker}) or 1
    report.tasks_sent = tasks_sent
    if recorder is not None:
        rec = recorder.batch(
            kernels=len(results), loaded=report.count(Outcome.LOADED),
            rekeyed=report.count(Outcome.REKEYED), compiled=report.count(Outcome.COMPILED),
            unsupported=len(report.unsupported), failed=len(report.failed),
            parallelism=report.parallelism, wall_s=wall, work_s=report.work_s, label=label,
            seq=requested_by.batch if requested_by else None)
        report.batch_seq = rec.stamp.seq if rec is not None else None
    return report


def _unsupported(res: KernelResult, registry: Registry, device: DeviceInfo) -> bool:
    """Lower for the target's limits; True (and the failure set) when it cannot run."""
    try:
        registry.get(res.artifact.kernel.family).lower_id(res.artifact, device)
    except UnsupportedFeature as exc:
        res.failure = KernelFailure(kind="unsupported", message=str(exc))
        return True
    except FarmError:
        return False  # the worker reports it, with its own device's view
    return False


def _apply_reply(meta: dict[str, Any], chunk: list[KernelResult], notify: Progress) -> None:
    if meta.get("status") != "SUCCESS":
        exc = meta.get("result") or {}
        what = (f"{exc.get('exc_type', 'error')}: {exc.get('exc_message', '')}"
                if isinstance(exc, dict) else str(exc))
        for res in chunk:
            res.failure = KernelFailure(kind="error",
                                        message=f"task failed on the worker: {what}")
            notify(res)
        return
    reply = CompileReply.model_validate(meta["result"])
    by_id = {r.id_hash: r for r in reply.results}
    for res in chunk:  # a family's key names its artifact id; a program's, its spec
        got = by_id.get(res.key.id_hash if res.key is not None else res.artifact.id_hash)
        if got is None:
            res.failure = KernelFailure(kind="error", message="missing from the worker's reply")
        else:
            res.outcome = got.outcome
            res.failure = got.failure
            res.add_part("worker", got.work_s)
            res.worker = got.worker
        notify(res)


#: a chunk is sent at most this often (first send included) before its kernels fail
MAX_SENDS = 5
#: seconds between looks at holders and heartbeats (results are polled every 50 ms)
CHECK_INTERVAL_S = 1.0
_READY = ("SUCCESS", "FAILURE", "REVOKED")


@dataclass
class _Chunk:
    payload: dict[str, Any]
    results: list[KernelResult]
    sends: int = 0


class Gatherer:
    """Sends chunks, gathers their replies, re-sends those of dead workers."""

    def __init__(self, settings: Settings, *, app: Any, fingerprint: str, notify: Progress,
                 say: Say | None, status: Say | None, waiter: Waiter | None) -> None:
        import redis

        self.settings = settings
        self._app = app
        self.fingerprint = fingerprint
        self.notify = notify
        self.say = say or (lambda line: None)
        self.status = status or (lambda line: None)
        self.waiter = waiter or redis_waiter(settings.redis_url or "", settings.outage_limit,
                                             say=self.say)
        self.client: Any = redis.Redis.from_url(settings.redis_url or "", socket_timeout=10,
                                                socket_connect_timeout=5)
        self.pending: dict[str, _Chunk] = {}
        self.tasks_sent = 0
        self.resent = 0
        #: worker field -> (heartbeat last seen, when this client saw it change)
        self._beats: dict[str, tuple[float, float]] = {}
        self._outages_seen = 0

    @property
    def app(self) -> Any:
        """The Celery app, made now if the caller gave a function that makes it."""
        if callable(self._app) and not hasattr(self._app, "send_task"):
            self._app = self._app()
        return self._app

    def send(self, payload: dict[str, Any], results: list[KernelResult]) -> str:
        chunk = _Chunk(payload=payload, results=results)
        return self._send(chunk)

    def _send(self, chunk: _Chunk) -> str:
        task_id = str(uuid.uuid4())
        def send() -> None:
            self.app.send_task(TASK_NAME, args=[chunk.payload],
                               queue=queue_name(self.fingerprint), task_id=task_id)

        self.waiter.call(send)
        chunk.sends += 1
        self.tasks_sent += 1
        self.pending[task_id] = chunk
        return task_id

    def run(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + CHECK_INTERVAL_S
        if not self.pending:
            return
        backend = self.app.backend
        while self.pending:
            if time.monotonic() > deadline:
                for chunk in self.pending.values():
                    self._fail(chunk, f"no reply from the workers within {timeout_s:.0f} s")
                self.pending.clear()
                return
            ids = list(self.pending)
            keys = [backend.get_key_for_task(t) for t in ids]
            values = self._mget(keys)
            for task_id, raw in zip(ids, values, strict=True):
                if raw is None:
                    continue
                meta = backend.decode(raw)
                if not isinstance(meta, dict) or meta.get("status") not in _READY:
                    continue
                _apply_reply(meta, self.pending.pop(task_id).results, self.notify)
                self._forget(task_id)
            if self.pending and time.monotonic() >= next_check:
                self._check_holders()
                next_check = time.monotonic() + CHECK_INTERVAL_S
            if self.pending:
                time.sleep(0.05)

    def close(self) -> None:
        self.client.close()

    def _mget(self, keys: list[Any]) -> list[Any]:
        def mget() -> list[Any]:
            return list(self.client.mget(keys))

        return self.waiter.call(mget)

    def _forget(self, task_id: str) -> None:
        key = self.app.backend.get_key_for_task(task_id)

        def forget() -> None:
            self.client.delete(key, task_holder_key(task_id))

        self.waiter.call(forget)

    def _live(self) -> dict[str, bool]:
        """Worker field -> alive, judged on this client's clock: a worker is dead once
        its heartbeat has not changed for the grace (so clock skew does not matter, and
        the heartbeats missed during an outage of Redis do not count)."""
        raw = self.waiter.call(lambda: self.client.hgetall(workers_key(self.fingerprint)))
        now = time.monotonic()
        if self.waiter.outages != self._outages_seen:  # Redis was away: start afresh
            self._outages_seen = self.waiter.outages
            self._beats.clear()
        seen: dict[str, bool] = {}
        for name, value in raw.items():
            field = name.decode() if isinstance(name, bytes) else str(name)
            try:
                beat = WorkerInfo.model_validate_json(value).heartbeat
            except ValueError:
                continue
            last = self._beats.get(field)
            if last is None or last[0] != beat:
                self._beats[field] = (beat, now)
            seen[field] = now - self._beats[field][1] <= self.settings.dead_worker_grace
        return seen

    def _check_holders(self) -> None:
        ids = list(self.pending)
        holders = self._mget([task_holder_key(t) for t in ids])
        live = self._live()
        in_flight: dict[str, int] = {}
        for task_id, raw in zip(ids, holders, strict=True):
            if raw is None:
                in_flight["queued"] = in_flight.get("queued", 0) + 1
                continue
            holder = raw.decode() if isinstance(raw, bytes) else str(raw)
            alive = live[holder] if holder in live else not self._grace_over(holder)
            if alive:
                in_flight[holder] = in_flight.get(holder, 0) + 1
            else:
                self._resend(task_id, holder)
        self.status("in flight: " + ", ".join(f"{k} {v}" for k, v in sorted(in_flight.items()))
                    if in_flight else "")

    def _grace_over(self, holder: str) -> bool:
        """A holder this client never saw beat: dead once the grace has passed since
        it first noticed it (it may be a worker whose registration Redis lost)."""
        first = self._beats.setdefault(f"unseen:{holder}", (0.0, time.monotonic()))
        return time.monotonic() - first[1] > self.settings.dead_worker_grace

    def _resend(self, task_id: str, holder: str) -> None:
        chunk = self.pending.pop(task_id)
        kernels = len(chunk.results)
        if chunk.sends >= MAX_SENDS:
            self._fail(chunk, f"sent {chunk.sends} times, each time to a worker that died")
            return
        self.resent += 1
        self._release_lease_of(task_id)
        self._send(chunk)
        self.say(f"re-sent a chunk of {kernels} kernel(s): worker {holder} held it and "
                 f"has not heartbeaten for {self.settings.dead_worker_grace:.0f} s")

    def _release_lease_of(self, task_id: str) -> None:
        """Release the compile lease the dead holder noted for the task, so the re-sent
        chunk does not wait out its time-to-live (the token makes sure it is that one)."""
        def release() -> None:
            held = self.client.get(task_lease_key(task_id))
            if held:
                text = held.decode() if isinstance(held, bytes) else str(held)
                name, _, token = text.partition("\n")
                release_lease(self.client, name, token)

        self.waiter.call(release)

    def _fail(self, chunk: _Chunk, message: str) -> None:
        for res in chunk.results:
            res.failure = KernelFailure(kind="error", message=message)
            self.notify(res)
