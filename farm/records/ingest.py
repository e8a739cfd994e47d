"""The ingester: records streams -> session storage, each record exactly once.

Guarantees, and what gives each one:

- **Nothing lost while it is in the streams.** Ingesters read through one consumer group
  (``farm.core.keys.RECORDS_GROUP``); an entry a consumer has read stays *pending* (Redis
  keeps it, under that consumer) until acknowledged, and the ingester acknowledges only
  after the storage transaction that holds it has committed. An ingester that dies (even
  SIGKILL) between reading and acknowledging leaves its entries pending; any other
  ingester claims them once they have been idle ``claim_idle_ms`` (``XAUTOCLAIM``) and
  writes them. A restarted ingester with the same name also re-reads its own pending
  entries first.
- **Nothing twice.** Storage is keyed by (session, seq) and inserts skip rows already
  there, so an entry written twice (claimed from a slow ingester that was alive after
  all, sent twice by a producer that retried) is stored once. That is why several
  ingesters may run at once: they share the group's entries, and the rare overlap is
  harmless. Rows are inserted in (session, seq) order, so two PostgreSQL transactions
  over overlapping batches cannot deadlock.
- **Bounded by the cap.** The streams are capped (``farm.records.stream.STREAM_MAXLEN``,
  approximate trimming). An ingester more than the cap behind loses the oldest entries
  it has not read; it reports that (``lost``, and a log line) rather than pretending.
- **Stops cleanly.** ``run()`` returns at the first check of ``stop`` after the batch
  in hand is written and acknowledged; a blocking read waits at most ``block_ms``.
- **keep_sessions.** A session entry carries its producer's ``keep_sessions`` (the
  ingester's own applies to sessions that carry none). After a batch is committed, the
  ingester prunes storage protecting the batch's last session (in stream order, so the
  session that changed something last), as the embedded recorder does when it writes
  that session; with one ``keep_sessions`` for the cluster that is the same outcome as
  pruning once per session. Records of a pruned session that arrive after its prune (an
  ingester catching up reads the short sessions stream far ahead of the records) are
  dropped: after a prune, records of sessions older than every kept session are not
  written, and the next prune deletes any another ingester wrote.

Record entries are packs (many records of one kind, ``farm.records.stream``) or, from
producers before packs, one record each; a stream may hold both, and both are read.
Entries that do not validate (not UTF-8, out-of-range integers, non-finite floats, an
unknown kind, a pack that is not a JSON array of records) go to ``farm:records:dead``
(with the reason) and are acknowledged, so one bad entry neither blocks the stream nor
is retried for ever. A bad record inside a pack goes there alone, as a one-record
entry (``dead:index`` names its place): the pack's other records are written. Entries
that a newer farm may have written (a record kind or envelope version this version
does not know) go there too, flagged ``dead:newer``: left pending they would be
claimed and re-read by every ingester for ever. Upgrade the ingesters before the
producers; entries set aside meanwhile can be sent again from the dead stream
(docs/RECORDS.md).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from farm.core.defaults import INGEST_BATCH, INGEST_BLOCK_MS, INGEST_CLAIM_IDLE_MS
from farm.core.errors import StoreError
from farm.core.keys import (
    RECORDS_DEAD_STREAM,
    RECORDS_GROUP,
    RECORDS_SESSIONS_STREAM,
    records_stream_for,
)
from farm.records.model import RECORD_KINDS, Record
from farm.records.stream import (
    STREAM_MAXLEN,
    BadRecord,
    DecodedRecords,
    EntryError,
    SessionEntry,
    decode_records,
    decode_session,
    encode_record,
    stream_fields,
)

if TYPE_CHECKING:
    import redis

    from farm.records.storage import SessionStorage

log = logging.getLogger(__name__)

BATCH = INGEST_BATCH
"""Entries read per stream per round: large enough that one commit carries hundreds of
records (a PostgreSQL commit costs about a millisecond, a row a few microseconds), small
enough that a batch is written in well under a second."""

BLOCK_MS = INGEST_BLOCK_MS
"""Longest wait for new entries in one read; also the longest a stop request waits."""

CLAIM_IDLE_MS = INGEST_CLAIM_IDLE_MS
"""How long an entry must have been pending, unacknowledged, before another ingester
takes it over. Longer than any healthy write of a batch (so a slow but live ingester is
rarely overtaken, which would only cost a duplicate write), short enough that a dead
one's records are late by a minute, not lost."""

