"""What a record and a session are: the validated shapes every transport and storage share.

A record is written by one process and read back by another (the ingester, `farm`
commands, a later farm version), so each one is a pydantic model that validates where
it enters, and each kind carries a storage name (``KIND``) with a format version in it.
Reading must keep working across versions: a field that was renamed keeps its old name
as an alias, and fields a newer writer added are ignored rather than refused.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Protocol

from pydantic import (
    AliasChoices,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from farm.core.hashing import sha256_hex
from farm.core.keys import record_kind
from farm.core.model import (
    INT64_MAX,
    ColumnText,
    Int32,
    Key,
    LogText,
    Name,
    NonNegInt64,
    RecordLevel,
    ShortText,
)
from farm.core.outcomes import Outcome
from farm.version import __version__

#: the row of ``schema_version`` that marks a session storage as ours (read without
#: SQLAlchemy by ``farm.records.open`` to decide whether opening it can wait)
STORAGE_COMPONENT = "kernel-farm records"


class Effect(StrEnum):
    """Whether a record changed the environment or only looked at it.

    A session is written only once it changes something, so that the many processes that
    merely load artifacts do not fill the storage with sessions nobody needs.
    """

    CHANGES = "changes"
    OBSERVES = "observes"


class RecordsConfig(BaseModel):
    """Settings of the records of one environment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: RecordLevel = RecordLevel.BASIC
    keep_sessions: int | None = Field(
        default=None,
        ge=0,
        le=INT64_MAX,
        description="Sessions kept when a new one is written; unset keeps every session, "
        "0 acts as 1 (the session being written always survives).",
    )
    max_held: int = Field(
        default=10_000,
        ge=0,
        le=INT64_MAX,
        description="Observed records held in memory while the session is not written "
        "yet; beyond it the oldest are dropped (and counted), so a process that only "
        "loads can run for ever in bounded memory.",
    )


class Clock(Protocol):
    """Where a recorder reads time; tests pass a fake one.

    Two clocks because they answer different questions: the wall clock dates a session
    (and makes its id), the monotonic clock measures offsets, which must never go
    backwards when the wall clock is adjusted.
    """

    def wall_ns(self) -> int:
        """Nanoseconds since the Unix epoch."""
        ...

    def monotonic_ns(self) -> int:
        """Nanoseconds of a clock that never goes backwards."""
        ...


class SystemClock:
    """The process's real clocks."""

    def wall_ns(self) -> int:
        """``time.time_ns()``."""
        return time.time_ns()

    def monotonic_ns(self) -> int:
        """``time.monotonic_ns()``."""
        return time.monotonic_ns()


_id_lock = threading.Lock()
_last_session_id = 0


def _unique_session_id(wall_ns: int) -> int:
    """The start in ns, bumped past any id this process handed out already.

    Two sessions started within one clock tick in one process (an environment switch
    in a tight loop) would otherwise share an id and mix their records.
    """
    global _last_session_id
    with _id_lock:
        session_id = max(wall_ns, _last_session_id + 1)
        _last_session_id = session_id
        return session_id


class Session(BaseModel):
    """One process's use of one environment.

    The id is the start time in nanoseconds since the epoch: ids sort by start, need no
    coordination between machines, and fit a signed 64-bit column until the year 2262.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    id: int = Field(gt=0, le=INT64_MAX)
    started_at: AwareDatetime
    farm_version: ColumnText = __version__
    label: ShortText = ""
    pid: Int32 = 0
    os: ColumnText = ""
    arch: ColumnText = ""
    host: ShortText = ""

    @field_validator("started_at")
    @classmethod
    def _storable(cls, value: dt.datetime) -> dt.datetime:
        """In UTC (how both storages keep it) within the years an id in ns can name:
        ``9999-12-31T23:59-23:59`` validates as a datetime but overflows when stored."""
        try:
            utc = value.astimezone(dt.UTC)
        except OverflowError:
            raise ValueError("start time out of range") from None
        if not 1970 <= utc.year <= 2262:
            raise ValueError("start time must be between 1970 and 2262")
        return value

    @classmethod
    def start(cls, label: str = "", clock: Clock | None = None) -> Session:
        """A new session of this process, started now."""
        wall_ns = (clock or SystemClock()).wall_ns()
        session_id = _unique_session_id(wall_ns)
        started_at = dt.datetime.fromtimestamp(session_id / 1e9, tz=dt.UTC)
        return cls(
            id=session_id,
            started_at=started_at,
            farm_version=__version__,
            label=label,
            pid=os.getpid(),
            os=platform.system(),
            arch=platform.machine(),
            host=socket.gethostname(),
        )


class Stamp(BaseModel):
    """Where a record sits: its session, its place in it, and when it happened.

    ``seq`` is shared by every record kind of a session, so the records of a session
    read back in the order they happened, whatever their kind.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    session: int = Field(gt=0, le=INT64_MAX)
    seq: NonNegInt64
    offset_s: float = Field(ge=0.0, le=1e12)


