"""Benchmark: what each cluster fault of docs/RELIABILITY.md costs a build, measured.

For each scenario a fresh local cluster (this script's own Redis and MinIO, a fresh
Redis database and bucket, ``--workers`` workers of one process each, default settings
unless the scenario says otherwise) builds the manifest from a fresh client while the
fault is injected by hand, as an operator would:

* ``baseline``: no fault;
* ``redis``: Redis stopped for ``--outage`` seconds once the first task succeeded, then
  started again on the same port with its data;
* ``minio``: the same for MinIO;
* ``worker-kill``: the whole of one worker (main process and pool) SIGKILLed once it
  received a task; the client re-sends its chunk after ``FARM_DEAD_WORKER_GRACE``;
* ``crash-loop``: the manifest plus one kernel whose compile aborts its process
  (``tests/faults``' fault-injection family); it fails as ``crashed`` after
  ``FARM_CRASH_LIMIT`` deaths and the rest builds;
* ``poison``: eleven malformed task messages put on the queue before the build; the
  time until every one is dead-lettered, then the build.

Caches off (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``).

    .venv/bin/python bench/bench_faults.py [--manifest tiny] [--workers 2] [--outage 10]
        [--only redis,minio]

Prints one line per scenario, then one JSON line (``{"bench": "faults", ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "faults"
CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
SCENARIOS = ("baseline", "redis", "minio", "worker-kill", "crash-loop", "poison")


def _wait_for(path: Path, text: str, count: int = 1, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while path.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            sys.exit(f"{text!r} never appeared in {path}")
        time.sleep(0.05)


def _manifest(name: str, work: Path, crash: bool) -> str:
    if not crash:
        return name
    from farm.manifest import resolve_manifest

    text = Path(resolve_manifest(name)).read_text()
    path = work / "crashy.toml"
    path.write_text(text + '\n[[kernels]]\nfamily = "fault"\n'
                    'params = { mode = "abort", salt = 1 }\n')
    return str(path)


def scenario(kind: str, args: argparse.Namespace, redis: Any, minio: Any,
             work: Path, db: int) -> dict[str, Any]:
    from farm.devservices.cluster import local_cluster

    env = {"PYTHONPATH": str(FAULTS), "FARM_FAULT_INJECT": "1",
           "FARM_FAMILY_MODULES": '["faultfam"]'}
    with local_cluster(work / kind, redis=redis, minio=minio,
                       bucket=f"bench-{uuid.uuid4().hex[:12]}", redis_db=db, **env) as c:
        workers = [c.start_worker(concurrency=1) for _ in range(args.workers)]
        c.wait_ready()
        manifest = _manifest(args.manifest, work, kind == "crash-loop")
        extra: dict[str, Any] = {}
        if kind == "poison":
            sys.path.insert(0, str(ROOT / "tests"))
            import redis as redis_py
            from test_faults import _publish_poison  # the test's messages, not a copy

            from farm.core.keys import DEAD_LETTERS
            served = json.loads(subprocess.run(
                [sys.executable, "-m", "farm", "workers", "--json"], env=c.env(),
                capture_output=True, text=True, check=True).stdout)
            t0 = time.perf_counter()
            sent = _publish_poison(c, f"farm.{next(iter(served))}")
            client = redis_py.Redis.from_url(c.redis_url)
            while client.llen(DEAD_LETTERS) < sent:
                time.sleep(0.02)
            extra["dead_lettered"] = sent
            extra["dead_letter_s"] = round(time.perf_counter() - t0, 2)
        logs = [w.log for w in workers]
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "farm", "build", manifest, "--cluster",
                                 "--json"], env=c.env(work / f"{kind}-client"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if kind in ("redis", "minio"):
            _wait_for(logs[0], "succeeded in")
            server = redis if kind == "redis" else minio
            server.halt()
            time.sleep(args.outage)
            server.resume()
            extra["outage_s"] = args.outage
        elif kind == "worker-kill":
            _wait_for(logs[0], "received")
            workers[0].kill_all()
        out, err = proc.communicate(timeout=3600)
        wall = time.perf_counter() - start
        report = json.loads(out) if out.strip() else {}
        alive = sum(1 for w in c.workers if w.process.poll() is None)
        lines = [line for line in err.splitlines() if line.strip()]
        return {"scenario": kind, "exit": proc.returncode, "wall_s": round(wall, 2),
                **{k: report.get("summary", {}).get(k) for k in (
                    "kernels", "compiled", "loaded", "failed", "tasks_sent")},
                "failures": sorted({f["kind"] for f in report.get("failures", [])}),
                "workers_alive": alive, "stderr": lines[:4], **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--outage", type=float, default=10.0)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    args = parser.parse_args()
    for name in [k for k in os.environ if k.startswith("FARM_")]:
        del os.environ[name]
    os.environ.update(CACHES_OFF)
    from farm.devservices import MinioServer, RedisServer

    results = []
    with tempfile.TemporaryDirectory(prefix="farm-bench-faults-") as tmp, \
            RedisServer(Path(tmp)) as redis, MinioServer(Path(tmp)) as minio:
        for db, kind in enumerate(args.only.split(","), start=1):
            row = scenario(kind, args, redis, minio, Path(tmp), db)
            results.append(row)
            print(f"{kind:12s} exit {row['exit']}  wall {row['wall_s']:7.2f} s  "
                  f"compiled {row['compiled']} loaded {row['loaded']} failed {row['failed']} "
                  f"{row['failures']}  workers alive {row['workers_alive']}  "
                  + "  ".join(f"{k}={row[k]}" for k in ("outage_s", "dead_letter_s")
                              if k in row), flush=True)
    print(json.dumps({"bench": "faults", "manifest": args.manifest, "workers": args.workers,
                      "results": results}))


if __name__ == "__main__":
    main()
