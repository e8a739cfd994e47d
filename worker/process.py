"""What each pool process of a worker holds, and what its main process reads of them.

A pool process opens its ``WorkerState`` (device, store, leases, records) once, at its
start, and tells the main process whether it could (``ProcessReports``): a process whose
state could not be opened stays up but runs no task, each task it gets going back to the
queue (``WorkerUnavailable``), and the worker does not consume while one is so
(``worker.readiness``). Before this, such a process only logged its failure and failed
every task it got with ``KeyError('state')``, draining the queue for everybody.

Here too: the main process's readiness probe of the store (``store_probe``) and the ids
of the tasks it holds, for its heartbeat (``held_tasks``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from farm.core.device import DeviceInfo
from farm.core.errors import WorkerUnavailable, one_line
from farm.core.keys import Namespace
from farm.core.outage import redis_client
from farm.core.settings import Settings
from worker.crashes import InHand
from worker.readiness import ProcessReports
from worker.state import WorkerState, open_state

if TYPE_CHECKING:
    import redis

    from farm.cluster.metrics import Served
    from farm.store.base import ArtifactStore

log = logging.getLogger(__name__)


class QuietTrace(logging.Filter):
    """Celery logs every task's full return value at INFO ("succeeded in ...: {...}"):
    a chunk's reply is kilobytes of JSON. Keep that line for DEBUG; the compile task
    logs a one-line count per chunk instead (``worker.app``). The same for a chunk given
    back (Celery's "rejected" line, with a traceback): the task says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from celery.app.trace import LOG_REJECTED, LOG_SUCCESS

        if record.msg in (LOG_SUCCESS, LOG_REJECTED):
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


class PoolProcess:
    """One pool process's ``WorkerState`` and Redis client (see the module docstring)."""

    def __init__(self, settings: Settings, devices: list[DeviceInfo],
                 reports: ProcessReports, inherited: Sequence[Served] = ()) -> None:
        self._settings = settings
        self._inherited = inherited  # the main process's metrics listeners
        self._devices = devices
        self._reports = reports
        self._state: WorkerState | None = None
        self._problem = "this process has not opened its state"
        self._redis: redis.Redis | None = None

    def open(self, **_: object) -> None:
        """Celery's ``worker_process_init``: open the state, say whether it could."""
        from billiard import current_process

        for listener in self._inherited:  # forked with the metrics socket: not ours
            listener.close_inherited()
        logging.getLogger("celery.app.trace").addFilter(QuietTrace())
        index = getattr(current_process(), "index", 0) or 0
        try:
            self._state = open_state(self._settings, self._devices, index)
        except Exception as exc:  # the process stays up, runs nothing, says why
            self._problem = f"{type(exc).__name__}: {one_line(exc)}"
            log.error("process %s could not open its state: %s", os.getpid(), self._problem)
            self._reports.report(index, self._problem)
            return
        try:  # where the main process reads the kernel in hand, should this one die
            self._state.in_hand = InHand(self._reports.folder, os.getpid())
        except OSError as exc:  # crashes are then blamed by the delivery count alone
            log.warning("process %s cannot note its kernel in hand: %s", os.getpid(), exc)
        log.info("process %s opened %s", os.getpid(), self._state.device.fingerprint)
        self._reports.report(index, None)

    def close(self, **_: object) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.close()

    def state(self) -> WorkerState:
        """The state, or ``WorkerUnavailable`` (the chunk goes back) when it is not open."""
        if self._state is None:
            raise WorkerUnavailable(self._problem)
        return self._state

    def redis(self) -> redis.Redis:
        """This process's Redis client for the chunk bookkeeping (``worker.chunks``)."""
        if self._redis is None:
            self._redis = redis_client(self._settings.redis_url or "",
                                       self._settings.socket_timeout)
        return self._redis


def held_tasks() -> list[str] | None:
    """Ids of the tasks this worker holds (received, not done): Celery's own set, read
    from the heartbeat thread (a set changing under the copy is read again; ``None``,
    "not said", if it keeps changing)."""
    from celery.worker.state import reserved_requests

    for _ in range(5):
        try:
            return sorted(r.id for r in list(reserved_requests))
        except RuntimeError:  # changed size during iteration
            continue
    return None


def store_probe(settings: Settings, fingerprint: str) -> Callable[[], None]:
    """The readiness check of the store: one signed read in the fingerprint's namespace,
    one attempt (the store object is made at the first check that reaches MinIO)."""
    from farm.store.open import open_store

    made: list[ArtifactStore] = []
    ns = Namespace.for_fingerprint(fingerprint)

    def probe() -> None:
        if not made:
            made.append(open_store(settings, shared=True, probe=True, signed=False))
        made[0].probe(ns)

    return probe
