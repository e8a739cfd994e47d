"""The compile task, registered on the Celery app of :mod:`farm.cluster.celery_app`.

The app itself (its settings and why) lives in the core, so that clients reach it
without importing the worker.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Celery, Task

from farm.cluster.metrics import outcome_label
from farm.core.keys import TASK_NAME

if TYPE_CHECKING:
    from celery.worker.request import Request

    from worker.state import WorkerState

log = logging.getLogger(__name__)



def register_tasks(app: Celery, get_state: Callable[[], WorkerState],
                   request_cls: type[Request] | None = None) -> None:
    """Register the compile task; ``get_state()`` gives the process's ``WorkerState``;
    ``request_cls`` is the worker's Celery ``Request`` (crash bookkeeping).

    Each chunk is counted in the worker's metrics (``farm.cluster.metrics``) and logged as one
    line of counts: Celery's own "succeeded" line, which carries the whole reply, is
    kept at DEBUG (see ``worker.startup``).
    """
    from celery.exceptions import SoftTimeLimitExceeded

    from farm.cluster.metrics import worker_metrics
    from farm.cluster.payloads import parse_request
    from worker.execute import execute_job

    transient: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)

    options = {"Request": request_cls} if request_cls is not None else {}

    @app.task(name=TASK_NAME, bind=True, max_retries=5, acks_late=True, **options)
    def compile_task(self: Task, payload: dict[str, Any]) -> dict[str, Any]:
        request = parse_request(payload)  # a bad payload: one line back to the client
        metrics = worker_metrics()
        try:
            reply = execute_job(request, get_state(), task_id=self.request.id)
        except SoftTimeLimitExceeded:
            metrics.timed_out(request.fingerprint, len(request.kernels))
            raise
        except transient as exc:  # store or broker hiccup: retry, never for a bad kernel
            metrics.task(request.fingerprint, "retry")
            raise self.retry(exc=exc, countdown=min(2 ** self.request.retries, 30)) from exc
        except BaseException:
            metrics.task(request.fingerprint, "failure")
            raise
        metrics.task(request.fingerprint, "success")
        metrics.reply(request.fingerprint, reply)
        counts = Counter(outcome_label(k.outcome, k.failure.kind if k.failure else None)
                         for k in reply.results)
        log.info("chunk %s: %s", self.request.id,
                 ", ".join(f"{n} {what}" for what, n in sorted(counts.items())))
        return reply.model_dump(mode="json")
