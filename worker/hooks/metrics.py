"""The metrics hook: each chunk counted in the worker's Prometheus metrics
(:mod:`farm.cluster.metrics`), served on ``/metrics`` when the worker has a port.

Prometheus-client's multiprocess mode, because the pool processes are forked: the
folder is chosen before anything imports prometheus-client (this hook's
``before_worker_boot`` runs first), each pool process writes its samples there and
closes the listener it inherited, and the main process serves them all.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from worker.hooks.base import Boot, Chunk, Hook

if TYPE_CHECKING:
    from farm.cluster.metrics import Served
    from farm.cluster.payloads import CompileReply
    from worker.state import WorkerState

log = logging.getLogger(__name__)


def chunk_status(reply: CompileReply) -> str:
    """``success`` when every kernel of the chunk was obtained (or is one the device
    cannot run), ``kernel_failed`` when one failed: a chunk with a failed kernel is not a
    success on the dashboard's task panel."""
    from farm.core.outcomes import Fate

    failed = any(k.outcome is None and not (k.failure and k.failure.kind == Fate.UNSUPPORTED)
                 for k in reply.results)
    return "kernel_failed" if failed else "success"


class MetricsHook(Hook):
    def __init__(self) -> None:
        self.folder: Path | None = None
        #: the main process's listener (a forked pool process closes its copy)
        self.served: list[Served] = []

    def before_worker_boot(self, boot: Boot) -> None:
        if not boot.metrics_port:
            return
        from farm.cluster.metrics import prepare_multiprocess

        self.folder = Path(tempfile.gettempdir()) / f"farm-metrics-{os.getpid()}"
        prepare_multiprocess(self.folder)

    def after_worker_boot(self, boot: Boot) -> None:
        if not boot.metrics_port:
            return
        from farm.cluster.metrics import ClusterCollector, serve

        settings = boot.settings
        self.served.append(serve(boot.metrics_port, [ClusterCollector(boot.client)],
                                 multiprocess=True, addr=settings.metrics_address))
        log.info("metrics on %s port %d", settings.metrics_address, boot.metrics_port)

    def after_worker_shutdown(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def after_process_boot(self, index: int, state: WorkerState | None,
                           problem: str | None) -> None:
        for listener in self.served:  # forked with the metrics socket: not ours
            listener.close_inherited()

    def after_chunk(self, chunk: Chunk, reply: CompileReply) -> None:
        from farm.cluster.metrics import worker_metrics

        metrics, fingerprint = worker_metrics(), chunk.request.fingerprint
        if reply.dropped:
            metrics.task(fingerprint, "dropped")
            return
        metrics.task(fingerprint, chunk_status(reply))
        metrics.reply(fingerprint, reply)

    def after_chunk_given_back(self, chunk: Chunk, reason: str | None) -> None:
        from farm.cluster.metrics import worker_metrics

        worker_metrics().task(chunk.request.fingerprint,
                              "avoided" if reason is None else "returned")

    def after_chunk_failed(self, chunk: Chunk, why: str) -> None:
        from farm.cluster.metrics import worker_metrics

        metrics = worker_metrics()
        if why == "timeout":
            metrics.timed_out(chunk.request.fingerprint, len(chunk.request.kernels))
        else:
            metrics.task(chunk.request.fingerprint, why)
