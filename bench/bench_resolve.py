"""Benchmark: how fast ``farm build`` resolves a manifest whose kernels are all stored.

Two paths, measured separately and labelled so:

**Cluster** (``--manifest``, default ``large``: 1554 kernels). The cluster client never
loads anything: it computes every key, asks MinIO which it holds in one bulk listing
and sends the misses to the workers; a stored key counts as Loaded without being read
(unless ``--verify``). So the store is filled directly, without compiling: for every
kernel, its real key (id hash, the client's build id) holding a small *placeholder*
binary (a valid frame with a correct digest, not a loadable program), written with
``MinioStore.put`` into a fresh bucket of a local cluster (Redis, MinIO and one real
``farm worker --concurrency 1``, so the fingerprint is served). Then, each
``farm build MANIFEST --cluster --json`` from a client with a fresh FARM_HOME:

* C1 *as after a real build*: only the kernels the device supports are stored (the
  unsupported ones can never be), so the build sends those to the workers again;
* C2 *every key stored*: the unsupported kernels' keys are filled too (a state a real
  build never reaches), so nothing is sent: the pure resolve, ``tasks_sent`` 0;
  repeated ``--repeat`` times;
* C3 as C2 with ``--verify``: every artifact read back and its digest checked.

Also timed in this process: one bulk ``existing`` listing of all the keys.

**Embedded** (``--embedded-manifest``, default ``medium``): a real store needs real
binaries, and compiling the large manifest on a small machine takes too long, so:
``farm build M --local --workers N`` in a fresh FARM_HOME (cold, fills SQLite), then
``farm build M --local --workers N`` again ``--repeat`` times: every kernel Loaded from
SQLite, digest verified and created on the device from its binary (real loads).

Kernels per second = kernels / wall, for the end-to-end wall (``time.perf_counter()``
around the process: Python start-up, device discovery, ...) and for the farm's own
batch ``wall_s``. Drivers' caches are off in every process
(``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``).

    .venv/bin/python bench/bench_resolve.py [--manifest large] [--embedded-manifest medium]
                                            [--workers 2] [--repeat 3]

Prints a table, then one JSON line (``{"bench": "resolve", ...}``) for machines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}


def clean_environ() -> None:
    """Caches off, and no FARM_* of the caller's (each step says what it uses)."""
    for name in [k for k in os.environ if k.startswith("FARM_")]:
        del os.environ[name]
    os.environ.update(CACHES_OFF)


