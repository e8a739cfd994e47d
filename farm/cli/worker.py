"""``farm worker`` (serve a fingerprint's queue) and ``farm workers`` (who serves what)."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table

from farm.cli.console import out, print_json
from farm.errors import SettingsError
from farm.settings import load_settings


def worker(
    concurrency: Annotated[int, typer.Option(
        "--concurrency", "-c", help="pool processes (default: one per core)")] = 0,
    fingerprint: Annotated[str | None, typer.Option(
        help="serve this fingerprint (default: the first device's)")] = None,
    queues: Annotated[str | None, typer.Option(
        help="comma-separated queues instead of the fingerprint's")] = None,
    loglevel: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Run a compile worker for one device fingerprint (needs FARM_REDIS_URL, FARM_MINIO_*)."""
    from worker.startup import run_worker

    settings = load_settings()
    if not settings.redis_url or not settings.minio_endpoint:
        raise SettingsError("setting FARM_REDIS_URL / FARM_MINIO_ENDPOINT: a worker needs "
                            "the broker and the artifact store")
    run_worker(settings, concurrency=concurrency or os.cpu_count() or 1,
               fingerprint=fingerprint, queues=queues.split(",") if queues else None,
               loglevel=loglevel)


def workers(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List which fingerprints are served, by which hosts, with how many processes."""
    import redis

    from farm.workers import served

    settings = load_settings()
    if not settings.redis_url:
        raise SettingsError("setting FARM_REDIS_URL: needed to list the workers")
    from farm.errors import ClusterError
    from farm.outage import is_redis_down, redis_location

    client: Any = redis.Redis.from_url(settings.redis_url, socket_timeout=10,
                                       socket_connect_timeout=5)
    try:
        found = served(client, settings.dead_worker_grace)
    except Exception as exc:
        if not is_redis_down(exc):
            raise
        raise ClusterError(f"{redis_location(settings.redis_url)} is unreachable "
                           f"({type(exc).__name__}); is it running? (FARM_REDIS_URL)") from None
    if json_out:
        print_json({fp: [w.model_dump() for w in ws] for fp, ws in sorted(found.items())})
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
