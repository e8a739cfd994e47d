"""What a worker hook is: the events of a worker's life, each a no-op unless a hook
overrides it (dramatiq's ``Middleware`` is the model), and the dispatcher that sends one
event to every hook registered (:mod:`worker.hooks`).

Main process: ``before_worker_boot`` (configure, before Celery starts and before
anything imports prometheus-client), ``after_worker_boot`` (start what runs beside
Celery), ``after_worker_ready`` (the consumer is up), ``after_heartbeat``,
``after_task_received``, and what became of each task it handed a pool process
(``after_task_done``, ``after_task_given_back``, ``after_task_died``: from the worker's
Celery ``Request``, :func:`request_class`), then ``before_worker_shutdown`` and
``after_worker_shutdown``.

Pool process: ``after_process_boot`` (its state opened, or why not), then per chunk
``before_chunk`` and one of ``after_chunk``, ``after_chunk_given_back`` (``reason``
``None``: avoided by its client) and ``after_chunk_failed`` (``timeout`` or
``failure``). The obtain itself is :func:`worker.execute.execute_job`, the one seam: the
hooks run around it, never inside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.core.settings import Settings
from worker.chunks import Delivery

if TYPE_CHECKING:
    import redis
    from celery import Celery
    from celery.worker.consumer import Consumer
    from celery.worker.request import Request

    from farm.cluster.payloads import CompileReply
    from farm.programs.request import ChunkRequest
    from worker.state import WorkerState


@dataclass
class Boot:
    """What a worker's main process made before Celery starts, for its hooks (a pool
    process inherits it through the fork)."""

    settings: Settings
    app: Celery
    fingerprint: str
    queues: list[str]
    processes: int
    #: the main process's Redis client
    client: redis.Redis
    #: the worker's own folder: its pool processes' reports and kernels in hand
    folder: Path
    #: this worker's ``host:pid``, as the registry and the task holder notes name it
    worker_field: str
    #: the port of ``/metrics`` (0: none)
    metrics_port: int = 0
    #: Celery's own heartbeat runs (else the farm's heartbeat thread is the beat)
    heartbeat: bool = True
    #: (consuming, why not) for the heartbeat's registration (the readiness hook's)
    status_of: Callable[[], tuple[bool, str]] = field(default=lambda: (True, ""))


@dataclass
class Chunk:
    """One delivery of one chunk, as the pool process's hooks see it."""

    request: ChunkRequest
    delivery: Delivery


class Hook:
    """A worker's cross-cutting concern (see the module docstring for the events)."""

    # -- main process ------------------------------------------------------------------
    def before_worker_boot(self, boot: Boot) -> None:
        """Configure, before Celery starts (and before prometheus-client is imported)."""

    def after_worker_boot(self, boot: Boot) -> None:
        """Start what runs beside Celery."""

    def after_worker_ready(self, consumer: Consumer) -> None:
        """Celery's consumer is up (``worker_ready``)."""

    def after_heartbeat(self) -> None:
        """The worker beat (Celery's heartbeat, else the farm's registry beat)."""

    def after_task_received(self, request: Request) -> None:
        """The main process accepted a task message (before a pool process runs it)."""

    def after_task_done(self, request: Request) -> None:
        """A pool process returned a task's result (whatever its kernels' fates)."""

    def after_task_given_back(self, request: Request, reason: str) -> None:
        """A pool process gave a task back to its queue (``Reject`` with requeue)."""

    def after_task_died(self, request: Request, status: str) -> None:
        """The pool process running a task died (``status``: its exit, as Celery says
        it); Celery puts the task back on its queue after the hooks."""

    def before_worker_shutdown(self) -> None:
        """Celery is shutting down (``worker_shutting_down``)."""

    def after_worker_shutdown(self) -> None:
        """Celery stopped, or the worker stops at once (``worker.stopping``): clean up."""

    # -- pool process -------------------------------------------------------------------
    def after_process_boot(self, index: int, state: WorkerState | None,
                           problem: str | None) -> None:
        """A pool process opened its state (``problem`` ``None``), or could not."""

    def before_chunk(self, chunk: Chunk, state: WorkerState) -> None:
        """A chunk is about to be obtained (``execute_job``)."""

    def after_chunk(self, chunk: Chunk, reply: CompileReply) -> None:
        """A chunk was built (or dropped: ``reply.dropped``)."""

    def after_chunk_given_back(self, chunk: Chunk, reason: str | None) -> None:
        """A chunk goes back to its queue: the farm's trouble (``reason``), or its client
        shut this worker out (``None``: avoided, uncounted)."""

    def after_chunk_failed(self, chunk: Chunk, why: str) -> None:
        """A chunk's task raised: ``timeout`` (the soft time limit) or ``failure``."""


#: every event a hook may handle
EVENTS = tuple(name for name in vars(Hook) if not name.startswith("_"))


class Hooks(Hook):
    """Several hooks as one: each event goes to every hook, in the order registered."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = tuple(hooks)


def _fan_out(event: str) -> Callable[..., None]:
    def emit(self: Hooks, *args: object) -> None:
        for hook in self.hooks:
            getattr(hook, event)(*args)

    emit.__name__ = event
    return emit


for _event in EVENTS:
    setattr(Hooks, _event, _fan_out(_event))


def request_class(hooks: Hook) -> type[Request]:
    """The worker's Celery ``Request``: what became of each task it handed a pool process
    goes to ``hooks`` (done, given back, or its process died)."""
    from celery.exceptions import Reject
    from celery.worker.request import Request

    from worker.crashes import lost_status

    class HookedRequest(Request):
        def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
            failed, _, _ = failed__retval__runtime
            if not failed:
                hooks.after_task_done(self)
            return super().on_success(failed__retval__runtime, **kwargs)

        def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                       return_ok: bool = False) -> Any:
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
            if isinstance(exc, Reject):  # a chunk given back (worker.app): no crash
                hooks.after_task_given_back(self, str(exc.reason))
            else:
                if isinstance(exc, SystemExit | KeyboardInterrupt):
                    status: str | None = None if (self._already_cancelled
                                                  or self._already_revoked) else "exited"
                else:
                    status = lost_status(exc) if exc is not None else None
                if status is not None:
                    hooks.after_task_died(self, status)
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)

    return HookedRequest
