"""The points of ``bench/bench_control_plane.py``: one fleet of one code measured
(:func:`one_point`: throughput, then latency on the idle fleet), and the bare Celery
round trip beside it (:func:`bare_point`, ``bench/cp_bare.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from cp_fleet import BENCH, Code, Link

SIM = {"FARM_FAMILY_MODULES": '["simfleet"]', "FARM_DEVICE_BACKEND": "simfleet",
       "FARM_RECORDS_LEVEL": "basic"}
#: the settings every process of a point gets besides (``--no-events``)
EXTRA: dict[str, str] = {}
#: the benchmark's own script: its clients run it with ``--client``
SCRIPT = BENCH / "bench_control_plane.py"


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


def run_clients(argv: list[str], env: dict[str, str], count: int,
                profile: Path | None = None) -> list[dict[str, Any]]:
    """``count`` client processes at once; the JSON line each printed."""
    import cp_profile

    # a home each: two processes making one FARM_HOME's store at once race (a store made
    # by the other half-way reads as "not a kernel-farm store")
    homes = [{"FARM_HOME": f"{env['FARM_HOME']}-{i}"} if "FARM_HOME" in env else {}
             for i in range(count)]
    procs = [subprocess.Popen(cp_profile.wrap(argv, profile.with_name(f"{profile.name}{i}.txt"))
                              if profile else argv, env={**env, **homes[i]},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tempfile.gettempdir())
             for i in range(count)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            sys.exit(f"a client ({' '.join(argv[1:4])}) failed:\n{err[-3000:]}")
        # the last JSON line (py-spy, under --profile, says more after it)
        results.append(json.loads([x for x in out.splitlines() if x.startswith("{")][-1]))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def layout_of(n: int, per_worker: int) -> list[int]:
    size = min(n, per_worker)
    return [size] * (n // size) + ([n % size] if n % size else [])


def one_point(args: argparse.Namespace, code: Code, n: int, chunk: int, link: Link,
              work: Path) -> dict[str, Any]:
    """One (code, N, chunk, RTT): a fresh fleet on the running Redis and MinIO, measured."""
    import cp_monitor
    import cp_profile
    import redis as redis_py
    from cp_fleet import Phase, code_fingerprint

    from farm.devservices.cluster import local_cluster

    layout = layout_of(n, args.per_worker)
    tag = f"{code.label.split()[0]}-n{n}-c{chunk}-r{link.rtt_ms}"
    with ExitStack() as stack:
        cluster = stack.enter_context(local_cluster(
            work / tag, redis=link.redis, minio=link.minio,
            bucket=f"cp-{uuid.uuid4().hex[:12]}", redis_db=0, FARM_CHUNK_SIZE=str(chunk),
            SIM_COMPILE_MS=str(args.compile_ms), SIM_BINARY_BYTES=str(args.binary_bytes),
            **SIM, **EXTRA, **code.env))
        cluster.redis_url = f"redis://{link.redis_addr}/0"
        cluster.minio_endpoint = link.minio_addr
        redis_py.Redis.from_url(link.redis.url).flushall()
        env = cluster.env(work / f"{tag}-client-home", **SIM, **EXTRA, **code.env)
        fp = code_fingerprint(code, env)
        t = time.perf_counter()
        for size in layout:
            cluster.start_worker(concurrency=size)
        cluster.wait_ready(timeout=600)
        ready = time.perf_counter() - t
        measured_rtt = measure_rtt(cluster.redis_url)
        client = [sys.executable, str(SCRIPT), "--client"]
        common = ["--fingerprint", fp, "--compile-ms", str(args.compile_ms),
                  "--chunk", str(chunk)]
        worker_pids = [w.pid for w in cluster.workers]
        # throughput
        spies = []
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            spies = [cp_profile.spy(pid, args.profile / f"{tag}-worker{i}.txt")
                     for i, pid in enumerate(worker_pids)]
            time.sleep(1)
        monitor = cp_monitor.Monitor(link.redis.url) if args.monitor else None
        phase = Phase(link, worker_pids)
        results = run_clients([*client, "throughput", *common, "--kernels", str(args.kernels)],
                              env, args.clients,
                              args.profile / f"{tag}-client" if args.profile else None)
        total = args.kernels * args.clients
        counts = phase.end(total)
        cp_profile.stop(spies)
        by_purpose = cp_monitor.table(monitor.stop(), total) if monitor else None
        # from the first build's start to the last one's end (not the clients' start-up)
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        failed = sum(r["failed"] for r in results)
        # latency, on the idle fleet: a free process and a free core for each chunk (on
        # one host the simulated workers share its cores; a real fleet's do not)
        free = max(1, min(n, os.cpu_count() or 1) // (2 * args.latency_clients))
        watch = cp_monitor.Monitor(link.redis.url) if args.timeline else None
        lat = run_clients([*client, "latency", *common, "--latency-rounds",
                           str(args.latency_rounds), "--free", str(free)],
                          env, args.latency_clients)
        timeline = _timeline(watch, lat, chunk * args.compile_ms / 1000, bare=False)
        added = [a for r in lat for a in r["added_s"]]
        on_worker = [a for r in lat for a in r["on_worker_s"]]
        failed += sum(r["failed"] for r in lat)
    counts["cpu_ms_per_kernel"].update(
        clients=round(1000 * sum(r["cpu_s"] for r in results) / total, 3),
        client_total=round(1000 * sum(r["cpu_total_s"] for r in results) / total, 3))
    return {
        "bench": "control_plane", "code": code.label, "workers": n, "layout": layout,
        "chunk": chunk, "rtt_ms": link.rtt_ms, "rtt_measured_ms": round(measured_rtt, 3),
        "compile_ms": args.compile_ms, "binary_bytes": args.binary_bytes,
        "clients": args.clients, "kernels": total, "failed": failed,
        "workers_ready_s": round(ready, 2), "wall_s": round(wall, 3),
        "kernels_per_s": round(total / wall, 1), **counts,
        "added_ms": {"p50": round(1000 * percentile(added, 0.5), 2),
                     "p99": round(1000 * percentile(added, 0.99), 2), "n": len(added)},
        # of which in the worker, per kernel: store reads and writes, lease, records
        "worker_ms": {"p50": round(1000 * percentile(on_worker, 0.5), 2),
                      "p99": round(1000 * percentile(on_worker, 0.99), 2)},
        "cores": os.cpu_count(), "loadavg": round(os.getloadavg()[0], 2),
        **({"redis_by_purpose": by_purpose} if by_purpose else {}),
        **({"timeline": timeline} if timeline else {})}


def _timeline(watch: Any, lat: list[dict[str, Any]], compiles_s: float, *,
              bare: bool) -> dict[str, Any] | None:
    """Where the latency phase's chunks spent their time (``--timeline``), or ``None``."""
    if watch is None:
        return None
    import cp_timeline

    lines = watch.close()
    chunks = [dict(c, first=i == 0) for r in lat for i, c in enumerate(r["chunks"])]
    dump = os.environ.get("CP_TIMELINE_DUMP")  # a folder: what was split, to look at
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        name = f"{'bare' if bare else 'farm'}-{int(time.time())}"
        (Path(dump) / f"{name}.monitor").write_text("\n".join(lines))
        (Path(dump) / f"{name}.chunks.json").write_text(json.dumps(chunks))
    return cp_timeline.split(lines, chunks, compiles_s, bare=bare)


