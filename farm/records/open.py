"""Choosing where a process's records go: the one place that picks the transport.

Embedded (no Redis configured): straight into the environment's session storage
(SQLite by default). The Redis-stream transport of the cluster plugs in here.
"""

from __future__ import annotations

from farm.records.model import RecordsConfig
from farm.records.recorder import Recorder
from farm.records.sink import StorageSink
from farm.records.storage import SessionStorage
from farm.settings import Settings


def open_recorder(settings: Settings, label: str) -> Recorder:
    """A new session for this process on the configured records transport."""
    config = RecordsConfig(level=settings.records_level, keep_sessions=settings.keep_sessions)
    if settings.records_url is None:
        settings.environment_dir.mkdir(parents=True, exist_ok=True)
    storage = SessionStorage(settings.effective_records_url)
    return Recorder(StorageSink(storage), config, label)
