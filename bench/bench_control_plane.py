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
commands (``INFO commandstats``, every command, minus our own ``INFO`` calls), MinIO
requests (``minio_api_requests_total`` from its Prometheus v3 endpoint, public for this
run), CPU seconds of the clients (their own ``getrusage``), of the workers (their
processes' ``/proc/<pid>/stat``), of Redis (``INFO cpu``) and MinIO (``/proc``).

Links: ``--rtt-ms 0.5`` makes every request of a worker or client pay the round trip it
pays between machines. Where ``ip`` and ``tc netem`` work, each RTT runs inside a network
namespace of its own whose loopback delays every packet by RTT / 2; elsewhere (the
development machine has no ``sch_netem``, the GPU host no ``ip``) a delay proxy
(``bench/delay_proxy.py``) stands in front of Redis and MinIO. The measured RTT (a Redis
``PING``) is printed: the proxy's own thread hops add about 0.3 ms.

    .venv/bin/python bench/bench_control_plane.py --workers 8,32 --chunks 1,4 --rtt-ms 0,0.5

Prints a table and one JSON line per point (``{"bench": "control_plane", ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# bench/ for the simulated family, before what the caller's PYTHONPATH holds (on the GPU
# host, the carried wheels)
SIM = {"PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", ""))
                                     if p),
       "FARM_FAMILY_MODULES": '["simfleet"]',
       "FARM_DEVICE_BACKEND": "simfleet", "FARM_RECORDS_LEVEL": "basic"}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
minio_pid = 0


