"""The lease hook: who holds a chunk, for a client that re-sends the chunks of a dead
worker, and how often a chunk went back (:mod:`worker.chunks`).

* the main process notes itself as the holder of each task it receives (a key with a
  time to live: without it a dead worker's chunk comes back only by the broker's
  visibility timeout). The note is sent and not waited for (:class:`HolderNotes`): its
  round trip was on every chunk's way from the consumer to the pool process, and
  Celery's consumer loop stood still for it;
* a pool process that gives a chunk back notes the return (per task and per build, what
  the client's circuit breaker reads) and that it holds it no more, before the message
  goes back. Both best effort.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from farm.core.keys import TASK_STATE_TTL_S, task_holder_key
from farm.core.outage import redis_client
from worker.chunks import note_return
from worker.hooks.base import Boot, Chunk, Hook

if TYPE_CHECKING:
    import redis
    from celery.worker.request import Request

log = logging.getLogger(__name__)


#: holder notes sent and not read back, past which the next note reads them first
UNREAD_LIMIT = 64


class HolderNotes:
    """The main process's holder notes, on a connection of their own: each ``SET`` is
    sent and its answer read later (those that have come when the next note is sent,
    all of them once ``UNREAD_LIMIT`` are out), so a note costs the consumer a send, not
    a round trip. One thread (Celery's consumer); a failure is a warning line, the
    connection made again at the next note, never an error of the task's."""

    def __init__(self, client: redis.Redis, worker_field: str) -> None:
        self._pool = client.connection_pool
        self._field = worker_field
        self._conn: Any = None
        self._unread = 0

    def note(self, task_id: str) -> None:
        try:
            if self._conn is None:
                self._conn = self._pool.make_connection()
            self._read(all_of_them=self._unread >= UNREAD_LIMIT)
            self._conn.send_command("SET", task_holder_key(task_id), self._field,
                                    "EX", TASK_STATE_TTL_S)
            self._unread += 1
        except Exception as exc:  # best effort: see the module docstring
            log.warning("could not note the holder of task %s: %s", task_id, exc)
            self.close()

    def _read(self, *, all_of_them: bool) -> None:
        """The answers that have come (all of them: waiting, up to the socket's
        timeout); an error answer is said, not raised."""
        import redis

        while self._unread and (all_of_them or self._conn.can_read(timeout=0)):
            self._unread -= 1
            try:
                self._conn.read_response()
            except redis.ResponseError as exc:
                log.warning("a holder note was refused: %s", exc)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.disconnect()
        self._conn = None
        self._unread = 0


class LeaseHook(Hook):
    def __init__(self) -> None:
        self.boot: Boot | None = None
        self._notes: HolderNotes | None = None  # the main process's, made at boot
        self._client: redis.Redis | None = None  # a pool process's own, made when needed

    def before_worker_boot(self, boot: Boot) -> None:
        self.boot = boot
        self._notes = HolderNotes(boot.client, boot.worker_field)

    def after_task_received(self, request: Request) -> None:
        if self._notes is not None:
            self._notes.note(request.id)

    def after_chunk_given_back(self, chunk: Chunk, reason: str | None) -> None:
        if self.boot is None:
            return
        if self._client is None:
            settings = self.boot.settings
            self._client = redis_client(settings.redis_url or "", settings.socket_timeout)
        note_return(self._client, chunk.delivery.task_id, chunk.request,
                    self.boot.worker_field, reason)
