"""Compilers: where ``finalize`` runs. The batch only sees the :class:`Compiler` seam.

* :class:`ProcessPoolCompiler` — the embedded default: a pool of *spawned* processes,
  each of which opens its OpenCL context once, in its initializer, and keeps it. Spawn,
  never fork: OpenCL state must not cross a fork, and the parent may already hold a
  context (it loads what the pool compiles).
  A process that dies while compiling (a compiler abort, an out-of-memory kill) fails
  only the kernel it held, with kind ``crashed`` after ``crash_limit`` deaths; the pool
  is rebuilt and the rest of the batch goes on (:mod:`farm.compilation.pool`).
* :class:`InlineCompiler` — compile in the calling thread (``--workers 0``, tests). A
  compiler that aborts takes the calling process with it: see docs/RELIABILITY.md.
* The cluster's Celery compiler implements the same protocol in ``worker/``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal, Protocol

from farm.compilation.finalize import FinalizeResult, finalize_and_validate
from farm.compilation.pool import CrashSafePool, JobCrashed
from farm.core.device import DeviceInfo, open_device
from farm.core.model import Lowered

if TYPE_CHECKING:
    import pyopencl as cl


#: a job a pool process runs with its own context: ``fn(ctx, device, native, arg)`` returns
#: a :class:`FinalizeResult` as JSON (kernels of other kinds than families: farm.programs)
PoolJob = Callable[[Any, Any, bool, str], str]


class Compiler(Protocol):
    """Runs ``finalize`` somewhere and validates the binary by loading it there;
    ``parallelism`` is how many compile at once."""

    parallelism: int

    def submit(self, lowered: Lowered) -> Future[FinalizeResult]: ...

    def close(self) -> None: ...


class InlineCompiler:
    """Compiles synchronously with a context the caller owns."""

    parallelism = 1

    def __init__(self, ctx: cl.Context, device: cl.Device, native: bool = True, *,
                 ready: bool = True) -> None:
        self._ctx = ctx
        self._device = device
        self._linker: Literal["auto"] | None = "auto" if native else None
        self._ready = ready

    def submit(self, lowered: Lowered) -> Future[FinalizeResult]:
        fut: Future[FinalizeResult] = Future()
        try:
            fut.set_result(finalize_and_validate(self._ctx, self._device, lowered,
                                                 self._linker, self._ready))
        except Exception as exc:  # pragma: no cover - finalize returns errors as values
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        pass


# Per-process state of a pool process: its one context, made once by the initializer,
# whether it stores native code, and whether it makes PoCL binaries ready.
_POOL_DEVICE: tuple[Any, Any, bool, bool] | None = None


def _pool_init(device_json: str, env: dict[str, str], native: bool = True,
               ready: bool = True) -> None:
    global _POOL_DEVICE
    os.environ.update(env)
    info = DeviceInfo.model_validate_json(device_json)
    _POOL_DEVICE = (*open_device(info), native, ready)


def _pool_finalize(lowered_json: str) -> str:
    assert _POOL_DEVICE is not None, "pool process was not initialised"
    ctx, dev, native, ready = _POOL_DEVICE
    lowered = Lowered.model_validate_json(lowered_json)
    return finalize_and_validate(ctx, dev, lowered, "auto" if native else None,
                                 ready).model_dump_json()


def _pool_job(job: tuple[PoolJob, str]) -> str:
    assert _POOL_DEVICE is not None, "pool process was not initialised"
    ctx, dev, native, _ = _POOL_DEVICE
    fn, arg = job
    return fn(ctx, dev, native, arg)


class ProcessPoolCompiler:
    """``workers`` spawned processes, one OpenCL context each, made at start."""

    def __init__(self, device: DeviceInfo, workers: int, native: bool = True,
                 crash_limit: int = 2, *, ready: bool = True) -> None:
        self.parallelism = max(1, workers)
        # Driver cache switches must reach the children before their drivers start.
        env = {k: v for k, v in os.environ.items()
               if k.startswith(("POCL_", "PYOPENCL_", "CUDA_"))}
        self._pool = CrashSafePool(self.parallelism, initializer=_pool_init,
                                   initargs=(device.model_dump_json(), env, native, ready),
                                   crash_limit=crash_limit)

    def submit(self, lowered: Lowered) -> Future[FinalizeResult]:
        return self._wrap(self._pool.submit(_pool_finalize, lowered.model_dump_json()))

    def submit_job(self, fn: PoolJob, arg: str) -> Future[FinalizeResult]:
        """Run ``fn(ctx, device, native, arg)`` in a pool process (a top-level function:
        it crosses to a spawned process by name)."""
        return self._wrap(self._pool.submit(_pool_job, (fn, arg)))

    @staticmethod
    def _wrap(raw: Future[object]) -> Future[FinalizeResult]:
        out: Future[FinalizeResult] = Future()

        def _done(f: Future[object]) -> None:
            if f.cancelled():  # the pool was closed with it still queued
                out.cancel()
                return
            exc = f.exception()
            if isinstance(exc, JobCrashed):
                out.set_result(FinalizeResult(error=str(exc), error_kind="crashed"))
            elif exc is not None:
                out.set_result(FinalizeResult(error=f"compile process failed: {exc}"))
            else:
                out.set_result(FinalizeResult.model_validate_json(str(f.result())))

        raw.add_done_callback(_done)
        return out

    def close(self, *, now: bool = False) -> None:
        """Stop the pool; ``now``: its processes too, whatever they are compiling (the
        caller was interrupted: nothing they make would be kept)."""
        self._pool.close(now=now)
