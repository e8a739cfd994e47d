"""Benchmark: ``farm build`` against a plain single-process pyopencl loop, side by side.

One run does, in order, each in a fresh process with the drivers' caches off
(``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``):

1. ``farm build MANIFEST --workers N --json`` in a new, empty FARM_HOME (a cold build);
2. the baseline: one Python process that lowers every kernel of the same manifest with
   the farm's registry exactly as the farm does (``expand`` then ``lower_id`` for the
   same device) and, one after the other, ``cl.Program(ctx, source).build(options)`` and
   makes its kernels: what a user's own pyopencl program does on a first run;
3. the same loop that also asks each program for its binary, as the farm's ``finalize``
   does to store it: on PoCL a plain build leaves the kernels' code generation to their
   first launch, and asking for the binary does it now, so this is the same compile work
   the farm does;
4. ``farm build`` again in the same FARM_HOME (a warm build: every kernel from the store).

Walls are end to end (process start to exit, as a user waits for them); the in-process
walls (the farm batch, the baseline's loop) are printed too. ``ratio`` is the plain
loop's wall / the farm's wall (above 1: the farm was faster); ``ratio_same_work`` uses
the loop that also fetches binaries.

    .venv/bin/python bench/bench_build.py [--manifest medium] [--workers 2]

Prints a table, then one JSON line (``{"bench": "build", ...}``) for machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}
FARM = [sys.executable, "-m", "farm"]
PLAIN_LOOP = Path(__file__).with_name("plain_loop.py")


def child_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FARM_") or k == "FARM_DEVICE"}
    env.update(CACHES_OFF, FARM_HOME=str(home))
    return env


def farm_build(manifest: str, workers: int, home: Path) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run([*FARM, "build", manifest, "--workers", str(workers), "--json"],
                          env=child_env(home), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"farm build failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    report = json.loads(proc.stdout)
    return {"wall_s": wall, **report}


def baseline(manifest: str, home: Path, binaries: bool) -> dict[str, Any]:
    start = time.perf_counter()
    extra = ["--with-binaries"] if binaries else []
    proc = subprocess.run([sys.executable, str(PLAIN_LOOP), manifest, *extra],
                          env=child_env(home), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"baseline failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return {"wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", default="medium", help="manifest file or built-in name")
    parser.add_argument("--workers", type=int, default=2, help="farm compile processes")
    args = parser.parse_args()
    os.environ.update(CACHES_OFF)
    print(f"bench_build: manifest {args.manifest}, farm --workers {args.workers}, "
          f"{os.cpu_count()} cores; drivers' caches off: "
          + " ".join(f"{k}={v}" for k, v in CACHES_OFF.items()), flush=True)
    home = Path(tempfile.mkdtemp(prefix="farm-bench-"))
    try:
        cold = step("1/4 farm build (cold, fresh FARM_HOME)",
                    lambda: farm_build(args.manifest, args.workers, home))
        base = step("2/4 plain pyopencl loop: build + make kernels, one process",
                    lambda: baseline(args.manifest, home / "unused", binaries=False))
        full = step("3/4 plain pyopencl loop + get each binary (the farm's compile work)",
                    lambda: baseline(args.manifest, home / "unused", binaries=True))
        warm = step("4/4 farm build again (warm: every kernel from the store)",
                    lambda: farm_build(args.manifest, args.workers, home))
    finally:
        shutil.rmtree(home, ignore_errors=True)

    s, w = cold["summary"], warm["summary"]
    if s["kernels"] != base["kernels"] or s["failed"] or w["loaded"] != s["compiled"] + \
            s["rekeyed"]:
        sys.exit(f"the runs disagree: farm {s}, warm {w}, baseline {base}")
    rows = [
        ("farm build (cold)", cold["wall_s"], s["wall_s"],
         f"{s['compiled']} compiled, {s['rekeyed']} rekeyed, {s['unsupported']} unsupported; "
         f"work {s['work_s']:.1f} s, work/wall {s['speedup']:.2f}x"),
        ("plain loop", base["wall_s"], base["loop_wall_s"],
         f"{base['built']} built, {base['unsupported']} unsupported"),
        ("plain loop + binaries", full["wall_s"], full["loop_wall_s"],
         f"{full['built']} built and their binaries fetched"),
        ("farm build (warm)", warm["wall_s"], w["wall_s"],
         f"{w['loaded']} loaded, {w['compiler_invocations']} compiler calls"),
    ]
    print()
    print(f"{'run':<22} {'wall':>9} {'in-process':>11}  notes")
    for name, wall, inner, notes in rows:
        print(f"{name:<22} {wall:>8.2f}s {inner:>10.2f}s  {notes}")
    ratio = base["wall_s"] / cold["wall_s"]
    ratio_full = full["wall_s"] / cold["wall_s"]
    print(f"\nratio baseline/farm (end to end; above 1: the farm is faster): {ratio:.2f}x "
          f"against the plain loop, {ratio_full:.2f}x against the loop doing the same "
          f"compile work; the warm build is {base['wall_s'] / warm['wall_s']:.1f}x faster "
          "than the plain loop")
    print(json.dumps({
        "bench": "build", "manifest": args.manifest, "workers": args.workers,
        "cores": os.cpu_count(), "fingerprint": cold["fingerprint"],
        "kernels": s["kernels"], "compiled": s["compiled"], "rekeyed": s["rekeyed"],
        "unsupported": s["unsupported"], "distinct_sources": base["distinct_sources"],
        "farm_wall_s": round(cold["wall_s"], 3), "farm_batch_wall_s": s["wall_s"],
        "farm_work_s": s["work_s"], "baseline_wall_s": round(base["wall_s"], 3),
        "baseline_loop_wall_s": round(base["loop_wall_s"], 3),
        "baseline_binaries_wall_s": round(full["wall_s"], 3),
        "baseline_binaries_loop_wall_s": round(full["loop_wall_s"], 3),
        "ratio": round(ratio, 3), "ratio_same_work": round(ratio_full, 3),
        "farm_warm_wall_s": round(warm["wall_s"], 3), "caches_off": CACHES_OFF,
    }))


def step(title: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    print(f"  {title} ...", flush=True)
    result = run()
    print(f"      {result['wall_s']:.1f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
