"""The broker's acknowledgement on a real Redis that freezes (farm.cluster.broker).

A worker whose acknowledgement met a frozen Redis must still take its next message:
kombu's own Redis transport keeps the message's prefetch place for ever then, and a
worker with one place stops consuming (seen as a stuck build after a Redis SIGSTOP).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from farm.cluster.broker import TRANSPORT
from farm.devservices.redis import RedisServer

KOMBU_OWN = "redis"


@pytest.fixture(scope="module")
def redis_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _queue(channel: Any) -> Any:
    return Queue("chunks", Exchange("chunks"), routing_key="chunks")(channel)


def _publish(channel: Any, chunk: int) -> None:
    channel.connection.client.Producer(channel).publish(
        {"chunk": chunk}, exchange="chunks", routing_key="chunks", serializer="json")


def _held_message(server: RedisServer, transport: str, db: int) -> tuple[Any, Any]:
    """A channel with one place, and the message that fills it (not yet acknowledged)."""
    url = server.url.rsplit("/", 1)[0] + f"/{db}"
    conn = Connection(url, transport=transport,
                      transport_options={"socket_timeout": 1, "socket_connect_timeout": 1,
                                         "visibility_timeout": 3600})
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    queue = _queue(channel)
    queue.declare()
    _publish(channel, 1)
    message = queue.get(no_ack=False)
    assert message is not None and message.payload == {"chunk": 1}
    assert not channel.qos.can_consume()  # its one place is taken
    return channel, message


def _settle_while_frozen(server: RedisServer, message: Any, verb: str = "ack") -> None:
    """``message.ack()`` or ``.reject()`` while Redis is frozen: it fails on its socket
    timeout, as a worker's did in the outage tests."""
    server.freeze()
    try:
        with pytest.raises(Exception, match=r"(?i)timeout|connection"):
            getattr(message, verb)()
    finally:
        server.thaw()


@pytest.mark.parametrize("verb", ["ack", "reject"])
def test_a_failed_acknowledgement_frees_the_place_and_keeps_the_message(
        redis_own: RedisServer, verb: str) -> None:
    db = {"ack": 1, "reject": 2}[verb]
    channel, message = _held_message(redis_own, TRANSPORT, db)
    _settle_while_frozen(redis_own, message, verb)
    assert channel.qos.can_consume()
    # and it does take the next message (the one it failed to settle stays in Redis's
    # unacknowledged index, or was settled there late, when Redis read the command
    # waiting in its socket: either way nothing is lost)
    _publish(channel, 2)
    again = _queue(channel).get(no_ack=False)
    assert again is not None and again.payload == {"chunk": 2}
    channel.connection.client.release()


def test_kombus_own_transport_keeps_the_place_which_is_why_ours_exists(
        redis_own: RedisServer) -> None:
    """The defect itself, shown on kombu's transport: when this fails, kombu fixed it
    and farm.cluster.broker can go."""
    channel, message = _held_message(redis_own, KOMBU_OWN, 3)
    _settle_while_frozen(redis_own, message)
    assert not channel.qos.can_consume()
    channel.connection.client.release()


def test_celery_is_given_the_transport(tmp_path: Path) -> None:
    from farm.cluster.celery_app import make_app
    from farm.core.settings import Settings

    app = make_app(Settings(redis_url="redis://127.0.0.1:1/0", home=tmp_path))
    with app.connection_for_read() as conn:
        assert type(conn.transport).__module__ == "farm.cluster.broker"
