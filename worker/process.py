"""What each pool process of a worker holds, and what its main process reads of them.

A pool process opens its ``WorkerState`` (device, store, leases, records) once, at its
start, and tells its hooks whether it could (``after_process_boot``: the readiness hook
reports it to the main process, ``worker.hooks.readiness``): a process whose state could
not be opened stays up but runs no task, each task it gets going back to the queue
(``WorkerUnavailable``), and the worker does not consume while one is so. Before this,
such a process only logged its failure and failed every task it got with
``KeyError('state')``, draining the queue for everybody.

Here too: the ids of the tasks the main process holds, for its heartbeat
(``held_tasks``).
"""

from __future__ import annotations

import logging
import os

from farm.core.device import DeviceInfo
from farm.core.errors import WorkerUnavailable, one_line
from farm.core.settings import Settings
from worker.hooks.base import Hook
from worker.state import WorkerState, open_state

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
    """One pool process's ``WorkerState`` (see the module docstring)."""

    def __init__(self, settings: Settings, devices: list[DeviceInfo], hooks: Hook) -> None:
        self._settings = settings
        self._devices = devices
        self._hooks = hooks
        self._state: WorkerState | None = None
        self._problem = "this process has not opened its state"

    def open(self, **_: object) -> None:
        """Celery's ``worker_process_init``: open the state, tell the hooks whether it
        could."""
        from billiard import current_process

        logging.getLogger("celery.app.trace").addFilter(QuietTrace())
        index = getattr(current_process(), "index", 0) or 0
        try:
            self._state = open_state(self._settings, self._devices, index)
        except Exception as exc:  # the process stays up, runs nothing, says why
            self._problem = f"{type(exc).__name__}: {one_line(exc)}"
            log.error("process %s could not open its state: %s", os.getpid(), self._problem)
            self._hooks.after_process_boot(index, None, self._problem)
            return
        log.info("process %s opened %s", os.getpid(), self._state.device.fingerprint)
        self._hooks.after_process_boot(index, self._state, None)

    def close(self, **_: object) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.close()

    def state(self) -> WorkerState:
        """The state, or ``WorkerUnavailable`` (the chunk goes back) when it is not open."""
        if self._state is None:
            raise WorkerUnavailable(self._problem)
        return self._state


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
