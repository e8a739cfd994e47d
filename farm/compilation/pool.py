"""A process pool that survives a job killing its process.

``concurrent.futures.ProcessPoolExecutor`` breaks for good when one of its processes
dies (a compiler abort, an out-of-memory kill): every pending job fails with
``BrokenProcessPool`` and every later submit too, so one bad kernel would fail an
innocent ``add`` submitted after it. :class:`CrashSafePool` rebuilds the pool instead and
fails only the job that killed it:

* each job reports ``(pid, job id)`` when it starts, on a queue the parent reads once the
  pool broke, so the job the dead process was running is known exactly; the dead process
  is the one whose exit status is not the SIGTERM the executor sends the others;
* that job has killed a process once more: at ``crash_limit`` it fails
  (:class:`JobCrashed`, with the exit status), else it runs again; every other job of
  the broken pool (running, or still queued) runs again on the new pool at no cost;
* when no job can be blamed (a process died before saying what it ran), every job that
  was running is blamed once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.queues import SimpleQueue
from typing import Any, TypeVar

log = logging.getLogger(__name__)

#: a pool job: an importable function of one picklable argument (the compile path's
#: JSON text, or a tuple of them), whose result is pickled back
Job = Callable[[Any], object]
A = TypeVar("A")

#: in a pool process: the queue its jobs report (process id, job id) on as they start
_STARTED: SimpleQueue[tuple[int, int]] | None = None


class JobCrashed(Exception):
    """A job killed its process ``crash_limit`` times; ``status`` says how it died."""

    def __init__(self, status: str, times: int) -> None:
        super().__init__(f"the compiling process died ({status}) {times} time(s) on this "
                         "kernel; not tried again")
        self.status = status
        self.times = times


def exit_status(exitcode: int | None) -> str:
    """``signal 6 (SIGABRT)`` or ``exit code 3``: how a process ended, for a person."""
    if exitcode is None:
        return "unknown exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "?"
        return f"signal {-exitcode} ({name})"
    return f"exit code {exitcode}"


def _init(started: SimpleQueue[tuple[int, int]], initializer: Callable[..., None] | None,
          initargs: tuple[object, ...]) -> None:
    global _STARTED
    _STARTED = started
    if initializer is not None:
        initializer(*initargs)


def _run(job_id: int, fn: Job, arg: object) -> object:
    if _STARTED is not None:
        _STARTED.put((os.getpid(), job_id))
    return fn(arg)


@dataclass
class _Job:
    id: int
    fn: Job
    arg: object
    out: Future[object]
    generation: int = -1
    crashes: int = 0


@dataclass
class _Generation:
    number: int
    executor: ProcessPoolExecutor
    started: SimpleQueue[tuple[int, int]]
    jobs: dict[int, _Job] = field(default_factory=dict)
    broken: bool = False


class CrashSafePool:
    """``workers`` spawned processes (``initializer`` runs once in each), rebuilt when
    one dies; see the module docstring for who is blamed."""

    def __init__(self, workers: int, *, initializer: Callable[..., None] | None = None,
                 initargs: tuple[object, ...] = (), crash_limit: int = 2) -> None:
        self.workers = max(1, workers)
        self.crash_limit = max(1, crash_limit)
        self._initializer = initializer
        self._initargs = initargs
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._closed = False
        #: pools rebuilt after a process died
        self.rebuilds = 0
        # Made at the first job: a batch whose kernels are all stored starts no process
        # (nor multiprocessing's resource tracker).
        self._gen: _Generation | None = None

    def _current(self) -> _Generation:
        if self._gen is None:
            self._gen = self._new_generation(0)
        return self._gen

    def _new_generation(self, number: int) -> _Generation:
        started = self._ctx.SimpleQueue()
        executor = ProcessPoolExecutor(
            max_workers=self.workers, mp_context=self._ctx, initializer=_init,
            initargs=(started, self._initializer, self._initargs))
        return _Generation(number=number, executor=executor, started=started)

    def submit(self, fn: Callable[[A], object], arg: A) -> Future[object]:
        """Run ``fn(arg)`` in a pool process (``fn`` importable, ``arg`` picklable)."""
        job = _Job(id=next(self._ids), fn=fn, arg=arg, out=Future())
        with self._lock:
            self._launch(job)
        return job.out

    def _launch(self, job: _Job) -> None:
        gen = self._current()
        job.generation = gen.number
        gen.jobs[job.id] = job
        try:
            raw = gen.executor.submit(_run, job.id, job.fn, job.arg)
        except (BrokenProcessPool, RuntimeError) as exc:  # broke before we noticed
            raw = Future()
            raw.set_exception(BrokenProcessPool(str(exc)))
        def done(f: Future[Any]) -> None:
            self._done(job, gen, f)

        raw.add_done_callback(done)

    def _done(self, job: _Job, gen: _Generation, raw: Future[Any]) -> None:
        if raw.cancelled():  # the pool was closed with it still queued
            job.out.cancel()
            return
        exc = raw.exception()
        if not isinstance(exc, BrokenProcessPool):
            with self._lock:
                gen.jobs.pop(job.id, None)
            if exc is not None:
                job.out.set_exception(exc)
            else:
                job.out.set_result(raw.result())
            return
        with self._lock:
            if not gen.broken and not self._closed:
                self._recover(gen)

    def _recover(self, gen: _Generation) -> None:
        """The pool of ``gen`` broke: blame, rebuild, run the others again."""
        gen.broken = True
        running: dict[int, int] = {}  # pid -> job id it was running last
        try:
            while not gen.started.empty():
                pid, job_id = gen.started.get()
                running[pid] = job_id
        except (OSError, EOFError, queue.Empty):  # a process died mid-write
            pass
        processes = dict(getattr(gen.executor, "_processes", None) or {})
        dead: dict[int, int] = {}
        deadline = time.monotonic() + 2.0
        while processes and not dead and time.monotonic() < deadline:
            # a process that aborts is reaped a moment after its pipe closes
            dead = {pid: p.exitcode for pid, p in processes.items()
                    if p.exitcode is not None and p.exitcode != -signal.SIGTERM}
            if not dead:
                time.sleep(0.01)
        culprits: dict[int, int | None] = {running[pid]: code for pid, code in dead.items()
                                           if pid in running}
        unfinished = [j for j in gen.jobs.values() if not j.out.done()]
        default_status = exit_status(next(iter(dead.values()), None))
        if not culprits:  # nobody to blame exactly: everyone that was running
            culprits = {job_id: None for job_id in running.values()}
        gen.executor.shutdown(wait=False, cancel_futures=True)
        self.rebuilds += 1
        self._gen = self._new_generation(gen.number + 1)
        for job in sorted(unfinished, key=lambda j: j.id):
            if job.id in culprits:
                job.crashes += 1
                code = culprits[job.id]
                status = exit_status(code) if code is not None else default_status
                log.warning("a compile process died (%s) while running job %d (%d of %d)",
                            status, job.id, job.crashes, self.crash_limit)
                if job.crashes >= self.crash_limit:
                    job.out.set_exception(JobCrashed(status, job.crashes))
                    continue
            self._launch(job)

    def close(self, *, now: bool = False) -> None:
        """Stop the processes (``now``: busy ones too, unwaited: an interrupted caller).

        Idle ones (every job answered: the end of a batch) hold nothing to flush, so
        they are sent SIGTERM and not waited for: a process's exit includes the driver's
        teardown of its GPU contexts, which NVIDIA's kernel driver runs one process at a
        time (about 2 s for 16 processes on an H200, two contexts each). Nothing the
        caller needs waits on that; a daemon thread reaps them, and a caller that exits
        first leaves them to init. A pool with jobs still running is shut down and
        waited for, as before.
        """
        with self._lock:
            self._closed = True
            gen = self._gen
            idle = gen is not None and all(j.out.done() for j in gen.jobs.values())
        if gen is None:
            return
        if now:  # the executor sees them die and ends its jobs: nothing waits at exit
            for process in list((getattr(gen.executor, "_processes", None) or {}).values()):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    process.terminate()
        elif idle:
            _stop_without_waiting(gen.executor)
        gen.executor.shutdown(wait=not now, cancel_futures=True)


def _stop_without_waiting(executor: ProcessPoolExecutor) -> None:
    """SIGTERM ``executor``'s idle processes and hand their reaping to a daemon thread.

    Both waits that would follow are on private tables: the executor joins the processes
    in its ``_processes`` at shutdown, and ``multiprocessing`` joins every process in
    ``multiprocessing.process._children`` at interpreter exit. Taking them out of both
    (before the signal, so the executor's thread never sees them die) leaves the waiting
    to :func:`_reap`. Where a Python keeps these tables otherwise, the processes are
    only terminated, and shutdown waits for them.
    """
    table = getattr(executor, "_processes", None)
    children = getattr(multiprocessing.process, "_children", None)
    if not isinstance(table, dict):
        return
    processes = list(table.values())
    detach = isinstance(children, set)
    if detach:
        table.clear()
        for process in processes:
            children.discard(process)  # type: ignore[union-attr]
    for process in processes:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            process.terminate()
    if detach and processes:
        threading.Thread(target=_reap, args=(processes,), name="pool-reaper",
                         daemon=True).start()


def _reap(processes: list[Any]) -> None:
    for process in processes:
        with contextlib.suppress(OSError, ValueError, AssertionError, AttributeError):
            process.join()
