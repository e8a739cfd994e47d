"""The Celery application: JSON only, late acknowledgement, one queue per fingerprint.

Why these settings:

* ``accept_content=["json"]``: a task is data (family names and parameters), never
  pickled objects, so a message cannot carry code to the workers.
* ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged only once it
  finished, so a worker that dies mid-build gives its tasks back.
* ``worker_prefetch_multiplier=1``: a worker holds one task per process, so a dead worker
  strands little work and idle workers are not starved by a busy one's prefetch.
* soft/hard time limits: a hung driver cannot stall a build; a task over its hard limit
  fails (its kernels are reported failed) instead of being re-queued forever.
* ``worker_send_task_events`` / ``task_send_sent_event`` (``FARM_WORKER_EVENTS``, on by
  default): Flower and ``celery events`` see every task; ``celery control
  enable_events`` works. A chunk is tens of milliseconds to seconds of work, so a few
  small event messages per chunk cost nothing that shows.
* ``visibility_timeout``: with Redis as broker, a message taken by a worker whose main
  process is killed comes back only after this timeout, so it is a setting, chosen
  longer than the hard time limit (see ``Settings``), not an inherited default.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from celery import Celery

from farm.errors import SettingsError
from farm.metrics import outcome_label
from farm.payloads import TASK_NAME
from farm.settings import Settings

log = logging.getLogger(__name__)


def make_app(settings: Settings) -> Celery:
    """A Celery app configured from ``settings`` (used by workers and build clients)."""
    if not settings.redis_url:
        raise SettingsError("setting FARM_REDIS_URL: the cluster needs a Redis URL")
    if settings.visibility_timeout <= settings.compile_hard_time_limit:
        raise SettingsError("setting FARM_VISIBILITY_TIMEOUT: must exceed "
                            "FARM_COMPILE_HARD_TIME_LIMIT, or running tasks are re-delivered")
    app = Celery("kernel_farm", broker=settings.redis_url, backend=settings.redis_url,
                 set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=settings.compile_soft_time_limit,
        task_time_limit=settings.compile_hard_time_limit,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout},
        result_expires=24 * 3600,
        broker_connection_retry_on_startup=True,
        # A Redis outage is waited out, not turned into a lost result (RELIABILITY.md).
        result_backend_always_retry=True,
        result_backend_max_retries=int(settings.outage_limit) + 10,
        result_backend_max_sleep_between_retries_ms=2000,
        worker_hijack_root_logger=False,
        worker_send_task_events=settings.worker_events,
        task_send_sent_event=settings.worker_events,
        task_default_queue="farm.default",
        enable_utc=True,
    )
    return app


def register_tasks(app: Celery, get_state: Any, request_cls: Any = None) -> None:
    """Register the compile task; ``get_state()`` gives the process's ``WorkerState``;
    ``request_cls`` is the worker's Celery ``Request`` (crash bookkeeping).

    Each chunk is counted in the worker's metrics (``farm.metrics``) and logged as one
    line of counts: Celery's own "succeeded" line, which carries the whole reply, is
    kept at DEBUG (see ``worker.startup``).
    """
    from celery.exceptions import SoftTimeLimitExceeded

    from farm.metrics import worker_metrics
    from farm.payloads import parse_request
    from worker.execute import execute_job

    transient: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)

    options = {"Request": request_cls} if request_cls is not None else {}

    @app.task(name=TASK_NAME, bind=True, max_retries=5, acks_late=True, **options)
    def compile_task(self: Any, payload: dict[str, Any]) -> dict[str, Any]:
        request = parse_request(payload)  # a bad payload: one line back to the client
        metrics = worker_metrics()
        try:
            reply = execute_job(request, get_state(), task_id=self.request.id)
        except SoftTimeLimitExceeded:
            metrics.task(request.fingerprint, "failure")
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
