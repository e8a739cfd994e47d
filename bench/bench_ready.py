"""Ready means ready: a stored kernel's time to first result, and what making it costs.

Side by side in one run, on this machine, drivers' caches off in every process
(``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``), ``--repeat`` rounds
alternating which goes first:

1. **cold builds**, each in a fresh FARM_HOME: ``farm build M --local --workers N`` (the
   farm as it is: on PoCL each binary carries its launch's machine code), the same with
   ``FARM_POCL_READY=0`` (the binaries as before), and the peer that delivers the same
   ready kernels without the farm: a bare pool of N spawned processes, each building a
   source with pyopencl and launching its kernel once (the declared launch; the same
   one-work-group rule as the farm). Then the farm's part a user still waits for: a
   fresh process loads every stored kernel and launches it once (``farm warm --on-miss
   fail``, empty PoCL cache folder). Ratios: farm over peer (below 1.1 is the goal);
2. **time to first result** (the issue's table), each in a fresh process with an empty
   PoCL cache folder: every stored kernel of the last round's homes loaded (the program
   from its binary and its ``pyopencl.Kernel``, whose first making costs pyopencl
   milliseconds on any device), then its example run twice with its data (buffers in,
   the launch, outputs back: ``farm.families.run.run_example``; checked against numpy);
   medians of load, first run, second run, and the number of first runs that made a
   PoCL work-group function. ``--source-row`` adds the plain pyopencl program for
   reference: a build from source in that process, then the same two launches.

    python bench/bench_ready.py --manifest tiny --workers 2 --repeat 2
    bench/nvidia_host.sh python3 bench/bench_ready.py --manifest medium --workers 16 \
        --device pocl --no-before

Prints tables and one JSON line (``BENCH_READY {...}``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
HERE = Path(__file__).resolve()


def _env(home: Path, device: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), **CACHES_OFF, **extra)
    if device:
        env["FARM_DEVICE"] = device
    return env


def _run(args: list[str], env: dict[str, str]) -> tuple[Any, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], env=env, text=True, capture_output=True,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args[:4])} failed ({proc.returncode}): "
                         f"{proc.stderr[-3000:]}")
    text = proc.stdout.strip()
    try:  # farm's --json is one document; a child prints its JSON on its last line
        return json.loads(text), wall
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1]), wall


# -- 1. cold builds -------------------------------------------------------------------------
def farm_build(manifest: str, workers: int, home: Path, device: str | None,
               ready: bool) -> dict[str, Any]:
    env = _env(home, device, FARM_POCL_READY="1" if ready else "0")
    report, wall = _run(["-m", "farm", "build", manifest, "--local", "--workers",
                         str(workers), "--json"], env)
    s = report["summary"]
    return {"compiled": s["compiled"], "batch_s": s["wall_s"], "work_s": s["work_s"],
            "command_s": round(wall, 3)}


def first_launches(manifest: str, home: Path, device: str | None,
                   cache: Path) -> dict[str, Any]:
    """A fresh process loads every stored kernel and launches each once."""
    cache.mkdir(parents=True)
    report, wall = _run(["-m", "farm", "warm", manifest, "--json", "--on-miss", "fail"],
                        _env(home, device, POCL_CACHE_DIR=str(cache)))
    s = report["summary"]
    return {"kernels": s["kernels"], "warm_s": s["wall_s"],
            "launch_s": s["phases"]["launch"]["wall_s"], "command_s": round(wall, 3),
            "readiness": s["readiness"]}


_CTX: Any = None


def _peer_init(device_json: str) -> None:
    global _CTX
    from farm.core.device import DeviceInfo, open_device

    _CTX = open_device(DeviceInfo.model_validate_json(device_json))


def _peer_job(job: tuple[str, list[str], str]) -> float:
    import pyopencl as cl

    from farm.compilation.ready import launch
    from farm.core.model import ReadyLaunch

    ctx, dev = _CTX
    source, options, ready_json = job
    start = time.perf_counter()
    program = cl.Program(ctx, source).build(options=options, devices=[dev])
    if ready_json:
        ready = ReadyLaunch.model_validate_json(ready_json)
        launch(cl.CommandQueue(ctx, dev), cl.Kernel(program, ready.kernel_name), ready)
    return time.perf_counter() - start


def peer_pool(manifest: str, workers: int) -> dict[str, Any]:
    """(child) N spawned processes: build each distinct source, launch its kernel once."""
    from farm.core.device import probe_devices, select_device
    from farm.core.errors import UnsupportedFeature
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    info = select_device(probe_devices(), settings.device)
    jobs: dict[str, tuple[str, list[str], str]] = {}
    for entry in expand(load_manifest(resolve_manifest(manifest)), registry):
        family = registry.get(entry.family)
        try:
            lowered = family.lower_id(entry.artifact, info)
        except UnsupportedFeature:
            continue
        ready = lowered.ready or family.ready_launch(
            family.validate(entry.artifact.kernel.params), entry.artifact.kernel.launch)
        jobs.setdefault(lowered.source_hash, (lowered.source, list(lowered.options),
                                              ready.model_dump_json() if ready else ""))
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, initializer=_peer_init, initargs=(info.model_dump_json(),)) as pool:
        work = list(pool.imap_unordered(_peer_job, list(jobs.values()), chunksize=1))
    return {"built": len(work), "pool_s": round(time.perf_counter() - start, 4),
            "work_s": round(sum(work), 4)}


# -- 2. time to first result ------------------------------------------------------------------
def stored_kernels(manifest: str) -> Iterator[tuple[Any, ...]]:
    """(child) The device and the store as the settings say, then each kernel of
    ``manifest`` that has an example, in manifest order: ``(ctx, dev, queue, info,
    family, entry, example, stored artifact or None)``. Shared with
    ``probe_ready_speed.py``."""
    import numpy as np
    import pyopencl as cl

    from farm.core.device import DeviceContext, probe_devices, select_device
    from farm.core.keys import Namespace
    from farm.core.model import Key
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest
    from farm.store import open_store

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    info = select_device(probe_devices(), settings.device)
    ctx, dev = DeviceContext(info).get()
    queue = cl.CommandQueue(ctx, dev)
    store = open_store(settings)
    ns = Namespace.for_fingerprint(info.fingerprint)
    try:
        for entry in expand(load_manifest(resolve_manifest(manifest)), registry):
            family = registry.get(entry.family)
            params = family.validate(entry.artifact.kernel.params)
            example = family.example(params, entry.artifact.kernel.launch,
                                     np.random.default_rng(0))
            if example is None:
                continue
            art = store.get(ns, Key(id_hash=entry.artifact.id_hash,
                                    build_id=family.build_id))
            yield (ctx, dev, queue, info, family, entry, example, art)
    finally:
        store.close()


def loads(manifest: str, mode: str) -> dict[str, Any]:
    """(child) Every kernel: load (stored binary, or ``source``: a pyopencl build; and the
    kernel object), then its example run twice; medians, compiles seen at the first run,
    numpy check."""
    import pyopencl as cl

    from farm.compilation.load import load_binary
    from farm.families.run import check_example, run_example

    top = Path(os.environ.get("POCL_CACHE_DIR", "/nonexistent"))
    rows: list[tuple[float, float, float]] = []
    compiled = wrong = 0
    fingerprint = ""
    for ctx, dev, queue, info, family, entry, example, art in stored_kernels(manifest):
        fingerprint = info.fingerprint
        if mode == "source":
            try:
                lowered = family.lower_id(entry.artifact, info)
            except Exception:  # unsupported here: the farm skipped it too
                continue
            t = time.perf_counter()
            program = cl.Program(ctx, lowered.source).build(options=list(lowered.options))
        else:
            if art is None:
                continue
            t = time.perf_counter()
            program = load_binary(ctx, dev, art.binary, arch=info.native_arch).program
        kernel = cl.Kernel(program, example.kernel_name)  # pyopencl's set-up: part of a load
        load_s = time.perf_counter() - t
        before = set(top.rglob("*.so"))
        times, outputs = [], []
        for _ in range(2):  # data in, the launch, data out: a result on the host
            t = time.perf_counter()
            outputs.append(run_example(queue, kernel, example))
            times.append(time.perf_counter() - t)
            if len(times) == 1:
                compiled += len(set(top.rglob("*.so")) - before) > 0
        wrong += bool(check_example(outputs[0], example))
        rows.append((load_s, times[0], times[1]))

    def med(i: int) -> float:
        return round(1000 * statistics.median(r[i] for r in rows), 3) if rows else 0.0

    return {"mode": mode, "kernels": len(rows), "load_ms": med(0), "first_ms": med(1),
            "second_ms": med(2), "first_sum_s": round(sum(r[1] for r in rows), 3),
            "compiled_at_first_launch": compiled, "wrong": wrong,
            "fingerprint": fingerprint}


# -- the run ------------------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in rows), 3)


def one_round(args: argparse.Namespace, tmp: Path, r: int) -> dict[str, Any]:
    """Farm (ready), farm as before, the peer; then the ready home's first launches."""
    homes = {"farm": tmp / f"farm-{r}", "before": tmp / f"before-{r}"}
    order = ["farm", "before", "peer"] if r % 2 == 0 else ["peer", "before", "farm"]
    farms = ["farm"] if args.no_before else ["farm", "before"]
    order = [n for n in order if n == "peer" or n in farms]
    row: dict[str, Any] = {}
    for name in order:
        if name == "peer":
            peer, wall = _run([str(HERE), "--child-peer", args.manifest, "--workers",
                               str(args.workers)], _env(tmp / "peer-home", args.device))
            row["peer"] = {**peer, "command_s": round(wall, 3)}
        else:
            row[name] = farm_build(args.manifest, args.workers, homes[name], args.device,
                                   ready=name == "farm")
    for name in farms:
        row[name]["first"] = first_launches(args.manifest, homes[name], args.device,
                                            tmp / f"pocl-{name}-{r}")
        first = row[name]["first"]
        row[name]["ready_s"] = round(row[name]["batch_s"] + first["warm_s"]
                                     + first["launch_s"], 3)
    peer_s = row["peer"]["pool_s"]
    row["ratio"] = {"batch": round(row["farm"]["batch_s"] / peer_s, 3),
                    "build_and_first_launch": round(row["farm"]["ready_s"] / peer_s, 3)}
    if "before" in row:
        row["ratio"]["before_build_and_first_launch"] = round(row["before"]["ready_s"]
                                                              / peer_s, 3)
    return row


