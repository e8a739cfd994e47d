"""How much work waits for each fingerprint: queue depth and chunks in flight.

Read straight from the broker (kombu's Redis transport): a queue is a Redis list, so its
depth is ``LLEN``; with late acknowledgement a chunk a worker has taken stays in kombu's
``unacked`` hash until it is done, so the chunks in flight are that hash's entries per
routing key. ``farm workers`` prints these, and the workers and the ingester export them
as Prometheus gauges (``farm.cluster.metrics``) for dashboards and autoscaling.

A chunk whose holder (the worker its task's holder note names, ``farm:task:<id>:holder``)
is dead, by the same heartbeat grace the clients use (``FARM_DEAD_WORKER_GRACE``), is not
in flight but ``stale``: it stays in the ``unacked`` hash until the broker's visibility
timeout (900 s by default) while a client has re-sent it long since.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    import redis

from farm.cluster.workers import STALE_S, WorkerInfo, served
from farm.core.keys import (
    CELERY_UNACKED,
    QUEUE_PATTERN,
    QUEUE_PRIORITY_SEP,
    queue_fingerprint,
    queue_name,
    task_holder_key,
)

#: kombu's default priority steps: messages of priority p > 0 wait in their own list
_PRIORITY_STEPS = (3, 6, 9)


class QueueStats(BaseModel):
    """One fingerprint's load: waiting chunks, chunks being worked on, who serves it."""

    fingerprint: str
    depth: int = 0
    in_flight: int = 0
    #: taken by a worker now dead (see the module docstring)
    stale: int = 0
    workers: int = 0
    processes: int = 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def queue_depth(client: redis.Redis, fingerprint: str) -> int:
    """Chunks waiting in ``farm.<fingerprint>`` (every priority)."""
    name = queue_name(fingerprint)
    pipe = client.pipeline(transaction=False)
    pipe.llen(name)
    for step in _PRIORITY_STEPS:
        pipe.llen(f"{name}{QUEUE_PRIORITY_SEP}{step}")
    return sum(int(n) for n in pipe.execute())


def _taken(client: redis.Redis) -> list[tuple[str, str | None]]:
    """(fingerprint, task id or None) of every delivered, unacknowledged message."""
    taken: list[tuple[str, str | None]] = []
    for raw in client.hvals(CELERY_UNACKED):
        try:
            message, _exchange, routing_key = json.loads(raw)
        except (ValueError, TypeError):
            continue  # not kombu's layout: not ours to count
        fp = queue_fingerprint(_text(routing_key))
        if fp is None:
            continue
        headers = message.get("headers") if isinstance(message, dict) else None
        task_id = headers.get("id") if isinstance(headers, dict) else None
        taken.append((fp, task_id if isinstance(task_id, str) else None))
    return taken


def in_flight(client: redis.Redis, live: dict[str, list[WorkerInfo]] | None = None
              ) -> dict[str, int]:
    """Fingerprint -> chunks delivered to a worker and not yet acknowledged. With
    ``live`` (``served()``), those whose holder is not among the live workers are left
    out (:func:`stale`)."""
    return _split(client, live)[0]


def stale(client: redis.Redis, live: dict[str, list[WorkerInfo]]) -> dict[str, int]:
    """Fingerprint -> chunks taken by a worker that is dead now."""
    return _split(client, live)[1]


def _split(client: redis.Redis, live: dict[str, list[WorkerInfo]] | None
           ) -> tuple[dict[str, int], dict[str, int]]:
    taken = _taken(client)
    holders: list[bytes | str | None] = [None] * len(taken)
    ids = [task_id for _, task_id in taken if task_id]
    if live is not None and ids:
        found = iter(client.mget([task_holder_key(t) for t in ids]))
        holders = [next(found) if task_id else None for _, task_id in taken]
    alive = {w.field for ws in (live or {}).values() for w in ws}
    flying: dict[str, int] = {}
    dead: dict[str, int] = {}
    for (fp, _), holder in zip(taken, holders, strict=True):
        counts = dead if holder is not None and _text(holder) not in alive else flying
        counts[fp] = counts.get(fp, 0) + 1
    return flying, dead


def queue_stats(client: redis.Redis, stale_s: float = STALE_S) -> dict[str, QueueStats]:
    """Every fingerprint that has a queue, a chunk taken or a live worker; workers dead
    for ``stale_s`` (``FARM_DEAD_WORKER_GRACE``) hold no chunk in flight."""
    fingerprints: set[str] = set()
    for name in client.scan_iter(match=QUEUE_PATTERN):
        base = _text(name).split(QUEUE_PRIORITY_SEP, 1)[0]
        fp = queue_fingerprint(base)
        if fp is not None:
            fingerprints.add(fp)
    live = served(client, stale_s)
    flying, dead = _split(client, live)
    fingerprints |= set(flying) | set(dead) | set(live)
    out = {}
    for fp in sorted(fingerprints):
        workers = live.get(fp, [])
        out[fp] = QueueStats(fingerprint=fp, depth=queue_depth(client, fp),
                             in_flight=flying.get(fp, 0), stale=dead.get(fp, 0),
                             workers=len(workers),
                             processes=sum(w.processes for w in workers))
    return out
