"""Reading records back as builds: summaries and timelines (``farm records``).

A **build** is one batch of work a session asked for, seen whole across processes:

- in a cluster, the client reserves a sequence number for its batch (``RequestedBy``)
  and every worker's compilation record names it, so the build is the client's batch
  record plus every record, of any session, that names (client session, batch);
- embedded, a session's compilation records belong to the batch record that follows
  them in sequence order (a batch writes its record when it ends);
- records with neither make a build of their own per session (batch ``None``).

Each kernel counts **once per build**, by key: a kernel recorded twice (a task
re-delivered after a worker died, loaded by one worker after another compiled it) is
the most telling of its records, Compiled over Rekeyed over Loaded. The client's batch
record, when there is one, is the authority on the build's totals (it also counts the
kernels the client found in the store itself and those that failed, which no worker
recorded).

Times: a record's stamp has an offset since its session's start, measured on the
monotonic clock at the moment the kernel was done, and its work time; a session has its
start in wall-clock time. So a kernel ran from ``start + offset - work`` to
``start + offset``. Workers on other machines put their bars on their own wall clocks,
so the picture is as exact as the hosts' clocks agree (NTP: milliseconds).
"""

from __future__ import annotations

import datetime as dt
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from farm.core.errors import InputError
from farm.core.outcomes import Outcome
from farm.records.model import CompilationBatchRecord, CompilationRecord, Record, Session

if TYPE_CHECKING:
    from farm.records.storage import SessionStorage

_PRECEDENCE = {Outcome.COMPILED: 3, Outcome.REKEYED: 2, Outcome.LOADED: 1}
"""Which of a kernel's records says most about it (see the module docstring)."""

CLIENT_LANE = "client"
"""The lane (and "by worker" row) of the kernels the build's own process obtained itself
(found in the store before sending the rest): not a worker, and named so."""

STRAGGLER_FACTOR = 2.0
"""A kernel is a straggler when its work is at least this many times the median work of
its build's kernels (of builds of at least ``STRAGGLER_MIN_KERNELS``)."""

STRAGGLER_MIN_KERNELS = 4

_BUILD_REF = re.compile(r"\s*([0-9]{1,19})\s*(?::\s*([0-9]{1,19})\s*)?", re.ASCII)


class BuildRef(BaseModel):
    """``SESSION[:BATCH]``: the session that asked, and the batch (its sequence number)."""

    model_config = ConfigDict(frozen=True)

    session: int
    batch: int | None = None

    @classmethod
    def parse(cls, text: str) -> BuildRef:
        """``"123"`` or ``"123:7"``; ``InputError`` otherwise."""
        found = _BUILD_REF.fullmatch(text)
        if found is None or int(found.group(1)) >= 2**63 or \
                (found.group(2) and int(found.group(2)) >= 2**63):
            raise InputError(f"build {text[:40]!r}: expected SESSION or SESSION:BATCH (numbers, as "
                             "`farm records sessions` and `farm records show` print them)")
        batch = found.group(2)
        return cls(session=int(found.group(1)), batch=int(batch) if batch else None)

    def __str__(self) -> str:
        return str(self.session) if self.batch is None else f"{self.session}:{self.batch}"


class Outcomes(BaseModel):
    """How a set of kernels was obtained."""

    kernels: int = 0
    loaded: int = 0
    rekeyed: int = 0
    compiled: int = 0
    unsupported: int = 0
    failed: int = 0

    def add(self, other: Outcomes) -> None:
        """Add another set's counts to these."""
        for name in type(self).model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count(self, outcome: Outcome) -> None:
        """Count one kernel of this outcome."""
        self.kernels += 1
        name = outcome.value.lower()
        setattr(self, name, getattr(self, name) + 1)


class GroupSummary(BaseModel):
    """The kernels of one family, or of one worker."""

    name: str
    kernels: int = 0
    loaded: int = 0
    rekeyed: int = 0
    compiled: int = 0
    work_s: float = 0.0
    slowest_s: float = 0.0


class KernelLine(BaseModel):
    """One kernel, as the summary's "slowest" list shows it."""

    build: str
    family: str
    #: family and parameters (``matmul(k=512,...)``); "" for records of before it
    kernel: str = ""
    key: str
    outcome: Outcome
    work_s: float
    worker: str


