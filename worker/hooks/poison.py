"""The poison hook: the worker's consumer checks every task message before Celery reads
it, and dead-letters one that would take the worker down (:mod:`worker.poison`)."""

from __future__ import annotations

from worker.hooks.base import Boot, Hook


class PoisonHook(Hook):
    def before_worker_boot(self, boot: Boot) -> None:
        boot.app.conf.worker_consumer = "worker.poison:GuardedConsumer"
