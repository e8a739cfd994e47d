"""``farm worker`` (serve a fingerprint's queue) and ``farm workers`` (who serves what)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from farm.cli.console import out, print_json
from farm.core.errors import SettingsError


def worker(
    concurrency: Annotated[int, typer.Option(
        "--concurrency", "-c", help="pool processes (default: one per core)")] = 0,
    fingerprint: Annotated[str | None, typer.Option(
        help="serve this fingerprint (default: the first device's)")] = None,
    queues: Annotated[str | None, typer.Option(
        help="comma-separated queues instead of the fingerprint's")] = None,
    loglevel: Annotated[str, typer.Option()] = "INFO",
    events: Annotated[bool | None, typer.Option(
        "--events/--no-events", help="send Celery task events, for Flower and `celery "
        "events` (default FARM_WORKER_EVENTS, on)")] = None,
    heartbeat: Annotated[bool | None, typer.Option(
        "--heartbeat/--no-heartbeat", help="send Celery worker heartbeats (default "
        "FARM_WORKER_HEARTBEAT, on)")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", min=1, max=65535, help="serve Prometheus metrics on this port "
        "(default FARM_METRICS_PORT; unset: none)")] = None,
    celery_args: Annotated[list[str] | None, typer.Argument(
        help="after `--`: options passed unchanged to `celery worker`, e.g. "
        "`farm worker -- --max-tasks-per-child=100`", show_default=False)] = None,
) -> None:
    """Run a compile worker for one device fingerprint (needs FARM_REDIS_URL, FARM_MINIO_*)."""
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


def workers(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List which fingerprints are served, by which hosts, with how many processes, and
    each fingerprint's queue depth and chunks in flight."""
    import redis
    from rich.table import Table

    from farm.cluster.queues import queue_stats
    from farm.cluster.workers import served
    from farm.core.settings import load_settings

    settings = load_settings()
    if not settings.redis_url:
        raise SettingsError("setting FARM_REDIS_URL: needed to list the workers")
    from farm.core.errors import ClusterError
    from farm.core.outage import is_redis_down, redis_location

    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10,
                                  socket_connect_timeout=5)
    try:
        found = served(client, settings.dead_worker_grace)
    except Exception as exc:
        if not is_redis_down(exc):
            raise
        raise ClusterError(f"{redis_location(settings.redis_url)} is unreachable "
                           f"({type(exc).__name__}); is it running? (FARM_REDIS_URL)") from None
    queues = queue_stats(client)
    if json_out:
        # One entry per fingerprint that has live workers, waiting or in-flight chunks.
        print_json({fp: {"workers": [w.model_dump(mode="json") for w in found.get(fp, [])],
                         "depth": q.depth, "in_flight": q.in_flight}
                    for fp, q in sorted(queues.items())})
        return
    table = Table(title="workers")
    for col in ("fingerprint", "host", "pid", "processes", "device", "version"):
        table.add_column(col)
    for fp, ws in sorted(found.items()):
        for w in sorted(ws, key=lambda w: (w.host, w.pid)):
            table.add_row(fp, w.host, str(w.pid), str(w.processes), w.device_name, w.version)
    out.print(table)
    if not found:
        out.print("no worker is running")
    if queues:
        qtable = Table(title="queues")
        for col in ("fingerprint", "waiting chunks", "in flight", "workers", "processes"):
            qtable.add_column(col, justify="left" if col == "fingerprint" else "right")
        for fp, q in queues.items():
            qtable.add_row(fp, str(q.depth), str(q.in_flight), str(q.workers),
                           str(q.processes))
        out.print(qtable)