class RequestedBy(BaseModel):
    """Which build asked for this work, so a worker's records join its client's."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    session: int = Field(gt=0, le=INT64_MAX)
    batch: NonNegInt64


@dataclass(frozen=True)
class Trip:
    """One kernel obtained, as the process that obtained it saw it: what its compilation
    record says before the recorder stamps it (and keeps or drops its code by level).
    A plain dataclass: it is made per kernel, and the record validates."""

    family: str
    key: Key | str
    outcome: Outcome
    work_s: float
    worker: str = ""
    host: str = ""
    requested_by: RequestedBy | None = None
    native_fallback: str = ""
    #: its readable name, family and parameters (``KernelId.label()``)
    kernel: str = ""


@dataclass(frozen=True)
class BatchCounts:
    """What a batch record counts: kernels asked for and what came of each, the
    threads/workers that compiled at once, and the batch's wall and work time."""

    kernels: int
    wall_s: float
    work_s: float = 0.0
    loaded: int = 0
    rekeyed: int = 0
    compiled: int = 0
    unsupported: int = 0
    failed: int = 0
    parallelism: int = 1


class _Record(BaseModel):
    """Common base of the record kinds. ``extra="ignore"``: newer writers may add fields."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    KIND: ClassVar[str]

    stamp: Stamp

    @property
    def effect(self) -> Effect:
        """Whether this record changed the environment (see ``Effect``)."""
        raise NotImplementedError

    @property
    def changes(self) -> bool:
        """True when the record changed the environment."""
        return self.effect is Effect.CHANGES


class CompilationRecord(_Record):
    """One kernel obtained: how (outcome), what it cost (work time), and where.

    At level Full a Compiled or Rekeyed record also carries the source and build options
    it was obtained from. A Loaded record never does: a load runs no compiler, so there
    is no code to explain, and the code is already recorded by the session that made the
    artifact. The validator drops them rather than refusing, so records written by an
    older or careless writer still read.
    """

    KIND: ClassVar[str] = record_kind("compilation")

    family: Name
    key: Name
    outcome: Outcome
    work_s: float = Field(ge=0.0, le=1e12, validation_alias=AliasChoices("work_s", "duration"))
    #: the kernel as people name it, family and parameters (``matmul(k=512,...)``): what
    #: `farm records` shows instead of the key's hashes. "" in records of before it.
    kernel: ShortText = ""
    worker: ShortText = ""
    host: ShortText = ""
    source: LogText | None = None
    options: list[str] | None = Field(default=None, max_length=256)
    requested_by: RequestedBy | None = None
    #: a native artifact whose machine code the device refused: why (its portable
    #: binary was loaded instead; see farm/compilation/native.py). "" for every normal load.
    native_fallback: str = Field(default="", max_length=1000)

    @field_validator("key", mode="before")
    @classmethod
    def _key_text(cls, value: object) -> object:
        """Accept a ``Key`` as well as its text form."""
        return str(value) if isinstance(value, Key) else value

    @field_validator("source", "options")
    @classmethod
    def _loaded_has_no_code(cls, value: object, info: ValidationInfo) -> object:
        """Drop code from a Loaded record (``outcome`` is validated before these two).

        Field validators, not a model validator that runs before the fields: that one
        makes pydantic build a Python dict of every record read from JSON, which cost an
        ingester a third of its validation time."""
        return None if info.data.get("outcome") is Outcome.LOADED else value

    @property
    def effect(self) -> Effect:
        """Compiled and Rekeyed stored an artifact; Loaded only read one.

        A Loaded record of a native fallback counts as a change all the same: the device
        refused stored machine code and paid a JIT, which is exactly what an operator
        needs to find later, so it must not vanish with a session that only loaded.
        """
        if self.outcome is Outcome.LOADED and not self.native_fallback:
            return Effect.OBSERVES
        return Effect.CHANGES


#: the most a record keeps of a source (LogText's bound), and of each build option
MAX_SOURCE = 4 * 1024 * 1024
MAX_OPTION = 1000
MAX_OPTIONS = 256


def fit_code(source: str | None, options: Sequence[str] | None
             ) -> tuple[str | None, list[str] | None]:
    """``source`` and ``options`` within a :class:`CompilationRecord`'s bounds.

    A family can generate any amount of code; a record is bounded (storage, streams).
    A source over :data:`MAX_SOURCE` keeps its beginning and ends with a comment that
    says it was cut, how long it was and its SHA-256 (so it can still be matched with
    the one a person has); options are cut the same way, one by one.
    """
    if source is not None and len(source) > MAX_SOURCE:
        note = (f"\n/* kernel-farm: source cut to fit the record: {len(source)} characters, "
                f"sha256 {sha256_hex(source)} */")
        source = source[:MAX_SOURCE - len(note)] + note
    if options is not None:
        options = [o if len(o) <= MAX_OPTION else o[:MAX_OPTION - 3] + "..."
                   for o in list(options)[:MAX_OPTIONS]]
    return source, list(options) if options is not None else None


class CompilationBatchRecord(_Record):
    """Many kernels obtained together: what was asked, what came of it, what it cost.

    ``wall_s`` is what the batch cost the user (start to last load); ``work_s`` is the
    sum of its kernels' own work, so their ratio shows how well the work was spread.
    """

    KIND: ClassVar[str] = record_kind("compilation_batch")

    kernels: int = Field(ge=0, le=INT64_MAX, description="kernels asked for, failures included")
    loaded: NonNegInt64 = 0
    rekeyed: NonNegInt64 = 0
    compiled: NonNegInt64 = 0
    unsupported: NonNegInt64 = 0
    failed: NonNegInt64 = 0
    parallelism: int = Field(default=1, ge=0, le=INT64_MAX,
                             description="threads/workers that compiled at once")
    wall_s: float = Field(ge=0.0, le=1e12)
    work_s: float = Field(default=0.0, ge=0.0, le=1e12,
                          validation_alias=AliasChoices("work_s", "duration"))
    label: ShortText = ""

    @property
    def effect(self) -> Effect:
        """A batch that compiled or rekeyed anything changed the store."""
        return Effect.CHANGES if self.compiled or self.rekeyed else Effect.OBSERVES


#: the outcome column of a tune record in storage (records of other kinds have theirs)
TUNED = "Tuned"


class TunedCandidate(BaseModel):
    """One candidate of a tune record: its parameters (as text), status and figures."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    params: ShortText
    status: Name
    ms: float | None = Field(default=None, ge=0.0, le=1e12)
    spread: float | None = Field(default=None, ge=0.0, le=1e12)


