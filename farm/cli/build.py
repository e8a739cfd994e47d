"""``farm build MANIFEST``: expand, skip what the store holds, compile the rest, summarize."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from farm.cli.build_report import (
    by_worker,
    failure_json,
    print_failures,
    print_summary,
    print_workers,
    recorded_line,
    recorded_session,
)
from farm.cli.console import err, print_json
from farm.cli.progress import progress
from farm.core.outcomes import Fate

if TYPE_CHECKING:
    from farm.compilation.batch import BatchReport
    from farm.core.model import ArtifactId
    from farm.core.settings import Settings
    from farm.families import Registry
    from farm.records import Recorder


def build(
    manifest: Annotated[str, typer.Argument(
        metavar="MANIFEST", help="a manifest file, a built-in one (tiny, medium, large), "
        "or a capture of an application's programs (farm capture)")],
    workers: Annotated[int | None, typer.Option(
        "--workers", "-w", min=0, metavar="N", help="local compile processes (default: "
        "FARM_WORKERS, else one per core; 0 compiles in this process)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="the summary as JSON")] = False,
    strict: Annotated[bool, typer.Option(
        "--strict", help="count kernels the device cannot run as failures")] = False,
    device: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT|NAME", help="the local device (default: FARM_DEVICE, else the "
        "first)")] = None,
    cluster: Annotated[bool | None, typer.Option(
        "--cluster/--local", help="build on the cluster, or here (default: on the cluster "
        "when FARM_REDIS_URL is set)")] = None,
    fingerprint: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT", help="cluster: the target fingerprint, whole or a unique "
        "prefix of one served (default: the local device's)")] = None,
    fallback_local: Annotated[bool, typer.Option(
        "--fallback-local",
        help="cluster: compile here when no worker serves the fingerprint")] = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="cluster: read and verify every stored artifact's digest (always "
        "done now; kept for scripts)")] = False,
    wait_for_workers: Annotated[bool, typer.Option(
        "--wait-for-workers", help="cluster: queue the kernels even when no worker serves "
        "the fingerprint now (a pool that scales from zero starts on its queue's "
        "length); needs --fingerprint")] = False,
    metrics_file: Annotated[Path | None, typer.Option(
        "--metrics-file", metavar="FILE", help="write the build's summary there as "
        "Prometheus text (for node-exporter's textfile collector); "
        "FARM_METRICS_PUSHGATEWAY pushes it")] = None,
) -> None:
    """Build a model's kernels into the store, here or on the cluster.

    MANIFEST may also be a capture of an application's programs (farm capture).
    Expands MANIFEST into kernels, skips those the store holds, compiles the rest (on
    local processes, or on the workers serving the fingerprint), and prints a summary.
    Progress goes to stderr: a live line on a terminal, a plain line every few seconds
    otherwise. Exit status 1 when a kernel failed (with --strict, also when the device
    cannot run one).
    """
    from farm.cli.build_capture import build_capture, is_capture

    if is_capture(manifest):
        build_capture(manifest, workers=workers, json_out=json_out, cluster=cluster,
                      fingerprint=fingerprint, device=device)
        return
    from farm.compilation.local import local_farm
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    if metrics_file is not None and not metrics_file.parent.is_dir():
        from farm.core.errors import InputError

        # bad input is said before any work: nothing is built for a file never written
        raise InputError(f"--metrics-file {metrics_file}: its folder "
                         f"{metrics_file.parent} does not exist")
    overrides = {"device": device} if device else {}
    settings = load_settings(**overrides)
    path = resolve_manifest(manifest)
    loaded = load_manifest(path)
    label = f"build {loaded.label}"
    use_cluster = settings.cluster if cluster is None else cluster
    registry = Registry.load(settings.family_modules)  # one registry, one expansion
    artifacts = [e.artifact for e in expand(loaded, registry)]
    report: BatchReport | None = None
    recorder: Recorder | None = None
    if use_cluster:
        target = _ClusterTarget(fingerprint=fingerprint, fallback_local=fallback_local,
                                wait_for_workers=wait_for_workers, verify=verify)
        report, fp, recorder = _cluster_build(settings, registry, artifacts, label, target,
                                              quiet=json_out)
    if report is None:
        with local_farm(settings, label=label, workers=workers, registry=registry) as farm:
            with progress(len(artifacts), quiet=json_out) as shown:
                report = farm.batch(label=label).run(artifacts, progress=shown)
            fp = farm.device.fingerprint
            recorder = farm.recorder
    failed = report.failed + (report.unsupported if strict else [])
    if metrics_file is not None or settings.metrics_pushgateway:
        _publish_metrics(report, settings, manifest=loaded.name or path.stem, fingerprint=fp,
                         cluster=use_cluster, textfile=metrics_file)
    if json_out:
        print_json({"manifest": str(path), "fingerprint": fp, "cluster": use_cluster,
                    "summary": report.summary(), "workers": by_worker(report),
                    "session": recorded_session(recorder),
                    Fate.UNSUPPORTED: [failure_json(r) for r in report.unsupported],
                    "failures": [failure_json(r) for r in report.failed]})
    else:
        print_summary(report, title=f"farm build {loaded.label} on {fp}")
        if use_cluster:
            print_workers(report)
        print_failures(report, strict)
        err.print(recorded_line(recorder), markup=False, highlight=False, soft_wrap=True)
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
                   ) -> tuple[BatchReport | None, str, Recorder | None]:
    """Build through the workers; ``None`` when falling back to a local build."""
    from farm.cluster.client import BuildOptions, ClusterClient
    from farm.cluster.workers import served
    from farm.core.device import probe_devices, resolve_fingerprint
    from farm.core.device_probe import choose_device
    from farm.core.errors import ClusterError, InputError
    from farm.records.open import open_recorder

    if target.wait_for_workers and not target.fingerprint:
        raise InputError("--wait-for-workers needs --fingerprint: with no worker to ask, "
                         "the target device must be named")
    # In this process: a build client never forks (a local fallback's pool is spawned).
    local_fp = choose_device(settings, probe_devices()).fingerprint \
        if target.fallback_local or not target.fingerprint else None
    fp = target.fingerprint or local_fp or ""
    with ClusterClient(settings, registry=registry, say=_say, ahead=True) as client:
        if target.fingerprint:  # whole, or a unique prefix of a fingerprint served
            grace = settings.dead_worker_grace
            fp = resolve_fingerprint(target.fingerprint, client.waiter.call(
                lambda: served(client.redis, grace)))
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
                return None, fp, None
        options = BuildOptions(fingerprint=fp, label=label, verify=target.verify,
                               wait_for_workers=target.wait_for_workers)
        recorder = open_recorder(settings, label)
        # an error on its way out is the one line to show, a records problem a warning
        with recorder, progress(len(artifacts), quiet=quiet) as shown:
            report = client.build(artifacts, options, recorder=recorder, progress=shown,
                                  status=shown.status)
    return report, fp, recorder


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
