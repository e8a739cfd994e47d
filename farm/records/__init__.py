"""Records and sessions: what the farm did, for whom, and what it cost.

- ``model``: the record kinds, sessions, levels and settings (pydantic).
- ``recorder``: one session's rules: what is recorded at each level, held observed
  records, when a session is written.
- ``sink``: the transport protocol, and the embedded one that writes straight into
  storage.
- ``storage``: where a record becomes durable (SQLite or PostgreSQL).
"""

# ruff: noqa: F401 - the TYPE_CHECKING block is the list of public names (farm.core.lazy)
from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.lazy import public_names

# The public names, imported on first use (PEP 562): the storage module pulls in
# SQLAlchemy, which a process that only loads kernels never needs. This block is their
# one list (farm.core.lazy reads it).
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

__getattr__, __dir__ = public_names(__name__)
