"""``farm ingest``: run a records ingester (Redis streams -> session storage).

Needs ``FARM_REDIS_URL``; writes into ``FARM_RECORDS_URL`` (PostgreSQL in a cluster).
Runs until SIGTERM or SIGINT, then finishes the batch in hand (written and acknowledged)
and exits 0; ``--drain`` exits instead once nothing is left to read. Redis away for
longer than ``FARM_OUTAGE_LIMIT`` ends it with one ``error:`` line and exit 1, as it ends
a worker (what it read and had not written stays pending for the next one). Several may
run at once (one per node, or a Deployment with replicas): they share the work through
the consumer group and never store a record twice. See ``farm.records.ingest``.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from farm.cli.console import err, print_json
from farm.core.defaults import INGEST_BATCH, INGEST_BLOCK_MS, INGEST_CLAIM_IDLE_MS
from farm.core.errors import SettingsError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from farm.cluster.health import HealthFiles


def _watched_ingester() -> type:
    """The Ingester class, extended to touch the probes' health files after each round it
    completes (a round blocks at most ``block_ms``), so a loop stuck or failing goes
    stale. Made on demand: the records modules are imported only by this command."""
    from farm.records.ingest import Ingester

    class _WatchedIngester(Ingester):
        health: HealthFiles | None = None

        def step(self) -> int:
            handled = super().step()
            if self.health is not None:
                self.health.ready()
                self.health.alive()
            return handled

    return _WatchedIngester


def ingest(
    batch: Annotated[int, typer.Option(
        "--batch", min=1, metavar="N",
        help="entries read per stream per round (one commit)")] = INGEST_BATCH,
    block_ms: Annotated[int, typer.Option(
        "--block-ms", min=1, metavar="MS",
        help="longest wait for new entries (and for a stop)")] = INGEST_BLOCK_MS,
    claim_idle_ms: Annotated[int, typer.Option(
        "--claim-idle-ms", min=0, metavar="MS", help="take over entries another "
        "ingester left pending this long (a dead one's)")] = INGEST_CLAIM_IDLE_MS,
    name: Annotated[str | None, typer.Option(
        metavar="NAME",
        help="consumer name (default host:pid); a restart under the same name re-reads "
        "its own pending entries at once")] = None,
    keep_sessions: Annotated[int | None, typer.Option(
        "--keep-sessions", min=0, metavar="N", help="prune to N sessions for sessions "
        "that carry no keep_sessions of their own (default FARM_KEEP_SESSIONS)")] = None,
    drain: Annotated[bool, typer.Option(
        "--drain", help="exit once nothing is left to read, instead of waiting for more")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="print the final counts as JSON on stdout")] = False,
    loglevel: Annotated[str, typer.Option(metavar="LEVEL", help="log level on stderr")] = "INFO",
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", min=1, max=65535, metavar="PORT", help="serve Prometheus "
        "metrics on this port (default FARM_METRICS_PORT; unset: none)")] = None,
) -> None:
    """Write the records streams into session storage until stopped.

    Reads the Redis streams (FARM_REDIS_URL) and writes FARM_RECORDS_URL; stops on
    SIGTERM or SIGINT after the batch in hand, or with --drain when nothing is left.
    """
    from farm.cluster.health import HealthFiles
    from farm.core.outage import redis_waiter
    from farm.core.settings import load_settings
    from farm.records.ingest import Pacing, default_consumer_name
    from farm.records.stream import connect

    settings = load_settings()
    if not settings.redis_url:
        raise SettingsError("setting FARM_REDIS_URL: the ingester reads the records streams "
                            "from Redis")
    logging.basicConfig(level=loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: finishing the batch in hand, then stopping",
                 signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    consumer = name or default_consumer_name()
    client = connect(settings.redis_url, socket_timeout_s=block_ms / 1000 + 10)
    from farm.records.storage import SessionStorage

    try:
        with SessionStorage(settings.effective_records_url) as storage:
            ingester = _watched_ingester()(
                client, storage, consumer=consumer,
                pacing=Pacing(batch=batch, block_ms=block_ms, claim_idle_ms=claim_idle_ms),
                keep_sessions=keep_sessions if keep_sessions is not None
                else settings.keep_sessions,
                # an outage past FARM_OUTAGE_LIMIT ends it with one line and exit 1, as
                # it ends a worker: an orchestrator restarts it, and an operator is told
                waiter=redis_waiter(settings.redis_url, settings.outage_limit,
                                    say=lambda line: log.warning("ingester %s: %s",
                                                                 consumer, line)))
            if settings.health_dir is not None:
                ingester.health = HealthFiles(settings.health_dir)
                ingester.health.reset()
            port = metrics_port or settings.metrics_port
            if port:
                from farm.cluster.metrics import ClusterCollector, IngestCollector, serve

                serve(port, [IngestCollector(ingester, client), ClusterCollector(client)],
                      addr=settings.metrics_address)
            err.print(f"ingester {consumer}: {settings.redis_url.split('@')[-1]} -> "
                      f"{storage.where}", markup=False, soft_wrap=True)
            stats = ingester.run(stop, drain=drain)
    finally:
        client.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if json_out:
        print_json({"consumer": consumer, **stats.model_dump()})
    err.print(f"ingester {consumer} stopped: {stats.records} record(s), {stats.sessions} "
              f"session(s) in {stats.batches} batch(es); claimed {stats.claimed}, dead "
              f"{stats.dead}, deferred {stats.deferred}, lost {stats.lost}, pruned "
              f"{stats.pruned} (late records {stats.late}), failures {stats.failures}",
              markup=False, soft_wrap=True)


if __name__ == "__main__":
    from farm.cli.records import run_standalone

    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    _app.command()(ingest)
    run_standalone(_app)
