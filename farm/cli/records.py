"""``farm records``: read the sessions and records of the environment's session storage.

Every listing also as ``--json`` (stdout only; progress and errors go to stderr). The
storage is ``FARM_RECORDS_URL`` (PostgreSQL in a cluster), else the environment's
SQLite file. In a cluster, records reach storage through ``farm ingest``: a build's
records show up here within a second or two of being made, while an ingester runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from farm.cli.console import out, print_error, print_json
from farm.cli.help import examples, new_app
from farm.cli.tables import (
    Column,
    natural_width,
    new_table,
    print_one_row,
    print_table,
    print_title,
)
from farm.core.errors import FarmError, InputError, StoreError
from farm.core.outcomes import OBTAINED, Fate, Outcome

if TYPE_CHECKING:
    from farm.core.settings import Settings
    from farm.records.model import CompilationRecord, Record, Session
    from farm.records.query import BuildRef, KernelLine, Summary
    from farm.records.storage import SessionStorage

#: the sessions table's counts, what changed the store first
SESSION_OUTCOMES = (Outcome.COMPILED, Outcome.REKEYED, Outcome.LOADED)

app = new_app("Read what the farm did: sessions, records, builds, timelines.",
              epilog=examples("farm records sessions", "farm records show latest",
                              "farm records summary --build latest", "farm records tuning",
                              "farm records timeline latest -o build.html"))

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
WideOpt = Annotated[bool, typer.Option(
    "--wide", help="every column (keys, hosts, builds) whatever the terminal's width")]


@contextmanager
def open_storage(settings: Settings | None = None, *,
                 write: bool = False) -> Iterator[SessionStorage]:
    """The environment's session storage. An embedded environment with no records file
    yet reads as empty (a read command creates no file). A read command never migrates
    (nor switches to WAL): it checks the database is ours and at this schema version,
    so a read-only or foreign file is diagnosed as what it is."""
    from farm.core.settings import load_settings
    from farm.records.storage import SCHEMA_VERSION, SessionStorage

    settings = settings or load_settings()
    path = settings.records_path
    if settings.records_url is None and not path.exists():
        with SessionStorage("sqlite://") as empty:
            empty.where = f"{path} (no records yet)"
            yield empty
        return
    with SessionStorage(settings.effective_records_url, migrate=write) as storage:
        if not write:
            version = storage.schema_version()
            if version != SCHEMA_VERSION:
                raise StoreError(f"records storage {storage.where} is at schema version "
                                 f"{version}, this farm reads {SCHEMA_VERSION}: a writing "
                                 "command (farm build, farm ingest) upgrades it")
        yield storage


def _when(session: Session, seconds: bool = True) -> str:
    """A session's start in local time, to the second (or minute): what a person reads."""
    return session.started_at.astimezone().strftime(
        "%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def _session_id(storage: SessionStorage, text: str) -> int:
    """A session id, or ``latest`` (the newest stored session)."""
    if text == "latest":
        newest = storage.sessions(limit=1)
        if not newest:
            raise InputError(f"no session in {storage.where}")
        return newest[0].id
    if text.isascii() and text.isdigit() and 0 < len(text) <= 19 and int(text) < 2**63:
        return int(text)
    raise InputError(f"session {text[:40]!r}: a session id (a number from `farm records "
                     "sessions`) or `latest`")


def _build_ref(storage: SessionStorage, text: str) -> BuildRef:
    """``SESSION[:BATCH]``, where SESSION may be ``latest``: the newest session that
    holds a build (a batch record), not a worker's session started later."""
    from farm.records.query import BuildRef

    session, colon, batch = text.partition(":")
    if session != "latest":
        return BuildRef.parse(text)
    newest = storage.sessions(limit=50)
    counts = storage.session_counts(s.id for s in newest)
    builds = [s.id for s in newest if counts.get(s.id, {}).get("batches", 0)]
    if not builds and not newest:
        raise InputError(f"no session in {storage.where}")
    return BuildRef.parse(f"{(builds or [newest[0].id])[0]}{colon}{batch}")


@app.command("sessions", epilog=examples("farm records sessions",
                                         "farm records sessions -n 5 --wide",
                                         "farm records sessions --json"))
def sessions(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, metavar="N",
                                       help="the newest N")] = 50,
    wide: WideOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """List sessions, newest first: label, host, and what each changed.

    The id is what `farm records show` and `farm records timeline` take.
    """
    with open_storage() as storage:
        found = storage.sessions(limit=limit)
        counts = storage.session_counts(s.id for s in found)
    rows = []
    for session in found:
        c = counts.get(session.id, {})
        row: dict[str, Any] = {
            **session.model_dump(mode="json"),
            **{o.fate: c.get(o, 0) for o in SESSION_OUTCOMES},
            "batches": c.get("batches", 0),
            "records": c.get("records", 0),
            "missing": max(0, c.get("max_seq", 0) - c.get("records", 0)),
        }
        rows.append(row)
    if json_out:
        print_json(rows)
        return
    columns = [Column("id"), Column("started"), Column("label", wrap=True),
               *(Column(o.fate, "right") for o in SESSION_OUTCOMES),
               Column("host", optional=True), Column("pid", "right", optional=True),
               Column("batches", "right", optional=True),
               Column("records", "right", optional=True)]
    cells = [[str(session.id), _when(session, seconds=wide), session.label,
              *(str(row[o.fate]) for o in SESSION_OUTCOMES), session.host,
              str(session.pid), str(row["batches"]), str(row["records"])]
             for session, row in zip(found, rows, strict=True)]
    title = f"sessions (newest first) in {storage.where}"
    if wide and natural_width(out, new_table(columns, cells)) > out.width:
        _print_blocks(title, columns, cells)
    else:
        print_table(columns, cells, title=title, wide=wide)
    if not found:
        out.print("no session stored yet (a session is written once it changes something)")