def farm_build(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """``farm build ARGS --json``: its summary, plus ``e2e_s`` around the whole process."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "farm", "build", *args, "--json"], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"farm build {' '.join(args)} failed (exit {proc.returncode}):\n"
                 f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout)
    return {"e2e_s": round(wall, 4), **report["summary"],
            "by_worker": report.get("workers", {})}


def placeholder(key: Any) -> bytes:
    return b"kernel-farm bench placeholder, not a program: " + str(key).encode()


# -- the cluster resolve ------------------------------------------------------------------
def plan(manifest: str) -> tuple[str, list[tuple[Any, str, str | None]]]:
    """(fingerprint, [(key, family, source hash or None when unsupported)])."""
    from farm.core.device import discover_devices, select_device
    from farm.core.errors import UnsupportedFeature
    from farm.core.model import Key
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    device = select_device(discover_devices())
    registry = Registry.load()
    out: list[tuple[Any, str, str | None]] = []
    for entry in expand(load_manifest(resolve_manifest(manifest)), registry):
        family = registry.get(entry.family)
        key = Key(id_hash=entry.artifact.id_hash, build_id=family.build_id)
        try:
            source_hash: str | None = family.lower_id(entry.artifact, device).source_hash
        except UnsupportedFeature:
            source_hash = None
        out.append((key, entry.family, source_hash))
    return device.fingerprint, out


def fill(store: Any, ns: Any, items: list[tuple[Any, str, str]]) -> float:
    """Put a placeholder artifact under each key; seconds taken."""
    from farm.core.model import Artifact
    from farm.store.base import PutResult

    def put(item: tuple[Any, str, str]) -> PutResult:
        key, family, source_hash = item
        art = Artifact.create(key, family, placeholder(key), source_hash,
                              build_log="bench_resolve placeholder", worker="bench")
        return store.put(ns, art)

    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(put, items))
    if any(r is PutResult.REFUSED for r in results):
        sys.exit("a placeholder put was refused: the bucket is not fresh")
    return time.perf_counter() - start


def cluster_resolve(manifest: str, repeat: int, work: Path) -> dict[str, Any]:
    from farm.core.keys import Namespace
    from farm.core.settings import Settings
    from farm.devservices.cluster import local_cluster
    from farm.store.open import open_store

    t = time.perf_counter()
    fingerprint, items = plan(manifest)
    plan_s = time.perf_counter() - t
    ns = Namespace.for_fingerprint(fingerprint)
    supported = [(k, f, s) for k, f, s in items if s is not None]
    unsupported = [(k, f, hashlib.sha256(b"bench-unsupported " + str(k).encode()).hexdigest())
                   for k, f, s in items if s is None]
    keys = [k for k, _, _ in items]
    bucket = f"bench-resolve-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {"manifest": manifest, "fingerprint": fingerprint,
                           "kernels": len(items), "supported": len(supported),
                           "unsupported": len(unsupported), "plan_s": round(plan_s, 3)}
    with local_cluster(work / "cluster", bucket=bucket) as c:
        c.start_worker(concurrency=1)
        c.wait_ready()
        store = open_store(Settings(
            minio_endpoint=c.minio_endpoint, minio_access_key=c.minio_access_key,
            minio_secret_key=c.minio_secret_key, minio_bucket=bucket), shared=True, signed=False)
        try:
            out["fill_supported_s"] = round(fill(store, ns, supported), 3)
            print(f"      {len(supported)} placeholders put in {out['fill_supported_s']:.1f} s",
                  flush=True)
            print("      C1 supported kernels stored (as after a real build) ...", flush=True)
            out["c1"] = farm_build([manifest, "--cluster"], c.env(work / "client-c1"))
            out["fill_unsupported_s"] = round(fill(store, ns, unsupported), 3)
            held = store.existing(ns, keys)
            if len(held) != len(keys):
                sys.exit(f"only {len(held)} of {len(keys)} keys in the store after the fill")
            listing = []
            for _ in range(max(3, repeat)):
                t = time.perf_counter()
                store.existing(ns, keys)
                listing.append(time.perf_counter() - t)
            out["bulk_existing_s"] = [round(x, 4) for x in listing]
            out["c2"] = []
            for i in range(repeat):
                print(f"      C2 every key stored, run {i + 1}/{repeat} ...", flush=True)
                out["c2"].append(farm_build([manifest, "--cluster"],
                                            c.env(work / f"client-c2-{i}")))
            print("      C3 every key stored, --verify ...", flush=True)
            out["c3"] = farm_build([manifest, "--cluster", "--verify"],
                                   c.env(work / "client-c3"))
        finally:
            store.close()
    return out


# -- the embedded resolve -----------------------------------------------------------------
def embedded_resolve(manifest: str, workers: int, repeat: int, home: Path) -> dict[str, Any]:
    env = dict(os.environ, FARM_HOME=str(home))
    args = [manifest, "--local", "--workers", str(workers)]
    print(f"      cold farm build {manifest} --local (fills SQLite) ...", flush=True)
    cold = farm_build(args, env)
    warm = []
    for i in range(repeat):
        print(f"      warm run {i + 1}/{repeat} ...", flush=True)
        warm.append(farm_build(args, env))
    return {"manifest": manifest, "workers": workers, "cold": cold, "warm": warm}


def rate(kernels: int, seconds: float) -> float:
    return kernels / seconds if seconds > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", default="large", help="cluster resolve manifest")
    parser.add_argument("--embedded-manifest", default="medium",
                        help="embedded resolve manifest (compiled for real once)")
    parser.add_argument("--workers", type=int, default=2,
                        help="embedded: local compile processes")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each warm resolve")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--skip-cluster", action="store_true")
    args = parser.parse_args()
    clean_environ()

    print(f"bench_resolve: cluster manifest {args.manifest}, embedded manifest "
          f"{args.embedded_manifest}; {os.cpu_count()} cores; drivers' caches off: "
          + " ".join(f"{k}={v}" for k, v in CACHES_OFF.items()), flush=True)
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="farm-bench-resolve-"))
    result: dict[str, Any] = {"bench": "resolve", "cores": os.cpu_count()}
    try:
        if not args.skip_cluster:
            print("  cluster: fill MinIO with placeholders, then farm build --cluster",
                  flush=True)
            result["cluster"] = cluster_resolve(args.manifest, args.repeat, work)
        if not args.skip_embedded:
            print("  embedded: farm build --local, cold then warm", flush=True)
            result["embedded"] = embedded_resolve(args.embedded_manifest, args.workers,
                                                  args.repeat, work / "embedded-home")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_before"] = round(load_before, 2)
    result["loadavg_after"] = round(os.getloadavg()[0], 2)
    result["caches_off"] = CACHES_OFF
    report(result)


def report(result: dict[str, Any]) -> None:
    rows: list[tuple[str, dict[str, Any], str]] = []
    problems: list[str] = []
    c = result.get("cluster")
    if c:
        print(f"\ncluster: {c['manifest']}, {c['kernels']} kernels ({c['supported']} "
              f"supported, {c['unsupported']} unsupported); placeholders put in "
              f"{c['fill_supported_s']:.1f} + {c['fill_unsupported_s']:.1f} s; one bulk "
              f"listing of all keys: {1000 * min(c['bulk_existing_s']):.0f} ms (best of "
              f"{len(c['bulk_existing_s'])})")
        rows.append(("C1 cluster, supported stored", c["c1"], "real state after a build"))
        rows += [(f"C2 cluster, all stored #{i + 1}", r, "pure resolve")
                 for i, r in enumerate(c["c2"])]
        rows.append(("C3 cluster, all stored, --verify", c["c3"], "reads every artifact"))
        if c["c1"]["loaded"] != c["supported"]:
            problems.append(f"C1 loaded {c['c1']['loaded']}, expected {c['supported']}")
        for r in [*c["c2"], c["c3"]]:
            if r["tasks_sent"] or r["loaded"] != c["kernels"]:
                problems.append(f"a C2/C3 run sent {r['tasks_sent']} tasks and loaded "
                                f"{r['loaded']} of {c['kernels']}")
    e = result.get("embedded")
    if e:
        cold = e["cold"]
        print(f"embedded: {e['manifest']}, {cold['kernels']} kernels; cold build "
              f"{cold['e2e_s']:.1f} s end to end ({cold['compiled']} compiled, "
              f"{cold['rekeyed']} rekeyed, {cold['unsupported']} unsupported)")
        rows += [(f"E warm --local #{i + 1}", r, "real loads from SQLite")
                 for i, r in enumerate(e["warm"])]
        for r in e["warm"]:
            if r["loaded"] != cold["compiled"] + cold["rekeyed"] or r["compiler_invocations"]:
                problems.append(f"a warm embedded run loaded {r['loaded']} and compiled "
                                f"{r['compiler_invocations']}")
    print(f"\n{'run':<34} {'kernels':>7} {'loaded':>6} {'tasks':>5} {'e2e':>8} {'kern/s':>8} "
          f"{'wall_s':>8} {'kern/s':>8}  note")
    for name, r, note in rows:
        print(f"{name:<34} {r['kernels']:>7} {r['loaded']:>6} {r['tasks_sent']:>5} "
              f"{r['e2e_s']:>7.2f}s {rate(r['kernels'], r['e2e_s']):>8.0f} "
              f"{r['wall_s']:>7.3f}s {rate(r['kernels'], r['wall_s']):>8.0f}  {note}")
    summary: dict[str, Any] = {}
    if c:
        e2e = statistics.median(r["e2e_s"] for r in c["c2"])
        inner = statistics.median(r["wall_s"] for r in c["c2"])
        summary["cluster_kernels_per_s_e2e"] = round(rate(c["kernels"], e2e), 1)
        summary["cluster_kernels_per_s_batch"] = round(rate(c["kernels"], inner), 1)
        summary["cluster_realistic_kernels_per_s_e2e"] = round(
            rate(c["kernels"], c["c1"]["e2e_s"]), 1)
        summary["cluster_verify_kernels_per_s_e2e"] = round(rate(c["kernels"],
                                                                 c["c3"]["e2e_s"]), 1)
    if e:
        n = e["cold"]["kernels"]
        e2e = statistics.median(r["e2e_s"] for r in e["warm"])
        inner = statistics.median(r["wall_s"] for r in e["warm"])
        summary["embedded_kernels_per_s_e2e"] = round(rate(n, e2e), 1)
        summary["embedded_kernels_per_s_batch"] = round(rate(n, inner), 1)
        summary["embedded_ms_per_kernel_batch"] = round(1000 * inner / n, 2)
    print("\nmedians: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    print(f"load average before {result['loadavg_before']:.2f}, after "
          f"{result['loadavg_after']:.2f}")
    for p in problems:
        print(f"WARNING: {p}")
    result.update(summary, problems=problems)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
