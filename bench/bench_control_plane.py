"""Benchmark: how many kernels one Redis and one MinIO feed, and what the farm adds per kernel.

A simulated fleet on one host (``bench/simfleet.py``: a device whose compile sleeps a set
time and returns a set-size binary, a benchmark-only family; no OpenCL), started the way
``farm cluster up`` starts a cluster (``farm.devservices``): Redis, MinIO and ``farm
worker`` processes, N pool processes in all (``--workers 8,32``: W workers of P
processes). For each N and chunk size (``--chunks 1,4``):

1. **throughput**: ``--clients`` client processes build ``--kernels`` new kernels each at
   once (``farm.cluster.client.ClusterClient.build``, what ``farm build --cluster`` runs); the
   control plane's rate is all kernels / wall from the first client's start to the last
   one's end. The simulated compile (``--compile-ms``, default 5) is short on purpose:
   N / compile time is far above what Redis and MinIO serve, so the rate found is theirs
   (and the farm's), not the workers';
2. **latency**: ``--latency-clients`` clients, while the fleet is otherwise idle, build
   ``--latency-rounds`` chunks each, in builds of at most min(N, cores) / (2 x clients)
   chunks so that every chunk finds a free worker process, and a free core, at once. A
   kernel's added latency is the arrival of its reply at the client minus the send of
   its chunk, minus the compiles of its chunk (chunk x compile time): what the farm
   adds between a build asking and knowing, queueing for a busy fleet and per-build
   costs (the store listing, the session) left out.

Counted per kernel, from the servers' own counters over the throughput phase: Redis
commands (``INFO commandstats``, every command, those a Lua script calls included, minus
our own ``INFO`` calls), MinIO requests (``minio_api_requests_total`` from its
Prometheus v3 endpoint, public for this run), CPU seconds of the clients (their own
``getrusage`` over their builds; ``client_total`` with their start-up), of the workers
(their processes' ``/proc/<pid>/stat``), of Redis (``INFO cpu``) and MinIO (``/proc``).

Side by side, in the same call and on the same Redis and MinIO, point by point:

* ``--baseline REF`` (a git ref, exported with ``git archive``, or a folder holding such
  an export, as ``bench/host_kit.sh`` carries one to the GPU host): the same points run
  with that code in every worker and client (``PYTHONPATH`` and ``PYTHONSAFEPATH``: the
  export's ``farm``, ``worker`` and ``bench/simfleet.py`` come first), the driver and its
  counters this tree's;
* ``--bare``: a bare Celery task round trip (``bench/cp_bare.py``): the farm's Celery
  configuration, one task per chunk that sleeps the chunk's compiles and answers a
  chunk's reply, N pool processes: what Celery itself costs a chunk.

Where each cost goes: ``--monitor`` puts every Redis command of the throughput phase
under its purpose (``bench/cp_monitor.py``: MONITOR, which costs Redis CPU itself),
``--profile DIR`` samples the workers and clients with py-spy (``bench/cp_profile.py``).

Links: ``--rtt-ms 0.5`` makes every request of a worker or client pay the round trip it
pays between machines. Where ``ip`` and ``tc netem`` work, each RTT runs inside a network
namespace of its own whose loopback delays every packet by RTT / 2; elsewhere (the
development machine has no ``sch_netem``, the GPU host no ``ip``) a delay proxy
(``bench/delay_proxy.py``) stands in front of Redis and MinIO. The measured RTT (a Redis
``PING``) is printed: the proxy's own thread hops add about 0.3 ms.

    .venv/bin/python bench/bench_control_plane.py --workers 8,32 --chunks 4 --rtt-ms 0.5 \\
        --baseline 624c62d --bare

Prints a table and one JSON line per point (``{"bench": "control_plane", ...}``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


def cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- a client process --------------------------------------------------------------------------
def client_main(args: argparse.Namespace) -> None:
    """One client (run as ``--client MODE``, with whichever farm its PYTHONPATH names):
    prints one JSON line."""
    from farm.cluster import gather
    from farm.cluster.client import BuildOptions, ClusterClient
    from farm.core.model import ArtifactId, KernelId
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.records.open import open_recorder
    from farm.store.open import open_store

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    store = open_store(settings)
    # as `farm build --cluster` makes it: the Celery app made ahead, where the code can
    ahead = {"ahead": True} if "ahead" in inspect.signature(ClusterClient).parameters else {}
    client = ClusterClient(settings, registry=registry, store=store, **ahead)
    tag = uuid.uuid4().hex[:10]

    def kernels(first: int, count: int) -> list[ArtifactId]:
        return [ArtifactId(kernel=KernelId(family="sim_compile",
                                           params={"index": i, "run": tag}))
                for i in range(first, first + count)]

    # when each chunk is sent: the gatherer's one way to send (today's code and the
    # code of this round alike), wrapped
    sends: list[float] = []
    sent_at: list[tuple[float, Any]] = []  # (wall clock, task id): --timeline's
    send_chunk = gather.Gatherer._send

    def timed_send(self: Any, chunk: Any) -> Any:
        sends.append(time.perf_counter())
        wall = time.time()
        task_id = send_chunk(self, chunk)
        sent_at.append((wall, task_id))
        return task_id

    gather.Gatherer._send = timed_send  # type: ignore[method-assign]

    def build(arts: list[ArtifactId],
              arrived: dict[str, tuple[float, float, float]]) -> tuple[float, int]:
        recorder = open_recorder(settings, "bench control plane")
        t = time.perf_counter()
        report = client.build(arts, BuildOptions(fingerprint=args.fingerprint,
                                                 label="bench control plane", timeout_s=600),
                              recorder=recorder, progress=lambda r: arrived.setdefault(
                                  r.artifact.id_hash,
                                  (time.perf_counter(), r.work_s, time.time())))
        wall = time.perf_counter() - t
        recorder.close()
        return wall, len(report.failed)

    out: dict[str, Any] = {"tag": tag}
    cpu0 = cpu_now()
    if args.client == "throughput":
        start = time.time()
        wall, failed = build(kernels(0, args.kernels), {})
        out.update(start=start, end=time.time(), wall_s=wall, kernels=args.kernels,
                   failed=failed)
    else:
        # Builds of at most --free chunks, so that every chunk finds a free worker
        # process: a kernel's added latency is its reply's arrival minus its chunk's
        # send, minus the compiles of its chunk (no queueing in it, no per-build costs).
        added: list[float] = []
        on_worker: list[float] = []  # a kernel's time in the worker beyond its compile
        chunks: list[dict[str, Any]] = []  # each chunk's send and last arrival, wall clock
        failed, done = 0, 0
        compile_s = args.compile_ms / 1000
        while done < args.latency_rounds:
            count = min(args.free, args.latency_rounds - done)
            arts = kernels(done * args.chunk, count * args.chunk)
            arrived: dict[str, tuple[float, float, float]] = {}
            first = len(sends)
            _, bad = build(arts, arrived)
            failed += bad
            for i, art in enumerate(arts):
                at, work, wall = arrived[art.id_hash]
                added.append(at - sends[first + i // args.chunk] - args.chunk * compile_s)
                on_worker.append(work - compile_s)
                if i % args.chunk == 0:
                    chunks.append({"task": sent_at[first + i // args.chunk][1],
                                   "sent": sent_at[first + i // args.chunk][0],
                                   "arrived": wall})
                chunks[-1]["arrived"] = max(chunks[-1]["arrived"], wall)
            done += count
        out.update(added_s=added, on_worker_s=on_worker, failed=failed, chunks=chunks)
    out["cpu_s"] = cpu_now() - cpu0  # the builds only
    out["cpu_total_s"] = cpu_now()  # with the start-up (imports, settings, store)
    client.close()
    store.close()
    print(json.dumps(out), flush=True)


# -- the driver ----------------------------------------------------------------------------------
def netem_available() -> bool:
    """Whether ``tc netem`` works here (tried in a throw-away network namespace)."""
    ns = f"kfb-probe-{os.getpid()}"
    try:  # the GPU host has no iproute2 at all
        if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
            return False
    except FileNotFoundError:
        return False
    try:
        return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo",
                               "root", "netem", "delay", "1ms"],
                              capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_netem_namespace(argv: list[str], rtt: float) -> list[dict[str, Any]]:
    """Run this benchmark for one RTT inside a network namespace of its own, whose
    loopback delays every packet by RTT/2 (``tc netem``): Redis, MinIO, workers and
    clients all inside, each request paying the round trip. The rows it printed."""
    ns = f"kfb-{os.getpid()}-{int(rtt * 1000)}"
    setup = [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
             ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
              "delay", f"{rtt / 2}ms"]]
    try:
        for command in setup:
            subprocess.run(command, check=True, capture_output=True)
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable,
                               str(Path(__file__).resolve()), *argv, "--rtt-ms", str(rtt),
                               "--link", "applied"], stdout=subprocess.PIPE, text=True,
                              check=False)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"the run in network namespace {ns} failed ({proc.returncode})")
    rows = [json.loads(line) for line in proc.stdout.splitlines()
            if line.startswith('{"bench"')]
    for row in rows:
        row["link"] = "netem"
    return rows


def run_points(args: argparse.Namespace, rtt: float, link_kind: str) -> list[dict[str, Any]]:
    """Every (N, chunk) at one RTT, on one Redis and one MinIO started here: for each,
    this tree's code, then the baseline's and the bare Celery round trip, if asked."""
    import cp_fleet
    from cp_fleet import Link, baseline_code, this_code
    from cp_points import bare_point, one_point, start_proxy

    from farm.devservices import MinioServer, RedisServer

    rows = []
    with tempfile.TemporaryDirectory(prefix="farm-bench-cp-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        redis = stack.enter_context(RedisServer(work))
        minio = stack.enter_context(MinioServer(work, {"MINIO_PROMETHEUS_AUTH_TYPE": "public"}))
        cp_fleet.minio_pid = minio._process.pid  # type: ignore[union-attr]
        codes = [this_code()]
        if args.baseline:
            codes.append(baseline_code(args.baseline, work))
        redis_addr = redis.url.split("//", 1)[1].split("/", 1)[0]
        minio_addr = minio.endpoint
        applied = rtt if link_kind == "proxy" else 0.0
        if applied > 0:
            redis_addr = start_proxy(redis_addr, applied / 2, stack)
            minio_addr = start_proxy(minio_addr, applied / 2, stack)
        link = Link(redis, minio, redis_addr, minio_addr, rtt)
        for n in (int(x) for x in args.workers.split(",")):
            for chunk in (int(x) for x in args.chunks.split(",")):
                points: list[dict[str, Any]] = [one_point(args, code, n, chunk, link, work)
                                                for code in codes]
                if args.bare:
                    points.append(bare_point(args, n, chunk, link, work))
                for row in points:
                    row.update(rtt_ms=rtt, link=link_kind if rtt > 0 else "none")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print(f"{'code':>20} {'N':>4} {'chunk':>5} {'rtt':>5} {'link':>6} {'k/s':>7} "
          f"{'redis/k':>8} {'minio/k':>8} {'cpu ms/k cl/wk/redis/minio':>28} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'wk p50':>7}")
    for r in rows:
        c = r["cpu_ms_per_kernel"]
        print(f"{r['code'][:20]:>20} {r['workers']:>4} {r['chunk']:>5} {r['rtt_ms']:>5} "
              f"{r['link']:>6} {r['kernels_per_s']:>7.0f} "
              f"{r['redis_commands_per_kernel']:>8.2f} {r['minio_requests_per_kernel']:>8.2f} "
              f"{c['clients']:>6.2f}/{c['workers']:>6.2f}/{c['redis']:>5.2f}/{c['minio']:>5.2f}"
              f" {r['added_ms']['p50']:>7.1f} {r['added_ms']['p99']:>7.1f} "
              f"{r['worker_ms']['p50']:>7.1f}")
    for r in rows:
        if "timeline" in r:
            print(f"\n{r['code']}, N {r['workers']}: where a chunk's added latency goes "
                  "(ms, p50 / p99)")
            for name, v in r["timeline"].items():
                print(f"  {name:42} {v['p50']:7.2f} / {v['p99']:7.2f}  ({v['n']} chunks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,32", help="pool processes in all, per point")
    parser.add_argument("--per-worker", type=int, default=16,
                        help="pool processes per farm worker (its --concurrency)")
    parser.add_argument("--chunks", default="4", help="FARM_CHUNK_SIZE values")
    parser.add_argument("--rtt-ms", default="0.5", help="round trips to Redis and MinIO")
    parser.add_argument("--compile-ms", type=float, default=5.0)
    parser.add_argument("--binary-bytes", type=int, default=32768)
    parser.add_argument("--kernels", type=int, default=1000, help="per throughput client")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--latency-clients", type=int, default=2)
    parser.add_argument("--latency-rounds", type=int, default=50)
    parser.add_argument("--baseline", metavar="REF", help="also run each point at this "
                        "commit (a git ref, or a folder holding its export)")
    parser.add_argument("--no-events", action="store_true", help="FARM_WORKER_EVENTS=false "
                        "everywhere (what Celery's task events cost: compare with a run "
                        "without it)")
    parser.add_argument("--bare", action="store_true",
                        help="also run a bare Celery round trip per point (cp_bare.py)")
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    parser.add_argument("--monitor", action="store_true", help="Redis commands by "
                        "purpose (MONITOR over the throughput phase: bench/cp_monitor.py)")
    parser.add_argument("--profile", type=Path, help="py-spy the workers and clients of "
                        "the throughput phase into this folder (bench/cp_profile.py)")
    parser.add_argument("--timeline", action="store_true", help="where the added latency "
                        "goes (MONITOR over the latency phase: bench/cp_timeline.py)")
    parser.add_argument("--link", choices=("auto", "netem", "proxy", "applied"),
                        default="auto", help="how a round trip is made: tc netem in a "
                        "network namespace, or the delay proxy (auto: netem where it works)")
    # a client process
    parser.add_argument("--client", choices=("throughput", "latency"), help=argparse.SUPPRESS)
    parser.add_argument("--fingerprint", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--free", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args)
        return
    sys.path.insert(0, str(BENCH))
    # a clean farm configuration, but the servers' binaries (FARM_REDIS_BIN, FARM_MINIO_BIN:
    # on a host with no network, the ones bench/host_kit.sh carried) stay chosen
    for name in [k for k in os.environ if k.startswith("FARM_") and not k.endswith("_BIN")]:
        del os.environ[name]
    from cp_fleet import baseline_code

    if args.baseline and not Path(args.baseline).is_dir():  # export once, before netem
        args.baseline = str(baseline_code(args.baseline, Path(tempfile.mkdtemp(
            prefix="farm-bench-base-"))).root)
    if args.no_events:
        from cp_points import EXTRA

        EXTRA["FARM_WORKER_EVENTS"] = "false"
    rtts = [float(r) for r in args.rtt_ms.split(",")]
    link = args.link
    if link == "auto" and any(rtts):
        link = "netem" if netem_available() else "proxy"
    if link != "applied":
        print(f"bench_control_plane: N {args.workers}, chunks {args.chunks}, RTT {rtts} ms "
              f"({link}); simulated compile {args.compile_ms} ms, binary "
              f"{args.binary_bytes} B; {args.clients} x {args.kernels} kernels; "
              f"{os.cpu_count()} cores; baseline {args.baseline or 'none'}; bare Celery "
              f"{'yes' if args.bare else 'no'}", flush=True)
    inner = ["--workers", args.workers, "--per-worker", str(args.per_worker),
             "--chunks", args.chunks, "--compile-ms", str(args.compile_ms),
             "--binary-bytes", str(args.binary_bytes), "--kernels", str(args.kernels),
             "--clients", str(args.clients), "--latency-clients", str(args.latency_clients),
             "--latency-rounds", str(args.latency_rounds),
             *(["--baseline", args.baseline] if args.baseline else []),
             *(["--bare"] if args.bare else []), *(["--monitor"] if args.monitor else []),
             *(["--no-events"] if args.no_events else []),
             *(["--timeline"] if args.timeline else []),
             *(["--profile", str(args.profile)] if args.profile else [])]
    rows = []
    for rtt in rtts:
        if rtt > 0 and link == "netem":
            got = in_netem_namespace(inner, rtt)
            for row in got:
                print(json.dumps(row), flush=True)
        else:
            got = run_points(args, rtt, link)
        rows += got
        if args.out:
            with args.out.open("a") as fh:
                fh.writelines(json.dumps(row) + "\n" for row in got)
    if link != "applied":
        print_table(rows)
        if args.profile:
            import cp_profile

            cp_profile.report(args.profile)


if __name__ == "__main__":
    main()