def _print_blocks(title: str, columns: list[Column], cells: list[list[str]]) -> None:
    """Every column of a listing too wide for the terminal, one block per row: the
    first three values on its first line, the others as ``name value`` pairs below,
    wrapped at words (``--wide`` at 80 columns)."""
    import textwrap

    print_title(title)
    width = max(40, out.width)
    for row in cells:
        out.print()
        head = "  ".join(row[:3])
        rest = ", ".join(f"{col.header} {value}" for col, value in
                         zip(columns[3:], row[3:], strict=True))
        for text, indent in ((head, "    "), (rest, "  ")):
            first = "" if indent == "    " else indent
            out.print("\n".join(textwrap.wrap(text, width, initial_indent=first,
                                              subsequent_indent=indent,
                                              break_long_words=False)),
                      markup=False, highlight=False, soft_wrap=True)


def _record_json(record: Record) -> dict[str, Any]:
    return {"kind": record.KIND, **record.model_dump(mode="json")}


def kernel_name(record: CompilationRecord | KernelLine, *, key: bool = False) -> str:
    """Family and parameters, as the build's progress named it; the key only on demand
    (``--wide``), or where an older record carries no name."""
    if not record.kernel:
        return f"{record.family} {record.key}"
    name = record.kernel.replace(",", ", ")  # a long one wraps between parameters
    return f"{name} {record.key}" if key else name


def _record_what(record: Record, wide: bool = False) -> str:
    from farm.records.model import CompilationBatchRecord, CompilationRecord, TuneRecord

    if isinstance(record, TuneRecord):
        won = record.candidates[record.winner].params if record.winner is not None \
            else "none"
        where = f" on {record.worker}" if record.worker else ""
        return (f"Tuned {record.family} {record.problem}: {len(record.candidates)} "
                f"candidates, winner {won} ({_ms(record.winner_ms)} ms, first "
                f"{_ms(record.first_ms)} ms){where}"
                + ("" if record.isolated else ", not isolated"))
    if isinstance(record, CompilationRecord):
        asked = (f" for {record.requested_by.session}:{record.requested_by.batch}"
                 if record.requested_by else "")
        where = f" on {record.worker}" if record.worker else ""
        return f"{record.outcome.value} {kernel_name(record, key=wide)}{where}{asked}"
    assert isinstance(record, CompilationBatchRecord)
    return (f"batch {record.label!r}: {record.kernels} kernels, {record.loaded} loaded, "
            f"{record.rekeyed} rekeyed, {record.compiled} compiled, {record.unsupported} "
            f"unsupported, {record.failed} failed; wall {record.wall_s:.3f} s")


@app.command("show", epilog=examples("farm records show latest",
                                     "farm records show latest --outcome compiled -n 20",
                                     "farm records show latest --family matmul --limit 0",
                                     "farm records show 1796187761603293040 --wide"))