class TuneRecord(_Record):
    """One tuning key measured on its device ("a key was tuned", seeds/records): the
    problem, every candidate's figures, the winner (``farm.tuning``). Always Changed: the
    store holds a new result. A key found tuned already is not measured, so it has no
    record."""

    KIND: ClassVar[str] = record_kind("tune")

    family: Name
    #: the tuning key (``id hash.build id``)
    key: Name
    #: the problem as people read it (``m=64 n=64 k=64 dtype=float``)
    problem: ShortText
    #: index into ``candidates`` of the winner; ``None`` when none had right values
    winner: int | None = Field(default=None, ge=0)
    candidates: list[TunedCandidate] = Field(default_factory=list, max_length=1024)
    #: seconds the check and the timing took
    work_s: float = Field(ge=0.0, le=1e12)
    #: the measurement had its device to itself (farm.core.isolation)
    isolated: bool = True
    worker: ShortText = ""
    host: ShortText = ""
    requested_by: RequestedBy | None = None

    @property
    def effect(self) -> Effect:
        return Effect.CHANGES

    @property
    def winner_ms(self) -> float | None:
        return None if self.winner is None or self.winner >= len(self.candidates) \
            else self.candidates[self.winner].ms

    @property
    def first_ms(self) -> float | None:
        return self.candidates[0].ms if self.candidates else None


Record = CompilationRecord | CompilationBatchRecord | TuneRecord
"""Any record kind."""

RECORD_KINDS: dict[str, type[CompilationRecord] | type[CompilationBatchRecord]
                   | type[TuneRecord]] = {
    CompilationRecord.KIND: CompilationRecord,
    CompilationBatchRecord.KIND: CompilationBatchRecord,
    TuneRecord.KIND: TuneRecord,
}
"""Storage name -> model, for reading records back from any transport."""


def parse_record(kind: str, payload: str | bytes | dict[str, Any]) -> Record:
    """Validate a stored record of the named kind (JSON text or already-decoded dict).

    Raises ``KeyError`` for a kind this version does not know, so that a caller can
    decide whether to skip it (a newer writer) or fail.
    """
    model = RECORD_KINDS[kind]
    if isinstance(payload, dict):
        return model.model_validate(payload)
    return model.model_validate_json(payload)
