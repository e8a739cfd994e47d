"""What a served application pays that its second run does not, in pieces: start-up,
the stored binaries' kinds, and every OpenCL call whose time depends on the drivers'
caches (on NVIDIA: what the driver translates in a served run).

    python bench/probe_served_start.py [--device nvidia] [--app bench/apps/pyopencl_array_app.py]
    bench/nvidia_host.sh python3 bench/probe_served_start.py --device nvidia   # ~1 minute

Steps, each application run a fresh process:

1. **start-up**: medians of five of ``python -c pass``, ``import pyopencl``, the same
   under ``farm run``, and ``import pyopencl`` plus the farm's hook module;
2. **fill**: ``farm run`` of the application with the drivers' caches off, into a new
   ``FARM_HOME`` (its local tier then holds every program);
3. **stored kinds**: each stored program's binary: a native container (machine code
   for which architecture) or a plain binary, and of which kind (``bench/cltrace.py``:
   cubin, ptx, elf, pocl);
4. **traced runs** (``bench/cltrace.py``): served from that local tier with the drivers'
   caches (CUDA's compute cache, PoCL's kernel cache, pyopencl's generated code) in new
   empty folders, then again with them (warm), then with the caches off; the plain
   application with its caches warm (a second run) and off (cold). After each, the size
   of the CUDA cache folder (a served run that adds to it made the driver translate);
5. **driver operations** (``bench/apps/driver_ops_app.py``): first and second copy,
   fill, build and launch with no farm, caches off and warm.

Then the calls that cost at least 2 ms more with the caches off than warm in a served
run (the translations, where they happen), the loads by binary kind, and one JSON line
``PROBE_SERVED_START {...}``. The drivers' caches are switched off only where a step
says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from cltrace import binary_kind  # this folder
from cpu import cpu_model  # this folder

HERE = Path(__file__).resolve().parent
OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FARM_", "PYOPENCL_", "POCL_CACHE", "POCL_KERNEL", "CUDA_CACHE",
                                "XDG_CACHE"))}
    return {**env, **extra}


def caches(folder: Path) -> dict[str, str]:
    return {"POCL_CACHE_DIR": str(folder / "pocl"), "CUDA_CACHE_PATH": str(folder / "cuda"),
            "XDG_CACHE_HOME": str(folder / "xdg")}


def farm_cmd() -> list[str]:
    console = Path(sys.executable).with_name("farm")
    return [str(console)] if console.exists() else [sys.executable, "-m", "farm"]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return wall, proc.stdout


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) \
        if folder.exists() else 0


def start_up(work: Path) -> dict[str, float]:
    """Medians of five, in seconds (step 1)."""
    py = sys.executable
    env = base_env(FARM_HOME=str(work / "startup-home"), **caches(work / "startup-caches"))
    probes = {
        "python -c pass": [py, "-c", "pass"],
        "import pyopencl": [py, "-c", "import pyopencl"],
        "farm run: import pyopencl": [*farm_cmd(), "run", "--", py, "-c", "import pyopencl"],
        "import pyopencl + the hook": [py, "-c", "import pyopencl, farm.programs.hook"],
    }
    return {name: round(statistics.median(timed(cmd, env)[0] for _ in range(5)), 3)
            for name, cmd in probes.items()}


def stored_kinds(home: Path) -> Counter[str]:
    """Each stored program binary's kind (step 3)."""
    from farm.compilation.native import unpack
    from farm.core.keys import PROGRAM_FAMILY
    from farm.core.settings import load_settings
    from farm.store import open_store

    kinds: Counter[str] = Counter()
    store = open_store(load_settings(home=home, minio_endpoint=None))
    try:
        for ns in store.namespaces():
            for key in store.keys(ns):
                art = store.get(ns, key)
                if art is None or art.meta.family != PROGRAM_FAMILY:
                    continue
                parts = unpack(art.binary)
                kinds[f"native {parts.arch} ({binary_kind(parts.native)}, portable "
                      f"{binary_kind(parts.portable)})" if parts else
                      f"plain {binary_kind(art.binary)}"] += 1
    finally:
        store.close()
    return kinds


def traced(work: Path, name: str, env: dict[str, str], app: list[str], farm: bool
           ) -> dict[str, Any]:
    out = work / f"trace-{name.replace(' ', '_').replace(',', '')}.json"
    command = [sys.executable, str(HERE / "cltrace.py"), str(out), *app]
    if farm:
        command = [*farm_cmd(), "run", "--", *command]
    wall, _ = timed(command, env)
    trace = json.loads(out.read_text())
    cuda = Path(env["CUDA_CACHE_PATH"]) if "CUDA_CACHE_PATH" in env else None
    return {"wall_s": round(wall, 3), "calls": trace["calls"],
            "cuda_cache_bytes": folder_bytes(cuda) if cuda else None}


