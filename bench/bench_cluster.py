"""Benchmark: the cluster build against the embedded build and a plain pyopencl loop.

One run does, in order, each step in fresh processes with the drivers' caches off
(``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``, in this process and
every process it starts):

1. **plain**: one Python process lowers every kernel of the manifest with the farm's
   registry exactly as the farm does (``expand``, then ``lower_id`` for the same
   device), then, one after the other, ``cl.Program(ctx, source).build(options)`` and
   makes its kernels: a user's own pyopencl program on a first run;
2. **plain + binaries**: the same loop also asking each program for its binary, which
   the farm must do to store an artifact (on PoCL a plain build leaves the kernels'
   code generation to their first launch; fetching the binary does it now);
3. **embedded**: ``farm build MANIFEST --local --workers N --json`` in a fresh FARM_HOME;
4. **cluster**: Redis, MinIO and N ``farm worker --concurrency 1`` processes started by
   :func:`farm.devservices.cluster.local_cluster` on a fresh bucket (started and ready
   *before* the clock starts: workers are long-running services), then
   ``farm build MANIFEST --cluster --json`` from a client with a fresh FARM_HOME.

``wall`` is ``time.perf_counter()`` around the whole command (process start to exit,
what a user waits for); ``farm wall_s`` is the farm's own batch wall time from its JSON
summary (the plain loops report their loop's wall the same way); ``cpu`` is user +
system time of the step's processes and the children they waited for
(``getrusage(RUSAGE_CHILDREN)``; cluster: client + workers with their start-up + Redis
and MinIO), steadier than walls on a shared machine. Ratios are of the end to end
walls: cluster/plain, embedded/plain, cluster/embedded (below 1: the first is faster).

    .venv/bin/python bench/bench_cluster.py [--manifest medium] [--workers 2]

Prints a table, then one JSON line (``{"bench": "cluster", ...}``) for machines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}


def clean_environ() -> None:
    """Caches off, and no FARM_* of the caller's (each step says what it uses)."""
    for name in [k for k in os.environ if k.startswith("FARM_")]:
        del os.environ[name]
    os.environ.update(CACHES_OFF)


