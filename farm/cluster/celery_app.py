"""The Celery application: JSON only, late acknowledgement, one queue per fingerprint.

In the core (not in ``worker/``) because both sides need it: a build client or a
loader sends tasks with it, a worker registers its task on it; neither should import
the other.

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
* socket timeouts (``FARM_SOCKET_TIMEOUT``) on the broker's and the result backend's
  connections, and health-check pings: kombu's and redis-py's defaults wait for ever on
  a frozen Redis (SIGSTOP, a dead network path), which no outage limit can then bound.
* ``broker_transport``: kombu's Redis transport whose acknowledgement frees the worker's
  prefetch place even when Redis fails (:mod:`farm.cluster.broker`); kombu's own never
  frees it then, and the worker stops taking work for good.
* the result backend's own retries (``result_backend_always_retry``) wait out a short
  outage, but are bounded to about the outage limit: past it the worker stops anyway
  (``worker.stopping``), and each retry logged a traceback.

A client's app (``client=True``, :class:`farm.cluster.client.ClusterClient`) sends its
chunks with ``ignore_result``: their replies come on the build's reply stream
(:mod:`farm.cluster.gather`), and it reads the results Celery still stores (failures)
itself. Its result backend does not retry a lost connection itself (``retry_policy`` of
no retries) and gives up a silent socket after ``FARM_SOCKET_TIMEOUT``: the client's own
outage waiter retries, says once what it waits for, and gives up at
``FARM_OUTAGE_LIMIT`` with one line.
"""

from __future__ import annotations

import logging

from celery import Celery

from farm.cluster.broker import TRANSPORT
from farm.core.errors import SettingsError
from farm.core.keys import DEFAULT_QUEUE
from farm.core.settings import Settings


def make_app(settings: Settings, *, client: bool = False) -> Celery:
    """A Celery app configured from ``settings``: a worker's, or a client's (``client``)."""
    if not settings.redis_url:
        raise SettingsError("setting FARM_REDIS_URL: the cluster needs a Redis URL")
    if settings.visibility_timeout <= settings.compile_hard_time_limit:
        raise SettingsError("setting FARM_VISIBILITY_TIMEOUT: must exceed "
                            "FARM_COMPILE_HARD_TIME_LIMIT, or running tasks are re-delivered")
    app = Celery("kernel_farm", broker=settings.redis_url, backend=settings.redis_url,
                 set_as_current=False)
    timeout = settings.socket_timeout
    transport = {"visibility_timeout": settings.visibility_timeout,
                 "socket_timeout": timeout, "socket_connect_timeout": min(timeout, 3.0),
                 "health_check_interval": max(1, int(timeout))}
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
        broker_transport=TRANSPORT,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        redis_socket_timeout=timeout,
        redis_socket_connect_timeout=min(timeout, 3.0),
        redis_backend_health_check_interval=max(1, int(timeout)),
        broker_connection_timeout=min(timeout, 3.0),
        result_expires=24 * 3600,
        broker_connection_retry_on_startup=True,
        # A Redis outage is waited out, not turned into a lost result (RELIABILITY.md):
        # Celery sleeps a random 0 to 1 s (full jitter) between retries once past its
        # first few, so 3 retries a second of the limit last about 1.5 times the limit
        # (the worker itself stops at the limit: worker.stopping).
        result_backend_always_retry=True,
        result_backend_max_retries=3 * int(settings.outage_limit) + 10,
        result_backend_max_sleep_between_retries_ms=1000,
        # A compile under way when the broker connection drops finishes (its result
        # waits out the outage; a duplicate delivery is harmless: first writer wins),
        # as Celery 5 does by default; said explicitly to keep Celery 6's change away.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=settings.worker_events,
        task_send_sent_event=settings.worker_events,
        task_default_queue=DEFAULT_QUEUE,
        enable_utc=True,
    )
    if client:
        app.conf.update(
            result_backend_transport_options={**transport, "retry_policy": {"max_retries": 0}},
        )
        _quiet_result_reconnects()
    return app


class _ReconnectNoise(logging.Filter):
    """Drops the result backend's "retry limit exceeded" line: in a client, the outage
    waiter reports the outage (and its end) instead, and the app is made again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Retry limit exceeded while trying to reconnect" not in str(record.msg)


_RECONNECT_NOISE = _ReconnectNoise()


def _quiet_result_reconnects() -> None:
    logging.getLogger("celery.backends.asynchronous").addFilter(_RECONNECT_NOISE)  # once

