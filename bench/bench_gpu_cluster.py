"""Benchmark on the GPU host: the cluster against the embedded build, per fingerprint, and
a warm from MinIO against a warm from the local tier.

For each device (``--devices``, default ``nvidia,pocl``), one after the other, with the
drivers' caches off (``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``, in
this process and every process it starts):

1. **embedded**: ``farm build MANIFEST --local --workers W --device FP --json`` in a fresh
   FARM_HOME;
2. **cluster**: one ``farm worker --concurrency W --fingerprint FP`` against Redis and MinIO
   (started by ``farm.devservices`` once, before the clock; the worker is started and
   ready before the clock too: workers are long-running services), then ``farm build
   MANIFEST --cluster --fingerprint FP --json`` from a client with a fresh FARM_HOME;
3. **warm from MinIO**: ``bench/warm_probe.py MANIFEST`` (the compiler forbidden) in a
   fresh process with an empty local tier;
4. **warm from the local tier**: the same again in the same FARM_HOME, which step 3 filled.

``wall`` is around the whole command (process start to exit); ``farm wall`` is the
farm's own batch (or warm) wall from its JSON. The ratio cluster/embedded is of the end
to end walls (below 1: the cluster is faster).

    bench/nvidia_host.sh python3 bench/bench_gpu_cluster.py [--manifest large] [--workers 16]

Prints a table, then one JSON line (``{"bench": "gpu_cluster", ...}``).
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

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
WARM_PROBE = Path(__file__).with_name("warm_probe.py")


def run_json(argv: list[str], env: dict[str, str], what: str) -> tuple[float, dict[str, Any]]:
    """(wall seconds around the process, its last stdout line as JSON)."""
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                 f"{proc.stderr[-3000:]}")
    text = proc.stdout.strip()
    try:  # farm build --json prints one indented document, the probes one line
        return wall, json.loads(text)
    except json.JSONDecodeError:
        return wall, json.loads(text.splitlines()[-1])


def one_device(fp: str, args: argparse.Namespace, cluster: Any,
               work: Path) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    base.update(CACHES_OFF)
    slug = fp[:16]
    print(f"  {fp}: embedded --workers {args.workers} ...", flush=True)
    e_wall, e = run_json([sys.executable, "-m", "farm", "build", args.manifest, "--local",
                          "--workers", str(args.workers), "--device", fp, "--json"],
                         {**base, "FARM_HOME": str(work / f"embedded-{slug}")},
                         "farm build --local")
    print(f"      {e_wall:.1f} s; cluster worker --concurrency {args.workers} ...", flush=True)
    t = time.perf_counter()
    cluster.start_worker(concurrency=args.workers, args=("--fingerprint", fp))
    cluster.wait_ready(timeout=300)
    ready = time.perf_counter() - t
    c_wall, c = run_json([sys.executable, "-m", "farm", "build", args.manifest, "--cluster",
                          "--fingerprint", fp, "--json"],
                         cluster.env(work / f"client-{slug}"), "farm build --cluster")
    cluster.stop_workers()
    print(f"      {c_wall:.1f} s (worker ready in {ready:.1f} s, not in the wall); warm "
          "from MinIO, then from the local tier ...", flush=True)
    home = work / f"warm-{slug}"
    r_wall, r = run_json([sys.executable, str(WARM_PROBE), args.manifest],
                         cluster.env(home, FARM_DEVICE=fp), "warm from MinIO")
    l_wall, l_ = run_json([sys.executable, str(WARM_PROBE), args.manifest],
                          cluster.env(home, FARM_DEVICE=fp), "warm from the local tier")
    print(f"      {r_wall:.1f} s, {l_wall:.1f} s", flush=True)
    problems = []
    es, cs = e["summary"], c["summary"]
    if es["failed"] or cs["failed"]:
        problems.append(f"failed: embedded {es['failed']}, cluster {cs['failed']}")
    if es["compiled"] + es["rekeyed"] != cs["compiled"] + cs["rekeyed"]:
        problems.append("embedded and cluster built different counts")
    if r["summary"]["remote"] != cs["compiled"] + cs["rekeyed"]:
        problems.append(f"warm from MinIO: {r['summary']['remote']} remote hits")
    if l_["summary"]["local"] != r["summary"]["remote"]:
        problems.append(f"warm from local: {l_['summary']['local']} local hits")
    return {"fingerprint": fp, "kernels": es["kernels"],
            "built": cs["compiled"] + cs["rekeyed"], "unsupported": es["unsupported"],
            "embedded": {"wall_s": round(e_wall, 3), "farm_wall_s": es["wall_s"],
                         "work_s": es["work_s"]},
            "cluster": {"wall_s": round(c_wall, 3), "farm_wall_s": cs["wall_s"],
                        "work_s": cs["work_s"], "tasks_sent": cs["tasks_sent"],
                        "worker_ready_s": round(ready, 2)},
            "warm_minio": {"wall_s": round(r_wall, 3), "farm_wall_s": r["summary"]["wall_s"],
                           "per_kernel_ms": r["summary"]["per_kernel_ms"],
                           "remote": r["summary"]["remote"],
                           "compiler_invocations": r["stats"]["compiler_invocations"]},
            "warm_local": {"wall_s": round(l_wall, 3), "farm_wall_s": l_["summary"]["wall_s"],
                           "per_kernel_ms": l_["summary"]["per_kernel_ms"],
                           "local": l_["summary"]["local"]},
            "ratio_cluster_embedded": round(c_wall / e_wall, 3),
            "ratio_warm_minio_local": round(r["summary"]["wall_s"]
                                            / max(l_["summary"]["wall_s"], 1e-9), 3),
            "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", default="large")
    parser.add_argument("--devices", default="nvidia,pocl", help="device selectors")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="embedded compile processes, and the cluster worker's pool")
    args = parser.parse_args()
    os.environ.update(CACHES_OFF)
    from farm.core.device import discover_devices, select_device
    from farm.devservices.cluster import local_cluster

    found = discover_devices()
    fps = [select_device(found, s).fingerprint for s in args.devices.split(",") if s]
    print(f"bench_gpu_cluster: manifest {args.manifest}, {args.workers} processes, "
          f"{os.cpu_count()} cores; drivers' caches off: "
          + " ".join(f"{k}={v}" for k, v in CACHES_OFF.items()), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="farm-bench-gpu-cluster-") as tmp:
        work = Path(tmp)
        with local_cluster(work / "cluster", bucket=f"bench-{uuid.uuid4().hex[:12]}",
                           **CACHES_OFF) as cluster:
            for fp in fps:
                rows.append(one_device(fp, args, cluster, work))
    print()
    print(f"{'fingerprint':<40} {'built':>6} {'embedded':>9} {'cluster':>9} {'c/e':>5} "
          f"{'warm MinIO':>11} {'warm local':>11} {'ms/k MinIO':>11} {'ms/k local':>11}")
    for r in rows:
        print(f"{r['fingerprint'][:40]:<40} {r['built']:>6} {r['embedded']['wall_s']:>8.2f}s "
              f"{r['cluster']['wall_s']:>8.2f}s {r['ratio_cluster_embedded']:>5.2f} "
              f"{r['warm_minio']['farm_wall_s']:>10.3f}s "
              f"{r['warm_local']['farm_wall_s']:>10.3f}s "
              f"{r['warm_minio']['per_kernel_ms']:>11.3f} "
              f"{r['warm_local']['per_kernel_ms']:>11.3f}")
        for p in r["problems"]:
            print(f"WARNING: {r['fingerprint']}: {p}")
    print("walls: embedded and cluster end to end (process start to exit); warm: the "
          "loader's warm wall (its JSON), per kernel = that / kernels")
    print(json.dumps({"bench": "gpu_cluster", "manifest": args.manifest,
                      "workers": args.workers, "cores": os.cpu_count(), "devices": rows,
                      "caches_off": CACHES_OFF}))


if __name__ == "__main__":
    main()
