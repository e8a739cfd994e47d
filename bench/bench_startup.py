"""Start-up: what a process pays before it does anything, each in a fresh interpreter.

* ``farm --help``;
* ``import loader`` and ``from loader import KernelLoader`` (and which heavy modules the
  latter pulls in: SQLAlchemy, Celery, kombu, minio, redis, cryptography must not be);
* ``farm build MANIFEST`` with every kernel already stored, embedded (a first build
  fills a fresh FARM_HOME; not timed).

Each is run ``--repeat`` times; the median and the minimum are printed (the minimum is
the machine's floor, the median what a user sees on a busy one). Drivers' caches off.

    .venv/bin/python bench/bench_startup.py [--repeat 7] [--manifest tiny]

Prints a table and one JSON line (``BENCH_STARTUP {...}``).
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

HEAVY = ("sqlalchemy", "celery", "kombu", "minio", "redis", "cryptography")
CHECK = ("import sys, time; t = time.perf_counter(); from loader import KernelLoader; "
         f"print(time.perf_counter() - t, [m for m in {HEAVY!r} if m in sys.modules])")


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr[-1000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--manifest", default="tiny")
    args = parser.parse_args()
    console = Path(sys.executable).with_name("farm")  # the console script, where installed
    farm_cmd = [str(console)] if console.exists() else [sys.executable, "-m", "farm"]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        env = dict(os.environ, FARM_HOME=tmp, PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
                   CUDA_CACHE_DISABLE="1")
        env.pop("FARM_REDIS_URL", None)
        env.pop("FARM_MINIO_ENDPOINT", None)
        timed([*farm_cmd, "build", args.manifest, "--json"], env)  # fill the store
        commands = {
            "farm --help": [*farm_cmd, "--help"],
            "python -c pass": [sys.executable, "-c", "pass"],
            "import loader": [sys.executable, "-c", "import loader"],
            "from loader import KernelLoader": [sys.executable, "-c",
                                                "from loader import KernelLoader"],
            f"farm build {args.manifest} (all stored)": [*farm_cmd, "build", args.manifest,
                                                         "--json"],
        }
        for name, argv in commands.items():
            walls = [timed(argv, env) for _ in range(args.repeat)]
            results[name] = {"median_s": round(statistics.median(walls), 3),
                             "min_s": round(min(walls), 3)}
        proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                              text=True, check=True)
        seconds, heavy = proc.stdout.strip().split(" ", 1)
    print("drivers' caches off: PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1")
    for name, r in results.items():
        print(f"{name:45} median {r['median_s']:.3f} s   min {r['min_s']:.3f} s")
    print(f"heavy modules after `from loader import KernelLoader`: {heavy}")
    print("BENCH_STARTUP " + json.dumps({"results": results, "heavy_after_loader": heavy,
                                         "in_process_s": float(seconds),
                                         "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