CHECK_INTERVAL_S = 30.0
"""How often the ingester looks at how far behind it is, and forgets dead consumers."""

DEAD_CONSUMER_IDLE_MS = 3_600_000
"""A consumer with nothing pending and idle this long is an ingester that is gone; it
is removed from the group so that the group's listing stays readable."""

RETRY_MAX_S = 5.0
"""Longest pause between attempts when storage or Redis fails."""


def default_consumer_name() -> str:
    """``host:pid``: unique per running ingester, and says where it runs."""
    return f"{socket.gethostname()}:{os.getpid()}"


def record_streams() -> list[str]:
    """Every stream an ingester of this version reads: sessions first, then each kind."""
    kinds = sorted({records_stream_for(kind) for kind in RECORD_KINDS})
    return [RECORDS_SESSIONS_STREAM, *kinds]


class IngestStats(BaseModel):
    """What an ingester did; logged, and printed by ``farm ingest`` when it stops."""

    batches: int = 0
    sessions: int = 0
    records: int = 0
    claimed: int = 0
    dead: int = 0
    deferred: int = 0
    lost: int = 0
    pruned: int = 0
    late: int = 0
    failures: int = 0


@dataclass
class _Entry:
    stream: str
    id: str
    fields: dict[Any, Any] | None  # None: trimmed away while pending
    decoded: SessionEntry | DecodedRecords | None = None
    error: EntryError | None = None  # the entry as a whole is set aside
    bad: list[BadRecord] = field(default_factory=list)  # records of a pack set aside


def _places(decoded: DecodedRecords) -> list[int]:
    """Each valid record's index in its pack (the bad ones' indices skipped)."""
    skipped = {bad.index for bad in decoded.bad}
    total = len(decoded.records) + len(skipped)
    return [i for i in range(total) if i not in skipped]


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector off for one round.

    A round builds tens of thousands of short-lived objects (a validated model and a
    row per record, none in a reference cycle: reference counting frees them all when
    the round ends). Left on, the collector runs every few hundred allocations and
    traverses everything the round holds, and now and then the whole heap: it took a
    third of the ingester's time. Cycles made meanwhile wait for the next collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _unstorable(exc: BaseException) -> EntryError:
    return EntryError(f"the records storage cannot hold it: {type(exc).__name__}: {exc}"[:300])


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_ours(name: bytes | str) -> bool:
    """A field the dead stream adds itself (a producer's copy of it is dropped)."""
    text = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
    return text.startswith("dead:")


