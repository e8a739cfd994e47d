"""The cluster's records transport: a recorder's session and records appended to Redis
streams, for the ingester (``farm.records.ingest``) to write into session storage.

Why streams and not direct writes to PostgreSQL from every process: a build may start
hundreds of worker processes, each with a short burst of records; an append to Redis
costs a fraction of a millisecond and needs no database connection per process, and the
ingester turns many small appends into few large, idempotent transactions.

Layout (names from ``farm.keys``):

- ``farm:records:sessions``: one entry per session, sent when the session first changes
  something (the recorder decides when; this sink never sees an observe-only session),
  carrying the session and its ``keep_sessions`` for the ingester to apply.
- ``farm:records:<kind>`` (``compilation``, ``compilation_batch``): one entry per
  record. The record keeps its own stamp, so the entry id Redis gives it plays no part
  in identity: the ingester writes by (session, seq), and an entry sent twice (a retry
  after a timeout) is stored once.

Every entry is an envelope of flat string fields (``ENVELOPE_VERSION``), validated with
pydantic when it is read back (``decode_session``, ``decode_record``).

Each stream is capped with approximate trimming (``XADD ... MAXLEN ~ STREAM_MAXLEN``):
Redis then drops whole internal nodes of old entries, which costs next to nothing,
instead of trimming to the exact length on every append. The stream keeps at least the
cap (and at most about one node, 100 entries by default, more). Entries the ingester
has not yet written are trimmed like any others once it is more than the cap behind;
``docs/RECORDS.md`` says what that means and how the ingester reports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from farm.keys import RECORDS_SESSIONS_STREAM, records_stream_for
from farm.model import INT64_MAX
from farm.records.model import RECORD_KINDS, Record, Session, parse_record

STREAM_MAXLEN = 100_000
"""Entries kept per stream (at least; trimming is approximate). At level Basic a
compilation entry is about 0.5 KB, so a full stream is about 50 MB of Redis memory and
an ingester may be down (or behind) for 100,000 records of one kind before any is lost.
Level Full carries kernel sources (several KB each): lower the cap (``maxlen``) there."""

ENVELOPE_VERSION = 1
"""Version of the entry fields below. A reader refuses versions it does not know
(leaves them for a newer ingester) rather than guess."""

SOCKET_TIMEOUT_S = 5.0
"""How long a producer waits on Redis before the append fails (and the recorder keeps
the records to retry): a records problem must not hang a build."""


class EntryError(ValueError):
    """A stream entry that does not validate (malformed, or of an unknown format).

    ``retry_later`` is true when a newer farm version may have written it (a kind or
    envelope version this one does not know). The ingester sets it aside in the dead
    stream like any other, flagged, so that it neither blocks nor is re-read for ever;
    after an upgrade it can be sent again from there (docs/RECORDS.md).
    """

    def __init__(self, message: str, *, retry_later: bool = False) -> None:
        super().__init__(message)
        self.retry_later = retry_later


class SessionEntry(BaseModel):
    """A session as read back from ``farm:records:sessions``."""

    model_config = ConfigDict(frozen=True)

    session: Session
    keep_sessions: int | None = Field(default=None, ge=0, le=INT64_MAX)


def encode_session(session: Session, keep_sessions: int | None) -> dict[str, str]:
    """The fields of a session entry."""
    return {
        "v": str(ENVELOPE_VERSION),
        "session": session.model_dump_json(),
        "keep_sessions": "" if keep_sessions is None else str(keep_sessions),
    }


def encode_record(record: Record) -> dict[str, str]:
    """The fields of a record entry (its kind, so that one stream can carry versions)."""
    return {"v": str(ENVELOPE_VERSION), "kind": record.KIND, "record": record.model_dump_json()}


MAX_FIELD_BYTES = 32 * 1024 * 1024
"""Largest entry field read (a Full record's source is kilobytes)."""


def _text_fields(fields: Mapping[Any, Any]) -> dict[str, str]:
    """Entry fields as text, whether the client decodes responses or not; ``EntryError``
    for bytes that are not UTF-8 or a field over :data:`MAX_FIELD_BYTES`."""
    out: dict[str, str] = {}
    for name, value in fields.items():
        try:
            key = name.decode("utf-8") if isinstance(name, bytes) else str(name)
            text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as exc:
            raise EntryError(f"entry field {name!r} is not UTF-8 text ({exc.reason} at "
                             f"byte {exc.start})") from None
        if len(text) > MAX_FIELD_BYTES:
            raise EntryError(f"entry field {key!r} holds {len(text)} characters, over "
                             f"the limit of {MAX_FIELD_BYTES}")
        out[key] = text
    return out


def _check_version(fields: dict[str, str]) -> None:
    version = fields.get("v", "")
    if version != str(ENVELOPE_VERSION):
        # ASCII digits only: "²".isdigit() is true and int() of 5000 digits raises
        newer = (version.isascii() and version.isdigit() and len(version) <= 9
                 and int(version) > ENVELOPE_VERSION)
        raise EntryError(f"envelope version {version[:20]!r} is not {ENVELOPE_VERSION}",
                         retry_later=newer)


def decode_session(fields: Mapping[Any, Any]) -> SessionEntry:
    """Validate a session entry; ``EntryError`` when it does not."""
    text = _text_fields(fields)
    _check_version(text)
    keep = text.get("keep_sessions", "")
    try:
        if keep and not (keep.isascii() and keep.isdigit() and len(keep) <= 19):
            raise ValueError(f"keep_sessions {keep[:20]!r} is not a count")
        return SessionEntry(session=Session.model_validate_json(text.get("session", "")),
                            keep_sessions=int(keep) if keep else None)
    except (ValidationError, ValueError) as exc:
        raise EntryError(f"session entry does not validate: {_first_error(exc)}") from exc


def decode_record(fields: Mapping[Any, Any]) -> Record:
    """Validate a record entry; ``EntryError`` when it does not."""
    text = _text_fields(fields)
    _check_version(text)
    kind = text.get("kind", "")
    if kind not in RECORD_KINDS:
        raise EntryError(f"record kind {kind[:100]!r} is not known to this farm version",
                         retry_later=kind.startswith("records/"))
    try:
        return parse_record(kind, text.get("record", ""))
    except ValidationError as exc:
        raise EntryError(f"{kind} record does not validate: {_first_error(exc)}") from exc


def _first_error(exc: Exception) -> str:
    """One line for a log: pydantic's first error, or the exception's text."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def connect(url: str, *, socket_timeout_s: float | None = SOCKET_TIMEOUT_S) -> Any:
    """A Redis client for the records streams (bytes responses, bounded waits)."""
    import redis  # the `cluster` extra; imported here so the embedded path needs none

    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=SOCKET_TIMEOUT_S,
                                health_check_interval=30)


class RedisStreamSink:
    """A ``RecordSink`` that appends to the records streams.

    Each call is one round trip: the appends of a ``write_records`` call go in one
    MULTI/EXEC pipeline, so a batch is in Redis entirely or not at all, and a retried
    batch (the recorder retries whole batches) adds at most a second copy that the
    ingester stores once. Not thread-safe on its own, like the recorder's use of it
    requires (one recorder, one sink).
    """

    def __init__(self, client: Any, *, maxlen: int = STREAM_MAXLEN, owns: bool = False) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be at least 1")
        self.client = client
        self.maxlen = maxlen
        self._owns = owns

    @classmethod
    def open(cls, url: str, *, maxlen: int = STREAM_MAXLEN) -> RedisStreamSink:
        """A sink over a client of its own, closed with it."""
        return cls(connect(url), maxlen=maxlen, owns=True)

    def write_session(self, session: Session, *, keep_sessions: int | None = None) -> None:
        """Append the session; the ingester inserts it and prunes by ``keep_sessions``."""
        self.client.xadd(RECORDS_SESSIONS_STREAM, encode_session(session, keep_sessions),
                         maxlen=self.maxlen, approximate=True)

    def write_records(self, records: Sequence[Record]) -> None:
        """Append each record to its kind's stream, all in one MULTI/EXEC."""
        if not records:
            return
        pipe = self.client.pipeline(transaction=True)
        for record in records:
            pipe.xadd(records_stream_for(record.KIND), encode_record(record),
                      maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def close(self) -> None:
        """Close the client when this sink opened it."""
        if self._owns:
            self.client.close()

    def __repr__(self) -> str:
        return f"RedisStreamSink(maxlen={self.maxlen})"


__all__ = [
    "ENVELOPE_VERSION",
    "STREAM_MAXLEN",
    "EntryError",
    "RedisStreamSink",
    "SessionEntry",
    "connect",
    "decode_record",
    "decode_session",
    "encode_record",
    "encode_session",
]
