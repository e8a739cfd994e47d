"""How much work waits for each fingerprint: queue depth and chunks in flight.

Read straight from the broker (kombu's Redis transport): a queue is a Redis list, so its
depth is ``LLEN``; with late acknowledgement a chunk a worker has taken stays in kombu's
``unacked`` hash until it is done, so the chunks in flight are that hash's entries per
routing key. ``farm workers`` prints these, and the workers and the ingester export them
as Prometheus gauges (``farm.cluster.metrics``) for dashboards and autoscaling.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    import redis

from farm.cluster.workers import served
from farm.core.keys import (
    CELERY_UNACKED,
    QUEUE_PATTERN,
    QUEUE_PRIORITY_SEP,
    queue_fingerprint,
    queue_name,
)

#: kombu's default priority steps: messages of priority p > 0 wait in their own list
_PRIORITY_STEPS = (3, 6, 9)


class QueueStats(BaseModel):
    """One fingerprint's load: waiting chunks, chunks being worked on, who serves it."""

    fingerprint: str
    depth: int = 0
    in_flight: int = 0
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


def in_flight(client: redis.Redis) -> dict[str, int]:
    """Fingerprint -> chunks delivered to a worker and not yet acknowledged."""
    counts: dict[str, int] = {}
    for raw in client.hvals(CELERY_UNACKED):
        try:
            _message, _exchange, routing_key = json.loads(raw)
        except (ValueError, TypeError):
            continue  # not kombu's layout: not ours to count
        fp = queue_fingerprint(_text(routing_key))
        if fp is not None:
            counts[fp] = counts.get(fp, 0) + 1
    return counts


def queue_stats(client: redis.Redis) -> dict[str, QueueStats]:
    """Every fingerprint that has a queue, a chunk in flight or a live worker."""
    fingerprints: set[str] = set()
    for name in client.scan_iter(match=QUEUE_PATTERN):
        base = _text(name).split(QUEUE_PRIORITY_SEP, 1)[0]
        fp = queue_fingerprint(base)
        if fp is not None:
            fingerprints.add(fp)
    flying = in_flight(client)
    live = served(client)
    fingerprints |= set(flying) | set(live)
    out = {}
    for fp in sorted(fingerprints):
        workers = live.get(fp, [])
        out[fp] = QueueStats(fingerprint=fp, depth=queue_depth(client, fp),
                             in_flight=flying.get(fp, 0), workers=len(workers),
                             processes=sum(w.processes for w in workers))
    return out