class Summary(BaseModel):
    """What ``farm records summary`` prints (and ``--json`` returns)."""

    scope: str
    builds: list[str]
    sessions: int
    kernels: int
    outcomes: Outcomes
    unattributed: int = Field(description="kernels of a build with no compilation record: "
                              "found in the store by the client itself, or failed")
    missing: int = Field(default=0, description="kernels a build's batch record counts as "
                         "compiled or rekeyed (an artifact was stored) with no Compiled or "
                         "Rekeyed record: records that never came")
    store_hit_rate: float | None = Field(description="loaded / (loaded+rekeyed+compiled)")
    compiler_avoided_rate: float | None = Field(
        description="(loaded+rekeyed) / (loaded+rekeyed+compiled)")
    work_s: float
    wall_s: float
    work_over_wall: float | None
    workers: list[str]
    by_family: list[GroupSummary]
    by_worker: list[GroupSummary]
    slowest: list[KernelLine]


@dataclass
class Build:
    """One build's records, gathered from every session that worked on it."""

    ref: BuildRef
    batch: CompilationBatchRecord | None = None
    runs: list[CompilationRecord] = field(default_factory=list)

    @property
    def kernels(self) -> dict[str, CompilationRecord]:
        """Key -> the most telling record of that kernel (each kernel once)."""
        chosen: dict[str, CompilationRecord] = {}
        for run in self.runs:
            best = chosen.get(run.key)
            if best is None or _PRECEDENCE[run.outcome] > _PRECEDENCE[best.outcome]:
                chosen[run.key] = run
        return chosen

    @property
    def sessions(self) -> set[int]:
        """Every session with a record in this build."""
        found = {run.stamp.session for run in self.runs}
        if self.batch is not None:
            found.add(self.batch.stamp.session)
        return found

    def outcomes(self) -> Outcomes:
        """The client's batch record's counts when there is one, else the records'."""
        if self.batch is not None:
            b = self.batch
            return Outcomes(kernels=b.kernels, loaded=b.loaded, rekeyed=b.rekeyed,
                            compiled=b.compiled, unsupported=b.unsupported, failed=b.failed)
        counted = Outcomes()
        for run in self.kernels.values():
            counted.count(run.outcome)
        return counted


    def missing(self) -> int:
        """Kernels the client counts as stored (compiled or rekeyed) that no record
        says were: a compile whose artifact is stored but whose record never came.
        (Workers send such a record before they store; see docs/RELIABILITY.md.)"""
        if self.batch is None:
            return 0
        recorded = sum(1 for r in self.kernels.values() if r.outcome is not Outcome.LOADED)
        return max(0, self.batch.compiled + self.batch.rekeyed - recorded)


def group_builds(records: Iterable[Record]) -> list[Build]:
    """Gather records into builds (see the module docstring), ordered by reference."""
    compilations: list[CompilationRecord] = []
    batches: dict[int, list[CompilationBatchRecord]] = defaultdict(list)
    for record in records:
        if isinstance(record, CompilationBatchRecord):
            batches[record.stamp.session].append(record)
        elif isinstance(record, CompilationRecord):  # tune records: farm.records.tuning
            compilations.append(record)
    for session_batches in batches.values():
        session_batches.sort(key=lambda b: b.stamp.seq)

    def next_batch(session: int, seq: int) -> CompilationBatchRecord | None:
        """The session's batch record at ``seq`` or the first after it."""
        return next((b for b in batches.get(session, []) if b.stamp.seq >= seq), None)

    # A batch record written under a reserved seq has the workers' number already; one
    # written later (a client that did not pass the reserved seq) is found as the first
    # batch record after the reservation, and takes the workers' number.
    ref_of_batch: dict[tuple[int, int], BuildRef] = {}
    for asked in {r.requested_by for r in compilations if r.requested_by is not None}:
        found = next_batch(asked.session, asked.batch)
        if found is not None:
            ref_of_batch.setdefault((asked.session, found.stamp.seq),
                                    BuildRef(session=asked.session, batch=asked.batch))

    builds: dict[BuildRef, Build] = {}

    def build_of(ref: BuildRef) -> Build:
        return builds.setdefault(ref, Build(ref=ref))

    for session, session_batches in batches.items():
        for b in session_batches:
            ref = ref_of_batch.get((session, b.stamp.seq),
                                   BuildRef(session=session, batch=b.stamp.seq))
            build_of(ref).batch = b
    for run in compilations:
        if run.requested_by is not None:
            ref = BuildRef(session=run.requested_by.session, batch=run.requested_by.batch)
        else:
            own = next_batch(run.stamp.session, run.stamp.seq)
            if own is None:
                ref = BuildRef(session=run.stamp.session)
            else:
                ref = ref_of_batch.get((own.stamp.session, own.stamp.seq),
                                       BuildRef(session=own.stamp.session, batch=own.stamp.seq))
        build_of(ref).runs.append(run)
    return sorted(builds.values(),
                  key=lambda b: (b.ref.session, -1 if b.ref.batch is None else b.ref.batch))


