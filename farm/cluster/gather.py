"""Sending a build's chunks to the workers, gathering their replies, re-sending those of
dead workers.

Replies come through Celery's own result mechanism: every task sent is an
``AsyncResult``, and the pending ones are waited on together as a ``ResultSet``
(``backend.iter_native``). With Redis as the result backend that is a publish/subscribe
channel per task, subscribed when the task is sent: a reply reaches the client the
moment a worker stores it, without asking Redis twenty times a second. Each wait lasts
at most ``check_interval_s``; it starts with one ``MGET`` of the pending results (Celery
does it, so a reply stored while the client was not listening is never missed), and
between waits the client looks at who holds what.

Faults (docs/RELIABILITY.md): every Redis round trip goes through the client's
:class:`~farm.core.outage.Waiter`, so an outage shorter than ``FARM_OUTAGE_LIMIT`` only
pauses the build (one line says what is waited for); after one, the result channel is
opened afresh. A chunk lost without a reply (its holder died, its holder dropped it
while Redis was away, a restarted Redis lost it: :mod:`farm.cluster.holders`) is sent
again as a new task (first writer wins makes a duplicate compile harmless), instead of
waiting for the broker's visibility timeout. The build keeps a heartbeat key alive
(``farm:build:<token>:alive``): once its client is gone, workers drop its chunks
instead of compiling them for nobody (``worker.chunks``). A worker whose chunks of this
build all go back for infrastructure reasons is sent no more of them
(:mod:`farm.cluster.breaker`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from farm.cluster.breaker import Breaker
from farm.cluster.holders import HolderWatch
from farm.cluster.lease import read_kernel_note, release_lease
from farm.cluster.payloads import CompileReply
from farm.compilation.batch import KernelResult
from farm.core.keys import (
    TASK_NAME,
    TASK_STATE_TTL_S,
    build_alive_key,
    build_avoid_key,
    build_returns_key,
    queue_name,
    task_holder_key,
    task_kernel_key,
)
from farm.core.model import KernelFailure
from farm.core.outage import Say, Waiter
from farm.core.settings import Settings

if TYPE_CHECKING:
    import redis
    from celery import Celery
    from celery.result import AsyncResult, ResultSet

Progress = Callable[[KernelResult], None]
#: a task's payload as sent: JSON data
Payload = dict[str, object]

#: a chunk is sent at most this often (first send included) before its kernels fail
MAX_SENDS = 5
#: seconds between looks at holders and heartbeats (replies arrive as they are stored)
CHECK_INTERVAL_S = 1.0


class Line(Protocol):
    """The client's connections, as the gatherer uses them (:class:`ClusterClient`)."""

    settings: Settings
    waiter: Waiter

    @property
    def redis(self) -> redis.Redis: ...

    @property
    def app(self) -> Celery: ...

    def renew_app(self) -> None:
        """Open the result channel afresh (after an outage of Redis)."""

    def say(self, line: str) -> None: ...


@dataclass
class _Chunk:
    payload: Payload
    results: list[KernelResult]
    sends: int = 0


