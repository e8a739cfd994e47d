"""A worker's holder notes (``worker.hooks.leases.HolderNotes``), against a real Redis:
each note is sent and not waited for (the consumer does not stand still for its round
trip), lands with the worker's field and a time to live, its answers are read later
and never pile up past the limit; a Redis that cannot be reached is a warning, and the
notes go on once it answers.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid

import pytest
import redis

from farm.core.keys import TASK_STATE_TTL_S, task_holder_key
from worker.hooks.leases import UNREAD_LIMIT, HolderNotes

pytestmark = pytest.mark.integration


def _until(check: object, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_a_note_is_sent_without_waiting_for_its_answer(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    notes = HolderNotes(client, "host-a:17")
    task = str(uuid.uuid4())
    client.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # writes held, reads not
    try:
        notes.note(task)  # returns while its SET is held by the paused server
        assert client.exists(task_holder_key(task)) == 0
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    assert _until(lambda: client.exists(task_holder_key(task)))
    assert client.get(task_holder_key(task)) == b"host-a:17"
    assert 0 < client.ttl(task_holder_key(task)) <= TASK_STATE_TTL_S
    notes.close()
    client.close()


def test_answers_are_read_later_and_never_pile_up(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    notes = HolderNotes(client, "host-b:18")
    tasks = [str(uuid.uuid4()) for _ in range(3 * UNREAD_LIMIT)]
    for task in tasks:
        notes.note(task)
        assert notes._unread <= UNREAD_LIMIT
    assert _until(lambda: client.exists(*[task_holder_key(t) for t in tasks]) == len(tasks))
    notes.close()
    client.close()


def test_a_redis_out_of_reach_is_a_warning_and_the_notes_go_on(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1,
                       socket_connect_timeout=1)
    notes = HolderNotes(gone, "host-c:19")
    with caplog.at_level(logging.WARNING, logger="worker.hooks.leases"):
        notes.note("t-1")  # no exception: the task goes on without its note
    assert "could not note the holder of task t-1" in caplog.text
    client = redis.Redis.from_url(redis_url)
    notes._pool = client.connection_pool  # the same Redis answering again
    task = str(uuid.uuid4())
    notes.note(task)
    assert _until(lambda: client.get(task_holder_key(task)) == b"host-c:19")
    notes.close()
    client.close()
