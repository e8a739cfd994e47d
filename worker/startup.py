"""Starting a worker: find devices without touching OpenCL here, then fork the pool.

OpenCL state never crosses a fork (NVIDIA's OpenCL runs on CUDA, which forbids it), so
the main process learns its devices and fingerprints from a short-lived child
(``farm.core.device.discover_devices``) and only the pool processes create contexts, once
each, in ``worker_process_init``.

Faults (docs/RELIABILITY.md): the consumer refuses malformed messages
(``worker.poison``), the task's ``Request`` books crashes of pool processes
(``worker.crashes``), the main process says which worker holds each task it receives
(so a client can re-send the chunks of a worker that died), and a Redis outage at start
or longer than ``FARM_OUTAGE_LIMIT`` later stops the worker with one line and exit 1.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.cluster.celery_app import make_app
from farm.cluster.workers import Heartbeat, WorkerInfo
from farm.compilation.backend import discover
from farm.core.device import DeviceInfo, resolve_fingerprint
from farm.core.errors import DeviceError
from farm.core.keys import TASK_STATE_TTL_S, queue_name, task_holder_key
from farm.core.outage import OutageError, redis_waiter
from farm.core.settings import Settings
from farm.version import __version__
from worker.app import register_tasks
from worker.crashes import crash_request_class
from worker.state import WorkerState, open_state

if TYPE_CHECKING:
    from celery.worker import WorkController
    from celery.worker.request import Request

    from farm.cluster.metrics import Served

log = logging.getLogger(__name__)


def pick_devices(devices: list[DeviceInfo], fingerprint: str | None) -> list[DeviceInfo]:
    """The devices of one fingerprint (given whole or by a unique prefix, or the first
    device's)."""
    if not devices:
        raise DeviceError("no OpenCL device found: a worker needs one")
    wanted = resolve_fingerprint(fingerprint, (d.fingerprint for d in devices)) \
        if fingerprint else devices[0].fingerprint
    chosen = [d for d in devices if d.fingerprint == wanted]
    if not chosen:
        known = ", ".join(sorted({d.fingerprint for d in devices}))
        raise DeviceError(f"no device here has fingerprint {wanted}; devices here: {known}")
    return chosen


def _pool_pids(controller: WorkController) -> list[int]:
    """The pids of a Celery worker's pool processes (prefork's ``pool.info``, what
    `celery inspect stats` reports); none before the pool starts, or for a solo pool."""
    try:
        return [int(pid) for pid in controller.pool.info.get("processes", [])]
    except Exception:  # no pool yet, or one being restarted: the next beat has it
        return []


class _QuietSuccess(logging.Filter):
    """Celery logs every task's full return value at INFO ("succeeded in ...: {...}"):
    a chunk's reply is kilobytes of JSON. Keep that line for DEBUG; the compile task
    logs a one-line count per chunk instead (``worker.app``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from celery.app.trace import LOG_SUCCESS

        if record.msg == LOG_SUCCESS:
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def celery_argv(*, concurrency: int, queues: list[str], loglevel: str, hostname: str,
                events: bool, heartbeat: bool, extra: list[str] | None = None) -> list[str]:
    """The ``celery worker`` command line; ``extra`` (from ``farm worker -- ...``) last,
    so an operator's option wins over ours."""
    argv = ["worker", "--pool=prefork", f"--concurrency={concurrency}",
            f"--queues={','.join(queues)}", f"--loglevel={loglevel}",
            f"--hostname={hostname}", "--without-gossip", "--without-mingle"]
    if events:
        argv.append("--task-events")
    if not heartbeat:
        argv.append("--without-heartbeat")
    return [*argv, *(extra or [])]


@dataclass(frozen=True)
class WorkerOptions:
    """``farm worker``'s options. ``fingerprint`` defaults to the first device's,
    ``queues`` to the fingerprint's; ``events``, ``heartbeat`` and ``metrics_port`` to the
    settings (FARM_WORKER_EVENTS, FARM_WORKER_HEARTBEAT, FARM_METRICS_PORT);
    ``extra_args`` go to ``celery worker`` unchanged."""

    concurrency: int
    fingerprint: str | None = None
    queues: list[str] | None = None
    loglevel: str = "INFO"
    events: bool | None = None
    heartbeat: bool | None = None
    metrics_port: int | None = None
    extra_args: list[str] | None = None


def run_worker(settings: Settings, options: WorkerOptions) -> None:
    """Run a Celery worker for one fingerprint until it is stopped."""
    import tempfile

    port = options.metrics_port if options.metrics_port is not None else settings.metrics_port
    metrics_dir = Path(tempfile.gettempdir()) / f"farm-metrics-{os.getpid()}"
    if port:
        # Before anything imports prometheus-client: the pool's processes inherit it.
        from farm.cluster.metrics import prepare_multiprocess

        prepare_multiprocess(metrics_dir)

    import redis
    from celery import signals

    from farm.cluster.health import HealthFiles

    events = settings.worker_events if options.events is None else options.events
    heartbeat = settings.worker_heartbeat if options.heartbeat is None else options.heartbeat
    devices = pick_devices(discover(settings), options.fingerprint)
    fp = devices[0].fingerprint
    queue_list = options.queues or [queue_name(fp)]
    app = make_app(settings.model_copy(update={"worker_events": events}))
    holder: dict[str, WorkerState] = {}
    health = HealthFiles(settings.health_dir) if settings.health_dir else None
    if health is not None:
        health.reset()

    def get_state() -> WorkerState:
        return holder["state"]

    served: list[Served] = []

    def init_process(**_: object) -> None:
        from billiard import current_process

        for listener in served:  # forked with the metrics socket: not this process's
            listener.close_inherited()
        logging.getLogger("celery.app.trace").addFilter(_QuietSuccess())
        index = getattr(current_process(), "index", 0) or 0
        holder["state"] = open_state(settings, devices, index)
        log.info("process %s opened %s", os.getpid(), holder["state"].device.fingerprint)

    def close_process(**_: object) -> None:
        state = holder.pop("state", None)
        if state is not None:
            state.close()

    client = redis.Redis.from_url(settings.redis_url or "", socket_timeout=10,
                                  socket_connect_timeout=5)
    info = WorkerInfo(host=socket.gethostname(), pid=os.getpid(), fingerprint=fp,
                      device_name=devices[0].device_name, processes=options.concurrency,
                      version=__version__, queues=queue_list, device=devices[0])

    def received(request: Request, **_: object) -> None:
        try:  # best effort: without it a dead worker's chunk comes back by the timeout
            client.set(task_holder_key(request.id), info.field, ex=TASK_STATE_TTL_S)
        except Exception as exc:
            log.warning("could not note the holder of task %s: %s", request.id, exc)

    controller: dict[str, Any] = {}  # Celery's WorkController, for its pool's pids
    signals.worker_init.connect(lambda sender=None, **_: controller.update(wc=sender),
                                weak=False)
    signals.worker_process_init.connect(init_process, weak=False)
    signals.worker_process_shutdown.connect(close_process, weak=False)
    signals.task_received.connect(received, weak=False)
    if health is not None:
        def on_ready(**_: object) -> None:
            health.ready()
            health.alive()

        signals.worker_ready.connect(on_ready, weak=False)
        signals.worker_shutting_down.connect(lambda **_: health.not_ready(), weak=False)
        if heartbeat:  # the consumer's own heartbeat: proves its event loop turns
            signals.heartbeat_sent.connect(lambda **_: health.alive(), weak=False)
    register_tasks(app, get_state, request_cls=crash_request_class(client))
    app.conf.worker_consumer = "worker.poison:GuardedConsumer"
    # How long the pool waits for a dead process's result before declaring it lost
    # (Celery's default, 10 s, is added to every crash of a crash loop).
    app.conf.worker_lost_wait = 1.0

    if port:
        from farm.cluster.metrics import ClusterCollector, serve

        served.append(serve(port, [ClusterCollector(client)], multiprocess=True,
                            addr=settings.metrics_address))
        log.info("metrics on %s port %d", settings.metrics_address, port)

    gave_up: list[str] = []

    def give_up(line: str) -> None:
        log.critical("%s: stopping the worker", line)
        gave_up.append(line)
        os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown
        # ... and if that hangs on the missing broker, stop anyway
        stopper = threading.Timer(30.0, os._exit, (1,))
        stopper.daemon = True
        stopper.start()

    waiter = redis_waiter(settings.redis_url or "", settings.outage_limit)
    on_beat = health.alive if health is not None and not heartbeat else None
    beat = Heartbeat(client, info, interval_s=settings.heartbeat_interval,
                     stale_s=settings.dead_worker_grace, waiter=waiter, on_give_up=give_up,
                     on_beat=on_beat)
    beat.pool_of = lambda: _pool_pids(controller.get("wc"))
    beat.start()  # OutageError (one line, exit 1) when Redis stays away past the limit
    try:
        app.worker_main(argv=celery_argv(
            concurrency=options.concurrency, queues=queue_list, loglevel=options.loglevel,
            hostname=f"farm-{os.getpid()}@{socket.gethostname()}", events=events,
            heartbeat=heartbeat, extra=options.extra_args))
    finally:
        beat.stop()
        if health is not None:
            health.reset()
        if port:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if gave_up:  # also over Celery's own SystemExit: this line is what to report
            raise OutageError(gave_up[0])
