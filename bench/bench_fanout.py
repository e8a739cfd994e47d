"""Fan-out scaling of the embedded build: ``farm build M --workers N`` for several N.

Each N builds into a fresh FARM_HOME (so every kernel is compiled), side by side in one
run, then one rebuild (all in the store) of the last home, then ``farm warm`` of that
home, which loads every kernel on the device in this process: once with the drivers'
caches off, and twice with CUDA's JIT cache on in a fresh folder (NVIDIA's binaries are
PTX, so a load is a JIT that this cache turns into a look-up; the second run is what a
machine sees from then on). Builds run with the caches off (PYOPENCL_NO_CACHE=1,
POCL_KERNEL_CACHE=0, CUDA_CACHE_DISABLE=1).

    python bench/bench_fanout.py --manifest medium --workers 1,16 [--device nvidia]

Prints a table and one JSON line: wall per N, kernels compiled, speed-up against the
first N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


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
                                   "wall_s", "work_s") if k in summary}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="medium")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--device", default=None, help="FARM_DEVICE (name or fingerprint)")
    args = parser.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        for n in counts:
            rows.append(run(args.manifest, n, Path(tmp) / f"w{n}", args.device))
        home = Path(tmp) / f"w{counts[-1]}"
        rebuild = run(args.manifest, counts[-1], home, args.device)
        loads = {"caches_off": warm_run(args.manifest, home, args.device, None)}
        cache = Path(tmp) / "cuda-cache"
        loads["jit_cache_first"] = warm_run(args.manifest, home, args.device, cache)
        loads["jit_cache_warm"] = warm_run(args.manifest, home, args.device, cache)
    base = rows[0]["wall_s"]
    print("drivers' caches off: PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1")
    print(f"{'workers':>8} {'kernels':>8} {'compiled':>9} {'unsupp.':>8} {'wall s':>9} "
          f"{'work s':>9} {'vs first':>9}")
    for r in rows:
        print(f"{r['workers']:>8} {r['kernels']:>8} {r['compiled']:>9} {r['unsupported']:>8} "
              f"{r['wall_s']:>9.2f} {r['work_s']:>9.2f} {base / r['wall_s']:>8.2f}x")
    print(f"rebuild, all in the store: {rebuild['loaded']} in {rebuild['wall_s']:.3f} s")
    for name, w in loads.items():
        n = max(1, int(str(w.get("local", 0))))
        print(f"farm warm ({name}): {w.get('local')} loaded in {w['wall_s']} s "
              f"= {float(str(w['wall_s'])) / n * 1000:.2f} ms a kernel")
    print(json.dumps({"manifest": args.manifest, "runs": rows, "rebuild": rebuild,
                      "loads": loads}))


if __name__ == "__main__":
    main()
