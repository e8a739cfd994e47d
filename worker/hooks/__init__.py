"""The worker's cross-cutting concerns, as hooks registered here, in one place.

dramatiq's middleware is the model: each concern is a small :class:`~worker.hooks.base.Hook`
in a file of its own, told of the events of the worker's life (the main process's boot,
readiness, tasks received, given back or lost; a pool process's boot and each chunk
around :func:`worker.execute.execute_job`, the one seam that obtains it), rather than
wired into the task and the start-up by hand. ``worker.startup`` and the compile task
(``worker.app``) send the events; :data:`HOOKS` says who hears them, in order.

A new concern is a ``Hook`` subclass in ``worker/hooks/<name>.py`` that overrides the
events it needs, added to :data:`HOOKS`.
"""

from __future__ import annotations

from worker.hooks.base import Hook, Hooks
from worker.hooks.crashes import CrashHook
from worker.hooks.leases import LeaseHook
from worker.hooks.metrics import MetricsHook
from worker.hooks.poison import PoisonHook
from worker.hooks.readiness import ReadinessHook

#: the hooks of a worker, in the order each event reaches them: metrics first (its
#: boot chooses prometheus-client's folder before anything imports it)
HOOKS: tuple[type[Hook], ...] = (MetricsHook, ReadinessHook, CrashHook, LeaseHook, PoisonHook)


def worker_hooks() -> Hooks:
    """A worker's hooks, one of each of :data:`HOOKS`."""
    return Hooks([hook() for hook in HOOKS])