def _id_tuple(entry_id: str) -> tuple[int, int]:
    """A stream id ``ms-seq`` as a comparable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Ingester:
    """One consumer of the records group, writing into one ``SessionStorage``.

    ``client`` is a ``redis.Redis`` (bytes responses). ``step()`` does one round (claim,
    or own backlog, or new entries) and returns how many entries it handled; ``run()``
    loops until ``stop`` is set.
    """

    def __init__(
        self,
        client: redis.Redis,
        storage: SessionStorage,
        *,
        consumer: str | None = None,
        batch: int = BATCH,
        block_ms: int = BLOCK_MS,
        claim_idle_ms: int = CLAIM_IDLE_MS,
        keep_sessions: int | None = None,
        check_interval_s: float = CHECK_INTERVAL_S,
        maxlen: int = STREAM_MAXLEN,
    ) -> None:
        if batch < 1 or block_ms < 0 or claim_idle_ms < 0:
            raise ValueError("batch must be >= 1, block_ms and claim_idle_ms >= 0")
        self.client = client
        self.storage = storage
        self.consumer = consumer or default_consumer_name()
        self.batch = batch
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.keep_sessions = keep_sessions
        self.check_interval_s = check_interval_s
        self.maxlen = maxlen
        self.streams = record_streams()
        self.stats = IngestStats()
        self._backlog_cursor: str | None = "0"  # own pending entries to re-read first
        self._next_claim = 0.0
        self._next_check = 0.0
        self._deferred_logged: set[str] = set()
        self._horizon: int | None = None  # after a prune: the oldest session kept
        self._stop = threading.Event()

    # -- set-up ---------------------------------------------------------------------------

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (and the streams), from the start:
        entries sent before the first ingester ever ran are read too."""
        import redis

        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, RECORDS_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, drain: bool = False) -> IngestStats:
        """Ingest until ``stop`` is set (or, with ``drain``, until nothing is left to read
        now). Failures of Redis or storage are logged and retried, never raised."""
        import redis

        stop = stop if stop is not None else self._stop
        delay = 0.1
        groups_ok = False
        while not stop.is_set():
            try:
                if not groups_ok:
                    self.ensure_groups()
                    groups_ok = True
                handled = self.step()
                delay = 0.1
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):  # streams deleted (or Redis lost them): recreate
                    log.warning("ingester %s: %s; creating the group again", self.consumer, exc)
                    groups_ok = False
                    continue
                log.error("ingester %s: Redis refused a command: %s", self.consumer, exc)
                self.stats.failures += 1
                stop.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("ingester %s: Redis unreachable (%s); retrying", self.consumer, exc)
                self.stats.failures += 1
                self._backlog_cursor = "0"
                stop.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            except StoreError as exc:
                log.warning("ingester %s: %s; retrying the batch", self.consumer, exc)
                self.stats.failures += 1
                self._backlog_cursor = "0"
                stop.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            if drain and handled == 0 and self._backlog_cursor is None:
                break
        return self.stats

    def stop(self) -> None:
        """Ask ``run()`` (without an event of its own) to return."""
        self._stop.set()

    def step(self) -> int:
        """One round: claim idle entries of others when due, else re-read own pending
        entries, else read new ones (blocking up to ``block_ms``). Returns entries handled.

        Raises Redis errors and ``StoreError``; nothing is acknowledged then, so the
        entries stay pending and are read again.
        """
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.check_interval_s
            self.check()
        if now >= self._next_claim:
            claimed, more = self._claim()
            if not more:
                self._next_claim = now + max(0.05, self.claim_idle_ms / 2000)
            if claimed:
                return self._handle(claimed)
        if self._backlog_cursor is not None:
            entries = self._read(self._backlog_cursor, block=False)
            if entries:
                self._backlog_cursor = max((e.id for e in entries), key=_id_tuple)
                return self._handle(entries)
            self._backlog_cursor = None
        return self._handle(self._read(">", block=True))

    # -- reading --------------------------------------------------------------------------

    def _read(self, after: str, *, block: bool) -> list[_Entry]:
        """Entries of every stream: ``>`` new ones, or own pending ones after an id."""
        reply = self.client.xreadgroup(
            RECORDS_GROUP, self.consumer, dict.fromkeys(self.streams, after),
            count=self.batch, block=self.block_ms if block else None)
        return list(self._entries(reply))

    @staticmethod
    def _entries(reply: object) -> Iterable[_Entry]:
        """Flatten XREADGROUP's reply: RESP2 ``[[stream, messages], ...]``, or redis-py's
        RESP3 ``{stream: [messages]}``."""
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
                yield _Entry(_text(stream), _text(entry_id), fields or None)

    def _claim(self) -> tuple[list[_Entry], bool]:
        """Take over entries idle longer than ``claim_idle_ms`` under any consumer (a dead
        ingester's). Returns them, and whether there may be more to claim."""
        claimed: list[_Entry] = []
        more = False
        for stream in self.streams:
            start = "0-0"
            while len(claimed) < self.batch:
                reply = self.client.xautoclaim(stream, RECORDS_GROUP, self.consumer,
                                               self.claim_idle_ms, start_id=start,
                                               count=self.batch - len(claimed))
                cursor, messages = _text(reply[0]), reply[1]
                deleted = reply[2] if len(reply) > 2 else []
                if deleted:
                    self.stats.lost += len(deleted)
                    log.error(
                        "ingester %s: %d pending entr(ies) of %s were trimmed before they "
                        "were written (the ingesters fell more than the cap behind): lost",
                        self.consumer, len(deleted), stream)
                for entry_id, fields in messages:
                    claimed.append(_Entry(stream, _text(entry_id), fields or None))
                if cursor == "0-0":
                    break
                start = cursor
            else:
                more = True
        if claimed:
            self.stats.claimed += len(claimed)
            log.info("ingester %s: claimed %d entr(ies) left pending by another ingester",
                     self.consumer, len(claimed))
        return claimed, more

    # -- writing --------------------------------------------------------------------------

    def _handle(self, entries: list[_Entry]) -> int:
        """Decode, write in one transaction, prune, then acknowledge."""
        if not entries:
            return 0
        with _cyclic_gc_paused():
            return self._handle_round(entries)

    def _handle_round(self, entries: list[_Entry]) -> int:
        sessions: list[SessionEntry] = []
        records: list[Record] = []
        ack: dict[str, list[str]] = {}
        dead: list[_Entry] = []
        for entry in entries:
            if entry.fields is None:  # trimmed while pending: nothing left to write
                self.stats.lost += 1
                log.error("ingester %s: entry %s of %s was trimmed before it was written: "
                          "lost", self.consumer, entry.id, entry.stream)
                ack.setdefault(entry.stream, []).append(entry.id)
                continue
            try:
                if entry.stream == RECORDS_SESSIONS_STREAM:
                    decoded_session = decode_session(entry.fields)
                    entry.decoded = decoded_session
                    sessions.append(decoded_session)
                else:
                    decoded = decode_records(entry.fields)
                    entry.decoded = decoded
                    entry.bad.extend(decoded.bad)
                    records.extend(decoded.records)
            except EntryError as exc:
                entry.error = exc
                dead.append(entry)
            ack.setdefault(entry.stream, []).append(entry.id)

        if self._horizon is not None:
            arriving = {s.session.id for s in sessions}
            kept = [r for r in records
                    if r.stamp.session >= self._horizon or r.stamp.session in arriving]
            self.stats.late += len(records) - len(kept)
            records = kept
        try:
            self.storage.write_batch([s.session for s in sessions], records)
        except (ValueError, TypeError, OverflowError):
            # A value that validated but that the storage cannot take. The models bound
            # every field so this should not happen; if it does, it must not stop the
            # ingester on every retry: find the entries that fail, one by one.
            sessions, records = self._write_singly(entries, sessions, records, dead)
        self._prune(sessions)
        pipe = self.client.pipeline(transaction=False)
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
                pipe.xadd(RECORDS_DEAD_STREAM, fields, maxlen=self.maxlen, approximate=True)
            for bad in entry.bad:  # one record of a pack, alone, as a one-record entry
                pipe.xadd(RECORDS_DEAD_STREAM, stream_fields(
                    {**bad.fields, "dead:stream": entry.stream, "dead:id": entry.id,
                     "dead:index": str(bad.index), "dead:error": str(bad.error)}),
                          maxlen=self.maxlen, approximate=True)
                bad_records += 1
        for stream, ids in ack.items():
            pipe.xack(stream, RECORDS_GROUP, *ids)
        pipe.execute()
        newer = [e for e in dead if e.error is not None and e.error.retry_later]
        for entry in dead:
            if entry in newer:
                self._defer(entry)
            else:
                log.error("ingester %s: entry %s of %s set aside in %s: %s", self.consumer,
                          entry.id, entry.stream, RECORDS_DEAD_STREAM, entry.error)
        for entry in entries:
            if entry.bad:  # one line per pack, however many of its records are bad
                log.error("ingester %s: %d record(s) of pack %s of %s set aside in %s, the "
                          "others written; first: %s", self.consumer, len(entry.bad),
                          entry.id, entry.stream, RECORDS_DEAD_STREAM, entry.bad[0].error)
        self.stats.batches += 1
        self.stats.sessions += len(sessions)
        self.stats.records += len(records)
        self.stats.dead += len(dead) - len(newer) + bad_records
        self.stats.deferred += len(newer)
        return len(entries)

    def _write_singly(self, entries: list[_Entry], sessions: list[SessionEntry],
                      records: list[Record], dead: list[_Entry]
                      ) -> tuple[list[SessionEntry], list[Record]]:
        """Write the batch item by item; set aside those the storage refuses for their
        data: a session or one-record entry whole (in ``dead``), a record of a pack
        alone (in its entry's ``bad``). Storage being down still raises ``StoreError``."""
        wanted = {id(x) for x in (*sessions, *records)}
        kept_sessions: list[SessionEntry] = []
        kept_records: list[Record] = []
        for entry in entries:
            item = entry.decoded
            if isinstance(item, SessionEntry):
                if id(item) not in wanted:
                    continue
                try:
                    self.storage.write_batch([item.session], [])
                    kept_sessions.append(item)
                except (ValueError, TypeError, OverflowError) as exc:
                    entry.error = _unstorable(exc)
                    dead.append(entry)
                continue
            if item is None:
                continue
            places = _places(item)
            for place, record in zip(places, item.records, strict=True):
                if id(record) not in wanted:
                    continue
                try:
                    self.storage.write_batch([], [record])
                    kept_records.append(record)
                except (ValueError, TypeError, OverflowError) as exc:
                    if not item.packed:  # the entry is this one record: set it aside whole
                        entry.error = _unstorable(exc)
                        dead.append(entry)
                    else:
                        entry.bad.append(BadRecord(place, encode_record(record),
                                                   _unstorable(exc)))
        return kept_sessions, kept_records

    def _prune(self, sessions: list[SessionEntry]) -> None:
        """Apply keep_sessions for the batch's last session that has one; a failure is
        logged (the records are committed; the next session prunes again)."""
        for entry in reversed(sessions):
            keep = entry.keep_sessions if entry.keep_sessions is not None else self.keep_sessions
            if keep is None:
                continue
            try:
                self.stats.pruned += self.storage.prune(keep, protect=entry.session.id)
                self._horizon = self.storage.oldest_session_id()
            except StoreError as exc:
                log.warning("ingester %s: pruning to %d session(s) failed: %s",
                            self.consumer, keep, exc)
            return

    def _defer(self, entry: _Entry) -> None:
        """Log (once per reason) an entry of a newer format set aside for a newer
        ingester: in the dead stream flagged ``dead:newer``, never left pending, where
        every claim would hand it out again for ever."""
        reason = str(entry.error)
        if reason not in self._deferred_logged:
            self._deferred_logged.add(reason)
            log.warning("ingester %s: setting aside entries for a newer ingester in %s "
                        "(flagged dead:newer): %s", self.consumer, RECORDS_DEAD_STREAM,
                        reason)

    # -- looking after the group ----------------------------------------------------------

    def check(self) -> None:
        """Warn when the group is far behind or past the cap; forget dead consumers.

        Advisory: a Redis error here is logged and the round goes on (the read that
        follows reports Redis being down properly)."""
        import redis

        for stream in self.streams:
            try:
                groups = self.client.xinfo_groups(stream)
                info = self.client.xinfo_stream(stream)
            except redis.RedisError as exc:
                log.debug("ingester %s: cannot inspect %s: %s", self.consumer, stream, exc)
                continue
            group = next((g for g in groups if _text(g.get("name")) == RECORDS_GROUP), None)
            if group is None:
                continue
            lag = group.get("lag")
            if isinstance(lag, int) and lag > self.maxlen // 2:
                log.warning("ingester %s: %s is %d entries behind (cap %d): add ingesters "
                            "before the cap trims unread records", self.consumer, stream,
                            lag, self.maxlen)
            first = info.get("first-entry")
            last_delivered = _text(group.get("last-delivered-id", "0-0"))
            if first and last_delivered != "0-0" and \
                    _id_tuple(_text(first[0])) > _id_tuple(last_delivered):
                log.error("ingester %s: %s was trimmed past the last entry the ingesters "
                          "read (%s): unread records are being lost", self.consumer, stream,
                          last_delivered)
            try:
                self._forget_dead_consumers(stream)
            except redis.RedisError as exc:
                log.debug("ingester %s: cannot tidy consumers of %s: %s", self.consumer,
                          stream, exc)

    def _forget_dead_consumers(self, stream: str) -> None:
        for consumer in self.client.xinfo_consumers(stream, RECORDS_GROUP):
            name = _text(consumer.get("name"))
            if name == self.consumer or consumer.get("pending", 0):
                continue
            if int(consumer.get("idle", 0)) > DEAD_CONSUMER_IDLE_MS:
                self.client.xgroup_delconsumer(stream, RECORDS_GROUP, name)


__all__ = [
    "BATCH",
    "BLOCK_MS",
    "CLAIM_IDLE_MS",
    "IngestStats",
    "Ingester",
    "default_consumer_name",
    "record_streams",
]
