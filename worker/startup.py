"""Starting a worker: find devices without touching OpenCL here, then fork the pool.

OpenCL state never crosses a fork (NVIDIA's OpenCL runs on CUDA, which forbids it), so
the main process learns its devices and fingerprints from a short-lived child
(``farm.core.device.discover_devices``), and whether each compiles from others
(``farm.core.device_probe``, once per fingerprint), and only the pool processes create
contexts, once each, in ``worker_process_init``.

Faults (docs/RELIABILITY.md): the worker consumes its queues only while it can serve
them (``worker.readiness``: its pool processes opened their state, the store answers);
the consumer refuses malformed messages (``worker.poison``); the task's ``Request``
books crashes of pool processes (``worker.crashes``); the main process says which worker
holds each task it receives (so a client can re-send the chunks of a worker that died)
and, in its heartbeat, which tasks it still holds; and a Redis outage at start or longer
than ``FARM_OUTAGE_LIMIT`` later stops the worker with one line and exit 1
(``worker.stopping``), promptly, pool included.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm.cluster.celery_app import make_app
from farm.cluster.workers import Heartbeat, WorkerInfo
from farm.compilation.backend import device_probes, discover
from farm.core.device import (
    DeviceInfo,
    ProbeResult,
    cannot_compile,
    resolve_fingerprint,
    select_device,
    usable,
)
from farm.core.errors import DeviceChoiceError, DeviceError
from farm.core.keys import DEFAULT_QUEUE, TASK_STATE_TTL_S, queue_name, task_holder_key
from farm.core.outage import redis_client, redis_waiter
from farm.core.settings import Settings
from farm.version import __version__
from worker.app import register_tasks
from worker.crashes import crash_request_class
from worker.process import PoolProcess, held_tasks, store_probe
from worker.readiness import ProcessReports, Readiness
from worker.stopping import ignore_cancel_notice, quiet_celery_outages, stop_now

if TYPE_CHECKING:
    from celery.worker import WorkController
    from celery.worker.request import Request

    from farm.cluster.metrics import Served

log = logging.getLogger(__name__)


def pick_devices(devices: list[DeviceInfo], fingerprint: str | None,
                 probes: Mapping[str, ProbeResult] | None = None) -> list[DeviceInfo]:
    """The devices of one fingerprint: given whole or by a unique prefix, else the one
    the farm would choose (``select_device``: the first whose compiler works). A worker
    never serves a device whose probe build failed (``probes``; None: not probed, as a
    simulated backend's devices): it would fail every kernel it takes."""
    if not devices:
        raise DeviceError("no OpenCL device found: a worker needs one")
    wanted = resolve_fingerprint(fingerprint, (d.fingerprint for d in devices)) \
        if fingerprint else select_device(devices, None, probes).fingerprint
    chosen = [d for d in devices if d.fingerprint == wanted]
    if not chosen:
        known = ", ".join(sorted({d.fingerprint for d in devices}))
        raise DeviceChoiceError(f"no device here has fingerprint {wanted}; devices here: "
                                f"{known}")
    if not usable(chosen[0], probes):
        raise DeviceError(f"device {cannot_compile(chosen[0], probes)}: a worker serves "
                          "only a device that compiles")
    return chosen


def _pool_pids(controller: WorkController) -> list[int]:
    """The pids of a Celery worker's pool processes (prefork's ``pool.info``, what
    `celery inspect stats` reports); none before the pool starts, or for a solo pool."""
    try:
        return [int(pid) for pid in controller.pool.info.get("processes", [])]
    except Exception:  # no pool yet, or one being restarted: the next beat has it
        return []


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
    """Run a Celery worker for one fingerprint until it is stopped. It consumes its
    queues only while its checks pass (``worker.readiness``)."""
    import tempfile

    port = options.metrics_port if options.metrics_port is not None else settings.metrics_port
    metrics_dir = Path(tempfile.gettempdir()) / f"farm-metrics-{os.getpid()}"
    if port:
        # Before anything imports prometheus-client: the pool's processes inherit it.
        from farm.cluster.metrics import prepare_multiprocess

        prepare_multiprocess(metrics_dir)

    from celery import signals

    from farm.cluster.health import HealthFiles

    events = settings.worker_events if options.events is None else options.events
    heartbeat = settings.worker_heartbeat if options.heartbeat is None else options.heartbeat
    found = discover(settings)
    devices = pick_devices(found, options.fingerprint, device_probes(settings, found))
    fp = devices[0].fingerprint
    queue_list = options.queues or [queue_name(fp)]
    app = make_app(settings.model_copy(update={"worker_events": events}))
    health = HealthFiles(settings.health_dir) if settings.health_dir else None
    if health is not None:
        health.reset()
    reports = ProcessReports(Path(tempfile.gettempdir()) / f"farm-worker-{os.getpid()}")
    reports.reset()
    served: list[Served] = []  # the metrics listeners, closed in each forked process
    process = PoolProcess(settings, devices, reports, inherited=served)

    client = redis_client(settings.redis_url or "", settings.socket_timeout)
    info = WorkerInfo(host=socket.gethostname(), pid=os.getpid(), fingerprint=fp,
                      device_name=devices[0].device_name, processes=options.concurrency,
                      version=__version__, queues=queue_list, device=devices[0])
    readiness = Readiness(
        queues=queue_list, reports=reports, processes=options.concurrency,
        probe=store_probe(settings, fp), interval_s=settings.heartbeat_interval,
        on_change=(lambda ready: health.ready() if ready else health.not_ready())
        if health is not None else None)

    def received(request: Request, **_: object) -> None:
        try:  # best effort: without it a dead worker's chunk comes back by the timeout
            client.set(task_holder_key(request.id), info.field, ex=TASK_STATE_TTL_S)
        except Exception as exc:
            log.warning("could not note the holder of task %s: %s", request.id, exc)

    controller: dict[str, Any] = {}  # Celery's WorkController, for its pool's pids
    signals.worker_init.connect(lambda sender=None, **_: controller.update(wc=sender),
                                weak=False)
    signals.worker_process_init.connect(process.open, weak=False)
    signals.worker_process_shutdown.connect(process.close, weak=False)
    signals.task_received.connect(received, weak=False)
    signals.worker_ready.connect(lambda sender=None, **_: readiness.attach(sender), weak=False)
    signals.worker_ready.connect(lambda **_: ignore_cancel_notice(), weak=False)
    if health is not None:
        signals.worker_ready.connect(lambda **_: health.alive(), weak=False)
        signals.worker_shutting_down.connect(lambda **_: health.not_ready(), weak=False)
        if heartbeat:  # the consumer's own heartbeat: proves its event loop turns
            signals.heartbeat_sent.connect(lambda **_: health.alive(), weak=False)
    register_tasks(app, process.state,
                   request_cls=crash_request_class(client, readiness, reports.folder),
                   redis_of=process.redis, worker_field=info.field)
    app.conf.worker_consumer = "worker.poison:GuardedConsumer"
    # How long the pool waits for a dead process's result before declaring it lost
    # (Celery's default, 10 s, is added to every crash of a crash loop).
    app.conf.worker_lost_wait = 1.0
    quiet_celery_outages(settings.outage_limit)

    if port:
        from farm.cluster.metrics import ClusterCollector, serve

        served.append(serve(port, [ClusterCollector(client)], multiprocess=True,
                            addr=settings.metrics_address))
        log.info("metrics on %s port %d", settings.metrics_address, port)

    def cleanup() -> None:
        if health is not None:
            health.reset()
        if port:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        reports.remove()

    def pool() -> list[int]:
        return _pool_pids(controller.get("wc"))

    waiter = redis_waiter(settings.redis_url or "", settings.outage_limit)
    on_beat = health.alive if health is not None and not heartbeat else None
    beat = Heartbeat(client, info, interval_s=settings.heartbeat_interval,
                     stale_s=settings.dead_worker_grace, waiter=waiter,
                     on_give_up=lambda line: stop_now(line, pool(), cleanup), on_beat=on_beat)
    beat.pool_of = pool
    beat.status_of = readiness.status
    beat.tasks_of = held_tasks
    beat.start()  # OutageError (one line, exit 1) when Redis stays away past the limit
    readiness.start()
    try:
        app.worker_main(argv=celery_argv(
            concurrency=options.concurrency, queues=[DEFAULT_QUEUE],
            loglevel=options.loglevel, hostname=f"farm-{os.getpid()}@{socket.gethostname()}",
            events=events, heartbeat=heartbeat, extra=options.extra_args))
    finally:
        readiness.stop()
        beat.stop()
        cleanup()
