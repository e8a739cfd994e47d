"""``farm cluster up``: Redis, MinIO, N workers and a records ingester on this machine.

Records of every process go through the Redis streams to the ingester, which writes them
to a SQLite file in the cluster's temporary folder (``FARM_RECORDS_URL`` in the printed
settings), so ``farm records`` works against the cluster too.
"""

from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path
from typing import Annotated

import typer

from farm.cli.console import out

app = typer.Typer(help="A local cluster for trying the distributed mode on one machine.",
                  no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Keep ``up`` a sub-command."""


@app.command("up")
def up(
    workers: Annotated[int, typer.Option("--workers", "-n", help="worker processes")] = 2,
    concurrency: Annotated[int, typer.Option(help="pool processes per worker")] = 1,
    env_file: Annotated[Path | None, typer.Option(
        help="write the settings here (mode 0600; default: a temporary file)")] = None,
) -> None:
    """Start Redis, MinIO and N workers; print the settings; stop all on Ctrl-C."""
    from farm.devservices import export_lines
    from farm.devservices.cluster import local_cluster

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="farm-cluster-") as tmp, \
            local_cluster(Path(tmp)) as cluster:
        records_url = f"sqlite:///{Path(tmp) / 'records.sqlite'}"
        cluster.extra_env["FARM_RECORDS_URL"] = records_url
        cluster.start_ingester(records_url)
        for _ in range(workers):
            cluster.start_worker(concurrency=concurrency)
        cluster.wait_ready()
        env = cluster.env()
        lines = export_lines({k: env[k] for k in sorted(env) if k.startswith("FARM_")})
        # Credentials go to a 0600 file, never to the terminal or a log.
        target = env_file or Path(tmp) / "cluster.env"
        target.touch(mode=0o600)
        target.chmod(0o600)
        target.write_text("\n".join(lines) + "\n")
        out.print(f"# {workers} worker(s) ready. In another shell:", markup=False)
        out.print(f"source {target}", markup=False, soft_wrap=True)
        out.print("farm workers && farm build tiny --cluster", markup=False)
        out.print("# Ctrl-C stops the cluster", markup=False)
        stop.wait()
    out.print("cluster stopped")
