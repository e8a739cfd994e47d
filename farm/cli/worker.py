"""``farm worker`` (serve a fingerprint's queue) and ``farm workers`` (who serves what)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from farm.cli.console import out, print_json
from farm.core.errors import SettingsError

if TYPE_CHECKING:
    from farm.cluster.queues import QueueStats
    from farm.cluster.workers import WorkerInfo


def worker(
    concurrency: Annotated[int, typer.Option(
        "--concurrency", "-c", metavar="N", show_default=False,
        help="pool processes (default: one per core)")] = 0,
    fingerprint: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT", help="serve this fingerprint, whole or a unique prefix "
        "(default: the device the farm chooses: the first that compiles)")] = None,
    queues: Annotated[str | None, typer.Option(
        metavar="Q1,Q2", help="comma-separated queues instead of the fingerprint's")] = None,
    loglevel: Annotated[str, typer.Option(metavar="LEVEL", help="log level")] = "INFO",
    events: Annotated[bool | None, typer.Option(
        "--events/--no-events", help="send Celery task events, for Flower and `celery "
        "events` (default FARM_WORKER_EVENTS, on)")] = None,
    heartbeat: Annotated[bool | None, typer.Option(
        "--heartbeat/--no-heartbeat", help="send Celery worker heartbeats (default "
        "FARM_WORKER_HEARTBEAT, on)")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", min=1, max=65535, metavar="PORT", help="serve Prometheus "
        "metrics on this port (default FARM_METRICS_PORT; unset: none)")] = None,
    celery_args: Annotated[list[str] | None, typer.Argument(
        metavar="CELERY_OPTION",
        help="after `--`: options passed unchanged to `celery worker`, e.g. "
        "`farm worker -- --max-tasks-per-child=100`", show_default=False)] = None,
) -> None:
    """Run a compile worker for one device fingerprint.

    Needs FARM_REDIS_URL and FARM_MINIO_*. Runs until SIGTERM or SIGINT; see
    `farm workers` for who serves what.
    """
    from farm.core.settings import load_settings
    from worker.startup import WorkerOptions, run_worker

    settings = load_settings()
    if not settings.redis_url or not settings.minio_endpoint:
        raise SettingsError("setting FARM_REDIS_URL / FARM_MINIO_ENDPOINT: a worker needs "
                            "the broker and the artifact store")
    run_worker(settings, WorkerOptions(
        concurrency=concurrency or os.cpu_count() or 1, fingerprint=fingerprint,
        queues=queues.split(",") if queues else None, loglevel=loglevel, events=events,
        heartbeat=heartbeat, metrics_port=metrics_port, extra_args=list(celery_args or [])))


def workers(json_out: Annotated[bool, typer.Option("--json", help="as JSON")] = False,
            ) -> None:
    """List who serves each fingerprint, and each fingerprint's queue.

    A worker is named by its main process (host:pid); its pool processes, which
    compile, by theirs: the names a build's "work by worker" and the records use.
    """
    import redis

    from farm.cluster.queues import queue_stats
    from farm.cluster.workers import served
    from farm.core.settings import load_settings

    settings = load_settings()
    if not settings.redis_url:
        raise SettingsError("setting FARM_REDIS_URL: needed to list the workers; for a "
                            "cluster on this machine, run `farm cluster up` and source "
                            "the settings it prints")
    from farm.core.errors import ClusterError
    from farm.core.outage import redis_client, redis_failure

    client = redis_client(settings.redis_url, settings.socket_timeout)
    try:
        found = served(client, settings.dead_worker_grace)
    except redis.exceptions.RedisError as exc:  # down, a wrong password, untrusted TLS
        raise ClusterError(redis_failure(settings.redis_url, exc)) from None
    queues = queue_stats(client, settings.dead_worker_grace)
    if json_out:
        # One entry per fingerprint that has live workers, waiting or in-flight chunks
        # (``stale``: taken by a worker now dead, back by the broker's visibility timeout)
        print_json({fp: {"workers": [w.model_dump(mode="json") for w in found.get(fp, [])],
                         "depth": q.depth, "in_flight": q.in_flight, "stale": q.stale}
                    for fp, q in sorted(queues.items())})
        return
    print_served(found, queues)


def print_served(found: dict[str, list[WorkerInfo]], queues: dict[str, QueueStats]) -> None:
    """One block a fingerprint: the fingerprint whole on a line of its own (the value
    `--fingerprint` takes), its queue, then its workers."""
    from rich.text import Text

    from farm.cli.tables import Column, print_table, print_title

    print_title("workers, by the fingerprint they serve")
    for fp in sorted(set(found) | set(queues)):
        ws = sorted(found.get(fp, []), key=lambda w: (w.host, w.pid))
        q = queues.get(fp)
        out.print()
        out.print(Text(fp, style="bold", overflow="fold"))
        if ws:
            out.print(Text(f"  {ws[0].device_name}"))
        stale = f", {q.stale} held by dead workers" if q and q.stale else ""
        out.print(Text(f"  {len(ws)} worker(s), {sum(w.processes for w in ws)} process(es); "
                       f"{q.depth if q else 0} chunk(s) waiting, "
                       f"{q.in_flight if q else 0} in flight{stale}"))
        for w in ws:
            if not w.ready:
                out.print(Text(f"  {w.field} is not consuming: {w.why}", overflow="fold"))
        if ws:
            print_table([Column("worker"), Column("pool processes (host:pid)", wrap=True),
                         Column("version")],
                        [[w.field, " ".join(w.process_names), w.version] for w in ws])
    if not found:
        out.print("no worker is running")
