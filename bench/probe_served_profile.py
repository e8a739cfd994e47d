"""Where a served run's extra time goes, against the application's second run: cProfile
of both, side by side, from the same node.

    python bench/probe_served_profile.py [--device nvidia] [--app bench/apps/reikna_app.py]
    bench/nvidia_host.sh python3 bench/probe_served_profile.py --device nvidia   # ~1 minute

A node (a new ``FARM_HOME``, its drivers' caches in folders of its own) is filled by one
``farm run`` of the application with the drivers' caches off; the plain application runs
once there to fill its own caches. Then ``--rounds`` times each, a fresh process: the
plain application (its second run) and the application under ``farm run`` (served from
the node's local tier, its programs proven), both as ``python -m cProfile``. Printed:
the medians of the walls and of the application's own ``main_s``; ``farm run pass``
against ``python -c pass`` (the launcher alone); the functions whose cumulative time
differs most between the two (the served run's extra, by where it is spent); and the
farm's own functions in the served run. Nothing is asserted: it is a probe.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_pyopencl_app import OFF, base_env, farm_cmd, node_caches  # noqa: E402


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float | None]:
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-3000:]}")
    main_s = None
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            main_s = json.loads(line).get("main_s")
            break
    return wall, main_s


def cumulative(path: Path) -> dict[str, float]:
    """Each function's cumulative seconds (``file:line(name)``)."""
    stats = pstats.Stats(str(path))
    out: dict[str, float] = {}
    for (file, line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        out[f"{file}:{line}({name})"] = max(out.get(f"{file}:{line}({name})", 0.0), row[3])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="")
    parser.add_argument("--app", default=str(HERE / "apps" / "reikna_app.py"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="probe-served-profile-") as tmp:
        work = Path(tmp)
        node = base_env(**node_caches(work / "caches"), FARM_HOME=str(work / "home"))
        timed([*farm_cmd(), "run", "--", py, args.app, args.device], {**node, **OFF})
        timed([py, args.app, args.device], node)  # the plain run's caches filled
        walls: dict[str, list[float]] = {"plain": [], "served": []}
        mains: dict[str, list[float]] = {"plain": [], "served": []}
        for i in range(args.rounds):
            for kind in ("plain", "served"):
                prof = work / f"{kind}-{i}.prof"
                command = [py, "-m", "cProfile", "-o", str(prof), args.app, args.device]
                if kind == "served":
                    command = [*farm_cmd(), "run", "--", *command]
                wall, main_s = timed(command, node)
                walls[kind].append(wall)
                if main_s is not None:
                    mains[kind].append(main_s)
        launcher = [timed([*farm_cmd(), "run", "--", py, "-c", "pass"], node)[0]
                    for _ in range(5)]
        bare = [timed([py, "-c", "pass"], node)[0] for _ in range(5)]
        for kind in ("plain", "served"):
            print(f"{kind:7} wall {statistics.median(walls[kind]):.3f} s (profiled), main_s "
                  f"{statistics.median(mains[kind]) if mains[kind] else float('nan'):.3f} s")
        print(f"farm run -- python -c pass {statistics.median(launcher):.3f} s; python -c "
              f"pass {statistics.median(bare):.3f} s")
        last = args.rounds - 1
        plain = cumulative(work / f"plain-{last}.prof")
        served = cumulative(work / f"served-{last}.prof")
        diff = sorted(((served.get(k, 0.0) - plain.get(k, 0.0), k) for k in served),
                      reverse=True)
        print(f"\nlargest cumulative differences, served - plain (round {last + 1}):")
        for d, k in diff[:args.top]:
            print(f"  {d * 1000:8.1f} ms  {served[k] * 1000:8.1f}  {k[-110:]}")
        print("\nthe farm's functions in the served run, by cumulative time:")
        ours = sorted(((v, k) for k, v in served.items()
                       if f"{os.sep}farm{os.sep}" in k or "loader" in k), reverse=True)
        for v, k in ours[:args.top]:
            print(f"  {v * 1000:8.1f} ms  {k[-110:]}")


if __name__ == "__main__":
    main()
