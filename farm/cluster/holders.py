"""Who holds a build's chunks, seen from its client: which are in flight, which are lost.

A chunk sent to a fingerprint's queue is waited for until its reply comes. Three ways it
can be lost without a reply, each turned into a re-send (first writer wins makes the
duplicate harmless; docs/RELIABILITY.md):

* **its holder died**: the worker its holder note names (``farm:task:<id>:holder``, set
  by the worker's main process when Celery hands it the message) has not heartbeaten for
  ``FARM_DEAD_WORKER_GRACE``, judged on this client's clock (clock skew does not matter,
  and heartbeats missed while Redis was away do not count);
* **its holder no longer holds it**: a live worker whose heartbeat lists the tasks it
  holds (``WorkerInfo.tasks``) has not listed this one for the grace, and no reply came.
  Two causes, told apart in the re-send's line: its pool process died on it (the
  worker's main process notes the exit status, ``task_crashes_key``, and Celery puts
  the message back at the end of the queue, where it may wait longer than the grace),
  or Redis was away during the build (Celery drops the messages a worker reserved but
  had not started when its broker connection breaks, counting on putting them back in
  the queue, which it cannot do while Redis is away: the message then waits for the
  broker's visibility timeout, 900 s). Neither: the line says so rather than guess;
* **Redis lost it**: a Redis that was killed and restarted (its ``run_id`` changed)
  keeps what its append-only file had, up to a second short: a chunk neither in its
  queue nor held by a live worker, once the workers have beaten since, was lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from farm.cluster.workers import WorkerInfo
from farm.core.keys import (
    CRASHES_STATUS,
    queue_name,
    task_crashes_key,
    task_holder_key,
    workers_key,
)
from farm.core.outage import Waiter

if TYPE_CHECKING:
    import redis

QUEUED = "queued"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Look:
    """One look at the pending chunks: who holds how many, and which to send again."""

    in_flight: dict[str, int] = field(default_factory=dict)
    #: (task id, the worker it was with or "", why it is sent again)
    lost: list[tuple[str, str, str]] = field(default_factory=list)


class HolderWatch:
    """A client's view of its pending chunks' holders (see the module docstring)."""

    def __init__(self, client: redis.Redis, waiter: Waiter, *, fingerprint: str, grace_s: float,
                 settle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._waiter = waiter
        self._fingerprint = fingerprint
        self._grace_s = grace_s
        self._settle_s = settle_s  # a worker beats within this once Redis is back
        self._clock = clock
        #: worker field -> (heartbeat last seen, when this client saw it change)
        self._beats: dict[str, tuple[float, float]] = {}
        self._outages_seen = waiter.outages
        self._outages_at_start = waiter.outages  # was Redis away during this build?
        #: task id -> since when its live holder has not listed it
        self._unlisted: dict[str, float] = {}
        self._run_id: str | None = None
        self._audit_at: float | None = None

    def look(self, pending: list[str]) -> Look:
        now = self._clock()
        if self._waiter.outages != self._outages_seen:  # Redis was away: start afresh
            self._outages_seen = self._waiter.outages
            self._beats.clear()
            self._unlisted.clear()
            if self._restarted():
                self._audit_at = now + self._settle_s
        holders = self._waiter.call(
            lambda: list(self._client.mget([task_holder_key(t) for t in pending]))
        ) if pending else []
        workers = self._workers(now)
        audit = self._audit_at is not None and now >= self._audit_at
        queued = self._queued() if audit else set()
        if audit:
            self._audit_at = None
        found = Look()
        for task_id, raw in zip(pending, holders, strict=True):
            holder = _text(raw) if raw is not None else ""
            why = self._why_lost(task_id, holder, workers, now)
            if why is None and audit and task_id not in queued and not any(
                    task_id in (w.tasks or ()) for w, _ in workers.values()):
                why = "Redis restarted, and it is neither queued nor held by a live worker"
            if why is not None:
                found.lost.append((task_id, holder, why))
                self._unlisted.pop(task_id, None)
                continue
            name = holder or QUEUED
            found.in_flight[name] = found.in_flight.get(name, 0) + 1
        return found

    def _why_lost(self, task_id: str, holder: str,
                  workers: dict[str, tuple[WorkerInfo, bool]], now: float) -> str | None:
        if not holder:
            return None
        if holder not in workers:
            if self._grace_over(holder, now):
                return f"worker {holder} held it and has not heartbeaten for " \
                       f"{self._grace_s:g} s"
            return None
        info, alive = workers[holder]
        if not alive:
            return f"worker {holder} held it and has not heartbeaten for {self._grace_s:g} s"
        if info.tasks is not None and task_id not in info.tasks:
            since = self._unlisted.setdefault(task_id, now)
            if now - since > self._grace_s:
                return self._why_unlisted(task_id, holder)
            return None
        self._unlisted.pop(task_id, None)
        return None

    def _why_unlisted(self, task_id: str, holder: str) -> str:
        """Why a live ``holder`` no longer holds ``task_id`` (see the module docstring):
        the real cause, never an outage of Redis that did not happen."""
        status = self._waiter.call(
            lambda: self._client.hget(task_crashes_key(task_id), CRASHES_STATUS))
        if status:
            return (f"the pool process of worker {holder} died on it ({_text(status)}); "
                    "the worker is alive and no longer holds it")
        if self._waiter.outages != self._outages_at_start:
            return f"worker {holder} no longer holds it (it dropped it while Redis was away)"
        return (f"worker {holder} is alive but no longer holds it and sent no reply "
                "(Redis was not away; a process of the worker may have died)")

    def _workers(self, now: float) -> dict[str, tuple[WorkerInfo, bool]]:
        """Worker field -> (its registration, alive on this client's clock)."""
        raw = self._waiter.call(lambda: self._client.hgetall(workers_key(self._fingerprint)))
        seen: dict[str, tuple[WorkerInfo, bool]] = {}
        for name, value in raw.items():
            try:
                info = WorkerInfo.model_validate_json(value)
            except ValueError:
                continue
            key = _text(name)
            last = self._beats.get(key)
            if last is None or last[0] != info.heartbeat:
                self._beats[key] = (info.heartbeat, now)
            seen[key] = (info, now - self._beats[key][1] <= self._grace_s)
        return seen

    def _grace_over(self, holder: str, now: float) -> bool:
        """A holder this client never saw beat: dead once the grace has passed since
        it first noticed it (it may be a worker whose registration Redis lost)."""
        first = self._beats.setdefault(f"unseen:{holder}", (0.0, now))
        return now - first[1] > self._grace_s

    def _restarted(self) -> bool:
        """Whether Redis is another run than the last look's (killed and started)."""
        info = self._waiter.call(lambda: self._client.info("server"))
        run_id = str(info.get("run_id", "")) if isinstance(info, dict) else ""
        before, self._run_id = self._run_id, run_id
        return before is not None and before != run_id

    def remember_run(self) -> None:
        """Note the Redis run this build started with (call once, before waiting)."""
        if self._run_id is None:
            info = self._waiter.call(lambda: self._client.info("server"))
            self._run_id = str(info.get("run_id", "")) if isinstance(info, dict) else ""

    def _queued(self) -> set[str]:
        """Task ids of the messages waiting in the fingerprint's queue."""
        raw = self._waiter.call(
            lambda: list(self._client.lrange(queue_name(self._fingerprint), 0, -1)))
        ids: set[str] = set()
        for entry in raw:
            try:
                headers = json.loads(entry).get("headers") or {}
            except (ValueError, AttributeError):
                continue
            if isinstance(headers, dict) and isinstance(headers.get("id"), str):
                ids.add(headers["id"])
        return ids