def load_builds(storage: SessionStorage, ref: BuildRef | None = None) -> list[Build]:
    """Every stored build, or those of one ``SESSION[:BATCH]``; ``InputError`` when a
    given build has no record (a wrong number, or not ingested yet)."""
    if ref is None:
        return group_builds(storage.all_records())
    builds = [b for b in group_builds(storage.build_records(ref.session))
              if b.ref.session == ref.session]
    if ref.batch is not None:
        builds = [b for b in builds if b.ref.batch == ref.batch
                  or (b.batch is not None and b.batch.stamp.seq == ref.batch)]
    if not builds:
        raise InputError(f"no records of build {ref} in {storage.where} (a session id from "
                         "`farm records sessions`; records of a cluster reach storage "
                         "through `farm ingest`)")
    return builds


def lane_of(run: CompilationRecord, client: int) -> str:
    """Where a kernel was obtained: its worker (``host:pid``), else its host, else the
    build's own process (:data:`CLIENT_LANE`), else the session that recorded it."""
    if run.worker or run.host:
        return run.worker or run.host
    return CLIENT_LANE if run.stamp.session == client else f"session {run.stamp.session}"


def summarize(builds: Sequence[Build], *, scope: str = "all", top: int = 10) -> Summary:
    """Totals over ``builds``, each kernel once per build."""
    outcomes = Outcomes()
    families: dict[str, GroupSummary] = {}
    workers: dict[str, GroupSummary] = {}
    lines: list[KernelLine] = []
    sessions: set[int] = set()
    unattributed = missing = 0
    work = wall = 0.0
    for build in builds:
        sessions |= build.sessions
        counted = build.outcomes()
        outcomes.add(counted)
        kernels = build.kernels
        unattributed += max(0, counted.kernels - len(kernels))
        missing += build.missing()
        for run in kernels.values():
            worker = lane_of(run, build.ref.session)
            for group, name in ((families, run.family), (workers, worker)):
                row = group.setdefault(name, GroupSummary(name=name))
                row.kernels += 1
                outcome = run.outcome.value.lower()
                setattr(row, outcome, getattr(row, outcome) + 1)
                row.work_s += run.work_s
                row.slowest_s = max(row.slowest_s, run.work_s)
            work += run.work_s
            lines.append(KernelLine(build=str(build.ref), family=run.family,
                                    kernel=run.kernel, key=run.key, outcome=run.outcome,
                                    work_s=run.work_s, worker=worker))
        wall += build.batch.wall_s if build.batch is not None else _span(build.runs)
    obtained = outcomes.loaded + outcomes.rekeyed + outcomes.compiled
    lines.sort(key=lambda line: line.work_s, reverse=True)
    return Summary(
        scope=scope,
        builds=[str(b.ref) for b in builds],
        sessions=len(sessions),
        kernels=outcomes.kernels,
        outcomes=outcomes,
        unattributed=unattributed,
        missing=missing,
        store_hit_rate=_ratio(outcomes.loaded, obtained),
        compiler_avoided_rate=_ratio(outcomes.loaded + outcomes.rekeyed, obtained),
        work_s=round(work, 6),
        wall_s=round(wall, 6),
        work_over_wall=_ratio(work, wall),
        workers=sorted(workers),
        by_family=_rounded(families),
        by_worker=_rounded(workers),
        slowest=lines[:top],
    )


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _rounded(groups: dict[str, GroupSummary]) -> list[GroupSummary]:
    rows = sorted(groups.values(), key=lambda g: (-g.work_s, g.name))
    return [g.model_copy(update={"work_s": round(g.work_s, 6),
                                 "slowest_s": round(g.slowest_s, 6)}) for g in rows]


def _span(runs: Sequence[CompilationRecord]) -> float:
    """Wall time of runs of one session with no batch record: first start to last end."""
    if not runs:
        return 0.0
    return max(r.stamp.offset_s for r in runs) - min(r.stamp.offset_s - r.work_s for r in runs)