# -- counters --------------------------------------------------------------------------------
def redis_counters(url: str) -> dict[str, float]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        cpu = client.info("cpu")
    finally:
        client.close()
    calls = {k: float(v["calls"]) for k, v in stats.items()}
    return {"commands": sum(calls.values()) - calls.get("cmdstat_info", 0.0),
            "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            **{k.removeprefix("cmdstat_"): v for k, v in calls.items()}}


#: MinIO's v3 metrics are read live (v2's are a snapshot cached for ten seconds)
_S3 = re.compile(r'^minio_api_requests_total\{[^}]*name="([^"]+)"[^}]*\}\s+([0-9.e+]+)', re.M)


def minio_counters(endpoint: str) -> dict[str, float]:
    with _DIRECT.open(f"http://{endpoint}/minio/metrics/v3/api/requests", timeout=10) as resp:
        text = resp.read().decode()
    apis: dict[str, float] = {}
    for api, value in _S3.findall(text):
        apis[api] = apis.get(api, 0.0) + float(value)
    return {"requests": sum(apis.values()), **apis}


def proc_cpu(pids: list[int]) -> float:
    """User + system seconds of ``pids`` and their children now alive, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += (int(stats[pid][11]) + int(stats[pid][12])) / tick
        todo += children.get(pid, [])
    return total


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


# -- a client process --------------------------------------------------------------------------
def client_main(args: argparse.Namespace) -> None:
    """One client (run as ``--client MODE``): prints one JSON line."""
    from farm.cluster.client import BuildOptions, ClusterClient
    from farm.core.model import ArtifactId, KernelId
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.records.open import open_recorder
    from farm.store.open import open_store

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    store = open_store(settings)
    client = ClusterClient(settings, registry=registry, store=store)
    app = client.app
    tag = uuid.uuid4().hex[:10]

    def kernels(first: int, count: int) -> list[ArtifactId]:
        return [ArtifactId(kernel=KernelId(family="sim_compile",
                                           params={"index": i, "run": tag}))
                for i in range(first, first + count)]

    sends: list[float] = []
    send_task = app.send_task

    def timed_send(*a: Any, **k: Any) -> Any:
        sends.append(time.perf_counter())
        return send_task(*a, **k)

    app.send_task = timed_send  # type: ignore[method-assign]

    def build(arts: list[ArtifactId],
              arrived: dict[str, tuple[float, float]]) -> tuple[float, int]:
        recorder = open_recorder(settings, "bench control plane")
        t = time.perf_counter()
        report = client.build(arts, BuildOptions(fingerprint=args.fingerprint,
                                                 label="bench control plane", timeout_s=600),
                              recorder=recorder, progress=lambda r: arrived.setdefault(
                                  r.artifact.id_hash, (time.perf_counter(), r.work_s)))
        wall = time.perf_counter() - t
        recorder.close()
        return wall, len(report.failed)

    out: dict[str, Any] = {"tag": tag}
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
        failed, done = 0, 0
        compile_s = args.compile_ms / 1000
        while done < args.latency_rounds:
            count = min(args.free, args.latency_rounds - done)
            arts = kernels(done * args.chunk, count * args.chunk)
            arrived: dict[str, tuple[float, float]] = {}
            first = len(sends)
            _, bad = build(arts, arrived)
            failed += bad
            for i, art in enumerate(arts):
                at, work = arrived[art.id_hash]
                added.append(at - sends[first + i // args.chunk] - args.chunk * compile_s)
                on_worker.append(work - compile_s)
            done += count
        out.update(added_s=added, on_worker_s=on_worker, failed=failed)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime
    client.close()
    store.close()
    print(json.dumps(out), flush=True)


# -- the driver ----------------------------------------------------------------------------------
def start_proxy(target: str, one_way_ms: float, stack: ExitStack) -> str:
    proc = subprocess.Popen([sys.executable, str(BENCH / "delay_proxy.py"), "--target", target,
                             "--one-way-ms", str(one_way_ms)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return f"127.0.0.1:{port}"


def measure_rtt(url: str) -> float:
    import redis

    client = redis.Redis.from_url(url)
    client.ping()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - t)
    client.close()
    return sorted(times)[len(times) // 2] * 1000


def run_clients(env: dict[str, str], mode: str, count: int, extra: list[str]
                ) -> tuple[float, list[dict[str, Any]]]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--client", mode, *extra]
    t = time.perf_counter()
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(count)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            sys.exit(f"a {mode} client failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return time.perf_counter() - t, results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_point(args: argparse.Namespace, n: int, chunk: int, rtt: float, redis: Any,
              minio: Any, work: Path) -> dict[str, Any]:
    """One (N, chunk, RTT): a fresh fleet on the running Redis and MinIO, measured."""
    from farm.devservices.cluster import local_cluster

    per_worker = min(n, args.per_worker)
    layout = [per_worker] * (n // per_worker) + ([n % per_worker] if n % per_worker else [])
    with ExitStack() as stack:
        redis_addr = redis.url.split("//", 1)[1].split("/", 1)[0]
        minio_addr = minio.endpoint
        if rtt > 0:
            redis_addr = start_proxy(redis_addr, rtt / 2, stack)
            minio_addr = start_proxy(minio_addr, rtt / 2, stack)
        bucket = f"cp-{uuid.uuid4().hex[:12]}"
        cluster = stack.enter_context(local_cluster(
            work / f"n{n}-c{chunk}-r{rtt}", redis=redis, minio=minio, bucket=bucket,
            redis_db=0, FARM_CHUNK_SIZE=str(chunk), SIM_COMPILE_MS=str(args.compile_ms),
            SIM_BINARY_BYTES=str(args.binary_bytes), **SIM))
        cluster.redis_url = f"redis://{redis_addr}/0"
        cluster.minio_endpoint = minio_addr
        import redis as redis_py

        redis_py.Redis.from_url(redis.url).flushall()
        t = time.perf_counter()
        for size in layout:
            cluster.start_worker(concurrency=size)
        cluster.wait_ready(timeout=600)
        ready = time.perf_counter() - t
        measured_rtt = measure_rtt(cluster.redis_url)
        from simfleet import device_info

        fp = device_info().fingerprint
        env = cluster.env(work / "client-home", **SIM)
        common = ["--fingerprint", fp, "--compile-ms", str(args.compile_ms),
                  "--chunk", str(chunk)]
        worker_pids = [w.pid for w in cluster.workers]
        # throughput
        r0, m0, w0 = redis_counters(redis.url), minio_counters(minio.endpoint), \
            proc_cpu(worker_pids)
        mcpu0 = proc_cpu([minio_pid])
        kernels = args.kernels
        _, results = run_clients(env, "throughput", args.clients,
                                 [*common, "--kernels", str(kernels)])
        # from the first build's start to the last one's end (not the clients' start-up)
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        r1, m1, w1 = redis_counters(redis.url), minio_counters(minio.endpoint), \
            proc_cpu(worker_pids)
        mcpu1 = proc_cpu([minio_pid])
        total = kernels * args.clients
        rd, md = delta(r1, r0), delta(m1, m0)
        failed = sum(r["failed"] for r in results)
        # latency, on the idle fleet
        # chunks a latency build sends: a free process and a free core for each (on one
        # host the simulated workers share its cores; a real fleet's do not)
        free = max(1, min(n, os.cpu_count() or 1) // (2 * args.latency_clients))
        _, lat = run_clients(env, "latency", args.latency_clients,
                             [*common, "--latency-rounds", str(args.latency_rounds),
                              "--free", str(free)])
        added = [a for r in lat for a in r["added_s"]]
        on_worker = [a for r in lat for a in r["on_worker_s"]]
        failed += sum(r["failed"] for r in lat)
    top_redis = sorted(((k, v) for k, v in rd.items() if k not in ("commands", "cpu_s")),
                       key=lambda kv: -kv[1])
    top_minio = sorted(((k, v) for k, v in md.items() if k != "requests"),
                       key=lambda kv: -kv[1])
    return {
        "bench": "control_plane", "workers": n, "layout": layout, "chunk": chunk,
        "rtt_ms": rtt, "rtt_measured_ms": round(measured_rtt, 3),
        "compile_ms": args.compile_ms, "binary_bytes": args.binary_bytes,
        "clients": args.clients, "kernels": total, "failed": failed,
        "workers_ready_s": round(ready, 2), "wall_s": round(wall, 3),
        "kernels_per_s": round(total / wall, 1),
        "redis_commands_per_kernel": round(rd.get("commands", 0) / total, 2),
        "redis_top": {k: round(v / total, 2) for k, v in top_redis},
        "minio_requests_per_kernel": round(md.get("requests", 0) / total, 2),
        "minio_apis": {k: round(v / total, 2) for k, v in top_minio},
        "cpu_ms_per_kernel": {
            "clients": round(1000 * sum(r["cpu_s"] for r in results) / total, 3),
            "workers": round(1000 * (w1 - w0) / total, 3),
            "redis": round(1000 * rd.get("cpu_s", 0) / total, 3),
            "minio": round(1000 * (mcpu1 - mcpu0) / total, 3)},
        "added_ms": {"p50": round(1000 * percentile(added, 0.5), 2),
                     "p99": round(1000 * percentile(added, 0.99), 2),
                     "n": len(added)},
        # of which in the worker, per kernel: store reads and writes, lease, records
        "worker_ms": {"p50": round(1000 * percentile(on_worker, 0.5), 2),
                      "p99": round(1000 * percentile(on_worker, 0.99), 2)},
        "cores": os.cpu_count(), "loadavg": round(os.getloadavg()[0], 2)}


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


def run_points(args: argparse.Namespace, rtt: float, link: str) -> list[dict[str, Any]]:
    """Every (N, chunk) at one RTT, on one Redis and one MinIO started here."""
    from farm.devservices import MinioServer, RedisServer

    global minio_pid
    rows = []
    with tempfile.TemporaryDirectory(prefix="farm-bench-cp-") as tmp, \
            RedisServer(Path(tmp)) as redis, \
            MinioServer(Path(tmp), {"MINIO_PROMETHEUS_AUTH_TYPE": "public"}) as minio:
        minio_pid = minio._process.pid  # type: ignore[union-attr]
        for n in (int(x) for x in args.workers.split(",")):
            for chunk in (int(x) for x in args.chunks.split(",")):
                row = one_point(args, n, chunk, rtt if link == "proxy" else 0.0,
                                redis, minio, Path(tmp))
                row.update(rtt_ms=rtt, link=link if rtt > 0 else "none")
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,32", help="pool processes in all, per point")
    parser.add_argument("--per-worker", type=int, default=16,
                        help="pool processes per farm worker (its --concurrency)")
    parser.add_argument("--chunks", default="1,4", help="FARM_CHUNK_SIZE values")
    parser.add_argument("--rtt-ms", default="0", help="round trips to Redis and MinIO")
    parser.add_argument("--compile-ms", type=float, default=5.0)
    parser.add_argument("--binary-bytes", type=int, default=32768)
    parser.add_argument("--kernels", type=int, default=1000, help="per throughput client")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--latency-clients", type=int, default=2)
    parser.add_argument("--latency-rounds", type=int, default=50)
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
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
    rtts = [float(r) for r in args.rtt_ms.split(",")]
    link = args.link
    if link == "auto" and any(rtts):
        link = "netem" if netem_available() else "proxy"
    if link != "applied":
        print(f"bench_control_plane: N {args.workers}, chunks {args.chunks}, RTT {rtts} ms "
              f"({link}); simulated compile {args.compile_ms} ms, binary "
              f"{args.binary_bytes} B; {args.clients} x {args.kernels} kernels; "
              f"{os.cpu_count()} cores", flush=True)
    inner = ["--workers", args.workers, "--per-worker", str(args.per_worker),
             "--chunks", args.chunks, "--compile-ms", str(args.compile_ms),
             "--binary-bytes", str(args.binary_bytes), "--kernels", str(args.kernels),
             "--clients", str(args.clients), "--latency-clients", str(args.latency_clients),
             "--latency-rounds", str(args.latency_rounds)]
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
    if link == "applied":
        return
    print()
    print(f"{'N':>4} {'chunk':>5} {'rtt':>5} {'link':>6} {'meas':>5} {'k/s':>7} {'redis/k':>8} "
          f"{'minio/k':>8} {'cpu ms/k cl/wk/redis/minio':>28} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'wk p50':>7}")
    for r in rows:
        c = r["cpu_ms_per_kernel"]
        print(f"{r['workers']:>4} {r['chunk']:>5} {r['rtt_ms']:>5} {r['link']:>6} "
              f"{r['rtt_measured_ms']:>5.2f} "
              f"{r['kernels_per_s']:>7.0f} {r['redis_commands_per_kernel']:>8.1f} "
              f"{r['minio_requests_per_kernel']:>8.1f} "
              f"{c['clients']:>6.2f}/{c['workers']:>6.2f}/{c['redis']:>5.2f}/{c['minio']:>5.2f}"
              f" {r['added_ms']['p50']:>7.1f} {r['added_ms']['p99']:>7.1f} "
              f"{r['worker_ms']['p50']:>7.1f}")


if __name__ == "__main__":
    main()
