"""A records stream entry in the ingester's hands, and setting entries aside.

An entry that does not validate (not UTF-8, out-of-range integers, non-finite floats, an
unknown kind, a pack that is not a JSON array of records) goes to ``farm:records:dead``
with the reason and is acknowledged, so one bad entry neither blocks the stream nor is
retried for ever. A bad record inside a pack goes there alone, as a one-record entry
(``dead:index`` names its place): the pack's other records are written. Entries that a
newer farm may have written (a record kind or envelope version this version does not
know) go there too, flagged ``dead:newer``: left pending they would be claimed and
re-read by every ingester for ever. Upgrade the ingesters before the producers; entries
set aside meanwhile can be sent again from the dead stream (docs/RECORDS.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from farm.core.keys import RECORDS_DEAD_STREAM
from farm.records.group import text
from farm.records.stream import (
    BadRecord,
    DecodedRecords,
    EntryError,
    SessionEntry,
    stream_fields,
)

if TYPE_CHECKING:
    from redis.client import Pipeline


@dataclass
class Entry:
    """One stream entry: where it is, its fields, and what decoding made of it."""

    stream: str
    id: str
    fields: dict[Any, Any] | None  # None: trimmed away while pending
    decoded: SessionEntry | DecodedRecords | None = None
    error: EntryError | None = None  # the entry as a whole is set aside
    bad: list[BadRecord] = field(default_factory=list)  # records of a pack set aside


def flatten_reply(reply: object) -> Iterable[Entry]:
    """The entries of an XREADGROUP reply: RESP2 ``[[stream, messages], ...]``, or
    redis-py's RESP3 ``{stream: [messages]}``."""
    if not reply:
        return
    if isinstance(reply, dict):
        pairs = [(stream, value[0] if value else []) for stream, value in reply.items()]
    elif isinstance(reply, list | tuple):
        pairs = [(stream, messages) for stream, messages in reply]
    else:
        return
    for stream, messages in pairs:
        for entry_id, fields in messages:
            yield Entry(text(stream), text(entry_id), fields or None)


def places(decoded: DecodedRecords) -> list[int]:
    """Each valid record's index in its pack (the bad ones' indices skipped)."""
    skipped = {bad.index for bad in decoded.bad}
    total = len(decoded.records) + len(skipped)
    return [i for i in range(total) if i not in skipped]


def unstorable(exc: BaseException) -> EntryError:
    return EntryError(f"the records storage cannot hold it: {type(exc).__name__}: {exc}"[:300])


def _is_ours(name: bytes | str) -> bool:
    """A field the dead stream adds itself (a producer's copy of it is dropped)."""
    name_text = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
    return name_text.startswith("dead:")


def set_aside(pipe: Pipeline, entries: list[Entry], dead: list[Entry], maxlen: int) -> int:
    """Queue on ``pipe`` the dead-stream entries of a round: each entry of ``dead``
    whole, and each bad record of a pack alone; how many such records there were."""
    bad_records = 0
    whole = {id(entry) for entry in dead}
    for entry in entries:  # in the order read: the dead stream reads like the streams
        if id(entry) in whole:
            # the fields as they came (bytes that are not UTF-8 included), then ours
            fields: dict[Any, Any] = {k: v for k, v in (entry.fields or {}).items()
                                      if not _is_ours(k)}
            fields.update({"dead:stream": entry.stream, "dead:id": entry.id,
                           "dead:error": str(entry.error)})
            if entry.error is not None and entry.error.retry_later:
                fields["dead:newer"] = "1"
            pipe.xadd(RECORDS_DEAD_STREAM, fields, maxlen=maxlen, approximate=True)
        for bad in entry.bad:  # one record of a pack, alone, as a one-record entry
            pipe.xadd(RECORDS_DEAD_STREAM, stream_fields(
                {**bad.fields, "dead:stream": entry.stream, "dead:id": entry.id,
                 "dead:index": str(bad.index), "dead:error": str(bad.error)}),
                      maxlen=maxlen, approximate=True)
            bad_records += 1
    return bad_records
