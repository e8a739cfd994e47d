"""What ``farm build`` (and ``farm demo``) print when a build is done: the summary, the
work by worker, the failures, and whether the build was recorded.

Kept apart from the command so that whoever runs the build (the local batch, the
cluster client) hands over a report and this module alone decides how it reads at 80
columns (see ``farm.cli.tables``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.cli.console import out
from farm.cli.tables import Column, print_one_row, print_table
from farm.core.errors import printable
from farm.core.outcomes import Fate, Outcome

if TYPE_CHECKING:
    from farm.compilation.batch import BatchReport, KernelResult
    from farm.records import Recorder

SUMMARY_COLUMNS = [Column(name, justify="right") for name in (
    "kernels", *Fate, "work", "wall", "work/wall")]


def print_summary(report: BatchReport, title: str) -> None:
    """The outcome counts and times of one build: a row, or stacked pairs at 80 columns."""
    s = report.summary()
    print_one_row(SUMMARY_COLUMNS, [
        str(s["kernels"]), *(str(s[fate]) for fate in Fate), f"{s['work_s']:.2f} s",
        f"{s['wall_s']:.2f} s", f"{s['speedup']:.2f}x"], title=title)


def by_worker(report: BatchReport) -> dict[str, dict[str, float]]:
    """Worker process (``host:pid``, as ``farm workers`` lists them) -> its share."""
    found: dict[str, dict[str, float]] = {}
    for r in report.results:
        if r.worker and r.outcome is not None:
            w = found.setdefault(r.worker, {"kernels": 0, Fate.COMPILED: 0, "work_s": 0.0})
            w["kernels"] += 1
            w[Fate.COMPILED] += r.outcome is Outcome.COMPILED
            w["work_s"] = round(w["work_s"] + r.work_s, 4)
    return found


def print_workers(report: BatchReport) -> None:
    rows = [[name, str(int(w["kernels"])), str(int(w[Fate.COMPILED])), f"{w['work_s']:.2f} s"]
            for name, w in sorted(by_worker(report).items())]
    print_table([Column("worker process"), Column("kernels", "right"),
                 Column(Fate.COMPILED, "right"), Column("work", "right")], rows,
                title="work by worker process (host:pid, see `farm workers`)")


#: a failure's message and build log are shown whole (to be copied as the compiler wrote
#: them), only their control characters escaped
WHOLE = 1 << 30


def print_failures(report: BatchReport, strict: bool) -> None:
    if report.unsupported:
        style = "red" if strict else "yellow"
        out.print(f"[{style}]{len(report.unsupported)} kernel(s) the device cannot run"
                  f"{' (failures under --strict)' if strict else ''}:[/{style}]")
        for r in report.unsupported[:20]:  # labels and messages echo input: printable
            out.print(printable(f"  {r.label}: {r.failure.message if r.failure else ''}",
                                WHOLE), markup=False)
        if len(report.unsupported) > 20:
            out.print(f"  ... and {len(report.unsupported) - 20} more")
    for r in report.failed:
        assert r.failure is not None
        # soft_wrap: a message or a build log line is left whole for the terminal to
        # wrap, so it can be copied and searched as the compiler wrote it
        out.print("[red]FAILED[/red] ", end="")
        out.print(printable(f"{r.label} ({r.failure.kind}): {r.failure.message}", WHOLE),
                  markup=False, soft_wrap=True)
        if r.failure.build_log:
            for line in r.failure.build_log.splitlines()[:40]:
                out.print(f"    | {printable(line, WHOLE)}", markup=False, soft_wrap=True)


def recorded_session(recorder: Recorder | None) -> int | None:
    """The session a build was recorded under; ``None`` when it was not recorded."""
    return recorder.session.id if recorder is not None and recorder.written else None


def recorded_line(recorder: Recorder | None) -> str:
    """Whether the build is in the records, and how to read it, in one line.

    A build that only loaded is not recorded, by design (docs/RECORDS.md): a session is
    written once it changes something, so the many processes that merely load leave
    nothing behind. Said here because a person looking for it in `farm records` would
    otherwise think it was lost."""
    from farm.core.model import RecordLevel

    session = recorded_session(recorder)
    if session is not None:
        return f"recorded as session {session}: farm records show {session}"
    if recorder is not None and recorder.level is RecordLevel.OFF:
        return "not recorded: FARM_RECORDS_LEVEL is off"
    return ("not recorded: this build changed nothing (every kernel was loaded or failed), "
            "and only a build that stores something is recorded (docs/RECORDS.md)")


def failure_json(r: KernelResult) -> dict[str, object]:
    assert r.failure is not None
    return {"kernel": r.artifact.kernel.model_dump(mode="json"), "label": r.label,
            "key": str(r.key) if r.key else None, **r.failure.model_dump()}


__all__ = ["by_worker", "failure_json", "print_failures", "print_summary", "print_workers",
           "recorded_line", "recorded_session"]
