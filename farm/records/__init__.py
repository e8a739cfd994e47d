"""Records and sessions: what the farm did, for whom, and what it cost.

- ``model``: the record kinds, sessions, levels and settings (pydantic).
- ``recorder``: one session's rules: what is recorded at each level, held observed
  records, when a session is written.
- ``sink``: the transport protocol, and the embedded one that writes straight into
  storage.
- ``storage``: where a record becomes durable (SQLite or PostgreSQL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.lazy import lazy_exports

if TYPE_CHECKING:
    from farm.core.model import RecordLevel
    from farm.records.model import (
        RECORD_KINDS,
        BatchCounts,
        Clock,
        CompilationBatchRecord,
        CompilationRecord,
        Effect,
        Record,
        RecordsConfig,
        RequestedBy,
        Session,
        Stamp,
        SystemClock,
        Trip,
        parse_record,
    )
    from farm.records.recorder import Recorder
    from farm.records.sink import RecordSink, StorageSink
    from farm.records.storage import MIGRATIONS, SCHEMA_VERSION, SessionStorage

# Names are imported on first use (PEP 562): the storage module pulls in SQLAlchemy,
# which a process that only loads kernels never needs.
_WHERE = {
    **dict.fromkeys(("RECORD_KINDS", "BatchCounts", "Clock", "CompilationBatchRecord",
                     "CompilationRecord", "Effect", "Record", "RecordsConfig",
                     "RequestedBy", "Session", "Stamp", "SystemClock", "Trip", "parse_record"),
                    "farm.records.model"),
    "RecordLevel": "farm.core.model",
    "Recorder": "farm.records.recorder",
    "RecordSink": "farm.records.sink",
    "StorageSink": "farm.records.sink",
    **dict.fromkeys(("MIGRATIONS", "SCHEMA_VERSION", "SessionStorage"), "farm.records.storage"),
}


__getattr__ = lazy_exports(__name__, _WHERE)


__all__ = [
    "MIGRATIONS",
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "BatchCounts",
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
    "Trip",
    "parse_record",
]
