"""Crash loops: a kernel that kills its compiling process is tried a bounded number of
times, then fails as ``crashed``, and is never sent again in that build.

With ``task_reject_on_worker_lost`` Celery puts a task back on its queue when the pool
process running it dies, with no limit: a compiler that aborts on one kernel would be
fed that kernel for ever while the client waits. So, per task id, in Redis (names in
:mod:`farm.core.keys`, all expiring after a day):

* the pool process counts the task's deliveries and notes the kernel it is working on
  with the compile lease it takes for it, in the round trip that takes the lease
  (``TaskLedger``; a kernel is noted from its lease on, which covers the compile, the
  load and the store: a crash while lowering is not blamed on a kernel, and is caught
  by the delivery count below);
* when the pool process dies, the worker's main process (which survives it) adds one
  crash to that kernel, with the exit status Celery reports (``signal 6 (SIGABRT)``),
  before Celery re-queues the task (``crash_request_class``);
* the next delivery fails every kernel with ``crash_limit`` crashes as ``crashed``
  without touching it, and obtains the others as usual. A task delivered more often than
  ``crash_limit`` plus its kernel count (a process that died before saying what it ran)
  fails what is left of it the same way.

A whole worker killed (main process included) counts no crash: that is a dead machine,
not a bad kernel, and its task simply comes back.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Protocol

from celery.worker.request import Request

from farm.cluster.lease import kernel_note, read_kernel_note, release_lease
from farm.core.keys import (
    TASK_STATE_TTL_S,
    task_crashes_key,
    task_deliveries_key,
    task_kernel_key,
)
from farm.core.outage import Waiter

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

STATUS_FIELD = "status"


class ChunkOutcomes(Protocol):
    """Who hears, in the main process, what became of each chunk (``Readiness``)."""

    def chunk_went_back(self, reason: str) -> None: ...

    def chunk_done(self) -> None: ...
_STATUS = re.compile(r"prematurely:\s*(.*?)(?:\s+Job:\s*\d+)?\.?$")


class TaskLedger:
    """One delivery of one task, seen from the pool process that runs it."""

    def __init__(self, client: redis.Redis, task_id: str, waiter: Waiter,
                 crash_limit: int) -> None:
        self._client = client
        self.task_id = task_id
        self._waiter = waiter
        self.crash_limit = crash_limit
        self.deliveries = 0
        self.crashes: dict[str, int] = {}
        self.status = ""

    def start(self) -> None:
        """Count this delivery and read the crashes so far. (Who holds the task the
        worker's main process notes when it receives it: ``worker.startup``.)"""
        key = task_deliveries_key(self.task_id)

        def once() -> tuple[int, dict[Any, Any]]:
            # The first delivery (nearly every one) is one command; only a delivery
            # after a crash counts on and reads what the crashes left.
            if self._client.set(key, 1, nx=True, ex=TASK_STATE_TTL_S):
                return 1, {}
            pipe = self._client.pipeline(transaction=False)
            pipe.incr(key)
            pipe.hgetall(task_crashes_key(self.task_id))
            count, found = pipe.execute()
            return int(count), found
        deliveries, crashes = self._waiter.call(once)
        self.deliveries = int(deliveries)
        for name, value in crashes.items():
            field = name.decode() if isinstance(name, bytes) else str(name)
            text = value.decode() if isinstance(value, bytes) else str(value)
            if field == STATUS_FIELD:
                self.status = text
            elif text.isdigit():
                self.crashes[field] = int(text)

    def given_back(self) -> None:
        """This delivery gave the chunk back (infrastructure): it counts no delivery,
        so that a chunk passed between broken workers never fails as ``crashed``, and
        nothing is being worked on. Best effort: Redis may be what failed."""
        pipe = self._client.pipeline(transaction=False)
        pipe.decr(task_deliveries_key(self.task_id))
        pipe.delete(task_kernel_key(self.task_id))
        try:
            pipe.execute()
        except Exception as exc:  # Redis away: a later delivery may count one too many
            log.warning("task %s: could not uncount a delivery: %s", self.task_id, exc)

    def crashed(self, id_hash: str, kernels: int) -> str | None:
        """Why the kernel is not to be tried again, or ``None``."""
        times = self.crashes.get(id_hash, 0)
        status = self.status or "unknown exit status"
        if times >= self.crash_limit:
            return (f"the compiling process died ({status}) {times} time(s) on this kernel; "
                    "not tried again")
        if self.deliveries > self.crash_limit + kernels:
            return (f"its task was delivered {self.deliveries} times, its processes dying "
                    f"({status}); not tried again")
        return None

    def note(self, pipe: Any, id_hash: str, lease_name: str, token: str) -> None:
        """Add to ``pipe`` (the round trip that tries the kernel's lease) the note of the
        kernel in hand and of that lease: should this process die, the main process
        blames the kernel and releases the lease at once instead of every worker waiting
        out its time-to-live. A note of a lease not taken, or already released, is
        harmless: releasing it again is a no-op (its token holds nothing)."""
        pipe.set(task_kernel_key(self.task_id), kernel_note(id_hash, lease_name, token),
                 ex=TASK_STATE_TTL_S)

    def finish(self) -> None:
        """The chunk is done: no kernel in hand, no lease to release."""
        self._waiter.call(lambda: self._client.delete(task_kernel_key(self.task_id)))


def record_crash(client: redis.Redis, task_id: str, status: str) -> str | None:
    """In the main process, once a pool process died on ``task_id``: one crash more for
    the kernel it was working on. Returns that kernel's id hash (``None``: unknown)."""
    id_hash, name, token = read_kernel_note(client.get(task_kernel_key(task_id)))
    if name:
        release_lease(client, name, token)
    pipe = client.pipeline(transaction=False)
    if id_hash:
        pipe.hincrby(task_crashes_key(task_id), id_hash, 1)
    pipe.hset(task_crashes_key(task_id), STATUS_FIELD, status)
    pipe.expire(task_crashes_key(task_id), TASK_STATE_TTL_S)
    pipe.execute()
    return id_hash or None


def lost_status(exc: BaseException) -> str | None:
    """The exit status in Celery's ``WorkerLostError`` text, ``None`` for other errors."""
    from billiard.exceptions import WorkerLostError

    if not isinstance(exc, WorkerLostError):
        return None
    found = _STATUS.search(str(exc).strip())
    return found.group(1) if found else str(exc)


def crash_request_class(client: redis.Redis, outcomes: ChunkOutcomes | None = None
                        ) -> type[Request]:
    """A Celery ``Request`` that books a crash before Celery re-queues the task, and
    tells ``outcomes`` (the worker's ``Readiness``) of every chunk given back
    (``chunk_went_back(reason)``) or built (``chunk_done()``)."""
    from celery.exceptions import Reject

    class CrashAwareRequest(Request):
        def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
            failed, _, _ = failed__retval__runtime
            if not failed and outcomes is not None:
                outcomes.chunk_done()
            return super().on_success(failed__retval__runtime, **kwargs)

        def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                       return_ok: bool = False) -> Any:
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
            if isinstance(exc, Reject):  # a chunk given back (worker.app): no crash
                if outcomes is not None:
                    outcomes.chunk_went_back(str(exc.reason))
                return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                          return_ok=return_ok)
            if isinstance(exc, SystemExit | KeyboardInterrupt):
                status: str | None = None if (self._already_cancelled
                                              or self._already_revoked) else "exited"
            else:
                status = lost_status(exc) if exc is not None else None
            if status is not None:
                try:
                    kernel = record_crash(client, self.id, status)
                    log.error("task %s: the pool process died (%s) on kernel %s", self.id,
                              status, kernel or "(unknown)")
                except Exception as err:  # Redis away: the task still comes back
                    log.error("task %s: could not record a crash: %s", self.id, err)
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)

    return CrashAwareRequest