def bare_point(args: argparse.Namespace, n: int, chunk: int, link: Link,
               work: Path) -> dict[str, Any]:
    """The bare Celery round trip (``bench/cp_bare.py``) of one (N, chunk, RTT)."""
    import redis as redis_py
    from cp_fleet import Phase, this_code

    from farm.devservices.cluster import local_cluster

    tasks = max(1, args.kernels // chunk)
    tag = f"bare-n{n}-c{chunk}-r{link.rtt_ms}"
    with local_cluster(work / tag, redis=link.redis, minio=link.minio,
                       **EXTRA, **this_code().env) as cluster:
        cluster.redis_url = f"redis://{link.redis_addr}/0"
        redis_py.Redis.from_url(link.redis.url).flushall()
        env = cluster.env(work / f"{tag}-home", **this_code().env,
                          BARE_SLEEP_S=str(chunk * args.compile_ms / 1000))
        procs = []
        for i, size in enumerate(layout_of(n, args.per_worker)):
            log = work / f"{tag}-{i}.log"
            with open(log, "wb") as fh:
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "cp_bare", "worker",
                     "--pool=prefork", f"--concurrency={size}", "-Q", "bench.bare",
                     "--without-gossip", "--without-mingle", "--loglevel=INFO",
                     f"--hostname=bare{i}-{os.getpid()}@%h"], env=env, stdout=fh,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    cwd=tempfile.gettempdir()), log))
        try:
            t0 = time.monotonic()
            for proc, log in procs:
                while " ready." not in log.read_text(errors="replace"):
                    if proc.poll() is not None or time.monotonic() - t0 > 300:
                        sys.exit(f"bare Celery worker did not start:\n{log.read_text()[-2000:]}")
                    time.sleep(0.1)
            client = [sys.executable, str(BENCH / "cp_bare.py"), "--chunk", str(chunk),
                      "--compile-ms", str(args.compile_ms)]
            phase = Phase(link, [p.pid for p, _ in procs])
            results = run_clients([*client, "--mode", "throughput", "--tasks", str(tasks)],
                                  env, args.clients)
            counts = phase.end(tasks * args.clients * chunk)
            free = max(1, min(n, os.cpu_count() or 1) // (2 * args.latency_clients))
            import cp_monitor

            watch = cp_monitor.Monitor(link.redis.url) if args.timeline else None
            lat = run_clients([*client, "--mode", "latency", "--tasks",
                               str(args.latency_rounds), "--free", str(free)],
                              env, args.latency_clients)
            timeline = _timeline(watch, lat, chunk * args.compile_ms / 1000, bare=True)
        finally:
            for proc, _ in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc, _ in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    total = tasks * args.clients * chunk
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    added = [a for r in lat for a in r["added_s"]]
    counts["cpu_ms_per_kernel"]["clients"] = round(
        1000 * sum(r["cpu_s"] for r in results) / total, 3)
    return {"bench": "control_plane", "code": "bare Celery", "workers": n, "chunk": chunk,
            "rtt_ms": link.rtt_ms, "rtt_measured_ms": 0.0, "compile_ms": args.compile_ms,
            "clients": args.clients, "kernels": total, "failed": 0,
            "wall_s": round(wall, 3), "kernels_per_s": round(total / wall, 1), **counts,
            "added_ms": {"p50": round(1000 * percentile(added, 0.5), 2),
                         "p99": round(1000 * percentile(added, 0.99), 2), "n": len(added)},
            "worker_ms": {"p50": 0.0, "p99": 0.0},
            "cores": os.cpu_count(), "loadavg": round(os.getloadavg()[0], 2),
            **({"timeline": timeline} if timeline else {})}