# -- timeline -----------------------------------------------------------------------------


class Bar(BaseModel):
    """One kernel's work on one lane, in seconds since the build started."""

    lane: str
    start_s: float
    end_s: float
    family: str
    #: family and parameters (``matmul(k=512,...)``); "" for records of before it
    kernel: str = ""
    key: str
    outcome: Outcome
    work_s: float
    straggler: bool = False


class Timeline(BaseModel):
    """What ``farm records timeline`` draws: one lane per worker, a bar per kernel."""

    build: str
    label: str
    started_at: dt.datetime | None
    wall_s: float
    lanes: list[str]
    bars: list[Bar]
    missing_sessions: list[int] = Field(
        default_factory=list,
        description="sessions with records in the build but no session row (not ingested "
        "yet, or pruned): their bars cannot be placed")

    @property
    def workers(self) -> list[str]:
        """The lanes that are workers: every lane but the build's own process."""
        return [lane for lane in self.lanes if lane != CLIENT_LANE]

    def lanes_text(self) -> str:
        """``2 worker(s) and the client``: what the lanes are, the same words in the
        picture and the CLI."""
        client = CLIENT_LANE in self.lanes
        if not self.workers:
            return "the client alone" if client else "no lane"
        return f"{len(self.workers)} worker(s){' and the client' if client else ''}"


def timeline(storage: SessionStorage, ref: BuildRef) -> Timeline:
    """The timeline of one build (all its batches when ``ref`` names only a session)."""
    builds = load_builds(storage, ref)
    runs = [run for b in builds for run in b.runs]
    batches = [b.batch for b in builds if b.batch is not None]
    sessions = storage.sessions_by_id({r.stamp.session for r in runs} | {ref.session})
    return place(ref, runs, batches, sessions)


def place(ref: BuildRef, runs: Sequence[CompilationRecord],
          batches: Sequence[CompilationBatchRecord], sessions: dict[int, Session]) -> Timeline:
    """Put runs on lanes and in time (see the module docstring for the clock rules)."""

    def end_of(session: int, offset_s: float) -> float:
        return sessions[session].started_at.timestamp() + offset_s

    missing = sorted({r.stamp.session for r in runs if r.stamp.session not in sessions})
    placed = [r for r in runs if r.stamp.session in sessions]
    spans = [(end_of(r.stamp.session, r.stamp.offset_s) - r.work_s,
              end_of(r.stamp.session, r.stamp.offset_s)) for r in placed]
    starts = [s for s, _ in spans]
    ends = [e for _, e in spans]
    client = sessions.get(ref.session)
    label = client.label if client is not None else ""
    for b in batches:
        if b.stamp.session in sessions:
            end = end_of(b.stamp.session, b.stamp.offset_s)
            starts.append(end - b.wall_s)
            ends.append(end)
            label = b.label or label
    if not starts:
        return Timeline(build=str(ref), label=label, started_at=None, wall_s=0.0, lanes=[],
                        bars=[], missing_sessions=missing)
    origin = min(starts)
    works = [r.work_s for r in placed]
    median = statistics.median(works) if len(works) >= STRAGGLER_MIN_KERNELS else None
    bars = [
        Bar(lane=lane_of(r, ref.session),
            start_s=round(start - origin, 6), end_s=round(end - origin, 6), family=r.family,
            kernel=r.kernel, key=r.key, outcome=r.outcome, work_s=r.work_s,
            straggler=median is not None and median > 0
            and r.work_s >= STRAGGLER_FACTOR * median)
        for r, (start, end) in zip(placed, spans, strict=True)
    ]
    bars.sort(key=lambda bar: (bar.start_s, bar.lane))
    lanes: list[str] = []
    for bar in bars:
        if bar.lane not in lanes:
            lanes.append(bar.lane)
    return Timeline(build=str(ref), label=label,
                    started_at=dt.datetime.fromtimestamp(origin, tz=dt.UTC),
                    wall_s=round(max(ends) - origin, 6), lanes=lanes, bars=bars,
                    missing_sessions=missing)


__all__ = [
    "CLIENT_LANE",
    "Bar",
    "Build",
    "BuildRef",
    "GroupSummary",
    "KernelLine",
    "Outcomes",
    "Summary",
    "Timeline",
    "group_builds",
    "lane_of",
    "load_builds",
    "place",
    "summarize",
    "timeline",
]