class Gatherer:
    """Sends chunks, gathers their replies, re-sends those of dead workers."""

    def __init__(self, line: Line, fingerprint: str, notify: Progress,
                 status: Say | None = None,
                 check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self.line = line
        self.fingerprint = fingerprint
        self.notify = notify
        self.status = status or (lambda text: None)
        self.check_interval_s = check_interval_s
        self.pending: dict[str, _Chunk] = {}
        self.tasks_sent = 0
        self.resent = 0
        #: the pending tasks' results, waited on together (made again when they change)
        self._results: dict[str, AsyncResult] = {}
        self._set: ResultSet | None = None
        #: tasks whose replies were applied and whose results are still to delete, and
        #: those of them a worker built (its holder is credited: the breaker)
        self._done: list[str] = []
        self._built: set[str] = set()
        #: chunks a worker dropped as orphaned although this client is alive
        self._dropped: list[_Chunk] = []
        self._outages_seen = line.waiter.outages
        settings = line.settings
        self.watch = HolderWatch(line.redis, line.waiter, fingerprint=fingerprint,
                                 grace_s=settings.dead_worker_grace,
                                 settle_s=2 * settings.heartbeat_interval + 1)
        self.breaker = Breaker()
        #: this build's token: its chunks name it, its heartbeat key is kept alive
        self.build = uuid.uuid4().hex
        self._alive = False

    def send(self, payload: Payload, results: list[KernelResult]) -> str:
        if not self._alive:
            self._keep_alive()
        return self._send(_Chunk(payload=payload, results=results))

    def _send(self, chunk: _Chunk) -> str:
        task_id = str(uuid.uuid4())

        def send() -> AsyncResult:
            return self.line.app.send_task(TASK_NAME, args=[chunk.payload],
                                           queue=queue_name(self.fingerprint),
                                           task_id=task_id)

        self._results[task_id] = self.line.waiter.call(send)
        self._set = None
        chunk.sends += 1
        self.tasks_sent += 1
        self.pending[task_id] = chunk
        return task_id

    def run(self, timeout_s: float) -> None:
        """Gather every pending chunk's reply; fail what has none after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self.pending:  # the Redis run, and the heartbeats as of now: a worker that
            self.watch.remember_run()  # is already dead is then found one check earlier
            self.watch.look([])
        while self.pending:
            if time.monotonic() > deadline:
                for chunk in self.pending.values():
                    self._fail(chunk, f"no reply from the workers within {timeout_s:.0f} s")
                self.pending.clear()
                return
            self.line.waiter.call(self._wait)
            if self.line.waiter.outages != self._outages_seen:
                self._after_outage()
            if self._done:
                self._forget(self._done)
                self._done = []
            if self._dropped:  # this client is alive: its heartbeat key was lost
                self._keep_alive()
                for chunk in self._dropped:
                    self._send(chunk)
                self._dropped = []
            if self.pending:
                self._keep_alive()
                self._check_holders()
        if self._alive and not self.line.waiter.down:  # the last replies may have come in
            # one wait: a worker whose chunks all went back is named all the same
            self._look_at_returns()

    def close(self) -> None:
        """Let go of the results still pending (a build that gave up: their ``__del__``
        would unsubscribe through a Redis that may be frozen, and print a traceback at
        exit) and delete this build's keys (best effort: they expire by themselves)."""
        for result in self._results.values():
            result.backend = None
        self._results.clear()
        self._set = None
        if not self._alive or self.line.waiter.down:  # a frozen Redis would hold us here
            return
        keys = [build_alive_key(self.build), build_avoid_key(self.build),
                build_returns_key(self.build)]
        try:
            self.line.redis.delete(*keys)
        except Exception:  # Redis away: the keys expire
            pass

    def _keep_alive(self) -> None:
        """This build's heartbeat key (``build_alive_key``): while it lives, workers build
        its chunks; once this client is gone it expires after the grace and they drop
        them instead of compiling for nobody (``worker.chunks``)."""
        ttl_ms = int(1000 * max(self.line.settings.dead_worker_grace,
                                3 * self.check_interval_s))
        client = self.line.redis
        key = build_alive_key(self.build)
        self.line.waiter.call(lambda: client.set(key, "1", px=ttl_ms))
        self._alive = True

    # -- replies -----------------------------------------------------------------------------
    def _wait(self) -> None:
        """Apply the replies that arrive within one check interval."""
        from celery.exceptions import TimeoutError as WaitOver
        from celery.result import ResultSet

        if self._set is None:
            self._set = ResultSet([self._results[t] for t in self.pending], app=self.line.app)
        try:
            # interval=0: Celery's look at the stored results (one MGET) otherwise sleeps
            # half a second after it, before listening: 500 ms added to every reply
            # that comes after the wait starts (bench/bench_control_plane.py found it)
            for task_id, meta in self.line.app.backend.iter_native(
                    self._set, timeout=self.check_interval_s, interval=0):
                chunk = self.pending.pop(task_id, None)
                if chunk is None:  # a reply already applied (or of a task re-sent since)
                    continue
                self._set.discard(self._results.pop(task_id))
                self._done.append(task_id)
                if _dropped(meta) and chunk.sends < MAX_SENDS:
                    self._dropped.append(chunk)
                    continue
                if meta.get("status") == "SUCCESS":
                    self._built.add(task_id)
                _apply_reply(meta, chunk.results, self.notify)
        except WaitOver:
            pass
        except RuntimeError as exc:  # Celery gave up reconnecting: the waiter decides
            if exc.__cause__ is not None:
                raise exc.__cause__ from None
            raise

    def _after_outage(self) -> None:
        """Redis was away: open the result channel afresh (the holder watch forgets the
        heartbeats seen: those missed during the outage do not count)."""
        self._outages_seen = self.line.waiter.outages
        self.line.renew_app()
        self._results = {t: self.line.app.AsyncResult(t) for t in self.pending}
        self._set = None

    def _forget(self, task_ids: list[str]) -> None:
        """Credit the holders of the chunks built (the breaker), then delete the results
        applied and their holder notes (two round trips)."""
        backend = self.line.app.backend
        client = self.line.redis
        built = [t for t in task_ids if t in self._built]
        if built:
            holders = self.line.waiter.call(
                lambda: client.mget([task_holder_key(t) for t in built]))
            for raw in holders:
                if raw is not None:
                    self.breaker.saw_built(raw.decode() if isinstance(raw, bytes)
                                           else str(raw))
            self._built.difference_update(built)
        keys = [k for t in task_ids for k in (backend.get_key_for_task(t), task_holder_key(t))]
        self.line.waiter.call(lambda: client.delete(*keys))

    # -- lost chunks, broken workers -------------------------------------------------------
    def _check_holders(self) -> None:
        look = self.watch.look(list(self.pending))
        for task_id, holder, why in look.lost:
            self._resend(task_id, holder, why)
        self._look_at_returns()
        self.status("in flight: " + ", ".join(
            f"{k} {v}" for k, v in sorted(look.in_flight.items())) if look.in_flight else "")

    def _look_at_returns(self) -> None:
        """The build's chunks given back, by worker: the breaker's count (one round
        trip), and whom it shuts out now."""
        client = self.line.redis
        key = build_returns_key(self.build)
        self.breaker.saw_returns(self.line.waiter.call(lambda: client.hgetall(key)))
        for worker in self.breaker.trip():
            self._avoid(worker)

    def _avoid(self, worker: str) -> None:
        """Shut ``worker`` out of this build (``farm.cluster.breaker``), in one line."""
        client = self.line.redis
        key = build_avoid_key(self.build)

        def avoid() -> None:
            pipe = client.pipeline(transaction=False)
            pipe.sadd(key, worker)
            pipe.expire(key, TASK_STATE_TTL_S)  # deleted when the build ends
            pipe.execute()

        self.line.waiter.call(avoid)
        self.line.say(self.breaker.line(worker))

    def _resend(self, task_id: str, holder: str, why: str) -> None:
        chunk = self.pending.pop(task_id)
        old = self._results.pop(task_id, None)
        if old is not None:  # stop listening for the lost task
            self.line.app.backend.remove_pending_result(old)
        self._set = None
        kernels = len(chunk.results)
        if chunk.sends >= MAX_SENDS:
            self._fail(chunk, f"sent {chunk.sends} times, each time lost ({why})")
            return
        self.resent += 1
        if holder:
            self._release_lease_of(task_id)
        self._send(chunk)
        self.line.say(f"re-sent a chunk of {kernels} kernel(s): {why}")

    def _release_lease_of(self, task_id: str) -> None:
        """Release the compile lease the dead holder noted for the task, so the re-sent
        chunk does not wait out its time-to-live (the token makes sure it is that one)."""
        client = self.line.redis

        def release() -> None:
            _, name, token = read_kernel_note(client.get(task_kernel_key(task_id)))
            if name:
                release_lease(client, name, token)

        self.line.waiter.call(release)

    def _fail(self, chunk: _Chunk, message: str) -> None:
        for res in chunk.results:
            res.failure = KernelFailure(kind="error", message=message)
            self.notify(res)


def _dropped(meta: dict[str, object]) -> bool:
    """Whether a worker dropped the chunk as orphaned (``CompileReply.dropped``)."""
    result = meta.get("result")
    return meta.get("status") == "SUCCESS" and isinstance(result, dict) \
        and bool(result.get("dropped"))


def _apply_reply(meta: dict[str, object], chunk: list[KernelResult], notify: Progress) -> None:
    """A task's result (Celery's meta: ``status`` and ``result``) onto its kernels."""
    if meta.get("status") != "SUCCESS":
        error = meta.get("result")
        what = (f"{type(error).__name__}: {error}" if isinstance(error, BaseException)
                else str(error or meta.get("status")))
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
