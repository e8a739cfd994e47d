"""Benchmark: what each cluster fault of docs/RELIABILITY.md costs a build, measured.

For each scenario a fresh local cluster (this script's own Redis and MinIO, a fresh
Redis database and bucket, ``--workers`` workers of one process each, default settings
unless the scenario says otherwise) builds the manifest from a fresh client while the
fault is injected by hand, as an operator would:

* ``baseline``: no fault;
* ``redis-sigterm``, ``redis-sigstop``, ``redis-sigkill``: Redis stopped cleanly,
  frozen, or killed for ``--outage`` seconds once the first chunk is done, then started
  again (thawed) on the same port with its data (``redis`` is ``redis-sigterm``);
* ``minio-sigterm``, ``minio-sigstop``, ``minio-sigkill``: the same for MinIO;
* ``redis-past-sigterm``, ``redis-past-sigstop``, ``redis-past-sigkill``: Redis away
  for good with ``FARM_OUTAGE_LIMIT=--limit``: when the first worker and the client exit
  after the fault, the worker's log lines after it, and its tracebacks;
* ``ingester-sigkill``: a ``farm ingest`` beside the workers; Redis killed for
  ``--outage`` seconds (within the limit) once the first chunk is done, then started
  again: the ingester waits it out, stays up, and every record of the build arrives;
* ``ingester-past-sigkill``: the same with Redis killed for good and
  ``FARM_OUTAGE_LIMIT=--limit``: when the ingester exits after the fault, its exit
  status and its one ``error:`` line (it used to retry for ever);
* ``worker-kill``: the whole of one worker (main process and pool) SIGKILLed once it
  received a task; the client re-sends its chunk after ``FARM_DEAD_WORKER_GRACE``;
* ``broken-workers``: next to the good workers, one with a wrong MinIO secret, one with
  a MinIO user that may read but not write, and one started while MinIO was down (then
  MinIO is started again): no kernel fails, the broken ones say why;
* ``orphans``: a client that queued the whole manifest (workers paused) is SIGKILLed,
  the workers go on after its heartbeat expired; then a fresh client builds 4 other
  kernels: how long it waited, and how many chunks the workers dropped;
* ``crash-loop``: the manifest plus one kernel whose compile aborts its process
  (``tests/faults``' fault-injection family); it fails as ``crashed`` after
  ``FARM_CRASH_LIMIT`` deaths and the rest builds;
* ``poison``: eleven malformed task messages put on the queue before the build; the
  time until every one is dead-lettered, then the build.

Caches off (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``).

    .venv/bin/python bench/bench_faults.py [--manifest tiny] [--workers 2] [--outage 10]
        [--limit 15] [--only redis-sigstop,minio-sigkill]

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
SIGNALS = ("sigterm", "sigstop", "sigkill")
SCENARIOS = ("baseline", *(f"{s}-{g}" for s in ("redis", "minio") for g in SIGNALS),
             *(f"redis-past-{g}" for g in SIGNALS), "ingester-sigkill",
             "ingester-past-sigkill", "worker-kill", "broken-workers",
             "orphans", "crash-loop", "poison")
#: how a server fails and comes back (farm.devservices.server.LocalServer's methods)
BREAK = {"sigterm": ("halt", "resume"), "sigstop": ("freeze", "thaw"),
         "sigkill": ("kill", "resume")}


def _wait_for(path: Path, text: str, count: int = 1, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while path.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            sys.exit(f"{text!r} never appeared in {path}")
        time.sleep(0.05)
    return time.monotonic()


def _manifest(name: str, work: Path, crash: bool) -> str:
    if not crash:
        return name
    from farm.manifest import resolve_manifest

    text = Path(resolve_manifest(name)).read_text()
    path = work / "crashy.toml"
    path.write_text(text + '\n[[kernels]]\nfamily = "fault"\n'
                    'params = { mode = "abort", salt = 1 }\n')
    return str(path)


def _build(c: Any, manifest: str, home: Path, *extra: str, **env: str) -> Any:
    return subprocess.Popen([sys.executable, "-m", "farm", "build", manifest, "--cluster",
                             "--json", *extra], env=c.env(home, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _row(kind: str, proc: Any, out: str, err: str, wall: float, c: Any) -> dict[str, Any]:
    report = json.loads(out) if out.strip() else {}
    lines = [line for line in err.splitlines() if line.strip()]
    return {"scenario": kind, "exit": proc.returncode, "wall_s": round(wall, 2),
            **{k: report.get("summary", {}).get(k) for k in (
                "kernels", "compiled", "loaded", "failed", "tasks_sent")},
            "failures": sorted({f["kind"] for f in report.get("failures", [])}),
            "workers_alive": sum(1 for w in c.workers if w.process.poll() is None),
            "stderr": lines[:4]}


def scenario(kind: str, args: argparse.Namespace, redis: Any, minio: Any,
             work: Path, db: int) -> dict[str, Any]:
    from farm.devservices.cluster import local_cluster

    env = {"PYTHONPATH": str(FAULTS), "FARM_FAULT_INJECT": "1",
           "FARM_FAMILY_MODULES": '["faultfam"]'}
    if kind.startswith(("redis-past", "ingester-past")):
        env["FARM_OUTAGE_LIMIT"] = f"{args.limit:g}"
    with local_cluster(work / kind, redis=redis, minio=minio,
                       bucket=f"bench-{uuid.uuid4().hex[:12]}", redis_db=db, **env) as c:
        workers = [c.start_worker(concurrency=1) for _ in range(args.workers)]
        c.wait_ready()
        manifest = _manifest(args.manifest, work, kind == "crash-loop")
        if kind == "broken-workers":
            return _broken_workers(c, manifest, minio, work)
        if kind == "orphans":
            return _orphans(c, manifest, workers, work)
        if kind.startswith("ingester"):
            return _ingester(c, manifest, args, redis, work / kind, kind)
        extra: dict[str, Any] = {}
        if kind == "poison":
            extra = _poison(c)
        logs = [w.log for w in workers]
        start = time.perf_counter()
        proc = _build(c, manifest, work / f"{kind}-client")
        service, _, fault = kind.rpartition("-")
        if service in ("redis", "minio", "redis-past"):
            _wait_for(logs[0], "chunk ")
            server = minio if service == "minio" else redis
            before = logs[0].read_text(errors="replace").count("\n")
            failed_at = time.monotonic()
            getattr(server, BREAK[fault][0])()
            if service == "redis-past":
                extra |= _past_limit(workers[0], proc, before, failed_at)
            else:
                time.sleep(args.outage)
                extra["outage_s"] = args.outage
            getattr(server, BREAK[fault][1])()
        elif kind == "worker-kill":
            _wait_for(logs[0], "received")
            workers[0].kill_all()
        out, err = proc.communicate(timeout=3600)
        return {**_row(kind, proc, out, err, time.perf_counter() - start, c), **extra}


def _past_limit(worker: Any, client: Any, before: int, failed_at: float) -> dict[str, Any]:
    """Redis away for good: when the worker and the client end, what the worker said."""
    ended: dict[str, float] = {}
    deadline = time.monotonic() + 600
    while len(ended) < 2 and time.monotonic() < deadline:
        for name, proc in (("worker", worker.process), ("client", client)):
            if name not in ended and proc.poll() is not None:
                ended[name] = time.monotonic() - failed_at
        time.sleep(0.05)
    worker_s, client_s = ended.get("worker", -1.0), ended.get("client", -1.0)
    after = worker.log.read_text(errors="replace").splitlines()[before:]
    return {"worker_exit_s": round(worker_s, 1), "client_exit_s": round(client_s, 1),
            "worker_lines_after": len(after),
            "worker_tracebacks": sum("Traceback" in line for line in after),
            "worker_error_lines": sum("error: Redis at" in line for line in after)}


def _ingester(c: Any, manifest: str, args: argparse.Namespace, redis: Any, work: Path,
              kind: str) -> dict[str, Any]:
    """Redis killed under a running ``farm ingest`` during a build: for ``--outage``
    seconds (it must heal: every record arrives), or for good (it must exit 1 with one
    line after the limit)."""
    records_url = f"sqlite:///{work / 'records.sqlite'}"
    c.extra_env["FARM_RECORDS_URL"] = records_url
    ingester = c.start_ingester(records_url)
    _wait_for(ingester.log, " -> ")
    start = time.perf_counter()
    proc = _build(c, manifest, work / "client")
    _wait_for(c.workers[0].log, "chunk ")
    before = ingester.log.read_text(errors="replace").count("\n")
    failed_at = time.monotonic()
    redis.kill()
    extra: dict[str, Any] = {}
    if kind == "ingester-past-sigkill":
        try:
            code = ingester.process.wait(timeout=args.limit + 120)
        except subprocess.TimeoutExpired:
            code = None  # the bug: it retried for ever
        extra["ingester_exit_s"] = round(time.monotonic() - failed_at, 1)
        extra["ingester_exit"] = code
        redis.resume()
    else:
        time.sleep(args.outage)
        extra["outage_s"] = args.outage
        redis.resume()
    out, err = proc.communicate(timeout=3600)
    row = _row(kind, proc, out, err, time.perf_counter() - start, c)
    if kind == "ingester-sigkill":
        label = json.loads(out)["summary"]["kernels"] if out.strip() else 0
        extra |= _records_arrived(c, label)
        extra["ingester_alive"] = ingester.process.poll() is None
    after = ingester.log.read_text(errors="replace").splitlines()[before:]
    said = [line for line in after if line.startswith("error:")]
    return {**row, **extra, "ingester_lines_after": len(after),
            "ingester_error_lines": len(said), "ingester_said": said[:1]}


def _records_arrived(c: Any, kernels: int) -> dict[str, Any]:
    """Wait (a minute at most) for the build's records: kernels counted, none missing."""
    found: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        shown = subprocess.run([sys.executable, "-m", "farm", "records", "summary", "--json"],
                               env=c.env(), capture_output=True, text=True, check=False)
        found = json.loads(shown.stdout) if shown.returncode == 0 and shown.stdout else {}
        if found.get("kernels") == kernels and found.get("missing") == 0:
            break
        time.sleep(0.5)
    return {"records_kernels": found.get("kernels"), "records_missing": found.get("missing")}


