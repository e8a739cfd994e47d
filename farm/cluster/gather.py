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
opened afresh. Each worker notes which tasks it holds (``farm:task:<id>:holder``); a
chunk whose holder has not heartbeaten for ``FARM_DEAD_WORKER_GRACE`` seconds is sent
again as a new task (first writer wins makes a duplicate compile harmless), instead of
waiting for the broker's visibility timeout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from farm.cluster.lease import read_kernel_note, release_lease
from farm.cluster.payloads import CompileReply
from farm.cluster.workers import WorkerInfo
from farm.compilation.batch import KernelResult
from farm.core.keys import TASK_NAME, queue_name, task_holder_key, task_kernel_key, workers_key
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
        #: tasks whose replies were applied and whose results are still to delete
        self._done: list[str] = []
        #: worker field -> (heartbeat last seen, when this client saw it change)
        self._beats: dict[str, tuple[float, float]] = {}
        self._outages_seen = line.waiter.outages

    def send(self, payload: Payload, results: list[KernelResult]) -> str:
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
        if self.pending:  # the heartbeats as of now: a worker that is already dead
            self._live()  # is then found one check earlier
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
            if self.pending:
                self._check_holders()

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
                _apply_reply(meta, chunk.results, self.notify)
                self._done.append(task_id)
        except WaitOver:
            pass
        except RuntimeError as exc:  # Celery gave up reconnecting: the waiter decides
            if exc.__cause__ is not None:
                raise exc.__cause__ from None
            raise

    def _after_outage(self) -> None:
        """Redis was away: forget the heartbeats seen (those missed during the outage do
        not count) and open the result channel afresh."""
        self._outages_seen = self.line.waiter.outages
        self._beats.clear()
        self.line.renew_app()
        self._results = {t: self.line.app.AsyncResult(t) for t in self.pending}
        self._set = None

    def _forget(self, task_ids: list[str]) -> None:
        """Delete the results applied and their holder notes (one round trip)."""
        backend = self.line.app.backend
        keys = [k for t in task_ids for k in (backend.get_key_for_task(t), task_holder_key(t))]
        self.line.waiter.call(lambda: self.line.redis.delete(*keys))

    # -- dead workers ------------------------------------------------------------------------
    def _live(self) -> dict[str, bool]:
        """Worker field -> alive, judged on this client's clock: a worker is dead once
        its heartbeat has not changed for the grace (so clock skew does not matter, and
        the heartbeats missed during an outage of Redis do not count)."""
        client = self.line.redis
        raw = self.line.waiter.call(lambda: client.hgetall(workers_key(self.fingerprint)))
        now = time.monotonic()
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
            seen[field] = now - self._beats[field][1] <= self.line.settings.dead_worker_grace
        return seen

    def _check_holders(self) -> None:
        ids = list(self.pending)
        client = self.line.redis
        holders = self.line.waiter.call(
            lambda: client.mget([task_holder_key(t) for t in ids]))
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
        return time.monotonic() - first[1] > self.line.settings.dead_worker_grace

    def _resend(self, task_id: str, holder: str) -> None:
        chunk = self.pending.pop(task_id)
        old = self._results.pop(task_id, None)
        if old is not None:  # stop listening for the dead holder's task
            self.line.app.backend.remove_pending_result(old)
        self._set = None
        kernels = len(chunk.results)
        if chunk.sends >= MAX_SENDS:
            self._fail(chunk, f"sent {chunk.sends} times, each time to a worker that died")
            return
        self.resent += 1
        self._release_lease_of(task_id)
        self._send(chunk)
        grace = self.line.settings.dead_worker_grace
        self.line.say(f"re-sent a chunk of {kernels} kernel(s): worker {holder} held it and "
                      f"has not heartbeaten for {grace:g} s")

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
