"""The lease hook: who holds a chunk, for a client that re-sends the chunks of a dead
worker, and how often a chunk went back (:mod:`worker.chunks`).

* the main process notes itself as the holder of each task it receives (a key with a
  time to live: without it a dead worker's chunk comes back only by the broker's
  visibility timeout);
* a pool process that gives a chunk back notes the return (per task and per build, what
  the client's circuit breaker reads) and that it holds it no more, before the message
  goes back. Both best effort.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from farm.core.keys import TASK_STATE_TTL_S, task_holder_key
from farm.core.outage import redis_client
from worker.chunks import note_return
from worker.hooks.base import Boot, Chunk, Hook

if TYPE_CHECKING:
    import redis
    from celery.worker.request import Request

log = logging.getLogger(__name__)


class LeaseHook(Hook):
    def __init__(self) -> None:
        self.boot: Boot | None = None
        self._client: redis.Redis | None = None  # a pool process's own, made when needed

    def before_worker_boot(self, boot: Boot) -> None:
        self.boot = boot

    def after_task_received(self, request: Request) -> None:
        if self.boot is None:
            return
        try:  # best effort: without it a dead worker's chunk comes back by the timeout
            self.boot.client.set(task_holder_key(request.id), self.boot.worker_field,
                                 ex=TASK_STATE_TTL_S)
        except Exception as exc:
            log.warning("could not note the holder of task %s: %s", request.id, exc)

    def after_chunk_given_back(self, chunk: Chunk, reason: str | None) -> None:
        if self.boot is None:
            return
        if self._client is None:
            settings = self.boot.settings
            self._client = redis_client(settings.redis_url or "", settings.socket_timeout)
        note_return(self._client, chunk.delivery.task_id, chunk.request,
                    self.boot.worker_field, reason)
