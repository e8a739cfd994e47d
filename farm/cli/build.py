"""``farm build MANIFEST``: expand, skip what the store holds, compile the rest, summarize."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from farm.batch import BatchReport, KernelResult
from farm.cli.console import err, out, print_json
from farm.local import local_farm
from farm.manifest import expand, load_manifest, resolve_manifest
from farm.settings import load_settings


def build(
    manifest: Annotated[str, typer.Argument(help="manifest file, or tiny/medium/large")],
    workers: Annotated[int | None, typer.Option(
        "--workers", "-w", help="compile processes (0: in this process)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="summary as JSON")] = False,
    strict: Annotated[bool, typer.Option(
        help="count kernels the device cannot run as failures")] = False,
    device: Annotated[str | None, typer.Option(help="device fingerprint or name")] = None,
) -> None:
    """Build a model's kernels into the store and load each on the device."""
    overrides = {"device": device} if device else {}
    settings = load_settings(**overrides)
    path = resolve_manifest(manifest)
    loaded = load_manifest(path)
    registry_entries = None
    with local_farm(settings, label=f"build {loaded.name}", workers=workers) as farm:
        registry_entries = expand(loaded, farm.registry)
        artifacts = [e.artifact for e in registry_entries]
        report = _run_with_progress(farm.batch(label=f"build {loaded.name}"), artifacts,
                                    quiet=json_out)
        fingerprint = farm.device.fingerprint
    failed = report.failed + (report.unsupported if strict else [])
    if json_out:
        print_json({"manifest": str(path), "fingerprint": fingerprint,
                    "summary": report.summary(),
                    "unsupported": [_failure_json(r) for r in report.unsupported],
                    "failures": [_failure_json(r) for r in report.failed]})
    else:
        print_summary(report, title=f"farm build {loaded.name} on {fingerprint}")
        print_failures(report, strict)
    if failed:
        raise typer.Exit(1)


def _run_with_progress(batch: object, artifacts: list, quiet: bool) -> BatchReport:
    from farm.batch import Batch

    assert isinstance(batch, Batch)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[last]}"), TimeElapsedColumn(), console=err,
                  disable=quiet, transient=True) as bar:
        task = bar.add_task("building", total=len(artifacts), last="")

        def tick(res: KernelResult) -> None:
            what = res.outcome.value if res.outcome else (res.failure.kind if res.failure
                                                           else "")
            bar.update(task, advance=1, last=f"{what} {res.label}"[:60])

        return batch.run(artifacts, progress=tick)


def print_summary(report: BatchReport, title: str) -> None:
    s = report.summary()
    table = Table(title=title, show_header=True)
    for col in ("kernels", "loaded", "rekeyed", "compiled", "unsupported", "failed",
                "work", "wall", "work/wall"):
        table.add_column(col, justify="right")
    table.add_row(str(s["kernels"]), str(s["loaded"]), str(s["rekeyed"]), str(s["compiled"]),
                  str(s["unsupported"]), str(s["failed"]), f"{s['work_s']:.2f} s",
                  f"{s['wall_s']:.2f} s", f"{s['speedup']:.2f}x")
    out.print(table)


def print_failures(report: BatchReport, strict: bool) -> None:
    if report.unsupported:
        style = "red" if strict else "yellow"
        out.print(f"[{style}]{len(report.unsupported)} kernel(s) the device cannot run"
                  f"{' (failures under --strict)' if strict else ''}:[/{style}]")
        for r in report.unsupported[:20]:
            out.print(f"  {r.label}: {r.failure.message if r.failure else ''}", markup=False)
        if len(report.unsupported) > 20:
            out.print(f"  ... and {len(report.unsupported) - 20} more")
    for r in report.failed:
        assert r.failure is not None
        out.print(f"[red]FAILED[/red] {r.label} ({r.failure.kind}): ", end="")
        out.print(r.failure.message, markup=False)
        if r.failure.build_log:
            for line in r.failure.build_log.splitlines()[:40]:
                out.print(f"    | {line}", markup=False)


def _failure_json(r: KernelResult) -> dict[str, object]:
    assert r.failure is not None
    return {"kernel": r.artifact.kernel.model_dump(mode="json"), "label": r.label,
            "key": str(r.key) if r.key else None, **r.failure.model_dump()}


def manifest_path(value: str) -> Path:
    return resolve_manifest(value)
