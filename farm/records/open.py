"""Choosing where a process's records go: the one place that picks the transport.

``FARM_RECORDS_TRANSPORT`` (``Settings.records_transport``) decides:

- ``auto`` (default): Redis streams when ``FARM_REDIS_URL`` is set (the process is part
  of a cluster: a worker, a cluster build, a loader next to them), straight into
  storage otherwise. The cluster is configuration, not another code path.
- ``storage``: straight into session storage (``FARM_RECORDS_URL``, SQLite beside the
  store by default) even in a cluster, e.g. a one-off process that must not depend on
  an ingester running.
- ``stream``: Redis streams; needs ``FARM_REDIS_URL``.

The embedded path (no Redis) is the recorder writing to SQLite, as before. In a cluster
the recorder also sends from a background thread once a second (``autoflush``), so a
worker that compiled a few kernels and went idle does not hold their records until its
next kernel or its exit.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from farm.core.errors import SettingsError
from farm.core.settings import Settings
from farm.records.model import STORAGE_COMPONENT, RecordsConfig
from farm.records.recorder import Recorder
from farm.records.sink import RecordSink, StorageSink


def records_transport(settings: Settings) -> str:
    """``"stream"`` or ``"storage"``: where this process's records go."""
    choice = settings.records_transport
    if choice == "stream" and not settings.redis_url:
        raise SettingsError("setting FARM_RECORDS_TRANSPORT=stream needs FARM_REDIS_URL")
    if choice == "auto":
        return "stream" if settings.cluster else "storage"
    return choice


def open_sink(settings: Settings) -> RecordSink:
    """The sink of the configured transport (it owns its client or storage)."""
    if records_transport(settings) == "stream":
        from farm.records.stream import RedisStreamSink

        return RedisStreamSink.open(settings.redis_url or "")
    url = settings.effective_records_url
    if settings.records_url is None:
        settings.environment_dir.mkdir(parents=True, exist_ok=True)
    # Opened at the first write where that is safe: a process that only loads never
    # writes a session, and then never imports SQLAlchemy. Anything but a new file or
    # one of our own (a foreign or damaged file, PostgreSQL) is opened now, so it is
    # refused now, before a build changes anything.
    lazy = settings.records_url is None and _ours_or_absent(settings.records_path)
    return StorageSink.open(url, lazy=lazy)


def _ours_or_absent(path: Path) -> bool:
    """Whether ``path`` is missing or plainly a records database of ours (stdlib only)."""
    if not path.exists():
        return True
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT version FROM schema_version WHERE component = ?",
                               (STORAGE_COMPONENT,)).fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return False
    return row is not None


def open_recorder(settings: Settings, label: str) -> Recorder:
    """A new session for this process on the configured records transport."""
    config = RecordsConfig(level=settings.records_level, keep_sessions=settings.keep_sessions)
    return Recorder(open_sink(settings), config, label, autoflush=settings.cluster)
