"""The crash hook: a kernel that kills its compiling process is tried a bounded number
of times (the rules and the ledger: :mod:`worker.crashes`).

* a pool process notes the kernel in hand on its worker's own host (``InHand``, made at
  its boot) and counts each delivery of a chunk, whose ledger (``TaskLedger``) rides
  on the chunk's ``Delivery`` for ``execute_job`` to read; a chunk given back counts no
  delivery;
* the main process, when a pool process died on a task, books one crash for the kernel
  it held and releases the leases it noted, before Celery re-queues the task.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from worker.crashes import InHand, TaskLedger, record_crash
from worker.hooks.base import Boot, Chunk, Hook

if TYPE_CHECKING:
    from celery.worker.request import Request

    from worker.state import WorkerState

log = logging.getLogger(__name__)


class CrashHook(Hook):
    def __init__(self) -> None:
        self.boot: Boot | None = None

    def before_worker_boot(self, boot: Boot) -> None:
        self.boot = boot

    def after_task_died(self, request: Request, status: str) -> None:
        if self.boot is None:
            return
        try:
            kernel = record_crash(self.boot.client, request.id, status,
                                  InHand.read(self.boot.folder, request.worker_pid,
                                              request.id))
            log.error("task %s: the pool process died (%s) on kernel %s", request.id,
                      status, kernel or "(unknown)")
        except Exception as err:  # Redis away: the task still comes back
            log.error("task %s: could not record a crash: %s", request.id, err)

    def after_process_boot(self, index: int, state: WorkerState | None,
                           problem: str | None) -> None:
        if state is None or self.boot is None:
            return
        try:  # where the main process reads the kernel in hand, should this one die
            state.in_hand = InHand(self.boot.folder, os.getpid())
        except OSError as exc:  # crashes are then blamed by the delivery count alone
            log.warning("process %s cannot note its kernel in hand: %s", os.getpid(), exc)

    def before_chunk(self, chunk: Chunk, state: WorkerState) -> None:
        if state.redis is None or state.redis_waiter is None:
            return
        ledger = TaskLedger(state.redis, chunk.delivery.task_id, state.redis_waiter,
                            state.settings.crash_limit, chunk.delivery.redelivered)
        ledger.start()
        chunk.delivery.ledger = ledger

    def after_chunk_given_back(self, chunk: Chunk, reason: str | None) -> None:
        if chunk.delivery.ledger is not None:
            chunk.delivery.ledger.given_back()
