"""Sending a build's chunks to the workers, gathering their replies, re-sending those of
dead workers.

Replies come on the build's own reply stream (``farm:build:<token>:replies``,
:func:`farm.core.keys.build_replies_key`): the client makes it when it sends its first
chunk and keeps it alive with its heartbeat key; a worker appends each chunk's reply to
it in the round trip that ends the chunk (``XADD ... NOMKSTREAM``: only while it
exists, so a gone client's stream is never made again); the client reads every reply
that came since the last one in one ``XREAD`` (blocking up to ``check_interval_s`` when
none is there). So a reply costs one command on each side; Celery's own results cost
seven a chunk (a ``SETEX`` and a ``PUBLISH`` in a ``MULTI``, the client's ``SUBSCRIBE``,
``UNSUBSCRIBE``, its ``GET`` and ``DEL``), which is why chunks are sent with
``ignore_result``. What still comes as a Celery result, the client reads once a check
interval (one ``MGET`` of the pending tasks' result keys): a chunk that failed (a bad
payload, a time limit: the task keeps its errors), a reply whose stream was gone (a
restarted Redis), a worker of a farm before reply streams.

Faults (docs/RELIABILITY.md): every Redis round trip goes through the client's
:class:`~farm.core.outage.Waiter`, so an outage shorter than ``FARM_OUTAGE_LIMIT`` only
pauses the build (one line says what is waited for); after one, the reply stream is
made again (a restarted Redis may have lost it). A chunk lost without a reply (its
holder died, its holder's pool process died on it, its holder dropped it while Redis was
away, a restarted Redis lost it: :mod:`farm.cluster.holders`, whose line names which) is
sent again as a new task (first writer wins makes a duplicate compile harmless), instead
of waiting for the broker's visibility timeout. The
build keeps a heartbeat key alive (``farm:build:<token>:alive``): once its client is
gone, workers drop its chunks instead of compiling them for nobody (``worker.chunks``).
A worker whose chunks of this build all go back for infrastructure reasons is sent no
more of them (:mod:`farm.cluster.breaker`).
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
    BUILD_AVOIDS,
    TASK_NAME,
    TASK_STATE_TTL_S,
    build_alive_key,
    build_avoid_key,
    build_replies_key,
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

Progress = Callable[[KernelResult], None]
#: a task's payload as sent: JSON data
Payload = dict[str, object]

#: a chunk is sent at most this often (first send included) before its kernels fail
MAX_SENDS = 5
#: with more chunks than this pending, replies are read at most every ``BATCH_S``
#: seconds: an ``XREAD`` for several replies instead of one for each, where a build is
#: long enough that no one waits on a single reply (its last chunks are read at once)
BATCH_PENDING = 16
BATCH_S = 0.1
#: seconds between looks at holders, heartbeats and results (replies arrive as they
#: are stored)
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
        """Make the Celery app afresh (after an outage of Redis)."""

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
        #: what the heartbeat key holds: "1", or BUILD_AVOIDS once a worker is shut out
        self._alive_value = "1"
        self._replies = build_replies_key(self.build)
        self._last_id = "0-0"  # the last entry of the reply stream read
        self._checked = 0.0  # when holders, heartbeats and results were last looked at
        self._read_at = 0.0  # when the reply stream was last read
        # a blocked read must end well within a request's time limit
        self._block_ms = max(1, int(1000 * min(check_interval_s,
                                               settings.socket_timeout / 2)))

    def send(self, payload: Payload, results: list[KernelResult]) -> str:
        if not self._alive:
            self._keep_alive(make_stream=True)
        return self._send(_Chunk(payload=payload, results=results))

    def _send(self, chunk: _Chunk) -> str:
        task_id = str(uuid.uuid4())

        def send() -> None:
            self.line.app.send_task(TASK_NAME, args=[chunk.payload],
                                    queue=queue_name(self.fingerprint), task_id=task_id,
                                    ignore_result=True)

        self.line.waiter.call(send)
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
            self._checked = time.monotonic()
        while self.pending or self._dropped:
            if time.monotonic() > deadline:
                for chunk in [*self.pending.values(), *self._dropped]:
                    self._fail(chunk, f"no reply from the workers within {timeout_s:.0f} s")
                self.pending.clear()
                self._dropped = []
                return
            if self.pending:
                self.line.waiter.call(self._wait)
            if self.line.waiter.outages != self._outages_seen:
                self._after_outage()
            if self.pending and time.monotonic() - self._checked >= self.check_interval_s:
                self._checked = time.monotonic()
                self._keep_alive()
                self._poll_results()
                self._check_holders()
            if self._dropped:  # this client is alive: its heartbeat key was lost
                self._keep_alive(make_stream=True)
                for chunk in self._dropped:
                    self._send(chunk)
                self._dropped = []
        if self._alive and not self.line.waiter.down:  # the last replies may have come in
            # one wait: a worker whose chunks all went back is named all the same
            self._look_at_returns()

    def close(self) -> None:
        """Delete this build's keys (best effort: they expire by themselves)."""
        if not self._alive or self.line.waiter.down:  # a frozen Redis would hold us here
            return
        keys = [build_alive_key(self.build), build_avoid_key(self.build),
                build_returns_key(self.build), self._replies]
        try:
            self.line.redis.delete(*keys)
        except Exception:  # Redis away: the keys expire
            pass

    def _keep_alive(self, *, make_stream: bool = False) -> None:
        """This build's heartbeat key (``build_alive_key``) and reply stream, kept for the
        grace: while they live, workers build its chunks and answer on the stream; once
        this client is gone they expire and workers drop its chunks instead of compiling
        for nobody (``worker.chunks``). ``make_stream``: make the stream (first, or after
        Redis may have lost it) with an entry of its own, which readers skip."""
        ttl_ms = int(1000 * max(self.line.settings.dead_worker_grace,
                                3 * self.check_interval_s))
        client = self.line.redis
        alive, replies, last = build_alive_key(self.build), self._replies, self._last_id

        def refresh() -> None:
            pipe = client.pipeline(transaction=False)
            pipe.set(alive, self._alive_value, px=ttl_ms)
            if make_stream:
                pipe.xadd(replies, {"start": "1"})
            elif last != "0-0":  # what was read goes (the last entry stays: the stream)
                pipe.xtrim(replies, minid=last)
            pipe.pexpire(replies, ttl_ms)
            pipe.execute()

        self.line.waiter.call(refresh)
        self._alive = True

    # -- replies -----------------------------------------------------------------------------
    def _wait(self) -> None:
        """Apply the replies that arrive within one check interval (one ``XREAD``; many
        chunks pending, at most one every ``BATCH_S``)."""
        if len(self.pending) > BATCH_PENDING:
            wait = self._read_at + BATCH_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        self._read_at = time.monotonic()
        self._read(self._block_ms)

    def _read(self, block_ms: int | None) -> None:
        """Apply the replies on the stream since the last one read, waiting up to
        ``block_ms`` for one when none is there (``None``: not at all)."""
        client = self.line.redis
        got = client.xread({self._replies: self._last_id}, count=1000, block=block_ms)
        for entry_id, fields in _entries(got):
            self._last_id = _text(entry_id)
            chunk = self.pending.pop(_text(fields.get(b"task", b"")), None)
            if chunk is None:  # the stream's own entry, or a reply applied already
                continue
            reply = CompileReply.model_validate_json(fields.get(b"reply", b""))
            self._replied(chunk, reply, _text(fields.get(b"holder", b"")))

    def _replied(self, chunk: _Chunk, reply: CompileReply, holder: str) -> None:
        if reply.dropped and chunk.sends < MAX_SENDS:
            self._dropped.append(chunk)
            return
        self.breaker.saw_built(holder)
        _apply_reply(reply, chunk.results, self.notify)

    def _poll_results(self) -> None:
        """The Celery results of the pending tasks (see the module docstring): one
        ``MGET``; each one found is applied, and its keys deleted."""
        backend = self.line.app.backend
        client = self.line.redis
        ids = list(self.pending)
        if not ids:
            return
        raw = self.line.waiter.call(
            lambda: client.mget([backend.get_key_for_task(t) for t in ids]))
        found = [(t, r) for t, r in zip(ids, raw, strict=True) if r is not None]
        for task_id, value in found:
            meta = backend.decode_result(value)
            if meta.get("status") not in ("SUCCESS", "FAILURE", "REVOKED"):
                continue
            chunk = self.pending.pop(task_id, None)
            if chunk is None:
                continue
            result = meta.get("result")
            if meta.get("status") != "SUCCESS":
                error = result
                what = (f"{type(error).__name__}: {error}" if isinstance(error, BaseException)
                        else str(error or meta.get("status")))
                _fail_all(chunk.results, f"task failed on the worker: {what}", self.notify)
                continue
            reply = CompileReply.model_validate(result)
            self._replied(chunk, reply, "")
        if found:
            keys = [k for t, _ in found
                    for k in (backend.get_key_for_task(t), task_holder_key(t))]
            self.line.waiter.call(lambda: client.delete(*keys))

    def _after_outage(self) -> None:
        """Redis was away: the Celery app afresh, the reply stream made again where a
        restarted Redis lost it (the holder watch forgets the heartbeats seen: those
        missed during the outage do not count)."""
        self._outages_seen = self.line.waiter.outages
        self.line.renew_app()
        self._keep_alive(make_stream=True)

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
        """Shut ``worker`` out of this build (``farm.cluster.breaker``), in one line; the
        heartbeat key says so from now on, for workers to look in the avoid set."""
        client = self.line.redis
        key = build_avoid_key(self.build)

        def avoid() -> None:
            pipe = client.pipeline(transaction=False)
            pipe.sadd(key, worker)
            pipe.expire(key, TASK_STATE_TTL_S)  # deleted when the build ends
            pipe.execute()

        self.line.waiter.call(avoid)
        self._alive_value = BUILD_AVOIDS
        self._keep_alive()
        self.line.say(self.breaker.line(worker))

    def _resend(self, task_id: str, holder: str, why: str) -> None:
        chunk = self.pending.pop(task_id)
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
        """Release the compile leases the dead holder noted for the task, so the re-sent
        chunk does not wait out their time-to-live (the token makes sure they are its)."""
        client = self.line.redis

        def release() -> None:
            _, name, token = read_kernel_note(client.get(task_kernel_key(task_id)))
            if name:
                release_lease(client, name, token)

        self.line.waiter.call(release)

    def _fail(self, chunk: _Chunk, message: str) -> None:
        _fail_all(chunk.results, message, self.notify)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(got: object) -> list[tuple[bytes | str, dict[bytes, bytes]]]:
    """The entries of a one-stream ``XREAD`` reply, as redis-py gives them (RESP2: a list
    of [stream, entries]; RESP3: a mapping of stream to [entries]), fields as bytes."""
    if not got:
        return []
    found: list[tuple[bytes | str, dict[bytes | str, bytes | str]]] = \
        next(iter(got.values()))[0] if isinstance(got, dict) else got[0][1]  # type: ignore[index]
    return [(entry_id, {(k if isinstance(k, bytes) else str(k).encode()):
                        (v if isinstance(v, bytes) else str(v).encode())
                        for k, v in fields.items()}) for entry_id, fields in found]


def _fail_all(chunk: list[KernelResult], message: str, notify: Progress) -> None:
    for res in chunk:
        res.failure = KernelFailure(kind="error", message=message)
        notify(res)


def _apply_reply(reply: CompileReply, chunk: list[KernelResult], notify: Progress) -> None:
    """A chunk's reply onto its kernels."""
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
