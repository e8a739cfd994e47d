"""Looking after the records streams' consumer group: making it, and watching it.

The ingesters of a cluster share one consumer group per stream (``RECORDS_GROUP``).
These are the group chores one ingester does beside reading: create the group (from the
start of each stream, so entries sent before any ingester ran are read too), and every
``check_interval_s`` warn when the group is far behind or the stream was trimmed past
what it read, and forget consumers that are gone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from farm.core.keys import RECORDS_GROUP

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

DEAD_CONSUMER_IDLE_MS = 3_600_000
"""A consumer with nothing pending and idle this long is an ingester that is gone; it
is removed from the group so that the group's listing stays readable."""


def text(value: object) -> str:
    """A Redis reply's bytes as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream id ``ms-seq`` as a comparable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def ensure_groups(client: redis.Redis, streams: list[str]) -> None:
    """Create the consumer group on every stream (and the streams), from the start:
    entries sent before the first ingester ever ran are read too."""
    import redis

    for stream in streams:
        try:
            client.xgroup_create(stream, RECORDS_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def check_group(client: redis.Redis, streams: list[str], consumer: str, maxlen: int) -> None:
    """Warn when the group is far behind or past the cap; forget dead consumers.

    Advisory: a Redis error here is logged and the round goes on (the read that
    follows reports Redis being down properly)."""
    import redis

    for stream in streams:
        try:
            groups = client.xinfo_groups(stream)
            info = client.xinfo_stream(stream)
        except redis.RedisError as exc:
            log.debug("ingester %s: cannot inspect %s: %s", consumer, stream, exc)
            continue
        group = next((g for g in groups if text(g.get("name")) == RECORDS_GROUP), None)
        if group is None:
            continue
        lag = group.get("lag")
        if isinstance(lag, int) and lag > maxlen // 2:
            log.warning("ingester %s: %s is %d entries behind (cap %d): add ingesters "
                        "before the cap trims unread records", consumer, stream, lag, maxlen)
        first = info.get("first-entry")
        last_delivered = text(group.get("last-delivered-id", "0-0"))
        if first and last_delivered != "0-0" and \
                stream_id(text(first[0])) > stream_id(last_delivered):
            log.error("ingester %s: %s was trimmed past the last entry the ingesters "
                      "read (%s): unread records are being lost", consumer, stream,
                      last_delivered)
        try:
            _forget_dead_consumers(client, stream, consumer)
        except redis.RedisError as exc:
            log.debug("ingester %s: cannot tidy consumers of %s: %s", consumer, stream, exc)


def _forget_dead_consumers(client: redis.Redis, stream: str, me: str) -> None:
    for consumer in client.xinfo_consumers(stream, RECORDS_GROUP):
        name = text(consumer.get("name"))
        if name == me or consumer.get("pending", 0):
            continue
        if int(consumer.get("idle", 0)) > DEAD_CONSUMER_IDLE_MS:
            client.xgroup_delconsumer(stream, RECORDS_GROUP, name)
