"""Readiness: a worker consumes its queues only while it can serve them.

Why: a worker that takes chunks it cannot build drains the queue for everybody. One
started with a wrong MinIO secret, or while MinIO was away, used to take every chunk and
fail it in milliseconds (docs/RELIABILITY.md). So the main process decides, and says why,
once, whenever the answer changes:

* **its pool processes opened their state** (device, connections): each reports through
  :class:`ProcessReports`; one that could not is never given a task;
* **the store answers with its credentials**: :meth:`ArtifactStore.probe` (one signed read
  in the namespace, one attempt, ``FARM_SOCKET_TIMEOUT``), so an unreachable, frozen or
  refusing MinIO stops consumption within seconds;
* **its chunks do not keep going back**: ``INFRA_STREAK`` chunks in a row given back
  for infrastructure reasons (a store that answers the probe but refuses writes, say)
  pause consumption for ``PAUSE_S`` seconds, then it tries again (the worker's own
  circuit breaker).

Redis is not one of these checks: without it nothing is consumed anyway, and a Redis
outage past ``FARM_OUTAGE_LIMIT`` ends the worker (``worker.startup``).

How it is applied: Celery starts consuming only the app's default queue, to which nothing
is sent; a timer in the consumer's own event loop (where Celery's control commands
``add_consumer`` and ``cancel_consumer`` run too, so the same thread-safety) adds the
fingerprint's queues when ready and cancels them when not. Chunks a worker took just
before it stopped consuming are given back by the task (``worker.app``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from farm.cluster.workers import READY_LINE
from farm.core.errors import one_line

if TYPE_CHECKING:
    from celery.worker.consumer import Consumer

log = logging.getLogger(__name__)

#: chunks given back in a row (infrastructure) before the worker pauses consuming
INFRA_STREAK = 3
#: seconds such a pause lasts before the worker tries consuming again
PAUSE_S = 30.0
#: seconds between the event loop's looks at the verdict
APPLY_INTERVAL_S = 0.5
#: seconds between checks while ready, at most (the heartbeat interval when shorter):
#: with a socket timeout of a few seconds, a frozen store is noticed within seconds
CHECK_S = 2.0
#: how a verdict of a pool still starting begins; said only past ``START_GRACE_S``
STARTING = "starting: "
START_GRACE_S = 60.0
_OK = "ok"


class ProcessReports:
    """Pool processes tell the main process whether they opened their state: one small
    file per process index in a folder of this worker's own (a replaced process writes
    over its predecessor's)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder  # the worker's own (``worker.startup`` makes and removes it)

    def report(self, index: int, problem: str | None) -> None:
        """In a pool process: ``None`` when its state is open, else why not."""
        path = self.folder / f"process-{index}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(_OK if problem is None else problem[:500])
        tmp.replace(path)

    def problem(self, expected: int) -> str | None:
        """Why the pool cannot serve (a process that failed, or not all started)."""
        reports = {p.name: p.read_text(errors="replace")
                   for p in sorted(self.folder.glob("process-*"))}
        for name, text in reports.items():
            if text != _OK:
                return f"pool {name.replace('-', ' ')} could not open its state: {text}"
        if len(reports) < expected:
            return f"{STARTING}{len(reports)} of {expected} pool process(es) started"
        return None


class Readiness:
    """The main process's verdict (checked on a thread of its own) and its application
    to the Celery consumer (on the consumer's event loop)."""

    def __init__(self, *, queues: list[str], reports: ProcessReports, processes: int,
                 probe: Callable[[], None], interval_s: float,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.queues = queues
        self._reports = reports
        self._processes = processes
        self._probe = probe
        self._interval_s = interval_s
        self._on_change = on_change or (lambda ready: None)
        self._lock = threading.Lock()
        self._why = STARTING
        self._born = time.monotonic()
        self._consuming = False
        self._streak = 0
        self._last_back = ""
        self._paused_until = 0.0
        self._said = ""  # the last "not consuming" said (only the event loop writes it)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="farm-readiness")

    # -- the verdict (any thread) ---------------------------------------------------------
    @property
    def why(self) -> str:
        """Why the worker does not consume ("" when it does, or will at the next look)."""
        with self._lock:
            return self._why

    def status(self) -> tuple[bool, str]:
        """(consuming, why not) for the heartbeat's registration."""
        with self._lock:
            return self._consuming, "" if self._consuming else self._why

    def check(self) -> str:
        """Run every check now; the verdict ("" when ready)."""
        why = self._reports.problem(self._processes) or ""
        if not why:
            try:
                self._probe()
            except Exception as exc:  # StoreError in one line, or anything the SDK raised
                why = f"store: {one_line(exc)}"
        with self._lock:
            if not why and time.monotonic() < self._paused_until:
                why = (f"its last {INFRA_STREAK} chunk(s) went back for infrastructure "
                       f"reasons ({self._last_back}); paused for {PAUSE_S:g} s")
            self._why = why
        return why

    def chunk_went_back(self, reason: str) -> None:
        """A chunk was given back for an infrastructure reason (main process)."""
        with self._lock:
            self._streak += 1
            self._last_back = reason[:300]
            if self._streak >= INFRA_STREAK:
                self._streak = 0
                self._paused_until = time.monotonic() + PAUSE_S
        self._wake.set()

    def chunk_done(self) -> None:
        """A chunk was built (whatever its kernels' outcomes): the streak ends."""
        with self._lock:
            self._streak = 0

    # -- the checking thread --------------------------------------------------------------
    def start(self) -> None:
        self.check()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.is_set():
            not_ready = bool(self.why)
            self._wake.wait(min(self._interval_s, 1.0 if not_ready else CHECK_S))
            self._wake.clear()
            if not self._stop.is_set():
                self.check()

    # -- the consumer's event loop ---------------------------------------------------------
    def attach(self, consumer: Consumer) -> None:
        """Look at the verdict from the consumer's event loop from now on."""
        self.apply(consumer)
        consumer.timer.call_repeatedly(APPLY_INTERVAL_S, self.apply, (consumer,))

    def apply(self, consumer: Consumer) -> None:
        """Consume the queues, or stop, as the verdict says; one line per change."""
        why = self.why
        names = ", ".join(self.queues)
        if not why and not self._consuming:
            for queue in self.queues:
                consumer.add_task_queue(queue)
            with self._lock:
                self._consuming = True
            self._said = ""
            log.info("%s%s", READY_LINE, names)
            self._on_change(True)
        elif why and self._consuming:
            for queue in self.queues:
                consumer.cancel_task_queue(queue)
            with self._lock:
                self._consuming = False
            self._said = why
            log.warning("not consuming %s: %s", names, why)
            self._on_change(False)
        elif why and not self._said and (not why.startswith(STARTING)
                                         or time.monotonic() - self._born > START_GRACE_S):
            self._said = why  # not ready from the start: said once, when it is not just
            log.warning("not consuming %s: %s", names, why)  # the pool starting
