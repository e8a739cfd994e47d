"""``farm build MANIFEST``: expand, skip what the store holds, compile the rest, summarize."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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

if TYPE_CHECKING:
    from farm.cluster.workers import WorkerInfo
    from farm.compilation.batch import BatchReport
    from farm.core.settings import Settings
    from farm.manifest import Manifest
    from farm.records import Recorder


def build(
    manifest: Annotated[str, typer.Argument(
        metavar="MANIFEST", help="a manifest file, or a built-in one: tiny, medium, large")],
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
        "--verify", help="cluster: read and verify every stored artifact's digest")] = False,
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

    Expands MANIFEST into kernels, skips those the store holds, compiles the rest (on
    local processes, or on the workers serving the fingerprint), and prints a summary.
    Progress goes to stderr: a live line on a terminal, a plain line every few seconds
    otherwise. Exit status 1 when a kernel failed (with --strict, also when the device
    cannot run one).
    """
    from farm.compilation.local import local_farm
    from farm.core.settings import load_settings
    from farm.manifest import expand, load_manifest, resolve_manifest

    overrides = {"device": device} if device else {}
    settings = load_settings(**overrides)
    path = resolve_manifest(manifest)
    loaded = load_manifest(path)
    label = f"build {loaded.label}"
    use_cluster = settings.cluster if cluster is None else cluster
    report: BatchReport | None = None
    recorder: Recorder | None = None
    if use_cluster:
        report, fp, recorder = _cluster_build(settings, loaded, label, fingerprint,
                                              fallback_local, verify, json_out,
                                              wait_for_workers=wait_for_workers)
    if report is None:
        with local_farm(settings, label=label, workers=workers) as farm:
            artifacts = [e.artifact for e in expand(loaded, farm.registry)]
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
                    "unsupported": [failure_json(r) for r in report.unsupported],
                    "failures": [failure_json(r) for r in report.failed]})
    else:
        print_summary(report, title=f"farm build {loaded.label} on {fp}")
        if use_cluster:
            print_workers(report)
        print_failures(report, strict)
        err.print(recorded_line(recorder), markup=False, highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(1)


def _cluster_build(settings: Settings, loaded: Manifest, label: str,
                   fingerprint: str | None, fallback_local: bool, verify: bool,
                   quiet: bool, *, wait_for_workers: bool = False
                   ) -> tuple[BatchReport | None, str, Recorder | None]:
    """Build through the workers; ``None`` when falling back to a local build."""
    import redis

    from farm.cluster.build import check_served, cluster_build
    from farm.cluster.celery_app import make_app
    from farm.cluster.workers import served
    from farm.core.device import probe_devices, resolve_fingerprint, select_device
    from farm.core.errors import ClusterError, InputError
    from farm.core.outage import redis_waiter
    from farm.families import Registry
    from farm.manifest import expand
    from farm.records.open import open_recorder
    from farm.store.open import open_store

    if wait_for_workers and not fingerprint:
        raise InputError("--wait-for-workers needs --fingerprint: with no worker to ask, "
                         "the target device must be named")
    # In this process: a build client never forks (a local fallback's pool is spawned).
    local_fp = select_device(probe_devices(), settings.device).fingerprint \
        if fallback_local or not fingerprint else None
    fp = fingerprint or local_fp or ""
    client: Any = redis.Redis.from_url(settings.redis_url or "", socket_timeout=10,
                                       socket_connect_timeout=5)

    def say(line: str) -> None:  # kept on stderr, also under --json
        err.print(line, markup=False, soft_wrap=True)

    def check() -> list[WorkerInfo]:
        nonlocal fp
        if fingerprint:  # whole, or a unique prefix of a fingerprint served
            fp = resolve_fingerprint(fingerprint, served(client, settings.dead_worker_grace))
        return check_served(client, fp, settings.dead_worker_grace)

    waiter = redis_waiter(settings.redis_url or "", settings.outage_limit, say=say)
    try:
        served_by = waiter.call(check)
    except ClusterError as exc:
        if wait_for_workers:
            served_by = []
            err.print(f"{exc}: queueing for the workers to come (--wait-for-workers)",
                      markup=False, soft_wrap=True)
        else:
            if not fallback_local:
                raise
            if local_fp != fp:
                raise ClusterError(f"{exc}; and the local device ({local_fp}) cannot "
                                   f"compile for {fp}") from None
            err.print(f"{exc}: compiling locally (--fallback-local)", markup=False,
                      soft_wrap=True)
            return None, fp, None
    registry = Registry.load(settings.family_modules)
    artifacts = [e.artifact for e in expand(loaded, registry)]
    store = open_store(settings)
    recorder = open_recorder(settings, label)

    def app() -> Any:  # made only when a chunk must be sent: no Celery for a stored build
        return make_app(settings)

    try:
        with progress(len(artifacts), quiet=quiet) as shown:
            report = cluster_build(settings, app=app, registry=registry, store=store,
                                   fingerprint=fp, artifacts=artifacts, recorder=recorder,
                                   label=label, progress=shown, verify=verify,
                                   device=next((w.device for w in served_by if w.device),
                                               None),
                                   say=say, status=shown.status, waiter=waiter)
    except BaseException:
        _close_quietly(recorder)  # the error on its way out is the one line to show
        raise
    else:
        recorder.close()
    finally:
        store.close()
    return report, fp, recorder


def _close_quietly(recorder: Any) -> None:
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
