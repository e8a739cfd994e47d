"""The crash-safe process pool: a job that kills its process fails alone, the rest go on."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time

import pytest

from farm.compilation.pool import CrashSafePool, JobCrashed, exit_status


def work(arg: str) -> str:
    """A job: ``abort``/``kill`` kill the process, anything else is echoed (slowly)."""
    if arg in ("abort", "kill"):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if arg == "abort":
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return f"done {arg}"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_that_kills_its_process_fails_alone_and_the_rest_go_on(workers: int) -> None:
    pool = CrashSafePool(workers, crash_limit=2)
    try:
        args = ["a", "b", "abort", "c", "d", "kill", "e"]
        futures = [pool.submit(work, a) for a in args]
        results = {}
        for arg, fut in zip(args, futures, strict=True):
            try:
                results[arg] = fut.result(timeout=120)
            except JobCrashed as exc:
                results[arg] = exc
        for arg in ("a", "b", "c", "d", "e"):
            assert results[arg] == f"done {arg}"
        aborted, killed = results["abort"], results["kill"]
        assert isinstance(aborted, JobCrashed) and "SIGABRT" in aborted.status
        assert isinstance(killed, JobCrashed) and "SIGKILL" in killed.status
        assert aborted.times == 2 and killed.times == 2
        assert pool.rebuilds == 4  # two deaths per bad job, none for the others
        assert pool.submit(work, "after").result(timeout=60) == "done after"
    finally:
        pool.close()


def test_exit_status_reads_like_celery() -> None:
    assert exit_status(-6) == "signal 6 (SIGABRT)"
    assert exit_status(3) == "exit code 3"


def slow_to_exit(arg: str) -> int:
    """A job that leaves its process a 20 s exit (as a driver's teardown can take)."""
    from multiprocessing import util

    util.Finalize(None, time.sleep, args=(20,), exitpriority=100)
    return os.getpid()


def test_closing_an_idle_pool_stops_its_processes_without_waiting_for_their_exit() -> None:
    pool = CrashSafePool(2, crash_limit=2)
    pids = {pool.submit(slow_to_exit, str(i)).result(timeout=60) for i in range(4)}
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 10, "close waited for the processes' own exit"
    assert not multiprocessing.active_children(), "interpreter exit would wait for them"
    deadline = time.monotonic() + 15
    for pid in pids:  # terminated and reaped (by the pool's reaper thread), not left behind
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_closing_a_busy_pool_waits_for_its_jobs_processes() -> None:
    pool = CrashSafePool(1, crash_limit=2)
    running = pool.submit(work, "slow")
    pool.close()  # a job in flight: shut down and waited for, never left running
    assert running.done()
    assert not multiprocessing.active_children()
