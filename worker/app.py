"""The compile task, registered on the Celery app of :mod:`farm.cluster.celery_app`.

The app itself (its settings and why) lives in ``farm/cluster/celery_app.py``, the
cluster's side that clients and workers share, so that a client reaches it without
importing the worker.

What a chunk becomes (docs/RELIABILITY.md): built, its kernels' own failures in the
reply; dropped, when its client is gone; or given back to its queue (Celery's ``Reject``
with requeue, at the back of the queue, for any worker of the pool) when this worker
cannot build it for reasons that are not its kernels' (``InfrastructureError``: the
store, Redis, this process's own state). See :mod:`worker.chunks`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Celery, Task

from farm.core.keys import TASK_NAME, TUNE_TASK_NAME
from farm.core.outcomes import fate_of
from worker.chunks import Delivery
from worker.hooks.base import Chunk, Hook, Hooks, request_class

if TYPE_CHECKING:
    from farm.cluster.payloads import CompileReply
    from worker.state import WorkerState

log = logging.getLogger(__name__)

#: what a task may raise that is the farm's trouble, never its kernels'
_TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)


def register_tasks(app: Celery, get_state: Callable[[], WorkerState],
                   hooks: Hook | None = None, worker_field: str = "") -> None:
    """Register the compile task; ``get_state()`` gives the process's ``WorkerState``
    (or raises ``WorkerUnavailable``); ``hooks`` hear what becomes of each chunk, here
    and, through the worker's Celery ``Request``, in the main process (``worker.hooks``:
    crash bookkeeping, returns, metrics, readiness); ``worker_field`` is this worker's
    ``host:pid``.

    Each chunk is logged as one line of counts: Celery's own "succeeded" line, which
    carries the whole reply, is kept at DEBUG (see ``worker.process``).
    """
    from celery.exceptions import Reject, SoftTimeLimitExceeded

    from farm.cluster.payloads import parse_request
    from farm.core.errors import InfrastructureError, one_line
    from farm.programs.request import ChunkRequest
    from worker.chunks import Avoided
    from worker.execute import execute_job

    hooks = hooks or Hooks()
    options = {"Request": request_class(hooks)}
    farms: tuple[type[BaseException], ...] = (InfrastructureError, *_TRANSIENT)

    # store_errors_even_if_ignored: a client sends its chunks with ignore_result (their
    # replies come on its build's reply stream), but a chunk that fails (its payload, a
    # time limit) still leaves its failure where the client looks for it
    @app.task(name=TASK_NAME, bind=True, acks_late=True, store_errors_even_if_ignored=True,
              **options)
    def compile_task(self: Task, payload: dict[str, Any]) -> dict[str, Any] | None:
        # a bad payload: one line back to the client
        request = parse_request(payload, ChunkRequest)
        task_id = self.request.id
        chunk = Chunk(request, Delivery(
            task_id=task_id, build=request.build, worker=worker_field,
            redelivered=bool((self.request.delivery_info or {}).get("redelivered"))))
        try:
            state = get_state()
            hooks.before_chunk(chunk, state)
            reply = execute_job(request, state, delivery=chunk.delivery)
        except Avoided as exc:
            hooks.after_chunk_given_back(chunk, None)
            log.info("chunk %s goes back to its queue: %s", task_id, exc)
            raise Reject("avoided by its client", requeue=True) from None
        except SoftTimeLimitExceeded:
            hooks.after_chunk_failed(chunk, "timeout")
            raise
        except farms as exc:  # the farm's trouble, not the kernels'
            reason = f"{type(exc).__name__}: {one_line(exc)}"
            hooks.after_chunk_given_back(chunk, reason)
            log.warning("chunk %s goes back to its queue: %s", task_id, reason)
            raise Reject(reason, requeue=True) from None
        except BaseException:
            hooks.after_chunk_failed(chunk, "failure")
            raise
        hooks.after_chunk(chunk, reply)
        if not reply.dropped:
            counts = Counter(fate_of(k.outcome, k.failure.kind if k.failure else None)
                             for k in reply.results)
            log.info("chunk %s: %s", task_id,
                     ", ".join(f"{n} {what}" for what, n in sorted(counts.items())))
        return _answer(self, chunk.delivery, reply)

    register_tune_task(app, get_state, farms, options)


def register_tune_task(app: Celery, get_state: Callable[[], WorkerState],
                       farms: tuple[type[BaseException], ...],
                       options: dict[str, Any]) -> None:
    """The tuning task (``farm.tune``, :mod:`worker.tune`): one key, measured here. The
    farm's own trouble gives the key back to its queue, like a chunk's."""
    from celery.exceptions import Reject

    from farm.core.errors import one_line
    from farm.tuning.payloads import parse_tune_request
    from worker.tune import tune_job

    @app.task(name=TUNE_TASK_NAME, bind=True, acks_late=True, **options)
    def tune_task(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
        request = parse_tune_request(payload)  # a bad payload: one line back to the client
        try:
            reply = tune_job(request, get_state(), task_id=self.request.id)
        except farms as exc:  # the farm's trouble, not the key's
            reason = f"{type(exc).__name__}: {one_line(exc)}"
            log.warning("tuning task %s goes back to its queue: %s", self.request.id, reason)
            raise Reject(reason, requeue=True) from None
        result = reply.result
        log.info("tuning task %s: %s %s", self.request.id, request.spec.family,
                 "reused" if reply.reused else
                 f"failed ({reply.failure})" if result is None else
                 f"measured, winner {result.winner}")
        return reply.model_dump(mode="json")


def _answer(task: Task, delivery: Delivery, reply: CompileReply) -> dict[str, Any] | None:
    """The task's result: nothing when the reply reached the build's reply stream; else
    the reply (a client before reply streams, or one whose stream Redis lost), stored
    as the task's result even though the client asked for none, for it to find."""
    if delivery.pushed:
        return None
    result = reply.model_dump(mode="json")
    if getattr(task.request, "ignore_result", False):
        task.backend.store_result(delivery.task_id, result, "SUCCESS", request=task.request)
    return result
