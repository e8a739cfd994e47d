"""Benchmark: is the default worker count the fastest on this machine?

``farm build M --local`` end to end (process start to exit, a fresh FARM_HOME each time,
so every kernel compiles) at ``--workers 0`` (in this process), ``1``, ``2`` ... and at
the default (no ``--workers``: the settings' default, one per core), ``--repeat`` rounds
with the order rotated each round. Beside them, the one-process peer: a plain loop that
builds each source and fetches its binary (``bench/plain_loop.py --with-binaries``). Manifests:
``tiny`` (20 kernels, built-in families) and ``clamp18``, 18 kernels of the example
plugin's family (``examples/clamp-plugin``, loaded with ``FARM_FAMILY_MODULES``), which
compile fast, so start-up weighs most there. Drivers' caches off.

    .venv/bin/python bench/bench_workers.py [--manifests tiny,clamp18] [--workers 0,1,2]
        [--repeat 3]

Prints a table (median seconds per setting; default over the best) and one JSON line.
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

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "examples" / "clamp-plugin"


def clamp18(folder: Path) -> Path:
    """18 distinct clamp kernels: six bounds, three widths."""
    lines = ['format = 1', 'name = "clamp18"', '']
    for lo, hi in ((-1.0, 1.0), (0.0, 6.0), (-2.0, 2.0), (0.0, 1.0), (-6.0, 0.0),
                   (-0.5, 0.5)):
        for width in (1, 2, 4):
            lines += ["[[kernels]]", 'family = "clamp"',
                      f"params = {{ lo = {lo}, hi = {hi}, width = {width} }}", ""]
    path = folder / "clamp18.toml"
    path.write_text("\n".join(lines))
    return path


def env(home: Path) -> dict[str, str]:
    return {**os.environ, "FARM_HOME": str(home), "PYOPENCL_NO_CACHE": "1",
            "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1",
            "FARM_FAMILY_MODULES": '["clamp_kernels"]',
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN),
                                                        os.environ.get("PYTHONPATH")]))}


def build(manifest: str, workers: str, home: Path) -> float:
    args = [sys.executable, "-m", "farm", "build", manifest, "--local", "--json"]
    if workers != "default":
        args += ["--workers", workers]
    start = time.perf_counter()
    proc = subprocess.run(args, env=env(home), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"farm build {manifest} --workers {workers} failed: "
                         f"{proc.stderr[-1500:]}")
    summary = json.loads(proc.stdout)["summary"]
    if summary["compiled"] == 0:
        raise SystemExit("nothing compiled: the home was not fresh")
    return wall


def plain(manifest: str, home: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plain_loop.py"), manifest,
                           "--with-binaries"], env=env(home), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"plain loop failed: {proc.stderr[-1500:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifests", default="tiny,clamp18")
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    settings = [*args.workers.split(","), "default", "plain"]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        folder = Path(tmp)
        for name in args.manifests.split(","):
            manifest = str(clamp18(folder)) if name == "clamp18" else name
            times: dict[str, list[float]] = {s: [] for s in settings}
            for r in range(args.repeat):
                order = settings[r % len(settings):] + settings[:r % len(settings)]
                for s in order:
                    home = folder / f"{name}-{s}-{r}"
                    times[s].append(plain(manifest, home) if s == "plain"
                                    else build(manifest, s, home))
            out[name] = {s: round(statistics.median(t), 3) for s, t in times.items()}
    print(f"cores: {os.cpu_count()}; medians of {args.repeat} (s, end to end)")
    print(f"{'manifest':<10}" + "".join(f"{s:>10}" for s in settings) + f"{'best/default':>14}")
    for name, row in out.items():
        best = min(v for s, v in row.items() if s != "plain")
        print(f"{name:<10}" + "".join(f"{row[s]:>10.2f}" for s in settings)
              + f"{best / row['default']:>14.3f}")
        row["best_over_default"] = round(best / row["default"], 3)
    print(json.dumps({"bench": "workers", "cores": os.cpu_count(), "repeat": args.repeat,
                      "medians_s": out}))


if __name__ == "__main__":
    main()
