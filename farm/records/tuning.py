"""Reading tune records back as a session's tuning table (``farm records tuning``).

A tuning belongs to the session that asked for it: a ``farm tune`` here records its keys
itself; on the cluster the workers that measured record them, naming the asking
session (``requested_by``, batch 0: its tuning rather than one of its builds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.errors import InputError
from farm.records.model import TuneRecord

if TYPE_CHECKING:
    from farm.records.storage import SessionStorage


def owner(record: TuneRecord) -> int:
    """The session whose tuning ``record`` is."""
    return record.requested_by.session if record.requested_by else record.stamp.session


def tunings(storage: SessionStorage, session: int | None = None
            ) -> tuple[int, list[TuneRecord]]:
    """(session, its tune records by recording session and order): of ``session``, or of
    the newest session that tuned anything (``None``). ``InputError`` when there is none."""
    found = [r for r in storage.all_records(kind=TuneRecord.KIND) if isinstance(r, TuneRecord)]
    if session is None:
        if not found:
            raise InputError(f"no tuning recorded in {storage.where} (`farm tune` records "
                             "one per key it measures)")
        session = max(owner(r) for r in found)
    mine = [r for r in found if owner(r) == session]
    if not mine:
        raise InputError(f"session {session} recorded no tuning in {storage.where}")
    mine.sort(key=lambda r: (r.stamp.session, r.stamp.seq))
    return session, mine


def compact(label: str) -> str:
    """``tile_m=64 tile_n=128 ...`` as ``64/128/...``: a candidate in a table cell."""
    return "/".join(part.partition("=")[2] or part for part in label.split())
