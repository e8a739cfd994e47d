"""What a tuning measures and keeps: the measurement policy, each candidate's figures,
and a key's result, the JSON stored under its key (:mod:`farm.tuning.store`).

A result is read back from stores, bundles and other machines, so it validates like any
input: figures are finite, every candidate of the key is there in its order with its
parameters, and the winner is the fastest candidate whose values were right. A result
that breaks any of it is not a result (a miss), never half of one.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import Field, model_validator

from farm.core.model import Frozen, ShortText
from farm.core.outcomes import Fate
from farm.tuning.keys import Params, TuningSpec

#: what became of a candidate: ``ok`` (right values, timed), ``wrong`` (its values differ
#: from the family's reference: never a winner), ``unsupported`` (the device cannot run
#: it: a work-group or local memory over the limits), ``failed`` (it did not compile,
#: load or launch)
Status = Literal["ok", "wrong", Fate.UNSUPPORTED, Fate.FAILED]


class MeasurePolicy(Frozen):
    """How long each candidate of a key is timed (docs/TUNING.md says why these).

    After the reference check (whose launch is not timed either), ``warmups`` launches of
    each candidate, then rounds in which every candidate still timed launches once, in
    a rotating order, until each has at least ``min_launches`` launches *and*
    ``min_ms`` of kernel time, or ``max_launches`` launches. Once a candidate has
    ``prune_after`` launches and even its fastest is slower than ``prune_factor`` times
    the fastest median, it is timed no more (``0``: never). ``max_s`` bounds one key's
    timing (a budget: the figures then say so); ``batch_ms`` is about how much kernel
    time is queued between two waits on the device."""

    warmups: int = Field(default=2, ge=0, le=100)
    min_launches: int = Field(default=10, ge=1, le=100_000)
    min_ms: float = Field(default=50.0, ge=0.0, le=1e7)
    max_launches: int = Field(default=1000, ge=1, le=1_000_000)
    prune_after: int = Field(default=3, ge=1, le=100_000)
    prune_factor: float = Field(default=1.5, ge=0.0, le=1000.0)
    max_s: float = Field(default=60.0, gt=0.0, le=86_400.0)
    batch_ms: float = Field(default=20.0, gt=0.0, le=10_000.0)

    @model_validator(mode="after")
    def _ordered(self) -> MeasurePolicy:
        if self.max_launches < self.min_launches:
            raise ValueError("max_launches must be at least min_launches")
        if self.prune_factor and self.prune_factor < 1.0:
            raise ValueError("prune_factor must be 0 (never) or at least 1")
        return self

    def exhaustive(self, factor: int = 3) -> MeasurePolicy:
        """``factor`` times the launches and kernel time, every candidate to the end:
        the reference a tuning is checked against (bench/bench_tune.py)."""
        return self.model_copy(update={
            "min_launches": self.min_launches * factor, "min_ms": self.min_ms * factor,
            "max_launches": max(self.max_launches, self.min_launches * factor),
            "prune_factor": 0.0, "max_s": self.max_s * factor})


class Figures(Frozen):
    """One candidate's measurement."""

    params: Params
    status: Status
    #: median kernel time of the timed launches (profiling events), milliseconds
    ms: float | None = Field(default=None, ge=0.0)
    #: interquartile range over the median: how much the launches varied
    spread: float | None = Field(default=None, ge=0.0)
    #: fastest timed launch, milliseconds
    min_ms: float | None = Field(default=None, ge=0.0)
    launches: int = Field(default=0, ge=0)
    #: why it is not ok, or why it was timed less than the policy asks ("" otherwise)
    note: ShortText = ""

    @model_validator(mode="after")
    def _timed_if_ok(self) -> Figures:
        if self.status == "ok" and (self.ms is None or not self.launches):
            raise ValueError("an ok candidate has a time")
        if self.status != "ok" and self.ms is not None:
            raise ValueError(f"a {self.status} candidate has no time")
        return self


class TuningResult(Frozen):
    """One key measured on one device: every candidate's figures and the winner."""

    #: the stored result's format
    format: Literal[1] = 1
    spec: TuningSpec
    fingerprint: ShortText
    candidates: tuple[Figures, ...]
    #: index of the fastest ok candidate; ``None`` when none is ok
    winner: int | None
    policy: MeasurePolicy
    #: whether the measurement had its device to itself (farm.core.isolation)
    isolated: bool
    #: seconds the check and the timing took
    wall_s: float = Field(ge=0.0)
    measured_at: dt.datetime
    host: ShortText = ""
    worker: ShortText = ""

    @model_validator(mode="after")
    def _consistent(self) -> TuningResult:
        if len(self.candidates) != len(self.spec.candidates) or any(
                f.params != c for f, c in zip(self.candidates, self.spec.candidates,
                                               strict=True)):
            raise ValueError("the figures are not those of the key's candidates")
        if fastest(self.candidates) != self.winner:
            raise ValueError("the winner is not the fastest ok candidate")
        return self

    @property
    def winner_figures(self) -> Figures | None:
        return None if self.winner is None else self.candidates[self.winner]

    @property
    def first(self) -> Figures:
        """The first-listed candidate: what a user launches untuned."""
        return self.candidates[0]

    @property
    def speedup(self) -> float | None:
        """The first-listed candidate's time over the winner's; ``None`` when either has
        none."""
        won, first = self.winner_figures, self.first
        if won is None or won.ms is None or first.ms is None or won.ms <= 0:
            return None
        return first.ms / won.ms


def fastest(figures: tuple[Figures, ...] | list[Figures]) -> int | None:
    """Index of the ok candidate with the lowest median (the first of equals)."""
    best: int | None = None
    for i, f in enumerate(figures):
        if f.status == "ok" and f.ms is not None and (
                best is None or f.ms < (figures[best].ms or 0.0)):
            best = i
    return best


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
