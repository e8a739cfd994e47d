"""A worker's end after an outage past its limit: one line, now, pool included.

Why not Celery's warm shutdown: it waits for the running tasks, whose results Celery
then tries to store in the (unreachable) result backend, retrying with a traceback per
attempt: after a 90 s Redis outage a worker used to log its one line at the limit, then
about 2,280 lines with 94 tracebacks, and exit about 35 s late (docs/RELIABILITY.md).
Nothing a pool process holds can be finished without Redis anyway: its message stays
unacknowledged in Redis, and comes back to another worker (a client re-sends the chunk
of a worker whose heartbeat stopped; the broker's visibility timeout is the backstop).

So :func:`stop_now` writes the one line, kills the pool processes and leaves at once
with exit status 1 (an orchestrator restarts the worker). And while an outage is still
shorter than the limit, :func:`quiet_celery_outages` keeps Celery's own retry lines to
the first of each kind, without tracebacks: the farm's waiter already says what is
waited for (``waiting for Redis at ...``) and when it is back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

#: Celery's and kombu's loggers that repeat themselves while Redis is away
_NOISY = ("celery.backends", "celery.backends.base", "celery.backends.redis",
          "celery.worker.consumer.consumer", "celery.worker.consumer", "kombu",
          "celery.worker.heartbeat", "celery.events")


def stop_now(line: str, pool: list[int], cleanup: Callable[[], None] | None = None) -> None:
    """Say ``line`` (as ``error: ...``, the CLI's one-line form), kill the pool (the
    pids Celery reports, or else this process's billiard children), exit 1.

    Called from the heartbeat thread of the main process; never returns."""
    try:
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        for child in pool or _pool_processes():
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if cleanup is not None:
            cleanup()
    finally:
        os._exit(1)


def _pool_processes() -> list[int]:
    """Process ids of this process's children that billiard started (the pool)."""
    try:
        from billiard import process

        return [p.pid for p in process.active_children() if p.pid]
    except Exception:  # pragma: no cover - billiard's internals moved: exit all the same
        return []


class _OncePerOutage(logging.Filter):
    """Lets the first record of each message template through (without its traceback),
    then drops the same template for ``window_s`` seconds; with ``only``, just the
    templates that begin so (the others pass untouched)."""

    def __init__(self, window_s: float, only: str | None = None) -> None:
        super().__init__()
        self._window_s = window_s
        self._only = only
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if self._only is not None and not str(record.msg).startswith(self._only):
            return True
        key = f"{record.name}:{record.msg}"
        now = time.monotonic()
        with self._lock:
            last = self._seen.get(key)
            if last is not None and now - last < self._window_s:
                return False
            self._seen[key] = now
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


def ignore_cancel_notice() -> None:
    """Drop Celery's notice (a dozen lines at each lost connection) that a later Celery
    will cancel late-acknowledged tasks on connection loss: ``celery_app`` sets that
    setting explicitly, and the notice comes all the same. Called once Celery has set up
    its logging, which puts its own "always" filter first."""
    import warnings

    from celery.exceptions import CPendingDeprecationWarning

    warnings.filterwarnings("ignore", category=CPendingDeprecationWarning,
                            message=r"(?s).*worker_cancel_long_running_tasks")


def quiet_celery_outages(window_s: float) -> None:
    """Keep Celery's and kombu's outage lines to one of each kind per ``window_s``."""
    once = _OncePerOutage(max(window_s, 1.0))
    for name in _NOISY:
        logging.getLogger(name).addFilter(once)
    # kombu's "Couldn't ack" (a finished chunk whose acknowledgement found no Redis: the
    # message comes back, and its redo finds the artifact stored), logged with a
    # traceback through the logger of Celery's requests, whose other lines stay as they are
    logging.getLogger("celery.worker.request").addFilter(
        _OncePerOutage(max(window_s, 1.0), only="Couldn't ack"))
