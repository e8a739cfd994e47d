"""Crash loops: a kernel that kills its compiling process is tried a bounded number of
times, then fails as ``crashed``, and is never sent again in that build.

With ``task_reject_on_worker_lost`` Celery puts a task back on its queue when the pool
process running it dies, with no limit: a compiler that aborts on one kernel would be
fed that kernel for ever while the client waits. So, per task id, in Redis (names in
:mod:`farm.core.keys`, all expiring after a day):

* the pool process counts the task's deliveries (from its second on: a message Celery
  delivers again says so, ``redelivered``, so a first delivery, nearly every one, costs
  no command) and notes the compile leases it takes for the chunk in the round trip that
  takes them; the kernel it is working on it notes on its own host (:class:`InHand`: a
  small file of the worker's, written in place, no round trip a kernel), from its
  look-ups on, which covers the compile, the load and the store: a crash while lowering
  is not blamed on a kernel, and is caught by the delivery count below;
* when the pool process dies, the worker's main process (which survives it) adds one
  crash to that kernel (read from the dead process's ``InHand``), with the exit status
  Celery reports (``signal 6 (SIGABRT)``), and releases the leases it noted, before
  Celery re-queues the task (:func:`record_crash`, from the crash hook:
  ``worker.hooks.crashes``);
* the next delivery fails every kernel with ``crash_limit`` crashes as ``crashed``
  without touching it, and obtains the others as usual. A task delivered more often than
  ``crash_limit`` plus its kernel count (a process that died before saying what it ran)
  fails what is left of it the same way.

A whole worker killed (main process included) counts no crash: that is a dead machine,
not a bad kernel, and its task simply comes back.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.cluster.lease import kernel_note, read_kernel_note, release_lease
from farm.core.keys import (
    CRASHES_STATUS,
    TASK_STATE_TTL_S,
    task_crashes_key,
    task_deliveries_key,
    task_kernel_key,
    task_returns_key,
)
from farm.core.outage import Waiter

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

_STATUS = re.compile(r"prematurely:\s*(.*?)(?:\s+Job:\s*\d+)?\.?$")


class InHand:
    """Which kernel a pool process works on, for its main process to blame should the
    pool process die: one small file per pool process in the worker's own folder (the
    one its pool processes report through, ``worker.readiness.ProcessReports``),
    written in place at each kernel. A main process outlives its pool processes, so it
    reads what the dead one wrote last, and checks that it was about the same task."""

    SIZE = 256

    def __init__(self, folder: Path, pid: int) -> None:
        self.path = folder / f"hand-{pid}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def note(self, task_id: str, id_hash: str) -> None:
        os.pwrite(self._fd, f"{task_id}\n{id_hash}\n".encode()[:self.SIZE].ljust(self.SIZE),
                  0)

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

    @classmethod
    def read(cls, folder: Path | None, pid: int | None, task_id: str) -> str:
        """The kernel pool process ``pid`` noted last for ``task_id``; "" when none."""
        if folder is None or not pid:
            return ""
        try:
            text = (folder / f"hand-{pid}").read_bytes()[:cls.SIZE].decode(errors="replace")
        except OSError:
            return ""
        noted_task, _, rest = text.partition("\n")
        return rest.partition("\n")[0] if noted_task == task_id else ""


class TaskLedger:
    """One delivery of one task, seen from the pool process that runs it."""

    def __init__(self, client: redis.Redis, task_id: str, waiter: Waiter,
                 crash_limit: int, redelivered: bool = True) -> None:
        self._client = client
        self.task_id = task_id
        self._waiter = waiter
        self.crash_limit = crash_limit
        self.redelivered = redelivered
        self.deliveries = 0
        self.crashes: dict[str, int] = {}
        self.status = ""
        #: the chunk's returns so far (``task_returns_key``), read with the crashes
        self.returns: dict[Any, Any] = {}

    def start(self) -> None:
        """Count this delivery and read the crashes (and returns) so far. A first
        delivery (nearly every one: Celery marks a message it delivers again
        ``redelivered``) is one, and costs no command. (Who holds the task the worker's
        main process notes when it receives it: ``worker.startup``.)"""
        if not self.redelivered:
            self.deliveries = 1
            return
        key = task_deliveries_key(self.task_id)

        def once() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            # the first delivery, which wrote nothing, counted now (unless it was given
            # back: it wrote its 0 then), then this one
            pipe.set(key, 1, nx=True, ex=TASK_STATE_TTL_S)
            pipe.incr(key)
            pipe.hgetall(task_crashes_key(self.task_id))
            pipe.hgetall(task_returns_key(self.task_id))
            return list(pipe.execute())
        _, count, crashes, self.returns = self._waiter.call(once)
        self.deliveries = int(count)
        for name, value in crashes.items():
            field = name.decode() if isinstance(name, bytes) else str(name)
            text = value.decode() if isinstance(value, bytes) else str(value)
            if field == CRASHES_STATUS:
                self.status = text
            elif text.isdigit():
                self.crashes[field] = int(text)

    def given_back(self) -> None:
        """This delivery gave the chunk back (infrastructure): it counts no delivery,
        so that a chunk passed between broken workers never fails as ``crashed``, and
        nothing is being worked on. Best effort: Redis may be what failed."""
        pipe = self._client.pipeline(transaction=False)
        if self.redelivered:
            pipe.decr(task_deliveries_key(self.task_id))
        else:  # a first delivery wrote nothing: its 0 says it is not to be counted
            pipe.set(task_deliveries_key(self.task_id), 0, nx=True, ex=TASK_STATE_TTL_S)
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


def record_crash(client: redis.Redis, task_id: str, status: str,
                 in_hand: str = "") -> str | None:
    """In the main process, once a pool process died on ``task_id``: one crash more for
    the kernel it was working on (``in_hand``, read from its :class:`InHand`, else the
    note's), and its leases released. Returns that kernel's id hash (``None``:
    unknown)."""
    noted, name, token = read_kernel_note(client.get(task_kernel_key(task_id)))
    id_hash = in_hand or noted
    if name:
        release_lease(client, name, token)
    pipe = client.pipeline(transaction=False)
    if id_hash:
        pipe.hincrby(task_crashes_key(task_id), id_hash, 1)
    pipe.hset(task_crashes_key(task_id), CRASHES_STATUS, status)
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
