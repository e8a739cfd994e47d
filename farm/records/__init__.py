"""Records and sessions: what the farm did, for whom, and what it cost.

- ``model``: the record kinds, sessions, levels and settings (pydantic).
- ``recorder``: one session's rules: what is recorded at each level, held observed
  records, when a session is written.
- ``sink``: the transport protocol, and the embedded one that writes straight into
  storage.
- ``storage``: where a record becomes durable (SQLite or PostgreSQL).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from farm.records.model import (
        RECORD_KINDS,
        Clock,
        CompilationBatchRecord,
        CompilationRecord,
        Effect,
        Record,
        RecordLevel,
        RecordsConfig,
        RequestedBy,
        Session,
        Stamp,
        SystemClock,
        parse_record,
    )
    from farm.records.recorder import Recorder
    from farm.records.sink import RecordSink, StorageSink
    from farm.records.storage import MIGRATIONS, SCHEMA_VERSION, SessionStorage

# Names are imported on first use (PEP 562): the storage module pulls in SQLAlchemy,
# which a process that only loads kernels never needs.
_WHERE = {
    **dict.fromkeys(("RECORD_KINDS", "Clock", "CompilationBatchRecord", "CompilationRecord",
                     "Effect", "Record", "RecordLevel", "RecordsConfig", "RequestedBy",
                     "Session", "Stamp", "SystemClock", "parse_record"), "model"),
    "Recorder": "recorder",
    "RecordSink": "sink",
    "StorageSink": "sink",
    **dict.fromkeys(("MIGRATIONS", "SCHEMA_VERSION", "SessionStorage"), "storage"),
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'farm.records' has no attribute {name!r}")
    return getattr(importlib.import_module(f"farm.records.{module}"), name)


__all__ = [
    "MIGRATIONS",
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "Clock",
    "CompilationBatchRecord",
    "CompilationRecord",
    "Effect",
    "Record",
    "RecordLevel",
    "RecordSink",
    "Recorder",
    "RecordsConfig",
    "RequestedBy",
    "Session",
    "SessionStorage",
    "Stamp",
    "StorageSink",
    "SystemClock",
    "parse_record",
]
