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
What does not validate, or what a newer farm may have written, is set aside in
``farm:records:dead`` and acknowledged (:mod:`farm.records.entries`, docs/RECORDS.md).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from farm.core.defaults import INGEST_BATCH, INGEST_BLOCK_MS, INGEST_CLAIM_IDLE_MS
from farm.core.errors import StoreError
from farm.core.gcpause import cyclic_gc_paused
from farm.core.keys import (
    RECORDS_DEAD_STREAM,
    RECORDS_GROUP,
    RECORDS_SESSIONS_STREAM,
    records_stream_for,
)
from farm.core.outage import Waiter, describe_refusal
from farm.records.entries import Entry, flatten_reply, places, set_aside, unstorable
from farm.records.group import check_group, ensure_groups, stream_id, text
from farm.records.model import RECORD_KINDS, Record
from farm.records.stream import (
    STREAM_MAXLEN,
    BadRecord,
    EntryError,
    SessionEntry,
    decode_records,
    decode_session,
    encode_record,
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

RETRY_MAX_S = 5.0
"""Longest pause between attempts when storage or Redis fails."""


@dataclass(frozen=True)
class Pacing:
    """How much an ingester reads at once and how long it waits (see the constants)."""

    batch: int = BATCH
    block_ms: int = BLOCK_MS
    claim_idle_ms: int = CLAIM_IDLE_MS
    check_interval_s: float = CHECK_INTERVAL_S


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


class Ingester:
    """One consumer of the records group, writing into one ``SessionStorage``.

    ``client`` is a ``redis.Redis`` (bytes responses). ``step()`` does one round (claim,
    or own backlog, or new entries) and returns how many entries it handled; ``run()``
    loops until ``stop`` is set.
    """

    def __init__(self, client: redis.Redis, storage: SessionStorage, *,
                 consumer: str | None = None, pacing: Pacing | None = None,
                 keep_sessions: int | None = None, maxlen: int = STREAM_MAXLEN,
                 waiter: Waiter | None = None) -> None:
        pacing = pacing or Pacing()
        if pacing.batch < 1 or pacing.block_ms < 0 or pacing.claim_idle_ms < 0:
            raise ValueError("batch must be >= 1, block_ms and claim_idle_ms >= 0")
        self.client = client
        self.storage = storage
        self.consumer = consumer or default_consumer_name()
        self.batch = pacing.batch
        self.block_ms = pacing.block_ms
        self.claim_idle_ms = pacing.claim_idle_ms
        self.keep_sessions = keep_sessions
        self.check_interval_s = pacing.check_interval_s
        self.maxlen = maxlen
        self.streams = record_streams()
        self.stats = IngestStats()
        self._backlog_cursor: str | None = "0"  # own pending entries to re-read first
        self._next_claim = 0.0
        self._next_check = 0.0
        self._deferred_logged: set[str] = set()
        self._horizon: int | None = None  # after a prune: the oldest session kept
        self._stop = threading.Event()
        #: Redis's outages (``farm ingest`` passes one with FARM_OUTAGE_LIMIT): ``run()``
        #: raises its OutageError once an outage outlasts the limit; without one it
        #: retries for ever (a test's in-process ingester)
        self.waiter = waiter

    # -- set-up ---------------------------------------------------------------------------

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream (:func:`farm.records.group.ensure_groups`)."""
        ensure_groups(self.client, self.streams)

    # -- the loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, drain: bool = False) -> IngestStats:
        """Ingest until ``stop`` is set (or, with ``drain``, until nothing is left to read
        now). Failures of Redis or storage are logged and retried; with a ``waiter``, an
        outage of Redis longer than its limit raises its
        :class:`~farm.core.outage.OutageError` (as a worker and a client give up: the
        entries read and not yet acknowledged stay pending for the next ingester)."""
        import redis

        stop = stop if stop is not None else self._stop
        delay = 0.1
        groups_ok = False
        while not stop.is_set():
            started = time.monotonic()  # an outage starts with the attempt that failed
            try:
                if not groups_ok:
                    self.ensure_groups()
                    groups_ok = True
                handled = self.step()
                delay = 0.1
                if self.waiter is not None:
                    self.waiter.mark_up()
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
                told = describe_refusal("Redis", exc, "FARM_REDIS_URL")  # not "unreachable"
                self.stats.failures += 1
                self._backlog_cursor = "0"
                if told is None and self.waiter is not None:
                    self.waiter.check(exc, started)  # one line; OutageError past the limit
                    stop.wait(self._outage_pause(delay))
                else:
                    log.warning("ingester %s: %s; retrying", self.consumer,
                                told or f"Redis unreachable ({exc})")
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

    def _outage_pause(self, delay: float) -> float:
        """``delay``, cut short so that the attempt after it is made by the outage
        limit: the end comes within one attempt (a socket timeout) of the limit."""
        since = self.waiter.down_since if self.waiter is not None else None
        if since is None or self.waiter is None:
            return delay
        return max(0.05, min(delay, since + self.waiter.limit_s - time.monotonic()))

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
                self._backlog_cursor = max((e.id for e in entries), key=stream_id)
                return self._handle(entries)
            self._backlog_cursor = None
        return self._handle(self._read(">", block=True))

    # -- reading --------------------------------------------------------------------------

    def _read(self, after: str, *, block: bool) -> list[Entry]:
        """Entries of every stream: ``>`` new ones, or own pending ones after an id."""
        reply = self.client.xreadgroup(
            RECORDS_GROUP, self.consumer, dict.fromkeys(self.streams, after),
            count=self.batch, block=self.block_ms if block else None)
        return list(flatten_reply(reply))

    def _claim(self) -> tuple[list[Entry], bool]:
        """Take over entries idle longer than ``claim_idle_ms`` under any consumer (a dead
        ingester's). Returns them, and whether there may be more to claim."""
        claimed: list[Entry] = []
        more = False
        for stream in self.streams:
            start = "0-0"
            while len(claimed) < self.batch:
                reply = self.client.xautoclaim(stream, RECORDS_GROUP, self.consumer,
                                               self.claim_idle_ms, start_id=start,
                                               count=self.batch - len(claimed))
                cursor, messages = text(reply[0]), reply[1]
                deleted = reply[2] if len(reply) > 2 else []
                if deleted:
                    self.stats.lost += len(deleted)
                    log.error(
                        "ingester %s: %d pending entr(ies) of %s were trimmed before they "
                        "were written (the ingesters fell more than the cap behind): lost",
                        self.consumer, len(deleted), stream)
                for entry_id, fields in messages:
                    claimed.append(Entry(stream, text(entry_id), fields or None))
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

    def _handle(self, entries: list[Entry]) -> int:
        """Decode, write in one transaction, prune, then acknowledge."""
        if not entries:
            return 0
        with cyclic_gc_paused():
            return self._handle_round(entries)

    def _handle_round(self, entries: list[Entry]) -> int:
        sessions: list[SessionEntry] = []
        records: list[Record] = []
        ack: dict[str, list[str]] = {}
        dead: list[Entry] = []
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
        bad_records = set_aside(pipe, entries, dead, self.maxlen)
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

    def _write_singly(self, entries: list[Entry], sessions: list[SessionEntry],
                      records: list[Record], dead: list[Entry]
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
                    entry.error = unstorable(exc)
                    dead.append(entry)
                continue
            if item is None:
                continue
            where = places(item)
            for place, record in zip(where, item.records, strict=True):
                if id(record) not in wanted:
                    continue
                try:
                    self.storage.write_batch([], [record])
                    kept_records.append(record)
                except (ValueError, TypeError, OverflowError) as exc:
                    if not item.packed:  # the entry is this one record: set it aside whole
                        entry.error = unstorable(exc)
                        dead.append(entry)
                    else:
                        entry.bad.append(BadRecord(place, encode_record(record),
                                                   unstorable(exc)))
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

    def _defer(self, entry: Entry) -> None:
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
        """Warn when the group is far behind or past the cap; forget dead consumers
        (:func:`farm.records.group.check_group`)."""
        check_group(self.client, self.streams, self.consumer, self.maxlen)


__all__ = [
    "BATCH",
    "BLOCK_MS",
    "CLAIM_IDLE_MS",
    "IngestStats",
    "Ingester",
    "Pacing",
    "default_consumer_name",
    "record_streams",
]
