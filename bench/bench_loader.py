"""Benchmark: a manifest's kernels onto the device by the loader, against pyopencl's caches.

One run, on this machine, of the same kernels (default: the medium manifest) obtained

(c) compiled from nothing: a fresh loader, empty local tier, empty MinIO (compiles on
    ``--workers`` processes, stores into MinIO and the local tier);
(a) from MinIO by a fresh loader with an empty local tier (another FARM_HOME);
(b) from the local tier (the FARM_HOME that (a) filled), MinIO still configured;
(m) from the loader's memory (the same loader warming again);
(f) the floor: ``cl.Program(ctx, [dev], [binary]).build()`` for every binary, read from
    the local store beforehand, in a process that loaded nothing before (what "load
    from binary" costs with nothing around it);
(d) pyopencl's own binary cache, warm: ``cl.Program(ctx, src).build(options,
    cache_dir=DIR)`` per kernel, run once to fill DIR, then timed. pyopencl skips its
    binary cache for PoCL and NVIDIA (``pyopencl.characterize.has_src_build_cache``
    says the driver caches), so the child patches that function to return False, which
    is the code path pyopencl takes on every other platform; ``PYOPENCL_NO_CACHE`` is
    unset and PoCL's cache is off, so what is measured is pyopencl's cache alone;
(e) a plain pyopencl program run a second time as it is today on PoCL: pyopencl skips
    its own cache and PoCL's kernel cache (``POCL_KERNEL_CACHE=1``, a dedicated
    ``POCL_CACHE_DIR``) serves the source builds.

(a), (b), (c), (m) and (f) run with the drivers' caches off (``PYOPENCL_NO_CACHE=1
POCL_KERNEL_CACHE=0``). Every phase runs in a process of its own; times exclude process
start, imports and context creation (the loader's ``warm`` wall time; the loop's wall
time for (d), (e), (f)). The fast phases run interleaved, (a) (b) (f) (d) (e) in each of
``--repeat`` rounds, so that all see the same conditions of a shared machine, and the
median of each is kept.
MinIO is started here (``farm.devservices.MinioServer``) and removed afterwards.

    .venv/bin/python bench/bench_loader.py [--manifest medium] [--workers 2] [--repeat 5]

Prints a table and one JSON line (``BENCH_LOADER {...}``) with per-kernel milliseconds and
the ratios to (b).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu import cpu_model  # this folder

HERE = Path(__file__).resolve()
BUCKET = "bench-loader"


# ----------------------------------------------------------------------------------------
# children: one measurement each, JSON on stdout
# ----------------------------------------------------------------------------------------
def child_warm(manifest: str, repeat_memory: bool) -> dict[str, Any]:
    """Warm ``manifest`` with a fresh loader from the FARM_* environment."""
    from loader import KernelLoader

    out: dict[str, Any] = {}
    with KernelLoader(label="bench warm") as loader:
        report = loader.warm(manifest, launch=True)  # and the readiness figure
        out["warm"] = report.summary()
        if repeat_memory:
            out["memory"] = loader.warm(manifest).summary()
    return out


def child_floor(manifest: str) -> dict[str, Any]:
    """Program from binary for every kernel of ``manifest`` in the local tier, binaries
    read beforehand, in a process that has loaded nothing yet: the bare load cost."""
    from farm.store import SQLiteStore
    from loader import KernelLoader
    from loader.warming import artifacts_of

    with KernelLoader(label="bench floor") as loader:
        store = loader.tiers[0].store
        assert isinstance(store, SQLiteStore), store
        artifacts, _ = artifacts_of(manifest, loader)
        binaries = []
        for artifact in artifacts:
            art = store.get(loader.namespace, loader.key_of(artifact))
            assert art is not None, artifact
            binaries.append(art.binary)
        return _floor(loader, binaries)


def _floor(loader: Any, binaries: list[bytes]) -> dict[str, Any]:
    import pyopencl as cl

    kept = []  # kept alive like the loader keeps its programs: a release is not a load
    start = time.perf_counter()
    for binary in binaries:
        kept.append(cl.Program(loader.context, [loader.cl_device], [binary]).build())
    wall = time.perf_counter() - start
    return {"kernels": len(binaries), "wall_s": wall}


def _sources(manifest: str) -> tuple[Any, Any, list[tuple[str, list[str]]], int]:
    """(ctx, device, [(source, options)], unsupported) of the manifest on device 0."""
    from farm.core.device import open_device, probe_devices, select_device
    from farm.core.errors import UnsupportedFeature
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    registry = Registry.load()
    info = select_device(probe_devices())
    ctx, dev = open_device(info)
    sources: list[tuple[str, list[str]]] = []
    unsupported = 0
    for entry in expand(load_manifest(resolve_manifest(manifest)), registry):
        family = registry.get(entry.family)
        try:
            lowered = family.lower_id(entry.artifact, info)
        except UnsupportedFeature:
            unsupported += 1
            continue
        sources.append((lowered.source, list(lowered.options)))
    return ctx, dev, sources, unsupported


def child_pyopencl(manifest: str, force_binary_cache: bool, cache_dir: str) -> dict[str, Any]:
    """Build every kernel from source as a plain pyopencl program does; time the loop."""
    import pyopencl as cl
    import pyopencl.characterize

    if force_binary_cache:  # take pyopencl's cached path, as on platforms it trusts
        pyopencl.characterize.has_src_build_cache = lambda dev: False
    ctx, dev, sources, unsupported = _sources(manifest)
    cached = 0
    kept = []
    start = time.perf_counter()
    for source, options in sources:
        program = cl.Program(ctx, source)
        kept.append(program)
        if force_binary_cache:
            program.build(options=options, devices=[dev], cache_dir=cache_dir)
        else:
            program.build(options=options, devices=[dev])
        info = getattr(program, "_build_duration_info", None)
        cached += bool(info and info[1])
    wall = time.perf_counter() - start
    return {"kernels": len(sources), "unsupported": unsupported, "wall_s": wall,
            "pyopencl_cache_hits": cached}


# ----------------------------------------------------------------------------------------
# the parent: services, environments, processes, the table
# ----------------------------------------------------------------------------------------
def run_child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HERE), "--child", *args], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FARM_", "PYOPENCL_", "POCL_"))}
    env.update(extra)
    return env


def machine() -> dict[str, str]:
    cpu = cpu_model()
    import pyopencl as cl

    from farm.core.device import discover_devices

    dev = discover_devices()[0]
    return {"cpu": cpu, "cores": str(os.cpu_count()), "python": platform.python_version(),
            "pyopencl": cl.VERSION_TEXT, "device": dev.device_name,
            "platform": dev.platform_version, "fingerprint": dev.fingerprint}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="medium")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "warm":
            result = child_warm(rest[0], "memory" in rest)
        elif kind == "floor":
            result = child_floor(rest[0])
        else:
            result = child_pyopencl(rest[0], kind == "pyopencl-cache", rest[1])
        print(json.dumps(result))
        return

    from farm.devservices import MinioServer

    work = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    results: dict[str, Any] = {}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()
    try:
        with MinioServer(workdir=work) as minio:
            minio_env = {"FARM_MINIO_ENDPOINT": minio.endpoint,
                         "FARM_MINIO_ACCESS_KEY": minio.access_key,
                         "FARM_MINIO_SECRET_KEY": minio.secret_key,
                         "FARM_MINIO_BUCKET": BUCKET, "FARM_WORKERS": str(args.workers)}
            off = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0"}

            def home(name: str) -> str:
                return str(work / name)

            print(f"(c) compile {args.manifest} from nothing on {args.workers} processes...",
                  file=sys.stderr, flush=True)
            results["c"] = run_child(["warm", args.manifest], base_env(
                **minio_env, **off, FARM_HOME=home("compile")))["warm"]

            pyo = {"d": ("pyopencl-cache", base_env(POCL_KERNEL_CACHE="0")),
                   "e": ("pyopencl-plain", base_env(POCL_KERNEL_CACHE="1",
                                                    POCL_CACHE_DIR=home("pocl-cache")))}
            for key, (kind, env) in pyo.items():
                print(f"({key}) {kind}: filling the cache...", file=sys.stderr, flush=True)
                results[f"{key}_first"] = run_child([kind, args.manifest, home(f"cache-{key}")],
                                                    env)

            # Interleaved, so that every phase sees the same conditions of a shared machine
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in "abmfde"}
            for i in range(args.repeat):
                print(f"round {i + 1} of {args.repeat}: (a) (b) (f) (d) (e)...",
                      file=sys.stderr, flush=True)
                runs["a"].append(run_child(["warm", args.manifest], base_env(
                    **minio_env, **off, FARM_HOME=home(f"fresh-{i}")))["warm"])
                got = run_child(["warm", args.manifest, "memory"], base_env(
                    **minio_env, **off, FARM_HOME=home("fresh-0")))
                runs["b"].append(got["warm"])
                runs["m"].append(got["memory"])
                runs["f"].append(run_child(["floor", args.manifest], base_env(
                    **off, FARM_HOME=home("fresh-0"))))
                for key, (kind, env) in pyo.items():
                    runs[key].append(run_child([kind, args.manifest, home(f"cache-{key}")],
                                               env))
            for key, got_runs in runs.items():
                results[key] = _median(got_runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results["loadavg"] = {"start": [round(x, 2) for x in load_before],
                          "end": [round(x, 2) for x in os.getloadavg()]}
    report(results, args, stamp)


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (all its fields kept together)."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["runs_wall_s"] = [round(r["wall_s"], 4) for r in runs]
    return chosen


def _kernels(r: dict[str, Any]) -> int:
    if "failed" in r:  # a warm summary: kernels obtained
        return int(r["kernels"] - r["unsupported"] - r["failed"])
    return int(r["kernels"])


def report(results: dict[str, Any], args: argparse.Namespace, stamp: str) -> None:
    rows = [
        ("c", "loader, compiled from nothing", "compiled"),
        ("a", "loader, from MinIO (empty local tier)", "remote"),
        ("b", "loader, from the local tier", "local"),
        ("m", "loader, from memory", "memory"),
        ("f", "floor: program from binary, nothing else", ""),
        ("d", "pyopencl binary cache, warm (forced on)", ""),
        ("e", "pyopencl as-is + PoCL kernel cache, warm", ""),
    ]
    per_ms = {k: 1000 * results[k]["wall_s"] / max(1, _kernels(results[k])) for k, _, _ in rows}
    base = per_ms["b"]
    print(f"\nbench_loader: {args.manifest}, {_kernels(results['b'])} kernels, {stamp}, "
          f"load average {results['loadavg']['start'][0]} -> {results['loadavg']['end'][0]}")
    print(f"{'':4}{'what':44}{'kernels':>8}{'source':>10}{'wall s':>10}{'ms/kernel':>11}"
          f"{'vs (b)':>9}")
    for key, what, source in rows:
        r = results[key]
        count = str(r.get(source, "")) if source else str(r.get("pyopencl_cache_hits", "-"))
        print(f"({key}) {what:44}{_kernels(r):>8}{count:>10}{r['wall_s']:>10.3f}"
              f"{per_ms[key]:>11.2f}{per_ms[key] / base:>8.2f}x")
    for key in ("a", "b", "c"):
        ph = results[key]["phases"]
        print(f"    ({key}) phases: " + ", ".join(
            f"{n} {p['wall_s']:.3f} s wall / {p['work_s']:.3f} s work" for n, p in ph.items()
            if p["kernels"]))
    for key in ("a", "b"):
        r = results[key].get("readiness") or {}
        if r.get("kernels"):
            print(f"    ({key}) time to first result per kernel (median): "
                  f"{r['first_result_ms']:.2f} ms = load {r['load_ms']:.2f} ms + first launch "
                  f"{r['first_launch_ms']:.2f} ms")
    line = {
        "manifest": args.manifest, "workers": args.workers, "repeat": args.repeat,
        "date": stamp, "machine": machine(), "loadavg": results["loadavg"],
        "kernels": _kernels(results["b"]),
        "ms_per_kernel": {k: round(v, 3) for k, v in per_ms.items()},
        "ratio_to_local": {k: round(v / base, 2) for k, v in per_ms.items()},
        "compile_over_local": round(per_ms["c"] / base, 1),
        "pyopencl_cache_over_local": round(per_ms["d"] / base, 2),
        "pyopencl_plain_over_local": round(per_ms["e"] / base, 2),
        "local_over_floor": round(base / per_ms["f"], 2),
        "phases": {k: results[k]["phases"] for k in ("a", "b", "c")},
        "readiness": {k: results[k].get("readiness") for k in ("a", "b", "c")},
        "runs_wall_s": {k: results[k].get("runs_wall_s") for k in per_ms},
        "checks": {"c_compiled": results["c"]["compiled"], "a_remote": results["a"]["remote"],
                   "a_compiled": results["a"]["compiled"], "b_local": results["b"]["local"],
                   "d_cache_hits": results["d"]["pyopencl_cache_hits"],
                   "d_first_cache_hits": results["d_first"]["pyopencl_cache_hits"]},
    }
    print("BENCH_LOADER " + json.dumps(line))


if __name__ == "__main__":
    main()