def children_cpu() -> float:
    """CPU seconds (user + system) of every finished child this process waited for,
    and of their own waited-for children (a worker's pool, a farm's compile processes)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_json(argv: list[str], env: dict[str, str], what: str) -> tuple[float, dict[str, Any]]:
    """Run ``argv``; (wall seconds around the whole process, its last stdout JSON line
    with ``cpu_s``: the CPU time of the process and the children it waited for)."""
    start = time.perf_counter()
    cpu = children_cpu()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    cpu = children_cpu() - cpu
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                 f"{proc.stderr[-4000:]}")
    text = proc.stdout.strip()
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        report = json.loads(text.splitlines()[-1])
    return wall, {**report, "cpu_s": round(cpu, 2)}


# -- 1, 2: the plain loop -----------------------------------------------------------------
def plain(manifest: str, binaries: bool) -> tuple[float, dict[str, Any]]:
    argv = [sys.executable, str(Path(__file__).with_name("plain_loop.py")), manifest]
    if binaries:
        argv.append("--with-binaries")
    return run_json(argv, dict(os.environ), "plain pyopencl loop")


def embedded(manifest: str, workers: int, home: Path) -> tuple[float, dict[str, Any]]:
    env = dict(os.environ, FARM_HOME=str(home))
    return run_json([sys.executable, "-m", "farm", "build", manifest, "--local", "--workers",
                     str(workers), "--json"], env, "farm build --local")


# -- 4: the cluster build -----------------------------------------------------------------
def cluster(manifest: str, workers: int, work: Path) -> tuple[float, dict[str, Any],
                                                              dict[str, Any]]:
    from farm.core.keys import Namespace
    from farm.core.settings import Settings
    from farm.devservices.cluster import local_cluster
    from farm.store.open import open_store

    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    extra: dict[str, Any] = {"bucket": bucket}
    t0 = time.perf_counter()
    cpu0 = children_cpu()
    with local_cluster(work / "cluster", **extra) as c:
        t_services = time.perf_counter()
        for _ in range(workers):
            c.start_worker(concurrency=1)
        c.wait_ready()
        t_ready = time.perf_counter()
        wall, report = run_json([sys.executable, "-m", "farm", "build", manifest, "--cluster",
                                 "--json"], c.env(work / "cluster-client"),
                                "farm build --cluster")
        store = open_store(Settings(
            minio_endpoint=c.minio_endpoint, minio_access_key=c.minio_access_key,
            minio_secret_key=c.minio_secret_key, minio_bucket=bucket), shared=True, signed=False)
        stored = sum(1 for _ in store.keys(Namespace.for_fingerprint(report["fingerprint"])))
        store.close()
        c.stop_workers()
        workers_cpu = children_cpu() - cpu0 - report["cpu_s"]
    services_cpu = children_cpu() - cpu0 - report["cpu_s"] - workers_cpu
    setup = {"workers_cpu_s": round(workers_cpu, 2), "services_cpu_s": round(services_cpu, 2),
             "services_s": round(t_services - t0, 3),
             "workers_ready_s": round(t_ready - t_services, 3), "bucket": bucket,
             "stored_in_minio": stored}
    return wall, report, setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", default="medium", help="manifest file or built-in name")
    parser.add_argument("--workers", type=int, default=2,
                        help="embedded compile processes, and cluster workers (one "
                             "process each)")
    args = parser.parse_args()
    clean_environ()
    print(f"bench_cluster: manifest {args.manifest}, embedded --workers {args.workers}, "
          f"cluster {args.workers} workers x --concurrency 1; {os.cpu_count()} cores; "
          "drivers' caches off: " + " ".join(f"{k}={v}" for k, v in CACHES_OFF.items()),
          flush=True)
    load_before = os.getloadavg()
    print(f"  load average before: {load_before[0]:.2f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="farm-bench-cluster-"))
    try:
        print("  1/4 plain pyopencl loop (one process) ...", flush=True)
        p_wall, p = plain(args.manifest, binaries=False)
        print(f"      {p_wall:.1f} s", flush=True)
        print("  2/4 plain pyopencl loop + fetch each binary ...", flush=True)
        pb_wall, pb = plain(args.manifest, binaries=True)
        print(f"      {pb_wall:.1f} s", flush=True)
        print(f"  3/4 farm build --local --workers {args.workers} (fresh FARM_HOME) ...",
              flush=True)
        e_wall, e = embedded(args.manifest, args.workers, work / "embedded-home")
        print(f"      {e_wall:.1f} s", flush=True)
        print(f"  4/4 farm build --cluster, {args.workers} workers (fresh bucket and "
              "FARM_HOME) ...", flush=True)
        c_wall, c, setup = cluster(args.manifest, args.workers, work)
        print(f"      {c_wall:.1f} s (services up in {setup['services_s']:.1f} s, workers "
              f"ready {setup['workers_ready_s']:.1f} s later; not in the wall)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    es, cs = e["summary"], c["summary"]
    supported = p["built"]
    problems = []
    if es["kernels"] != p["kernels"] or cs["kernels"] != p["kernels"]:
        problems.append("kernel counts differ")
    for name, s in (("embedded", es), ("cluster", cs)):
        if s["failed"]:
            problems.append(f"{name}: {s['failed']} failed")
        if s["compiled"] + s["rekeyed"] != supported or s["unsupported"] != p["unsupported"]:
            problems.append(f"{name}: {s['compiled']} compiled + {s['rekeyed']} rekeyed, "
                            f"{s['unsupported']} unsupported; plain loop built {supported}")
    if setup["stored_in_minio"] != supported:
        problems.append(f"{setup['stored_in_minio']} artifacts in MinIO, expected {supported}")
    if len(c["workers"]) != args.workers:
        problems.append(f"cluster work done by {len(c['workers'])} workers: "
                        f"{sorted(c['workers'])}")

    n = p["kernels"]
    rows = [
        ("plain loop", p_wall, p["loop_wall_s"], f"{p['built']} built, {p['unsupported']} "
         f"unsupported, {p['distinct_sources']} distinct sources"),
        ("plain loop + binaries", pb_wall, pb["loop_wall_s"],
         f"{pb['built']} built and their binaries fetched"),
        (f"embedded --workers {args.workers}", e_wall, es["wall_s"],
         f"{es['compiled']} compiled, {es['rekeyed']} rekeyed, {es['unsupported']} "
         f"unsupported; work {es['work_s']:.1f} s, work/wall {es['speedup']:.2f}x"),
        (f"cluster, {args.workers} workers", c_wall, cs["wall_s"],
         f"{cs['compiled']} compiled, {cs['rekeyed']} rekeyed, {cs['unsupported']} "
         f"unsupported; {cs['tasks_sent']} tasks; work {cs['work_s']:.1f} s, work/wall "
         f"{cs['speedup']:.2f}x"),
    ]
    print()
    print(f"{n} kernels ({supported} supported on {p['fingerprint']})")
    cpus = [p["cpu_s"], pb["cpu_s"], e["cpu_s"],
            c["cpu_s"] + setup["workers_cpu_s"] + setup["services_cpu_s"]]
    print(f"{'run':<24} {'wall':>9} {'ms/kernel':>10} {'farm wall_s':>12} {'cpu':>8}  notes")
    for (name, wall, inner, notes), cpu in zip(rows, cpus, strict=True):
        print(f"{name:<24} {wall:>8.2f}s {1000 * wall / n:>10.1f} {inner:>11.2f}s "
              f"{cpu:>7.1f}s  {notes}")
    print(f"cpu: user + system of the processes (the plain loop's one, the embedded build's "
          f"and its compile processes; cluster: client {c['cpu_s']:.1f} s + workers "
          f"{setup['workers_cpu_s']:.1f} s (incl. start-up) + Redis and MinIO "
          f"{setup['services_cpu_s']:.1f} s)")
    for name, w in sorted(c["workers"].items()):
        print(f"  worker {name}: {int(w['kernels'])} kernels, {int(w['compiled'])} compiled, "
              f"work {w['work_s']:.1f} s")
    ratios = {"cluster/plain": c_wall / p_wall, "embedded/plain": e_wall / p_wall,
              "cluster/embedded": c_wall / e_wall,
              "cluster/plain+binaries": c_wall / pb_wall,
              "embedded/plain+binaries": e_wall / pb_wall}
    print("\nratios of end-to-end walls (below 1: the first is faster): "
          + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    for problem in problems:
        print(f"WARNING: {problem}")
    print(json.dumps({
        "bench": "cluster", "manifest": args.manifest, "workers": args.workers,
        "cores": os.cpu_count(), "fingerprint": p["fingerprint"], "kernels": n,
        "supported": supported, "unsupported": p["unsupported"],
        "plain_wall_s": round(p_wall, 3), "plain_loop_wall_s": p["loop_wall_s"],
        "plain_binaries_wall_s": round(pb_wall, 3), "plain_binaries_loop_wall_s": pb["loop_wall_s"],
        "embedded_wall_s": round(e_wall, 3), "embedded_farm_wall_s": es["wall_s"],
        "embedded_work_s": es["work_s"], "cluster_wall_s": round(c_wall, 3),
        "cluster_farm_wall_s": cs["wall_s"], "cluster_work_s": cs["work_s"],
        "cluster_tasks_sent": cs["tasks_sent"], "cpu_s": {
            "plain": p["cpu_s"], "plain_binaries": pb["cpu_s"], "embedded": e["cpu_s"],
            "cluster_client": c["cpu_s"], "cluster_workers": setup["workers_cpu_s"],
            "cluster_services": setup["services_cpu_s"]}, "cluster_workers": c["workers"],
        "cluster_setup": setup,
        "ms_per_kernel": {"plain": round(1000 * p_wall / n, 2),
                          "plain_binaries": round(1000 * pb_wall / n, 2),
                          "embedded": round(1000 * e_wall / n, 2),
                          "cluster": round(1000 * c_wall / n, 2)},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "loadavg_before": round(load_before[0], 2), "loadavg_after": round(load_after[0], 2),
        "problems": problems, "caches_off": CACHES_OFF,
    }))


if __name__ == "__main__":
    main()