def table(args: argparse.Namespace, tmp: Path, rounds: int) -> list[dict[str, Any]]:
    """Time to first result in fresh processes, on the last round's homes."""
    last = rounds - 1
    runs = [("farm artifacts", tmp / f"farm-{last}", "stored")]
    if not args.no_before:
        runs.append(("farm artifacts as before (FARM_POCL_READY=0)", tmp / f"before-{last}",
                     "stored"))
    if args.source_row:
        runs.append(("no farm: pyopencl build from source in the process", tmp / "peer-home",
                     "source"))
    out = []
    for i, (label, home, mode) in enumerate(runs):
        cache = tmp / f"pocl-table-{i}"
        cache.mkdir()
        got, _ = _run([str(HERE), "--child-loads", args.manifest, "--mode", mode],
                      _env(home, args.device, POCL_CACHE_DIR=str(cache)))
        out.append({"label": label, **got})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="tiny")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default=None, help="FARM_DEVICE (name or fingerprint)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--source-row", action="store_true",
                        help="add the plain pyopencl program (a build from source per kernel) "
                             "to the time-to-first-result table")
    parser.add_argument("--no-before", action="store_true",
                        help="skip the binaries as before (FARM_POCL_READY=0): their first "
                             "launches compile, 40 to 550 ms a kernel")
    parser.add_argument("--child-peer", metavar="MANIFEST", help=argparse.SUPPRESS)
    parser.add_argument("--child-loads", metavar="MANIFEST", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="stored", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_peer:
        print(json.dumps(peer_pool(args.child_peer, args.workers)))
        return
    if args.child_loads:
        print(json.dumps(loads(args.child_loads, args.mode)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-ready-") as name:
        tmp = Path(name)
        rounds = [one_round(args, tmp, r) for r in range(args.repeat)]
        rows = table(args, tmp, args.repeat)
    _print(args, rounds, rows)


def _print(args: argparse.Namespace, rounds: list[dict[str, Any]],
           rows: list[dict[str, Any]]) -> None:
    print(f"drivers' caches off: {' '.join(f'{k}={v}' for k, v in CACHES_OFF.items())}; "
          f"{args.manifest}, {args.workers} workers, {len(rounds)} rounds; "
          f"device {rows[0]['fingerprint'] if rows else '?'}")
    print("1. cold: build, then a fresh process loads every kernel and launches it once "
          "(seconds; ratio = farm / peer, goal <= 1.1)")
    print(f"{'round':>5} {'peer build+launch':>18} {'farm batch':>11} {'+ load+launch':>14} "
          f"{'ratio':>6} {'before batch':>13} {'+ load+launch':>14} {'ratio':>6}")
    for i, r in enumerate(rounds):
        f = r["farm"]
        line = (f"{i:>5} {r['peer']['pool_s']:>17.2f}s {f['batch_s']:>10.2f}s "
                f"{f['ready_s']:>13.2f}s {r['ratio']['build_and_first_launch']:>6.3f}")
        if "before" in r:
            b = r["before"]
            line += (f" {b['batch_s']:>12.2f}s {b['ready_s']:>13.2f}s "
                     f"{r['ratio']['before_build_and_first_launch']:>6.3f}")
        print(line)
    medians = {k: statistics.median(r["ratio"][k] for r in rounds)
               for k in rounds[0]["ratio"]} if rounds else {}
    print("median ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    print("2. time to first result, fresh process, empty PoCL cache folder: each kernel "
          "loaded, its example launched twice (medians, ms)")
    print(f"{'':<52} {'kernels':>7} {'load':>8} {'first':>9} {'second':>8} "
          f"{'compiled':>9} {'wrong':>6}")
    for t in rows:
        print(f"{t['label']:<52} {t['kernels']:>7} {t['load_ms']:>8.2f} {t['first_ms']:>9.2f} "
              f"{t['second_ms']:>8.2f} {t['compiled_at_first_launch']:>9} {t['wrong']:>6}")
    print("BENCH_READY " + json.dumps({"manifest": args.manifest, "workers": args.workers,
                                       "rounds": rounds, "median_ratios": medians,
                                       "first_result": rows}))


if __name__ == "__main__":
    main()
