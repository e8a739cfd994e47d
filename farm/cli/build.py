"""``farm build MANIFEST``: expand, skip what the store holds, compile the rest, summarize."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from farm.cli.console import err, out, print_json

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from farm.compilation.batch import Batch, BatchReport, KernelResult
    from farm.core.model import ArtifactId
    from farm.core.settings import Settings
    from farm.families import Registry
    from farm.records import Recorder


def build(
    manifest: Annotated[str, typer.Argument(
        help="manifest file, tiny/medium/large, or a capture (farm capture)")],
    workers: Annotated[int | None, typer.Option(
        "--workers", "-w", min=0, help="local compile processes (0: in this process)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="summary as JSON")] = False,
    strict: Annotated[bool, typer.Option(
        help="count kernels the device cannot run as failures")] = False,
    device: Annotated[str | None, typer.Option(help="device fingerprint or name")] = None,
    cluster: Annotated[bool | None, typer.Option(
        "--cluster/--local", help="build on the cluster (default: when FARM_REDIS_URL is "
        "set) or locally")] = None,
    fingerprint: Annotated[str | None, typer.Option(
        help="cluster: target fingerprint (default: the local device's)")] = None,
    fallback_local: Annotated[bool, typer.Option(
        help="cluster: compile locally when no worker serves the fingerprint")] = False,
    verify: Annotated[bool, typer.Option(
        help="cluster: read and verify every stored artifact's digest")] = False,
    wait_for_workers: Annotated[bool, typer.Option(
        "--wait-for-workers", help="cluster: queue the kernels even when no worker serves "
        "the fingerprint now (a pool that scales from zero starts on its queue's "
        "length); needs --fingerprint")] = False,
    metrics_file: Annotated[Path | None, typer.Option(
        "--metrics-file", help="write the build's summary as Prometheus text here (for "
        "node-exporter's textfile collector); FARM_METRICS_PUSHGATEWAY pushes it")] = None,
) -> None:
    """Build a model's kernels (or a capture's programs) into the store (locally or on
    the cluster)."""
    from farm.cli.build_capture import build_capture, is_capture

    if is_capture(manifest):
        build_capture(manifest, workers=workers, json_out=json_out, cluster=cluster,
                      fingerprint=fingerprint, device=device)
        return
    from farm.compilation.local import local_farm
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    overrides = {"device": device} if device else {}
    settings = load_settings(**overrides)
    path = resolve_manifest(manifest)
    loaded = load_manifest(path)
    label = f"build {loaded.label}"
    use_cluster = settings.cluster if cluster is None else cluster
    registry = Registry.load(settings.family_modules)  # one registry, one expansion
    artifacts = [e.artifact for e in expand(loaded, registry)]
    report: BatchReport | None = None
    if use_cluster:
        target = _ClusterTarget(fingerprint=fingerprint, fallback_local=fallback_local,
                                wait_for_workers=wait_for_workers, verify=verify)
        report, fp = _cluster_build(settings, registry, artifacts, label, target,
                                    quiet=json_out)
    if report is None:
        with local_farm(settings, label=label, workers=workers, registry=registry) as farm:
            report = _run_with_progress(farm.batch(label=label), artifacts, quiet=json_out)
            fp = farm.device.fingerprint
    failed = report.failed + (report.unsupported if strict else [])
    if metrics_file is not None or settings.metrics_pushgateway:
        _publish_metrics(report, settings, manifest=loaded.name or path.stem, fingerprint=fp,
                         cluster=use_cluster, textfile=metrics_file)
    if json_out:
        print_json({"manifest": str(path), "fingerprint": fp, "cluster": use_cluster,
                    "summary": report.summary(), "workers": _by_worker(report),
                    "unsupported": [_failure_json(r) for r in report.unsupported],
                    "failures": [_failure_json(r) for r in report.failed]})
    else:
        print_summary(report, title=f"farm build {loaded.label} on {fp}")
        if use_cluster:
            print_workers(report)
        print_failures(report, strict)
    if failed:
        raise typer.Exit(1)


@dataclass(frozen=True)
class _ClusterTarget:
    """The cluster options of ``farm build``: where to build, and the fallback policy."""

    fingerprint: str | None
    fallback_local: bool
    wait_for_workers: bool
    verify: bool


def _say(line: str) -> None:
    """A line worth keeping (an outage, a re-sent chunk): stderr, also under --json."""
    err.print(line, markup=False, soft_wrap=True)


def _cluster_build(settings: Settings, registry: Registry, artifacts: list[ArtifactId],
                   label: str, target: _ClusterTarget, *, quiet: bool
                   ) -> tuple[BatchReport | None, str]:
    """Build through the workers; ``None`` when falling back to a local build."""
    from farm.cluster.client import BuildOptions, ClusterClient
    from farm.core.device import probe_devices, select_device
    from farm.core.errors import ClusterError, InputError
    from farm.records.open import open_recorder

    if target.wait_for_workers and not target.fingerprint:
        raise InputError("--wait-for-workers needs --fingerprint: with no worker to ask, "
                         "the target device must be named")
    # In this process: a build client never forks (a local fallback's pool is spawned).
    local_fp = select_device(probe_devices(), settings.device).fingerprint \
        if target.fallback_local or not target.fingerprint else None
    fp = target.fingerprint or local_fp or ""
    with ClusterClient(settings, registry=registry, say=_say) as client:
        try:
            client.served(fp)
        except ClusterError as exc:
            if target.wait_for_workers:
                _say(f"{exc}: queueing for the workers to come (--wait-for-workers)")
            elif not target.fallback_local:
                raise
            elif local_fp != fp:
                raise ClusterError(f"{exc}; and the local device ({local_fp}) cannot "
                                   f"compile for {fp}") from None
            else:
                _say(f"{exc}: compiling locally (--fallback-local)")
                return None, fp
        options = BuildOptions(fingerprint=fp, label=label, verify=target.verify,
                               wait_for_workers=target.wait_for_workers)
        recorder = open_recorder(settings, label)
        try:
            with _progress(len(artifacts), quiet) as tick:
                report = client.build(artifacts, options, recorder=recorder, progress=tick,
                                      status=tick.status)
        except BaseException:
            _close_quietly(recorder)  # the error on its way out is the one line to show
            raise
        recorder.close()
    return report, fp


def _close_quietly(recorder: Recorder) -> None:
    try:
        recorder.close()
    except Exception as exc:  # e.g. Redis gone too: the records stay unsent
        err.print(f"records of this build not sent: {exc}", markup=False, soft_wrap=True)


def _publish_metrics(report: BatchReport, settings: Settings, *, manifest: str,
                     fingerprint: str, cluster: bool, textfile: Path | None) -> None:
    """The summary as Prometheus metrics. A Pushgateway that fails is a warning (the
    build succeeded and its artifacts are stored); a file that cannot be written is an
    error of the option."""
    from farm.cluster.metrics import build_registry, publish_build
    from farm.core.errors import InputError

    registry = build_registry(report.summary(), manifest=manifest, fingerprint=fingerprint,
                              cluster=cluster)
    try:
        publish_build(registry, manifest=manifest, gateway=None, textfile=textfile)
    except OSError as exc:
        raise InputError(f"--metrics-file {textfile}: {exc.strerror or exc}") from None
    if settings.metrics_pushgateway:
        try:
            publish_build(registry, manifest=manifest, gateway=settings.metrics_pushgateway,
                          textfile=None)
        except OSError as exc:
            err.print(f"warning: could not push the build's metrics to "
                      f"FARM_METRICS_PUSHGATEWAY: {exc}", markup=False, soft_wrap=True)


def _by_worker(report: BatchReport) -> dict[str, dict[str, float]]:
    from farm.core.model import Outcome

    out_: dict[str, dict[str, float]] = {}
    for r in report.results:
        if r.worker and r.outcome is not None:
            w = out_.setdefault(r.worker, {"kernels": 0, "compiled": 0, "work_s": 0.0})
            w["kernels"] += 1
            w["compiled"] += r.outcome is Outcome.COMPILED
            w["work_s"] = round(w["work_s"] + r.work_s, 4)
    return out_


def print_workers(report: BatchReport) -> None:
    from rich.table import Table

    table = Table(title="work by worker")
    for col in ("worker", "kernels", "compiled", "work"):
        table.add_column(col, justify="right" if col != "worker" else "left")
    for name, w in sorted(_by_worker(report).items()):
        table.add_row(name, str(int(w["kernels"])), str(int(w["compiled"])),
                      f"{w['work_s']:.2f} s")
    out.print(table)


class _Tick:
    """The per-kernel progress callback, and ``status`` for the cluster's live line
    (chunks in flight per worker)."""

    def __init__(self, bar: Progress, task: TaskID) -> None:
        self._bar = bar
        self._task = task

    def __call__(self, res: KernelResult) -> None:
        what = res.outcome.value if res.outcome else (res.failure.kind if res.failure
                                                       else "")
        self._bar.update(self._task, advance=1, last=f"{what} {res.label}"[:60])

    def status(self, line: str) -> None:
        self._bar.update(self._task, status=line[:80])


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[_Tick]:
    """A progress bar on stderr; yields the per-kernel callback."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[last]}"), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=err,
                  disable=quiet, transient=True) as bar:
        task = bar.add_task("building", total=total, last="", status="")
        yield _Tick(bar, task)


def _run_with_progress(batch: Batch, artifacts: list[ArtifactId], quiet: bool) -> BatchReport:
    with _progress(len(artifacts), quiet) as tick:
        return batch.run(artifacts, progress=tick)


def print_summary(report: BatchReport, title: str) -> None:
    from rich.table import Table

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
