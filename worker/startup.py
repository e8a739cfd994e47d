"""Starting a worker: find devices without touching OpenCL here, then fork the pool.

OpenCL state never crosses a fork (NVIDIA's OpenCL runs on CUDA, which forbids it), so
the main process learns its devices and fingerprints from a short-lived child
(``farm.core.device.discover_devices``), and whether each compiles from others
(``farm.core.device_probe``, once per fingerprint), and only the pool processes create
contexts, once each, in ``worker_process_init``.

Faults (docs/RELIABILITY.md) are the hooks' (``worker.hooks``, told of each event of the
worker's life here): the worker consumes its queues only while it can serve them
(readiness: its pool processes opened their state, the store answers); the consumer
refuses malformed messages (poison); the task's ``Request`` books crashes of pool
processes (crashes); the main process says which worker holds each task it receives, so
a client can re-send the chunks of a worker that died (leases); metrics. Here: the
heartbeat, which says which tasks the worker still holds, and a Redis outage at start
or longer than ``FARM_OUTAGE_LIMIT`` later, which stops the worker with one line and exit
1 (``worker.stopping``), promptly, pool included.
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
from farm.core.keys import DEFAULT_QUEUE, queue_name
from farm.core.outage import redis_client, redis_waiter
from farm.core.settings import Settings
from farm.version import __version__
from worker.app import register_tasks
from worker.hooks import worker_hooks
from worker.hooks.base import Boot
from worker.process import PoolProcess, held_tasks
from worker.stopping import ignore_cancel_notice, quiet_celery_outages, stop_now

if TYPE_CHECKING:
    from celery.worker import WorkController

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
    queues only while its checks pass (the readiness hook); its cross-cutting concerns
    are the hooks of :mod:`worker.hooks`, told of each event here."""
    import tempfile

    from celery import signals

    events = settings.worker_events if options.events is None else options.events
    heartbeat = settings.worker_heartbeat if options.heartbeat is None else options.heartbeat
    found = discover(settings)
    devices = pick_devices(found, options.fingerprint, device_probes(settings, found))
    fp = devices[0].fingerprint
    queue_list = options.queues or [queue_name(fp)]
    app = make_app(settings.model_copy(update={"worker_events": events}))
    client = redis_client(settings.redis_url or "", settings.socket_timeout)
    info = WorkerInfo(host=socket.gethostname(), pid=os.getpid(), fingerprint=fp,
                      device_name=devices[0].device_name, processes=options.concurrency,
                      version=__version__, queues=queue_list, device=devices[0])
    folder = Path(tempfile.gettempdir()) / f"farm-worker-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    hooks = worker_hooks()
    boot = Boot(settings=settings, app=app, fingerprint=fp, queues=queue_list,
                processes=options.concurrency, client=client, folder=folder,
                worker_field=info.field, heartbeat=heartbeat,
                metrics_port=(options.metrics_port if options.metrics_port is not None
                              else settings.metrics_port) or 0)
    hooks.before_worker_boot(boot)  # first: the metrics hook's, before prometheus-client
    process = PoolProcess(settings, devices, hooks)

    controller: dict[str, Any] = {}  # Celery's WorkController, for its pool's pids
    signals.worker_init.connect(lambda sender=None, **_: controller.update(wc=sender),
                                weak=False)
    signals.worker_process_init.connect(process.open, weak=False)
    signals.worker_process_shutdown.connect(process.close, weak=False)
    signals.task_received.connect(lambda request, **_: hooks.after_task_received(request),
                                  weak=False)
    signals.worker_ready.connect(lambda sender=None, **_: hooks.after_worker_ready(sender),
                                 weak=False)
    signals.worker_ready.connect(lambda **_: ignore_cancel_notice(), weak=False)
    signals.worker_shutting_down.connect(lambda **_: hooks.before_worker_shutdown(),
                                         weak=False)
    if heartbeat:  # the consumer's own heartbeat: proves its event loop turns
        signals.heartbeat_sent.connect(lambda **_: hooks.after_heartbeat(), weak=False)
    register_tasks(app, process.state, hooks, worker_field=info.field)
    # How long the pool waits for a dead process's result before declaring it lost
    # (Celery's default, 10 s, is added to every crash of a crash loop).
    app.conf.worker_lost_wait = 1.0
    quiet_celery_outages(settings.outage_limit)

    def cleanup() -> None:
        hooks.after_worker_shutdown()
        shutil.rmtree(folder, ignore_errors=True)

    def pool() -> list[int]:
        return _pool_pids(controller.get("wc"))

    waiter = redis_waiter(settings.redis_url or "", settings.outage_limit)
    beat = Heartbeat(client, info, interval_s=settings.heartbeat_interval,
                     stale_s=settings.dead_worker_grace, waiter=waiter,
                     on_give_up=lambda line: stop_now(line, pool(), cleanup),
                     on_beat=None if heartbeat else hooks.after_heartbeat)
    beat.pool_of = pool
    beat.status_of = lambda: boot.status_of()
    beat.tasks_of = held_tasks
    try:
        beat.start()  # OutageError (one line, exit 1) when Redis stays away past the limit
    except BaseException:
        cleanup()
        raise
    try:
        hooks.after_worker_boot(boot)
        app.worker_main(argv=celery_argv(
            concurrency=options.concurrency, queues=[DEFAULT_QUEUE],
            loglevel=options.loglevel, hostname=f"farm-{os.getpid()}@{socket.gethostname()}",
            events=events, heartbeat=heartbeat, extra=options.extra_args))
    finally:
        beat.stop()
        cleanup()
