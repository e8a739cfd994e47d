"""The readiness hook: the worker consumes its queues only while it can serve them
(:mod:`worker.readiness`: its pool processes opened their state, the store answers, its
chunks do not keep going back), and says so in its health files for Kubernetes'
probes (``FARM_HEALTH_DIR``, :mod:`farm.cluster.health`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.keys import Namespace
from worker.hooks.base import Boot, Hook
from worker.readiness import ProcessReports, Readiness

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery.worker.consumer import Consumer
    from celery.worker.request import Request

    from farm.cluster.health import HealthFiles
    from farm.core.settings import Settings
    from farm.store.base import ArtifactStore
    from worker.state import WorkerState


def store_probe(settings: Settings, fingerprint: str) -> Callable[[], None]:
    """The readiness check of the store: one signed read in the fingerprint's namespace,
    one attempt (the store object is made at the first check that reaches MinIO)."""
    from farm.store.open import open_store

    made: list[ArtifactStore] = []
    ns = Namespace.for_fingerprint(fingerprint)

    def probe() -> None:
        if not made:
            made.append(open_store(settings, shared=True, probe=True, signed=False))
        made[0].probe(ns)

    return probe


class ReadinessHook(Hook):
    def __init__(self) -> None:
        self.reports: ProcessReports | None = None
        self.readiness: Readiness | None = None
        self.health: HealthFiles | None = None
        self.started = False

    def before_worker_boot(self, boot: Boot) -> None:
        from farm.cluster.health import HealthFiles

        settings = boot.settings
        self.health = HealthFiles(settings.health_dir) if settings.health_dir else None
        if self.health is not None:
            self.health.reset()
        health = self.health
        self.reports = ProcessReports(boot.folder)
        self.readiness = Readiness(
            queues=boot.queues, reports=self.reports, processes=boot.processes,
            probe=store_probe(settings, boot.fingerprint),
            interval_s=settings.heartbeat_interval,
            on_change=(lambda ready: health.ready() if ready else health.not_ready())
            if health is not None else None)
        boot.status_of = self.readiness.status

    def after_worker_boot(self, boot: Boot) -> None:
        if self.readiness is not None:
            self.readiness.start()
            self.started = True

    def after_worker_ready(self, consumer: Consumer) -> None:
        if self.readiness is not None:
            self.readiness.attach(consumer)
        if self.health is not None:
            self.health.alive()

    def after_heartbeat(self) -> None:
        if self.health is not None:  # the beat proves the worker's loop turns
            self.health.alive()

    def after_task_done(self, request: Request) -> None:
        if self.readiness is not None:
            self.readiness.chunk_done()

    def after_task_given_back(self, request: Request, reason: str) -> None:
        if self.readiness is not None:
            self.readiness.chunk_went_back(reason)

    def before_worker_shutdown(self) -> None:
        if self.health is not None:
            self.health.not_ready()

    def after_worker_shutdown(self) -> None:
        if self.readiness is not None and self.started:  # not when the start failed
            self.readiness.stop()
        if self.health is not None:
            self.health.reset()

    def after_process_boot(self, index: int, state: WorkerState | None,
                           problem: str | None) -> None:
        if self.reports is not None:
            self.reports.report(index, problem)
