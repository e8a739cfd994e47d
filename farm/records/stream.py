"""The cluster's records transport: a recorder's session and records appended to Redis
streams, for the ingester (``farm.records.ingest``) to write into session storage.

Why streams and not direct writes to PostgreSQL from every process: a build may start
hundreds of worker processes, each with a short burst of records; an append to Redis
costs a fraction of a millisecond and needs no database connection per process, and the
ingester turns many small appends into few large, idempotent transactions.

Layout (names from ``farm.core.keys``):

- ``farm:records:sessions``: one entry per session, sent when the session first changes
  something (the recorder decides when; this sink never sees an observe-only session),
  carrying the session and its ``keep_sessions`` for the ingester to apply.
- ``farm:records:<kind>`` (``compilation``, ``compilation_batch``): one entry per
  *pack*: the records of that kind from one ``write_records`` call (a recorder's
  flush), in seq order, as one JSON array, split so that no pack is over
  ``PACK_MAX_BYTES``. Every record keeps its own stamp, so the entry id Redis gives it
  plays no part in identity: the ingester writes by (session, seq), and an entry sent
  twice (a retry after a timeout) is stored once.

Why packs: one entry per record made Redis, redis-py and the ingester pay for every
record what they pay for an entry (a command packed and parsed in Python, a reply
parsed field by field, a validation call); one entry per flush pays it once for up to
``PACK_MAX_BYTES`` of records, which is what lets a producer and an ingester sharing
two cores move tens of thousands of records a second.

Every entry is an envelope of flat string fields, versioned by its ``v`` field and
validated with pydantic when it is read back (``decode_session``, ``decode_records``):

- ``v`` = 1 (``ENVELOPE_VERSION``): a session entry (``session``, ``keep_sessions``) or
  a one-record entry (``kind``, ``record``: one JSON object). Producers before packs
  wrote these; the ingester still reads them, and a record it sets aside from a pack
  goes to the dead stream in this form, ready to be sent again by itself.
- ``v`` = 2 (``PACK_VERSION``): a record pack (``kind``, ``records``: a JSON array of
  1 to ``PACK_MAX_RECORDS`` objects of that kind). A record in it that does not
  validate is set aside alone; the others are written.

Each stream is capped with approximate trimming (``XADD ... MAXLEN ~ STREAM_MAXLEN``):
Redis then drops whole internal nodes of old entries, which costs next to nothing,
instead of trimming to the exact length on every append. The stream keeps at least the
cap (and at most about one node, 100 entries by default, more). Entries the ingester
has not yet written are trimmed like any others once it is more than the cap behind;
``docs/RECORDS.md`` says what that means and how the ingester reports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import to_json

from farm.core.errors import one_line
from farm.core.keys import RECORDS_SESSIONS_STREAM, records_stream_for
from farm.core.model import INT64_MAX
from farm.records.model import RECORD_KINDS, Record, Session, parse_record

if TYPE_CHECKING:
    import redis
    from redis.typing import EncodableT, FieldT

STREAM_MAXLEN = 40_000
"""Entries kept per stream (at least; trimming is approximate). An entry is one record
or a pack of at most ``PACK_MAX_BYTES``, so a full stream holds at most about 320 MB of
Redis memory whatever the level, and usually far less: a cluster worker sends a small
pack a second (the records of the kernels it compiled meanwhile), a build's client
packs of about twenty Basic records. An ingester may be down (or behind) for 40,000
sends of one kind before any record is lost: 40 minutes of 16 workers."""

ENVELOPE_VERSION = 1
"""Version of session entries and one-record entries. A reader refuses versions it
does not know (leaves them for a newer ingester) rather than guess."""

PACK_VERSION = 2
"""Version of a record entry that carries a pack (``records``, a JSON array)."""

PACK_MAX_BYTES = 8 * 1024
"""Most characters of JSON in one pack; a record larger than that (a Full record with
a long source) travels alone. Bounds the memory of a full stream (see
``STREAM_MAXLEN``) while a flush of Basic records (about 0.3 KB each) still costs an
entry per twenty-odd records: measured, packs of 64 KB made end-to-end throughput only
a few per cent higher."""

PACK_MAX_RECORDS = 4096
"""Most records a reader accepts in one pack (producers stay far below: a pack is at
most ``PACK_MAX_BYTES``). An entry of more is malformed: refused whole before any of
its records is validated, so a hostile entry of millions of ``{}`` costs nothing."""

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
    """The fields of a one-record entry (version 1, its kind, so that one stream can carry
    versions). Producers send packs (``encode_packs``); this form remains what the
    ingester sets a record of a pack aside in, and what older producers sent."""
    return {"v": str(ENVELOPE_VERSION), "kind": record.KIND, "record": record.model_dump_json()}


def encode_packs(records: Sequence[Record], *,
                 max_bytes: int = PACK_MAX_BYTES) -> list[tuple[str, dict[str, str]]]:
    """(stream, fields) of the entries that carry ``records``: one pack per kind, in the
    order given (seq order, as the recorder sends), split before a pack would grow over
    ``max_bytes`` characters of JSON (a larger record goes alone)."""
    by_kind: dict[str, list[str]] = {}
    for record in records:  # the model's serializer itself: model_dump_json() costs more
        by_kind.setdefault(record.KIND, []).append(
            record.__pydantic_serializer__.to_json(record).decode())
    out: list[tuple[str, dict[str, str]]] = []
    for kind, texts in by_kind.items():
        stream = records_stream_for(kind)
        pack: list[str] = []
        size = 2  # the brackets
        for text in texts:
            if pack and size + len(text) + 1 > max_bytes:
                out.append((stream, _pack_fields(kind, pack)))
                pack, size = [], 2
            pack.append(text)
            size += len(text) + 1
        out.append((stream, _pack_fields(kind, pack)))
    return out


def _pack_fields(kind: str, texts: list[str]) -> dict[str, str]:
    return {"v": str(PACK_VERSION), "kind": kind, "records": "[" + ",".join(texts) + "]"}


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


def _check_version(fields: dict[str, str], known: tuple[int, ...] = (ENVELOPE_VERSION,)
                   ) -> int:
    """The entry's envelope version when it is one of ``known``; ``EntryError`` when not
    (``retry_later`` when it is a newer one)."""
    version = fields.get("v", "")
    for number in known:
        if version == str(number):
            return number
    # ASCII digits only: "²".isdigit() is true and int() of 5000 digits raises
    newer = (version.isascii() and version.isdigit() and len(version) <= 9
             and int(version) > max(known))
    raise EntryError(f"envelope version {version[:20]!r} is not "
                     f"{' or '.join(map(str, known))}", retry_later=newer)


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
        raise EntryError(f"session entry does not validate: {one_line(exc)}") from exc


def decode_record(fields: Mapping[Any, Any]) -> Record:
    """Validate a one-record entry (version 1); ``EntryError`` when it does not."""
    text = _text_fields(fields)
    _check_version(text)
    return _decode_one(_known_kind(text), text.get("record", ""))


def _known_kind(text: dict[str, str]) -> str:
    kind = text.get("kind", "")
    if kind not in RECORD_KINDS:
        raise EntryError(f"record kind {kind[:100]!r} is not known to this farm version",
                         retry_later=kind.startswith("records/"))
    return kind


def _decode_one(kind: str, payload: str) -> Record:
    try:
        return parse_record(kind, payload)
    except ValidationError as exc:
        raise EntryError(f"{kind} record does not validate: {one_line(exc)}") from exc


@dataclass(frozen=True)
class BadRecord:
    """A record of a pack that does not validate: set aside alone, the others written.

    ``fields`` are those of a one-record entry (version 1) holding it as it came (its
    JSON re-encoded), so that the dead stream keeps it in a form that can be sent again
    by itself; ``index`` is its place in the pack."""

    index: int
    fields: dict[str, str]
    error: EntryError


@dataclass(frozen=True)
class DecodedRecords:
    """What a record entry holds: its valid records, and those of a pack that are not."""

    kind: str
    records: list[Record]
    bad: list[BadRecord] = field(default_factory=list)
    #: a pack (version 2); False for a one-record entry, which is set aside whole
    packed: bool = True


def decode_records(fields: Mapping[Any, Any]) -> DecodedRecords:
    """Validate a record entry of either version: a one-record entry (version 1) or a
    pack (version 2).

    ``EntryError`` when the entry as a whole does not validate (fields, version, kind;
    a pack that is not a JSON array of 1 to ``PACK_MAX_RECORDS`` objects); a record of a
    pack that does not validate comes back in ``bad`` and costs only itself.
    """
    text = _text_fields(fields)
    version = _check_version(text, (ENVELOPE_VERSION, PACK_VERSION))
    kind = _known_kind(text)
    if version == ENVELOPE_VERSION:
        return DecodedRecords(kind, [_decode_one(kind, text.get("record", ""))], packed=False)
    payload = text.get("records", "")
    try:  # the whole pack in one call: the common case, and the cheap one
        return DecodedRecords(kind, list(_PACK_ADAPTERS[kind].validate_json(payload)))
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
    whole = next((e for e in errors if not e["loc"]), None)
    if whole is not None:  # not JSON, not an array, empty, too long
        raise EntryError(f"{kind} pack is malformed: {whole['msg']}")
    return _split_pack(kind, payload, errors)


def _split_pack(kind: str, payload: str, errors: list[Any]) -> DecodedRecords:
    """A pack with some bad records: validate the others one by one (the rare path).

    The pack is known to be a JSON array within the limits (its errors all name an
    element), so it parses as a list of plain values; each element is validated again
    from its own JSON, so exactly the rules of the whole-pack validation apply.
    """
    reasons: dict[int, str] = {}
    for error in errors:
        index = error["loc"][0]
        if isinstance(index, int) and index not in reasons:
            where = ".".join(str(p) for p in error["loc"][1:])
            why = str(error["msg"]).removeprefix("Value error, ")
            reasons[index] = f"{where}: {why}" if where else why
    try:
        items = _ANY_LIST.validate_json(payload)
    except ValidationError as exc:  # cannot happen after the element errors above
        raise EntryError(f"{kind} pack is malformed: {one_line(exc)}") from exc
    records: list[Record] = []
    bad: list[BadRecord] = []
    for index, item in enumerate(items):
        try:
            raw = to_json(item).decode("utf-8")
        except (ValueError, TypeError):  # PydanticSerializationError is a ValueError
            raw = ""
        problem = reasons.get(index)
        if problem is None:
            try:
                records.append(parse_record(kind, raw))
                continue
            except ValidationError as exc:
                problem = one_line(exc)
        bad.append(BadRecord(
            index, {"v": str(ENVELOPE_VERSION), "kind": kind, "record": raw},
            EntryError(f"{kind} record {index} of a pack of {len(items)} does not "
                       f"validate: {problem}")))
    return DecodedRecords(kind, records, bad)


_PACK_ADAPTERS: dict[str, TypeAdapter[list[Record]]] = {
    kind: TypeAdapter(Annotated[list[model],  # type: ignore[arg-type,valid-type]
                                Field(min_length=1, max_length=PACK_MAX_RECORDS)])
    for kind, model in RECORD_KINDS.items()
}
_ANY_LIST: TypeAdapter[list[Any]] = TypeAdapter(list[Any])


def connect(url: str, *, socket_timeout_s: float | None = SOCKET_TIMEOUT_S) -> redis.Redis:
    """A Redis client for the records streams (bytes responses, bounded waits)."""
    import redis  # the `cluster` extra; imported here so the embedded path needs none

    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                socket_connect_timeout=SOCKET_TIMEOUT_S,
                                health_check_interval=30)


def stream_fields(fields: Mapping[str, str]) -> dict[FieldT, EncodableT]:
    """An entry's fields as redis-py's ``xadd`` takes them."""
    return {k: v for k, v in fields.items()}


class RedisStreamSink:
    """A ``RecordSink`` that appends to the records streams.

    Each call is one round trip: a ``write_records`` call appends one pack per kind (a
    few when a pack would be over ``PACK_MAX_BYTES``), all in one MULTI/EXEC pipeline, so
    a batch is in Redis entirely or not at all, and a retried batch (the recorder
    retries whole batches) adds at most a second copy that the ingester stores once.
    Not thread-safe on its own, like the recorder's use of it requires (one recorder,
    one sink).
    """

    def __init__(self, client: redis.Redis, *, maxlen: int = STREAM_MAXLEN,
                 owns: bool = False) -> None:
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
        self.client.xadd(RECORDS_SESSIONS_STREAM,
                         stream_fields(encode_session(session, keep_sessions)),
                         maxlen=self.maxlen, approximate=True)

    def write_records(self, records: Sequence[Record]) -> None:
        """Append the records as packs to their kinds' streams, all in one MULTI/EXEC
        (a single XADD, without MULTI, when they fit one pack)."""
        if not records:
            return
        packs = encode_packs(records)
        if len(packs) == 1:  # one command is atomic by itself
            stream, fields = packs[0]
            self.client.xadd(stream, stream_fields(fields), maxlen=self.maxlen,
                             approximate=True)
            return
        pipe = self.client.pipeline(transaction=True)
        for stream, fields in packs:
            pipe.xadd(stream, stream_fields(fields), maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def close(self) -> None:
        """Close the client when this sink opened it."""
        if self._owns:
            self.client.close()

    def __repr__(self) -> str:
        return f"RedisStreamSink(maxlen={self.maxlen})"


__all__ = [
    "ENVELOPE_VERSION",
    "PACK_MAX_BYTES",
    "PACK_MAX_RECORDS",
    "PACK_VERSION",
    "STREAM_MAXLEN",
    "BadRecord",
    "DecodedRecords",
    "EntryError",
    "RedisStreamSink",
    "SessionEntry",
    "connect",
    "decode_record",
    "decode_records",
    "decode_session",
    "encode_packs",
    "encode_record",
    "encode_session",
]