def _broken_workers(c: Any, manifest: str, minio: Any, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from cluster_helpers import read_only_user

    access, secret = read_only_user(c)
    broken = [c.start_worker(FARM_MINIO_SECRET_KEY="not-the-secret-of-this-minio"),
              c.start_worker(FARM_MINIO_ACCESS_KEY=access, FARM_MINIO_SECRET_KEY=secret)]
    minio.halt()
    broken.append(c.start_worker())
    _wait_for(broken[-1].log, "not consuming")
    minio.resume()
    c.wait_ready(workers=broken[1:])
    start = time.perf_counter()
    proc = _build(c, manifest, work / "broken-client")
    out, err = proc.communicate(timeout=3600)
    row = _row("broken-workers", proc, out, err, time.perf_counter() - start, c)
    texts = [w.log.read_text(errors="replace") for w in broken]
    return {**row, "chunks_taken_by_wrong_secret": texts[0].count(" received"),
            "chunks_given_back_by_read_only": texts[1].count("goes back to its queue"),
            "not_consuming_lines": [t.count("not consuming") for t in texts],
            "key_errors": sum(t.count("KeyError") for t in texts)}


def _orphans(c: Any, manifest: str, workers: list[Any], work: Path) -> dict[str, Any]:
    import redis as redis_py

    from farm.cluster.queues import queue_depth
    from farm.core.settings import load_settings
    from farm.devservices.cluster import paused

    fp = str(next(iter(json.loads(subprocess.run(
        [sys.executable, "-m", "farm", "workers", "--json"], env=c.env(),
        capture_output=True, text=True, check=True).stdout))))
    client = redis_py.Redis.from_url(c.redis_url)
    with paused(*workers):
        dead = _build(c, manifest, work / "orphan-client", "--wait-for-workers",
                      "--fingerprint", fp)
        # all but one: the paused workers' pending BRPOP may hold the first (see
        # tests/test_orphans.py), then a second for the end of the burst
        while queue_depth(client, fp) < _chunks(manifest) - 1:
            time.sleep(0.05)
        time.sleep(1.0)
        queued = _chunks(manifest)
        dead.kill()
        dead.wait(timeout=30)
        time.sleep(load_settings().dead_worker_grace + 1)  # its heartbeat key expires
    rerun = work / "rerun.toml"
    rerun.write_text('format = 1\nname = "rerun"\n' + "".join(
        f'\n[[kernels]]\nfamily = "reduce"\nparams = {{ op = "sum", cols = {9000 + i} }}\n'
        for i in range(4)))
    start = time.perf_counter()
    proc = _build(c, str(rerun), work / "rerun-client")
    out, err = proc.communicate(timeout=3600)
    row = _row("orphans", proc, out, err, time.perf_counter() - start, c)
    return {**row, "orphaned_chunks": queued,
            "dropped": sum(w.log.read_text(errors="replace").count(": dropped ")
                           for w in workers)}


def _chunks(manifest: str) -> int:
    """Chunks a client sends for the whole of ``manifest`` (nothing stored yet)."""
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    kernels = len(expand(load_manifest(resolve_manifest(manifest)), Registry.load([])))
    size = load_settings().chunk_size
    return -(-kernels // size)


def _poison(c: Any) -> dict[str, Any]:
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
    return {"dead_lettered": sent, "dead_letter_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--outage", type=float, default=10.0)
    parser.add_argument("--limit", type=float, default=15.0,
                        help="FARM_OUTAGE_LIMIT of the redis-past-* scenarios")
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
            kind = {"redis": "redis-sigterm", "minio": "minio-sigterm"}.get(kind, kind)
            row = scenario(kind, args, redis, minio, Path(tmp), db)
            results.append(row)
            print(f"{kind:18s} exit {row['exit']}  wall {row['wall_s']:7.2f} s  "
                  f"compiled {row['compiled']} loaded {row['loaded']} failed {row['failed']} "
                  f"{row['failures']}  workers alive {row['workers_alive']}  "
                  + "  ".join(f"{k}={v}" for k, v in row.items() if k not in (
                      "scenario", "exit", "wall_s", "kernels", "compiled", "loaded",
                      "failed", "tasks_sent", "failures", "workers_alive", "stderr")),
                  flush=True)
    print(json.dumps({"bench": "faults", "manifest": args.manifest, "workers": args.workers,
                      "results": results}))


if __name__ == "__main__":
    main()
