"""The broker's transport: kombu's Redis transport, with its acknowledgement made safe.

kombu's Redis ``QoS.ack`` first removes the message from Redis's unacked index, then frees
the message's place in the prefetch window. When that Redis call fails (a frozen or
restarting Redis: "Couldn't ack ... TimeoutError" in a worker's log), the place is never
freed; a worker holds one message per process (``worker_prefetch_multiplier=1``), so
with its window full it never takes another message, although it runs, heartbeats and
looks healthy (RELIABILITY.md, the Redis outages).

Here the place is freed whatever the Redis call does. Nothing is lost by it: the message
is still in the unacked index, so Redis gives it back after the visibility timeout and a
worker compiles the chunk again, which is harmless (the store's first writer wins, the
client has its reply already). ``reject`` gets the same treatment.

Celery is given this transport by its import path (``broker_transport``); the URL still
says ``redis://`` and everything else is kombu's own.
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

#: what Celery's ``broker_transport`` names (kombu resolves an import path)
TRANSPORT = f"{__name__}:Transport"


class QoS(kombu_redis.QoS):
    """kombu's Redis QoS whose ack and reject free the window even when Redis fails."""

    def ack(self, delivery_tag: str) -> None:
        try:
            self._remove_from_indices(delivery_tag).execute()
        finally:
            virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            if requeue:
                self.restore_by_tag(delivery_tag, leftmost=True)
            else:
                self._remove_from_indices(delivery_tag).execute()
        finally:
            virtual.QoS.ack(self, delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel
