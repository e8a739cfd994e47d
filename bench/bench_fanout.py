"""Fan-out scaling of the embedded build: ``farm build M --workers N`` for several N,
each against its peer, a bare process pool of N (``bench/bare_pool.py``).

Each N builds into a fresh FARM_HOME (so every kernel is compiled), and the bare pool
builds the same sources with N processes right after it, side by side in one run
(``--repeat`` rounds, alternating which goes first); ratios are the pool's wall over the
farm's (above 1: the farm is faster), for the batch and end to end, and the farm's work
per compiled kernel over the pool's. Then one rebuild (all in the store) of the last
home, then ``farm warm`` of that home, which loads every kernel on the device in this
process: once with the drivers' caches off, and twice with CUDA's JIT cache on in a
fresh folder (where a load is a PTX JIT, this cache turns it into a look-up; the second
run is what a machine sees from then on). Builds run with the caches off (PYOPENCL_NO_CACHE=1,
POCL_KERNEL_CACHE=0, CUDA_CACHE_DISABLE=1).

    python bench/bench_fanout.py --manifest medium --workers 1,16 [--device nvidia]

Prints a table and one JSON line: wall per N, kernels compiled, speed-up against the
first N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _env(home: Path, device: str | None, cuda_cache: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1")
    if cuda_cache is not None:
        del env["CUDA_CACHE_DISABLE"]
        env["CUDA_CACHE_PATH"] = str(cuda_cache)
    if device:
        env["FARM_DEVICE"] = device
    return env


def warm_run(manifest: str, home: Path, device: str | None,
         cuda_cache: Path | None) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-m", "farm", "warm", manifest, "--json"],
                          env=_env(home, device, cuda_cache), text=True, capture_output=True,
                          check=False)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"farm warm failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout)["summary"]
    return {k: summary[k] for k in ("kernels", "local", "compiled", "unsupported",
                                   "wall_s", "work_s", "readiness") if k in summary}


def run(manifest: str, workers: int, home: Path, device: str | None) -> dict[str, object]:
    env = _env(home, device)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "farm", "build", manifest, "--local",
                           "--workers", str(workers), "--json"], env=env, text=True,
                          capture_output=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"farm build failed ({proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    return {"workers": workers, "command_wall_s": round(wall, 3),
            "fingerprint": report["fingerprint"], **report["summary"]}


def peer(manifest: str, workers: int, home: Path, device: str | None,
         load: bool = False) -> dict[str, object]:
    """The bare pool of ``workers`` processes, in a process of its own."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("bare_pool.py")),
                           manifest, "--workers", str(workers), *(["--load"] if load else [])],
                          env=_env(home, device),
                          text=True, capture_output=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bare pool failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout), "command_wall_s": round(wall, 3)}


def ratios(farm: dict[str, Any], pool: dict[str, Any]) -> dict[str, float]:
    """Pool over farm (above 1: the farm is faster); work: farm's per kernel over pool's."""
    compiled = max(1, int(farm["compiled"]))
    return {"batch": round(float(pool["pool_wall_s"]) / float(farm["wall_s"]), 3),
            "end_to_end": round(float(pool["command_wall_s"]) /
                                float(farm["command_wall_s"]), 3),
            "work_per_kernel": round((float(farm["work_s"]) / compiled) /
                                     (float(pool["work_s"]) / max(1, int(pool["built"]))), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="medium")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--device", default=None, help="FARM_DEVICE (name or fingerprint)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-loads", action="store_true", help="skip the rebuild and warms")
    parser.add_argument("--peer-load", action="store_true",
                        help="also run the pool that loads each binary once (bare_pool --load)")
    args = parser.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    rows = []
    peers: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        for r in range(args.repeat):
            for n in counts:
                home = Path(tmp) / f"w{n}" if r == 0 else Path(tmp) / f"w{n}-{r}"
                if r % 2 == 0:
                    farm_row = run(args.manifest, n, home, args.device)
                    pool_row = peer(args.manifest, n, Path(tmp) / "peer", args.device)
                else:  # the other goes first, so neither always runs on a warmer machine
                    pool_row = peer(args.manifest, n, Path(tmp) / "peer", args.device)
                    farm_row = run(args.manifest, n, home, args.device)
                rows.append(farm_row)
                peers.append({**pool_row, "ratio": ratios(farm_row, pool_row)})
                if args.peer_load:
                    loading = peer(args.manifest, n, Path(tmp) / "peer", args.device, True)
                    peers[-1]["with_load"] = {**loading, "ratio": ratios(farm_row, loading)}
        if args.no_loads:
            _print_pairs(rows, peers)
            print(json.dumps({"manifest": args.manifest, "runs": rows, "peers": peers,
                              "medians": _medians(rows, peers)}))
            return
        home = Path(tmp) / f"w{counts[-1]}"
        rebuild = run(args.manifest, counts[-1], home, args.device)
        loads = {"caches_off": warm_run(args.manifest, home, args.device, None)}
        cache = Path(tmp) / "cuda-cache"
        loads["jit_cache_first"] = warm_run(args.manifest, home, args.device, cache)
        loads["jit_cache_warm"] = warm_run(args.manifest, home, args.device, cache)
    _print_pairs(rows, peers)
    base = rows[0]["wall_s"]
    print("drivers' caches off: PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1")
    print(f"{'workers':>8} {'kernels':>8} {'compiled':>9} {'unsupp.':>8} {'wall s':>9} "
          f"{'work s':>9} {'vs first':>9}")
    for row in rows:
        print(f"{row['workers']:>8} {row['kernels']:>8} {row['compiled']:>9} "
              f"{row['unsupported']:>8} {row['wall_s']:>9.2f} {row['work_s']:>9.2f} "
              f"{base / row['wall_s']:>8.2f}x")
    print(f"rebuild, all in the store: {rebuild['loaded']} in {rebuild['wall_s']:.3f} s")
    for name, w in loads.items():
        n = max(1, int(str(w.get("local", 0))))
        ready = w.get("readiness") or {}
        print(f"farm warm ({name}): {w.get('local')} loaded in {w['wall_s']} s "
              f"= {float(str(w['wall_s'])) / n * 1000:.2f} ms a kernel; time to first result "
              f"{ready.get('first_result_ms', '-')} ms a kernel (median, load + first launch)")
    print(json.dumps({"manifest": args.manifest, "runs": rows, "peers": peers,
                      "medians": _medians(rows, peers), "rebuild": rebuild, "loads": loads}))


def _medians(rows: list[dict[str, Any]], peers: list[dict[str, Any]]
             ) -> dict[str, dict[str, float]]:
    """Per worker count and peer, the median of each ratio over the rounds."""
    out: dict[str, dict[str, float]] = {}
    for n in sorted({int(r["workers"]) for r in rows}):
        mine = [p for f, p in zip(rows, peers, strict=True) if int(f["workers"]) == n]
        for label, pick in (("pool", lambda p: p), ("pool+load", lambda p: p.get("with_load"))):
            got = [q["ratio"] for q in map(pick, mine) if q is not None]
            if got:
                out[f"{n} {label}"] = {k: round(statistics.median(g[k] for g in got), 3)
                                       for k in got[0]}
    return out


def _print_pairs(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> None:
    print("farm against the bare pool (ratio = pool / farm; above 1 the farm is faster)")
    print(f"{'N':>4} {'farm batch':>11} {'pool':>8} {'ratio':>6} {'farm e2e':>9} "
          f"{'pool e2e':>9} {'ratio':>6} {'work/kernel':>12}")
    for f, p in zip(rows, peers, strict=True):
        for label, q in (("", p), ("+load", p.get("with_load"))):
            if q is None:
                continue
            r = q["ratio"]
            print(f"{f['workers']:>4}{label:<6} {f['wall_s']:>10.2f}s {q['pool_wall_s']:>7.2f}s "
                  f"{r['batch']:>6.3f} {f['command_wall_s']:>8.2f}s "
                  f"{q['command_wall_s']:>8.2f}s {r['end_to_end']:>6.3f} "
                  f"{r['work_per_kernel']:>11.3f}x")
    for name, m in _medians(rows, peers).items():
        print(f"median over {sum(1 for f in rows if f['workers'] == int(name.split()[0]))} "
              f"rounds, N={name}: batch {m['batch']:.3f}, end to end {m['end_to_end']:.3f}, "
              f"work per kernel {m['work_per_kernel']:.3f}x")


if __name__ == "__main__":
    main()