def driver_ops(work: Path, device: str) -> dict[str, dict[str, float]]:
    app = [sys.executable, str(HERE / "apps" / "driver_ops_app.py"), device]
    warm_env = base_env(**caches(work / "ops-caches"))
    timed(app, warm_env)  # fills the caches
    return {"caches off": json.loads(timed(app, base_env(**OFF))[1])["ms"],
            "caches warm": json.loads(timed(app, warm_env)[1])["ms"]}


def by_call(calls: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Calls keyed by (op, what, occurrence), so two runs' calls can be matched."""
    n: Counter[tuple[str, str]] = Counter()
    out = {}
    for c in calls:
        n[(c["op"], c["what"])] += 1
        out[(c["op"], c["what"], n[(c["op"], c["what"])])] = c
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="", help="device name or platform substring")
    parser.add_argument("--app", default=str(HERE / "apps" / "pyopencl_array_app.py"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe-served-start-"))
    app = [args.app, args.device]
    report: dict[str, Any] = {"cpus": os.cpu_count(), "cpu": cpu_model(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        report["start_up_s"] = start_up(work)
        home = work / "home"
        fill_wall, _ = timed([*farm_cmd(), "run", "--", sys.executable, *app],
                             base_env(**OFF, FARM_HOME=str(home)))
        report["fill_s"] = round(fill_wall, 2)
        report["stored"] = dict(stored_kinds(home))
        runs: dict[str, dict[str, Any]] = {}
        served = base_env(FARM_HOME=str(home), **caches(work / "served-caches"))
        runs["served, caches empty"] = traced(work, "served empty", served, app, True)
        runs["served, caches warm"] = traced(work, "served warm", served, app, True)
        runs["served, caches off"] = traced(
            work, "served off", base_env(FARM_HOME=str(home), **OFF,
                                         XDG_CACHE_HOME=str(work / "off-xdg")), app, True)
        plain = base_env(**caches(work / "plain-caches"))
        timed([sys.executable, *app], plain)
        runs["plain, second run"] = traced(work, "plain second", plain, app, False)
        runs["plain, caches off"] = traced(work, "plain off", base_env(**OFF), app, False)
        report["runs"] = runs
        report["driver_ops_ms"] = driver_ops(work, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(report)


def print_report(report: dict[str, Any]) -> None:
    print(f"{report['cpus']} CPUs, {report['cpu']} | {report['date']}")
    print("start-up (medians of 5): " + ", ".join(f"{k} {v:.3f} s"
                                                  for k, v in report["start_up_s"].items()))
    print(f"fill (farm run, caches off): {report['fill_s']} s; stored programs: "
          + ", ".join(f"{n} {k}" for k, n in sorted(report["stored"].items())))
    runs = report["runs"]
    print(f"\n{'run':<24} {'wall':>7} {'builds':>8} {'loads':>8} {'launches':>9} "
          f"{'copies':>7} {'CUDA cache after':>17}   loads by kind")
    for name, run in runs.items():
        ms: defaultdict[str, float] = defaultdict(float)
        kinds: Counter[str] = Counter()
        for c in run["calls"]:
            ms[c["op"]] += c["ms"]
            if c["op"] == "load":
                kinds[c["what"]] += 1
        cache = run["cuda_cache_bytes"]
        print(f"{name:<24} {run['wall_s']:>6.2f}s {ms['build']:>6.0f}ms {ms['load']:>6.0f}ms "
              f"{ms['launch']:>7.0f}ms {ms['copy'] + ms['fill']:>5.0f}ms "
              f"{'-' if cache is None else f'{cache / 1024:.0f} KB':>17}   "
              + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    off, warm = (by_call(runs[k]["calls"]) for k in ("served, caches off",
                                                      "served, caches warm"))
    slower = sorted(((c["ms"] - warm[k]["ms"], k, c) for k, c in off.items() if k in warm
                     and c["ms"] - warm[k]["ms"] >= 2.0), key=lambda t: -t[0])
    print(f"\nserved run: calls at least 2 ms slower with the caches off than warm "
          f"({len(slower)}, {sum(d for d, _, _ in slower):.0f} ms in all):")
    for delta, (op, what, n), c in slower[:25]:
        print(f"  {op:<7} {what[:40]:<40} #{n}  off {c['ms']:8.2f} ms  warm "
              f"{warm[(op, what, n)]['ms']:8.2f} ms  (+{delta:.1f})  from {c['where']}")
    ops = report["driver_ops_ms"]
    print("\ndriver operations, no farm (ms, first and second call): "
          + "; ".join(f"{k}: off {v} / warm {ops['caches warm'].get(k)}"
                      for k, v in ops["caches off"].items()))
    for run in runs.values():  # the calls are summed above; the JSON line keeps the sums
        sums: defaultdict[str, float] = defaultdict(float)
        for c in run.pop("calls"):
            sums[c["op"]] += c["ms"]
        run["ms_by_op"] = {k: round(v, 1) for k, v in sums.items()}
    report["slower_when_off"] = [{"op": op, "what": what, "n": n, "extra_ms": round(d, 2),
                                  "where": c["where"]} for d, (op, what, n), c in slower]
    print("PROBE_SERVED_START " + json.dumps(report))


if __name__ == "__main__":
    main()