def show(
    session: Annotated[str, typer.Argument(help="session id, or `latest`",
                                           metavar="SESSION")],
    family: Annotated[str | None, typer.Option(
        "--family", metavar="NAME", help="only the kernels of this family")] = None,
    outcome: Annotated[str | None, typer.Option(
        "--outcome", metavar="OUTCOME",
        help="only the kernels of this outcome: compiled, rekeyed or loaded")] = None,
    limit: Annotated[int | None, typer.Option(
        "--limit", "-n", min=0, metavar="N",
        help=f"the first N records (default {SHOW_LIMIT}; 0: all; --json: all)")] = None,
    wide: Annotated[bool, typer.Option(
        "--wide", help="also each kernel's key (id hash . build id)")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Show one session and its records, in order.

    Kernels are named by family and parameters; --wide adds their keys. A long session
    shows its first records and says how many more there are.
    """
    with open_storage() as storage:
        session_id = _session_id(storage, session)
        found = storage.session(session_id)
        records = storage.records(session_id)
    if found is None and not records:
        raise InputError(f"no session {session_id} in {storage.where}")
    records = _filtered(records, family, outcome)
    shown = records if (json_out and limit is None) or limit == 0 else \
        records[:SHOW_LIMIT if limit is None else limit]
    if json_out:
        print_json({"session": found.model_dump(mode="json") if found else None,
                    "records": [_record_json(r) for r in shown]})
        return
    if found is not None:
        out.print(f"session {found.id}: {found.label!r} on {found.host} (pid {found.pid}, "
                  f"{found.os} {found.arch}), kernel-farm {found.farm_version}, started "
                  f"{_when(found)}", markup=False)
    else:
        out.print(f"session {session_id}: records without a session row (not ingested yet, "
                  "or pruned)", markup=False)
    print_table([Column("seq", "right"), Column("offset s", "right"),
                 Column("work s", "right"), Column("what", wrap=True)],
                [[str(record.stamp.seq), f"{record.stamp.offset_s:.3f}",
                  f"{record.work_s:.3f}", _record_what(record, wide)] for record in shown])
    which = " of that family or outcome" if family or outcome else ""
    if not records:
        out.print(f"no record{which}", markup=False)
    elif len(shown) < len(records):
        out.print(f"({len(records) - len(shown)} more record(s){which}: --limit N, --limit 0 "
                  "for all, --family, --outcome, or --json)", markup=False, highlight=False)


SHOW_LIMIT = 50
"""Records ``farm records show`` prints unless told (a model build has thousands)."""


def _filtered(records: list[Record], family: str | None,
              outcome: str | None) -> list[Record]:
    """The compilation records of ``family`` and ``outcome`` (either may be None); every
    record when neither is given. An outcome that is none is bad input, with the
    closest one."""
    import difflib

    from farm.records.model import CompilationRecord

    if family is None and outcome is None:
        return records
    wanted = None
    if outcome is not None:
        names = {o.value.lower(): o for o in Outcome}
        wanted = names.get(outcome.lower())
        if wanted is None:
            close = difflib.get_close_matches(outcome.lower(), list(names), n=1)
            guess = f"; did you mean {close[0]}?" if close else ""
            raise InputError(f"--outcome {outcome[:40]!r}: one of {', '.join(names)}{guess}")
    return [r for r in records if isinstance(r, CompilationRecord)
            and (family is None or r.family == family)
            and (wanted is None or r.outcome is wanted)]


def _print_summary(found: Summary, wide: bool = False) -> None:
    from farm.records.query import CLIENT_LANE

    o = found.outcomes

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    ratio = "-" if found.work_over_wall is None else f"{found.work_over_wall:.2f}x"
    print_one_row(
        [Column(c, "right") for c in ("kernels", *Fate, "store hits", "reused", "work",
                                      "wall", "work/wall")],
        [str(found.kernels), *(str(getattr(o, fate)) for fate in Fate),
         pct(found.store_hit_rate),
         pct(found.compiler_avoided_rate), f"{found.work_s:.2f} s", f"{found.wall_s:.2f} s",
         ratio],
        title=f"summary of {found.scope}: {len(found.builds)} build(s), "
              f"{found.sessions} session(s)")
    out.print(f"missing: {found.missing} (stored kernels whose record never came)",
              markup=False)
    for title, groups in (("by family", found.by_family), ("by worker", found.by_worker)):
        out.print()
        print_table([Column("name", wrap=True, fold=True), *(Column(c, "right") for c in (
            "kernels", *OBTAINED, "work", "slowest"))],
            [[g.name, str(g.kernels), *(str(getattr(g, fate)) for fate in OBTAINED),
              f"{g.work_s:.3f} s", f"{g.slowest_s:.3f} s"] for g in groups], title=title)
    if any(g.name == CLIENT_LANE for g in found.by_worker):
        out.print(f"({CLIENT_LANE}: kernels the build's own process found in the store)",
                  markup=False, highlight=False)
    out.print()
    print_table([Column("work", "right"), Column("outcome"), Column("kernel", wrap=True),
                 Column("worker", fold=True), Column("key", optional=True),
                 Column("build", optional=True)],
                [[f"{line.work_s:.3f} s", line.outcome.value, kernel_name(line), line.worker,
                  line.key, line.build] for line in found.slowest],
                title="slowest kernels", wide=wide)
    if found.unattributed:
        out.print(f"{found.unattributed} kernel(s) have no compilation record (found in the "
                  "store by the client itself, or failed): counted in the totals only")


@app.command("summary", epilog=examples("farm records summary",
                                        "farm records summary --build latest --top 20",
                                        "farm records summary --build 1796187761603293040:21"))
def summary(
    build: Annotated[str | None, typer.Option(
        "--build", metavar="SESSION[:BATCH]",
        help="one build, seen across every worker; SESSION may be `latest`")] = None,
    top: Annotated[int, typer.Option(min=0, metavar="N",
                                     help="the N slowest kernels")] = 10,
    wide: WideOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Totals, hit rates and slowest kernels, by family and worker.

    Outcomes, store hit rate, work against wall time, the slowest kernels (named by
    family and parameters; --wide adds their keys), by family and by worker. Every
    kernel is counted once per build, whichever workers recorded it.
    """
    from farm.records.query import load_builds, summarize

    with open_storage() as storage:
        ref = _build_ref(storage, build) if build else None
        builds = load_builds(storage, ref)
    found = summarize(builds, scope=f"build {ref}" if ref else "all builds", top=top)
    if json_out:
        print_json(found.model_dump(mode="json"))
        return
    _print_summary(found, wide)


@app.command("timeline", epilog=examples("farm records timeline latest -o build.html",
                                         "farm records timeline 1796187761603293040:21 -o b.svg"))
def timeline_cmd(
    build: Annotated[str, typer.Argument(
        help="the build: SESSION[:BATCH], SESSION may be `latest`",
        metavar="SESSION[:BATCH]")],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE",
                                         help="file to write: .html or .svg",
                                         dir_okay=False)],
    json_out: JsonOpt = False,
) -> None:
    """Draw a build: a lane per worker, a bar per kernel (HTML or SVG).

    Bars are coloured by family; stragglers are outlined. The picture fits the
    window it is opened in; .html adds a table of the stragglers.
    """
    from farm.records.query import timeline
    from farm.records.timeline import write_timeline

    with open_storage() as storage:
        data = timeline(storage, _build_ref(storage, build))
    written = write_timeline(data, output)
    stragglers = sum(bar.straggler for bar in data.bars)
    if json_out:
        print_json({"file": str(written), "build": data.build, "lanes": data.lanes,
                    "workers": data.workers,
                    "bars": len(data.bars), "stragglers": stragglers, "wall_s": data.wall_s,
                    "missing_sessions": data.missing_sessions})
        return
    out.print(f"wrote {written}: {len(data.bars)} kernel(s) on {data.lanes_text()}, "
              f"{stragglers} straggler(s), wall {data.wall_s:.2f} s", markup=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


@app.command("tuning", epilog=examples("farm records tuning", "farm records tuning latest",
                                       "farm records tuning 1796187761603293040 --json"))
def tuning(
    session: Annotated[str, typer.Argument(
        help="the session that tuned (`farm tune`), or `latest`", metavar="SESSION")
    ] = "latest",
    wide: WideOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """A session's tuning table: each key's winner and what it gained.

    Winner and first-listed candidate times are medians of the device's own timings;
    speedup is the first-listed candidate's time over the winner's. On the cluster the
    workers that measured are listed (--wide).
    """
    from farm.records.tuning import compact, tunings

    with open_storage() as storage:
        found, records = tunings(storage, None if session == "latest"
                                 else _session_id(storage, session))
    if json_out:
        print_json({"session": found, "records": [_record_json(r) for r in records]})
        return
    rows = []
    for r in records:
        won, first = r.winner_ms, r.first_ms
        rows.append([r.problem, compact(r.candidates[r.winner].params)
                     if r.winner is not None else "no winner", _ms(won), _ms(first),
                     f"{first / won:.2f}x" if won and first else "-", r.family,
                     r.worker or r.host, "yes" if r.isolated else "no"])
    print_table([Column("problem", wrap=True), Column("winner"), Column("ms", "right"),
                 Column("first ms", "right"), Column("speedup", "right"),
                 Column("family", optional=True), Column("worker", optional=True),
                 Column("isolated", optional=True)], rows,
                title=f"tuning of session {found}: {len(records)} key(s)", wide=wide)


@app.command("prune", epilog=examples("farm records prune --keep 100"))
def prune(
    keep: Annotated[int, typer.Option("--keep", min=0, max=2**63 - 1, metavar="N",
                                      help="sessions to keep (0 acts as 1)")],
    json_out: JsonOpt = False,
) -> None:
    """Delete the oldest sessions beyond N, with all their records."""
    with open_storage(write=True) as storage:
        deleted = storage.prune(keep)
        left = storage.count_sessions()
    if json_out:
        print_json({"deleted": deleted, "kept": left})
        return
    out.print(f"pruned {deleted} session(s); {left} kept")


def run_standalone(typer_app: typer.Typer) -> None:
    """Run a sub-app as a program of its own (``python -m farm.cli.records``), with the
    ``farm`` command's error handling: a FarmError is one line and an exit status."""
    try:
        typer_app(standalone_mode=False)
    except FarmError as exc:
        print_error(str(exc))
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click usage errors are ClickException; others are bugs
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    run_standalone(app)
