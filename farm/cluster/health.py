"""Health files for the chart's exec probes: ``ready`` and ``alive`` in one folder.

Why files and not an HTTP endpoint: a probe must say whether the *Celery consumer* is
alive, and the one thing that proves it is its own heartbeat (sent from the consumer's
event loop every couple of seconds). The worker touches ``alive`` on each heartbeat and
creates ``ready`` once Celery consumes its queues; the probes only look at the files'
age (``test``/``stat``), so they cost no Python start-up per probe.
"""

from __future__ import annotations

from pathlib import Path

READY = "ready"
ALIVE = "alive"


class HealthFiles:
    """The ``ready`` / ``alive`` files of one process; every method is best effort."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def reset(self) -> None:
        """Forget an earlier run's state (a restarted container keeps its emptyDir)."""
        for name in (READY, ALIVE):
            (self.folder / name).unlink(missing_ok=True)

    def ready(self) -> None:
        self._touch(READY)

    def not_ready(self) -> None:
        (self.folder / READY).unlink(missing_ok=True)

    def alive(self) -> None:
        self._touch(ALIVE)

    def _touch(self, name: str) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / name).touch()  # an existing file gets a new mtime
        except OSError:  # a full or read-only disk must not stop the worker
            pass
