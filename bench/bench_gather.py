"""Benchmark: how a cluster build gathers its replies: a blocking read of its reply
stream against polling it, side by side in one run.

The build client (:class:`farm.cluster.client.ClusterClient`) waits for its chunks'
replies on its build's reply stream, with one blocking ``XREAD`` (``farm.cluster.gather``;
before issue 31, Celery's own result channel: a publish/subscribe channel per task, and
before that an ``MGET`` of every pending result key every 50 ms). The peer here reads
the same stream without blocking every 50 ms. This script runs both in one process
against one local cluster (Redis, MinIO, ``--workers``
``farm worker --concurrency 1``), alternating ``poll, stream, poll, stream, ...``
``--repeat`` times, each build of ``--kernels`` fresh cheap kernels (``reduce`` with
salted shapes, so every build compiles the same amount of work) in chunks of
``--chunk``:

* wall: the build's ``wall_s`` (keys, bulk listing, sends, gathering);
* client CPU: ``time.process_time()`` of this process around the build;
* Redis CPU: ``used_cpu_sys + used_cpu_user`` of Redis's ``INFO cpu`` around the build
  (every client and worker of the cluster: polling shows up here);
* Redis commands: ``total_commands_processed`` around the build.

The polling variant is kept here only as the peer. Caches off
(``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``).

    .venv/bin/python bench/bench_gather.py [--kernels 24] [--chunk 1] [--workers 2]
                                           [--repeat 3]

Prints one line per build, the medians and their ratios, then one JSON line
(``{"bench": "gather", ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from farm.cluster.gather import Gatherer

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}


def polling_gatherer() -> type[Gatherer]:
    """The reply stream read without blocking every 50 ms (the previous code polled its
    result keys so, before it waited on Celery's result channel; issue 31 put replies on
    a stream per build, read with a blocking ``XREAD``)."""
    from farm.cluster.gather import Gatherer

    class PollingGatherer(Gatherer):
        def _wait(self) -> None:
            deadline = time.monotonic() + self.check_interval_s
            while self.pending and time.monotonic() < deadline:
                self._read(None)
                if self.pending:
                    time.sleep(0.05)

    return PollingGatherer


def artifacts(salt: int, count: int) -> list[Any]:
    from farm.families import Registry

    registry = Registry.load()
    family = registry.get("reduce")
    return [family.artifact_id({"op": "sum", "cols": salt * 1000 + i + 1})
            for i in range(count)]


def redis_figures(client: Any) -> tuple[float, int]:
    cpu = client.info("cpu")
    stats = client.info("stats")
    return (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            int(stats["total_commands_processed"]))


def one_build(settings: Any, fingerprint: str, gatherer: type[Gatherer], salt: int,
              kernels: int) -> dict[str, Any]:
    import redis

    import farm.cluster.client as client_module
    from farm.cluster.client import BuildOptions, ClusterClient

    client_module.Gatherer = gatherer  # type: ignore[misc]
    probe = redis.Redis.from_url(settings.redis_url)
    cpu0, cmds0 = redis_figures(probe)
    with ClusterClient(settings) as client:
        arts = artifacts(salt, kernels)
        t0 = time.process_time()
        report = client.build(arts, BuildOptions(fingerprint=fingerprint))
        cpu = time.process_time() - t0
    cpu1, cmds1 = redis_figures(probe)
    probe.close()
    s = report.summary()
    return {"wall_s": s["wall_s"], "client_cpu_s": round(cpu, 3),
            "redis_cpu_s": round(cpu1 - cpu0, 3), "redis_commands": cmds1 - cmds0,
            "compiled": s["compiled"], "failed": s["failed"], "tasks_sent": s["tasks_sent"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for name in [k for k in os.environ if k.startswith("FARM_")]:
        del os.environ[name]
    os.environ.update(CACHES_OFF)
    from farm.cluster.gather import Gatherer
    from farm.core.device import probe_devices, select_device
    from farm.core.settings import Settings
    from farm.devservices import MinioServer, RedisServer
    from farm.devservices.cluster import local_cluster

    variants: dict[str, type[Gatherer]] = {"poll": polling_gatherer(), "stream": Gatherer}
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="farm-bench-gather-") as tmp, \
            RedisServer(Path(tmp)) as redis_server, MinioServer(Path(tmp)) as minio_server:
        with local_cluster(Path(tmp) / "cluster", redis=redis_server, minio=minio_server,
                           bucket=f"bench-{uuid.uuid4().hex[:12]}", redis_db=1,
                           FARM_CHUNK_SIZE=str(args.chunk)) as c:
            for _ in range(args.workers):
                c.start_worker(concurrency=1)
            c.wait_ready()
            settings = Settings(redis_url=c.redis_url, minio_endpoint=c.minio_endpoint,
                                minio_access_key=c.minio_access_key,
                                minio_secret_key=c.minio_secret_key, minio_bucket=c.bucket,
                                minio_secure=False, chunk_size=args.chunk,
                                home=Path(tmp) / "client")
            fingerprint = select_device(probe_devices()).fingerprint
            one_build(settings, fingerprint, Gatherer, 1, 2)  # warm the workers up
            salt = 10
            for run in range(args.repeat):
                for name, gatherer in variants.items():
                    salt += 1
                    row = {"variant": name, "run": run + 1,
                           **one_build(settings, fingerprint, gatherer, salt, args.kernels)}
                    rows.append(row)
                    print(f"{name:7s} run {run + 1}: wall {row['wall_s']:6.2f} s  client cpu "
                          f"{row['client_cpu_s']:5.2f} s  redis cpu {row['redis_cpu_s']:5.2f} s"
                          f"  redis commands {row['redis_commands']:6d}  compiled "
                          f"{row['compiled']} failed {row['failed']}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rows if r["variant"] == name)
                      for k in ("wall_s", "client_cpu_s", "redis_cpu_s", "redis_commands")}
               for name in variants}
    ratios = {k: round(medians["stream"][k] / medians["poll"][k], 3)
              if medians["poll"][k] else None for k in medians["poll"]}
    print(f"medians: {json.dumps(medians)}")
    print(f"stream/poll: {json.dumps(ratios)}")
    print(json.dumps({"bench": "gather", "kernels": args.kernels, "chunk": args.chunk,
                      "workers": args.workers, "repeat": args.repeat, "cores": os.cpu_count(),
                      "rows": rows, "medians": medians, "ratios": ratios,
                      "loadavg_before": round(load_before, 2),
                      "loadavg_after": round(os.getloadavg()[0], 2),
                      "caches_off": CACHES_OFF}))


if __name__ == "__main__":
    main()
