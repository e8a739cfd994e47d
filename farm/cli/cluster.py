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
from farm.cli.help import examples, new_app

app = new_app("A local cluster for trying the distributed mode on one machine.",
              epilog=examples("farm cluster up"))


@app.callback()
def _group() -> None:
    """Keep ``up`` a sub-command."""


@app.command("up", epilog=examples(
    "farm cluster up", "farm cluster up --workers 3 --concurrency 2",
    "farm cluster up --workdir ./cluster  # then: source ./cluster/cluster.env"))
def up(
    workers: Annotated[int, typer.Option("--workers", "-n", metavar="N", min=1, max=64,
                                         help="worker processes")] = 2,
    concurrency: Annotated[int, typer.Option(metavar="N", min=1, max=256,
                                             help="pool processes per worker")] = 1,
    env_file: Annotated[Path | None, typer.Option(
        metavar="FILE", help="write the settings here (mode 0600; default: cluster.env in the work "
        "folder)")] = None,
    workdir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="folder for the logs, the records and the settings (default: a new "
        "farm-cluster-* folder in the temporary folder); kept after the cluster stops")
    ] = None,
) -> None:
    """Start Redis, MinIO, N workers and an ingester here, until Ctrl-C.

    Prints the settings (FARM_*) to source in another shell.

    The logs (worker-N.log, ingester-0.log) and the records stay in the work folder
    after the cluster stops: that is where to look when something went wrong.
    """
    from farm.core.keys import RECORDS_FILE
    from farm.devservices import export_lines
    from farm.devservices.cluster import local_cluster, local_fingerprint

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if workdir is None:
        work = Path(tempfile.mkdtemp(prefix="farm-cluster-"))
    else:
        work = workdir.resolve()
        work.mkdir(parents=True, exist_ok=True)
    fingerprint = local_fingerprint()
    with local_cluster(work) as cluster:
        # as the chart: root makes the users; workers sign with their pool's credentials
        cluster.set_access(fingerprint)
        records_url = f"sqlite:///{work / RECORDS_FILE}"
        cluster.extra_env["FARM_RECORDS_URL"] = records_url
        cluster.start_ingester(records_url)
        for _ in range(workers):
            cluster.start_worker(concurrency=concurrency)
        cluster.wait_ready()
        # What every node shares, never this shell's own FARM_HOME or FARM_DEVICE: a
        # shell that sources it keeps its own local tier and device.
        shared = cluster.shared()
        lines = export_lines({k: shared[k] for k in sorted(shared)})
        # Credentials go to 0600 files, never to the terminal or a log: a client's to
        # cluster.env, the repair role's (farm gc) to repair.env beside it.
        target = env_file or work / "cluster.env"
        _private(target, lines)
        repair = target.with_name("repair.env")
        _private(repair, export_lines(cluster.repair_settings()))
        out.print(f"# {workers} worker(s) ready. In another shell:", markup=False)
        out.print(f"source {target}", markup=False, soft_wrap=True)
        out.print("farm workers && farm build tiny --cluster", markup=False)
        out.print("celery -A worker inspect ping    # Celery's own view", markup=False)
        out.print(f"# farm gc with the repair role: source {repair} as well", markup=False,
                  soft_wrap=True)
        out.print(f"# logs: {work}/worker-*.log, {work}/ingester-0.log (kept after stop)",
                  markup=False, soft_wrap=True)
        out.print("# Ctrl-C stops the cluster", markup=False)
        stop.wait()
    out.print(f"cluster stopped; logs and records kept in {work}", markup=False,
              soft_wrap=True)


def _private(path: Path, lines: list[str]) -> None:
    """Write ``lines`` to ``path``, readable by its owner only."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("\n".join(lines) + "\n")
