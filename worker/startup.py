"""Starting a worker: find devices without touching OpenCL here, then fork the pool.

OpenCL state never crosses a fork (NVIDIA's OpenCL runs on CUDA, which forbids it), so
the main process learns its devices and fingerprints from a short-lived child
(``farm.device.discover_devices``) and only the pool processes create contexts, once
each, in ``worker_process_init``.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from farm.device import DeviceInfo, discover_devices
from farm.errors import DeviceError
from farm.keys import queue_name
from farm.settings import Settings
from farm.version import __version__
from farm.workers import Heartbeat, WorkerInfo
from worker.app import make_app, register_tasks
from worker.state import WorkerState, open_state

log = logging.getLogger(__name__)


def pick_devices(devices: list[DeviceInfo], fingerprint: str | None) -> list[DeviceInfo]:
    """The devices of one fingerprint (given, or the first device's)."""
    if not devices:
        raise DeviceError("no OpenCL device found: a worker needs one")
    wanted = fingerprint or devices[0].fingerprint
    chosen = [d for d in devices if d.fingerprint == wanted]
    if not chosen:
        known = ", ".join(sorted({d.fingerprint for d in devices}))
        raise DeviceError(f"no device here has fingerprint {wanted}; devices here: {known}")
    return chosen


def run_worker(settings: Settings, *, concurrency: int, fingerprint: str | None = None,
               queues: list[str] | None = None, loglevel: str = "INFO") -> None:
    """Run a Celery worker for one fingerprint until it is stopped."""
    import redis
    from celery import signals

    devices = pick_devices(discover_devices(), fingerprint)
    fp = devices[0].fingerprint
    queue_list = queues or [queue_name(fp)]
    app = make_app(settings)
    holder: dict[str, WorkerState] = {}

    def get_state() -> WorkerState:
        return holder["state"]

    def init_process(**_: Any) -> None:
        from billiard import current_process

        index = getattr(current_process(), "index", 0) or 0
        holder["state"] = open_state(settings, devices, index)
        log.info("process %s opened %s", os.getpid(), holder["state"].device.fingerprint)

    def close_process(**_: Any) -> None:
        state = holder.pop("state", None)
        if state is not None:
            state.close()

    signals.worker_process_init.connect(init_process, weak=False)
    signals.worker_process_shutdown.connect(close_process, weak=False)
    register_tasks(app, get_state)

    client: Any = redis.Redis.from_url(settings.redis_url or "")
    info = WorkerInfo(host=socket.gethostname(), pid=os.getpid(), fingerprint=fp,
                      device_name=devices[0].device_name, processes=concurrency,
                      version=__version__, queues=queue_list, device=devices[0])
    beat = Heartbeat(client, info)
    beat.start()
    try:
        app.worker_main(argv=[
            "worker", "--pool=prefork", f"--concurrency={concurrency}",
            f"--queues={','.join(queue_list)}", f"--loglevel={loglevel}",
            f"--hostname=farm-{os.getpid()}@{socket.gethostname()}",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])
    finally:
        beat.stop()
