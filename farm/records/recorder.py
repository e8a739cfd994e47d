"""The recorder: one session, and the rules for what it writes and when.

Rules (docs/ARCHITECTURE.md, "Records and sessions"):

- Level Off records nothing, Basic everything but code, Full also the source and build
  options of what was compiled or rekeyed (a Loaded record never carries code).
- A session is written only once a record that *changes* the environment arrives.
  Observed records before it (loads) are held in memory, at most ``max_held`` of them
  (the oldest are dropped beyond that, and counted), and are written with it, in order.
  A process that only ever loads leaves nothing behind, not even its session, unless
  other sessions' records name it: a cluster build that sends chunks calls
  ``referenced()`` first, because the workers' records of those chunks (Loaded ones
  too) name its session and batch (``RequestedBy``), and a record naming a session that
  was never written is what made ``farm records summary`` count a build that
  ``farm records sessions`` did not list.
- After that, records are written as they come, in small batches: a batch is sent when
  it reaches ``flush_records`` records, when a compilation batch record closes a batch
  of work, or when the oldest unsent record is ``flush_interval_s`` old (checked as
  records arrive). ``flush()`` and ``close()`` send everything. A recorder made with
  ``autoflush=True`` also sends from a background thread every ``flush_interval_s``,
  for processes that record a few kernels and then wait (a cluster worker): without it
  their last records would reach the sink only with the next record or at exit.
- A build that asks other processes to work for it takes a sequence number up front
  (``reserve_seq()``) for its batch record, names it in what it sends, and writes its
  batch record under it (``batch(..., seq=reserved)``), so that the workers' records and
  the client's batch record share one (session, batch) and join without guessing.
- Recording never fails a build: a sink that raises while records come in is logged,
  its records are kept and retried with the next send (sinks are idempotent by
  (session, seq)), bounded by ``max_held``. ``flush()`` and ``close()`` do raise, so
  the end of a build reports records that could not be written; a ``with`` block that
  an error or an interrupt leaves only warns, so that error stays the one shown.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from types import TracebackType

from farm.core.model import Lowered, RecordLevel
from farm.core.outcomes import Outcome
from farm.records.model import (
    BatchCounts,
    Clock,
    CompilationBatchRecord,
    CompilationRecord,
    Record,
    RecordsConfig,
    Session,
    Stamp,
    SystemClock,
    Trip,
    TuneRecord,
    fit_code,
)
from farm.records.sink import RecordSink

log = logging.getLogger(__name__)

FLUSH_RECORDS = 256
"""Records sent to the sink at once; a SQLite commit per record would cost more than the
record is worth when a batch loads thousands of kernels in a second."""

FLUSH_INTERVAL_S = 1.0
"""Oldest age of an unsent record before the next record sends it."""


class Recorder:
    """One session: a process's use of one environment, and the records it makes.

    Thread-safe: the compile path records from many threads. One lock orders
    everything, so sequence numbers are unique and increasing and records reach the
    sink in seq order. The recorder owns its sink and closes it in ``close()``.
    """

    def __init__(
        self,
        sink: RecordSink,
        config: RecordsConfig | None = None,
        label: str = "",
        *,
        clock: Clock | None = None,
        flush_records: int = FLUSH_RECORDS,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        autoflush: bool = False,
    ) -> None:
        self._sink = sink
        self.config = config if config is not None else RecordsConfig()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._flush_records = max(1, flush_records)
        self._flush_interval_ns = int(flush_interval_s * 1e9)
        self._lock = threading.Lock()
        self._session = Session.start(label, self._clock)
        self._start_ns = self._clock.monotonic_ns()
        self._seq = 0
        self._pending: deque[Record] = deque()
        self._pending_since_ns = 0
        self._due = False  # a changing record arrived: the session is to be written
        self._session_written = False
        self._dropped = 0
        self._failing = False
        self._closed = False
        self._reserved: set[int] = set()
        self._stop_flusher = threading.Event()
        self._flusher: threading.Thread | None = None
        if autoflush and self.config.level is not RecordLevel.OFF:
            self._flusher = threading.Thread(
                target=self._flush_periodically, name=f"records-flush-{self._session.id}",
                daemon=True)
            self._flusher.start()

    # -- state --------------------------------------------------------------------------

    @property
    def session(self) -> Session:
        """This recorder's session (whether written yet or not)."""
        return self._session

    @property
    def level(self) -> RecordLevel:
        """The recording level of this session."""
        return self.config.level

    @property
    def written(self) -> bool:
        """Whether the session has reached the sink (it changed something)."""
        with self._lock:
            return self._session_written

    @property
    def held(self) -> int:
        """Records made but not yet sent to the sink."""
        with self._lock:
            return len(self._pending)

    @property
    def dropped(self) -> int:
        """Records dropped because more than ``max_held`` waited to be written."""
        with self._lock:
            return self._dropped

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called; later records are ignored."""
        return self._closed

    # -- recording ----------------------------------------------------------------------

    def compilation(self, trip: Trip, lowered: Lowered | None = None
                    ) -> CompilationRecord | None:
        """Record one kernel obtained; None when nothing is recorded (level Off, closed).

        ``lowered`` (the source and build options it was obtained from) is kept only at
        level Full, and never on Loaded.
        """
        if self.config.level is RecordLevel.OFF or self._closed:
            return None
        keep_code = (self.config.level is RecordLevel.FULL and lowered is not None
                     and trip.outcome is not Outcome.LOADED)
        # any family can generate more than a record holds: cut, never fail
        source, options = fit_code(lowered.source, lowered.options) if keep_code and lowered \
            else (None, None)
        with self._lock:
            if self._closed:  # closed while this thread waited for the lock
                return None
            record = CompilationRecord(
                stamp=self._stamp(),
                family=trip.family,
                key=str(trip.key),
                outcome=trip.outcome,
                work_s=trip.work_s,
                worker=trip.worker,
                host=trip.host,
                source=source,
                options=options,
                requested_by=trip.requested_by,
                native_fallback=trip.native_fallback[:1000],
                kernel=trip.kernel[:1000],
            )
            self._add(record)
        return record

    def batch(self, counts: BatchCounts, *, label: str = "",
              seq: int | None = None) -> CompilationBatchRecord | None:
        """Record a batch of kernels obtained together; None when nothing is recorded.

        A batch record also sends what is waiting: the end of a batch is when a person
        may look at the records. ``seq``: a number from ``reserve_seq()`` to write the
        record under (each reserved number once); its offset is still "now", when the
        batch ended. Anything else raises ``ValueError``.
        """
        if self.config.level is RecordLevel.OFF or self._closed:
            return None
        with self._lock:
            if self._closed:  # closed while this thread waited for the lock
                return None
            if seq is not None and seq not in self._reserved:
                raise ValueError(f"records: seq {seq} was not reserved (or is used already)")
            stamp = self._stamp() if seq is None else self._stamp_reserved(seq)
            record = CompilationBatchRecord(stamp=stamp, label=label, **asdict(counts))
            self._add(record, send=True)
        return record

    def tune(self, make: Callable[[Stamp], TuneRecord]) -> TuneRecord | None:
        """Record one tuning key measured: ``make`` builds the record with this
        session's next stamp (``farm.tuning.runner``); ``None`` when nothing is
        recorded. Sent at once: a tuning is seconds of work, and a Changed record."""
        if self.config.level is RecordLevel.OFF or self._closed:
            return None
        with self._lock:
            if self._closed:
                return None
            record = make(self._stamp())
            self._add(record, send=True)
        return record

    def reserve_seq(self) -> int:
        """Take a sequence number now for a record written later (a build's batch), so
        that records made elsewhere on its behalf (workers) can name it up front."""
        with self._lock:
            self._seq += 1
            self._reserved.add(self._seq)
            return self._seq

    def referenced(self) -> None:
        """Other sessions are about to write records that name this one (a cluster
        build's workers): write the session now, and this session's records from now
        on, whatever their effect. Quiet on failure, like a record (retried later)."""
        if self.config.level is RecordLevel.OFF or self._closed:
            return
        with self._lock:
            if not self._due:
                self._due = True
                self._send(quiet=True)

    def flush(self) -> None:
        """Send every record waiting, if the session is to be written; raise on failure."""
        with self._lock:
            self._send(quiet=False)

    def close(self) -> None:
        """Send what is waiting (an observe-only session sends nothing), close the sink.

        Idempotent. Raises when the last records cannot be written; the sink is closed
        all the same.
        """
        self._stop_flusher.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=max(1.0, 2 * self._flush_interval_ns / 1e9))
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._send(quiet=False)
            finally:
                if self._dropped:
                    log.info("records: session %d dropped %d record(s) over max_held=%d",
                             self._session.id, self._dropped, self.config.max_held)
                self._pending.clear()
                self._sink.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.close_quietly()

    def close_quietly(self) -> None:
        """``close()`` for a block that an error or an interrupt is leaving: that one is
        the line to show, so records that cannot be written are a warning here, never a
        second error in its place. (Ctrl-C or SIGTERM in the middle of the first write's
        import of SQLAlchemy leaves it half imported, and the write at close then fails
        with an ``AttributeError`` that replaced the interrupt, traceback and all.)"""
        try:
            self.close()
        except Exception as exc:  # any sink failure: the records stay unwritten
            log.warning("records: the last records of session %d were not written (%s)",
                        self._session.id, " ".join(str(exc).split()))

    def __repr__(self) -> str:
        return (f"Recorder(session={self._session.id}, level={self.config.level.value}, "
                f"written={self._session_written})")

    # -- inside the lock ------------------------------------------------------------------

    def _stamp(self) -> Stamp:
        """The next stamp. Called with the lock held, so seq is unique and increasing."""
        self._seq += 1
        offset_ns = max(0, self._clock.monotonic_ns() - self._start_ns)
        return Stamp(session=self._session.id, seq=self._seq, offset_s=offset_ns / 1e9)

    def _stamp_reserved(self, seq: int) -> Stamp:
        """The stamp of a record written under a reserved seq (offset: now)."""
        self._reserved.discard(seq)
        offset_ns = max(0, self._clock.monotonic_ns() - self._start_ns)
        return Stamp(session=self._session.id, seq=seq, offset_s=offset_ns / 1e9)

    def _flush_periodically(self) -> None:
        """The autoflush thread: send what has waited ``flush_interval_s``, quietly."""
        interval_s = max(0.01, self._flush_interval_ns / 1e9)
        while not self._stop_flusher.wait(interval_s):
            with self._lock:
                if self._closed:
                    return
                if (
                    self._pending
                    and self._clock.monotonic_ns() - self._pending_since_ns
                    >= self._flush_interval_ns
                ):
                    self._send(quiet=True)

    def _add(self, record: Record, *, send: bool = False) -> None:
        """Queue a record and decide whether to send now."""
        now = self._clock.monotonic_ns()
        if not self._pending:
            self._pending_since_ns = now
        self._pending.append(record)
        if not self._due:
            if not record.changes:
                self._bound(self.config.max_held)
                return
            self._due = True
            send = True  # the session becomes durable as soon as it changed something
        if (
            send
            or len(self._pending) >= self._flush_records
            or now - self._pending_since_ns >= self._flush_interval_ns
        ):
            self._send(quiet=True)

    def _bound(self, limit: int) -> None:
        """Drop the oldest waiting records beyond ``limit``, counting them."""
        while len(self._pending) > limit:
            self._pending.popleft()
            self._dropped += 1

    def _send(self, *, quiet: bool) -> None:
        """Write the session (first time) and the waiting records to the sink.

        ``quiet``: a failure is logged and the records kept for the next send, because a
        records problem must not fail the kernel that is being recorded.
        """
        if not self._due:
            return
        try:
            if not self._session_written:
                self._sink.write_session(self._session, keep_sessions=self.config.keep_sessions)
                self._session_written = True
            if self._pending:
                # In seq order, as sinks expect: a batch record written under a reserved
                # seq comes after records with higher numbers.
                self._sink.write_records(sorted(self._pending, key=lambda r: r.stamp.seq))
                self._pending.clear()
        except Exception as exc:  # any sink failure: the records are kept and retried
            if not quiet:
                raise
            if not self._failing:
                log.warning("records: cannot write session %d yet (%s); will retry",
                            self._session.id, exc)
            self._failing = True
            self._bound(max(1, self.config.max_held))
            return
        if self._failing:
            log.warning("records: session %d written again", self._session.id)
        self._failing = False
        self._pending_since_ns = self._clock.monotonic_ns()
