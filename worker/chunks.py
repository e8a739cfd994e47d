"""A chunk a worker must not build: given back to its queue, or dropped.

* **Given back** (an ``InfrastructureError``: the store, Redis, this worker's own state):
  the task rejects its message with requeue, which puts it at the back of its queue for
  any worker of the pool. Each return is noted per task (``farm:task:<id>:returns``:
  worker -> times, ``why`` -> the last reason) so that the client can tell a worker
  whose chunks all go back (its circuit breaker) and so that a chunk that nobody can
  build is not passed around for ever: after ``MAX_RETURNS`` returns its kernels fail as
  ``infrastructure``, naming the last reason, a failure the client reports as the
  farm's, not the kernels'.
* **Avoided**: a chunk of a build whose client shut this worker out (its circuit
  breaker: every chunk this worker took went back) goes back at once, unbuilt and
  uncounted.
* **Dropped**: a chunk whose client is gone (its build's heartbeat key,
  ``farm:build:<token>:alive``, expired) is acknowledged without compiling anything, one
  log line, counted in the worker's metrics. Its reply says so (``dropped``), so that a
  client that is in fact alive (a Redis that lost the key) sends it again.

What a pool process asks Redis about a chunk costs no round trip of its own: whether
its build's client is alive (and shut this worker out) rides in the round trip that
takes the chunk's compile leases, and is remembered for ``ALIVE_FRESH_S`` per build
(:class:`BuildWatch`: a worker runs many chunks of one build a second); whether the
chunk went back before, and how often, is read only for a message Celery delivers again
(``redelivered``: a first delivery was never given back).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from farm.cluster.payloads import CompileReply, KernelReply
from farm.core.keys import (
    RETURNS_WHY,
    TASK_STATE_TTL_S,
    build_avoid_key,
    build_returns_key,
    task_holder_key,
    task_returns_key,
)
from farm.core.model import KernelFailure

if TYPE_CHECKING:
    import redis

    from farm.programs.request import ChunkRequest
    from worker.crashes import TaskLedger

log = logging.getLogger(__name__)

#: returns of one chunk (by any worker) before its kernels fail as ``infrastructure``
MAX_RETURNS = 10


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def note_return(client: redis.Redis, task_id: str, request: ChunkRequest, worker: str,
                reason: str | None) -> None:
    """Note that ``worker`` gives the chunk back (``reason`` ``None``: uncounted), per
    task and per build (what the client's circuit breaker reads), and that it holds it
    no more: the chunk is queued again, and a client must not take it for one its holder
    dropped. Before the message goes back, so before another worker can note itself as
    the holder. Best effort (Redis may be what failed)."""
    key = task_returns_key(task_id)
    pipe = client.pipeline(transaction=False)
    pipe.delete(task_holder_key(task_id))
    if reason is not None:
        pipe.hincrby(key, worker, 1)
        pipe.hset(key, RETURNS_WHY, reason[:300])
        pipe.expire(key, TASK_STATE_TTL_S)
        if request.build is not None:
            per_build = build_returns_key(request.build)
            pipe.hincrby(per_build, worker, 1)
            pipe.hset(per_build, f"{RETURNS_WHY}:{worker}", reason[:300])
            pipe.expire(per_build, TASK_STATE_TTL_S)
    try:
        pipe.execute()
    except Exception as exc:
        log.debug("task %s: return not noted: %s", task_id, exc)


def read_returns(raw: dict[Any, Any]) -> tuple[dict[str, int], str]:
    """(worker -> times it gave the chunk back, the last reason) of a returns hash."""
    why = ""
    counts: dict[str, int] = {}
    for name, value in raw.items():
        field, text = _text(name), _text(value)
        if field == RETURNS_WHY:
            why = text
        elif text.isdigit():
            counts[field] = int(text)
    return counts, why


def given_up(raw: dict[Any, Any], task_id: str, request: ChunkRequest) -> CompileReply | None:
    """The reply that ends a chunk given back ``MAX_RETURNS`` times (``raw``: its returns
    hash, read with the crash ledger), else ``None``."""
    counts, why = read_returns(raw)
    total = sum(counts.values())
    if total < MAX_RETURNS:
        return None
    message = (f"given back {total} time(s) by {len(counts)} worker(s) for infrastructure "
               f"reasons, not tried again; the last: {why}")
    log.error("chunk %s: %s", task_id, message)
    ids = [k.artifact.id_hash for k in request.kernels] + [
        p.spec.key.id_hash for p in request.programs]
    return CompileReply(results=[
        KernelReply(id_hash=id_hash,
                    failure=KernelFailure(kind="infrastructure", message=message))
        for id_hash in ids])


@dataclass
class Delivery:
    """One delivery of a chunk to this pool process: its task, its build (the client's
    token: ``None`` from a client before builds had one), this worker's ``host:pid``
    (the holder its main process noted), whether Celery delivered it before, its crash
    ledger; and, once run, whether its reply reached the build's reply stream."""

    task_id: str
    build: str | None = None
    worker: str = ""
    redelivered: bool = True
    pushed: bool = False
    #: its crash bookkeeping (the crash hook's, ``worker.hooks.crashes``; ``None``: none)
    ledger: TaskLedger | None = None


class Avoided(Exception):
    """The chunk's client sends this worker no more of its build (its circuit breaker):
    the chunk goes back at once, unbuilt and uncounted."""


#: seconds a pool process trusts what it read of a build's heartbeat key
ALIVE_FRESH_S = 1.0
#: builds a pool process remembers (the oldest go first)
_BUILDS_KEPT = 64


class BuildWatch:
    """What a pool process read of the builds whose chunks it runs (see the module
    docstring): the value of each one's heartbeat key (``"1"``, or ``BUILD_AVOIDS``),
    whether it shut this worker out, and whether a claim of its was refused. A build
    found gone is not remembered: its client, if alive after all (a Redis that lost the
    key), sends the chunk again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._avoided: set[tuple[str, str]] = set()
        self._refused: OrderedDict[str | None, None] = OrderedDict()

    def claims_refused(self, build: str | None) -> bool:
        """Whether a claim of a chunk of ``build`` was refused on this process (its
        source indexed already): its later chunks then wait for their claims before
        compiling (``worker.chunkrun``), so a rekey compiles nothing it throws away."""
        return build in self._refused

    def refused(self, build: str | None) -> None:
        """Note that a claim of a chunk of ``build`` was refused."""
        self._refused[build] = None
        self._refused.move_to_end(build)
        while len(self._refused) > _BUILDS_KEPT:
            self._refused.popitem(last=False)

    def fresh(self, build: str) -> str | None:
        """The heartbeat value read less than ``ALIVE_FRESH_S`` ago, else ``None``."""
        seen = self._seen.get(build)
        if seen is None or self._clock() - seen[0] > ALIVE_FRESH_S:
            return None
        return seen[1]

    def saw(self, build: str, value: bytes | str | None) -> str | None:
        """Note what was read (``None``: the key is gone); returns it as text."""
        if value is None:
            self._seen.pop(build, None)
            return None
        text = _text(value)
        self._seen[build] = (self._clock(), text)
        self._seen.move_to_end(build)
        while len(self._seen) > _BUILDS_KEPT:
            self._seen.popitem(last=False)
        return text

    def avoided(self, client: redis.Redis, build: str, worker: str) -> bool:
        """Whether ``build``'s client shut ``worker`` out (asked once it says it shut
        some worker out; once shut out, always). ``False`` when it cannot tell."""
        if (build, worker) in self._avoided:
            return True
        try:
            if client.sismember(build_avoid_key(build), worker):
                self._avoided.add((build, worker))
                return True
        except Exception:
            return False
        return False
