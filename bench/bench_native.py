"""Native artifacts on NVIDIA: what storing cubins beside PTX costs and what it saves.

Side by side in one run, on this machine (drivers' caches off in every process:
``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``):

1. cold ``farm build M --workers N`` into a fresh FARM_HOME, with native binaries
   (``FARM_NATIVE_BINARIES=1``, the default) and without (``=0``: PTX only, as before),
   alternating ``--repeat`` times; the difference per compiled kernel is the conversion's
   cost as the user sees it;
2. ``farm build M`` again with every kernel stored (end to end and in the batch);
3. ``farm warm M`` in a fresh process from the local tier of the native home (end to end
   and in the batch);
4. per-artifact loads in a fresh process: each stored artifact's native part (cubin) and,
   for the first ``--ptx-loads`` of them, its portable part (PTX, a JIT), each a
   ``clCreateProgramWithBinary`` + build, medians and 90th percentiles;
5. start-up pieces in a fresh process: importing the CLI, finding the devices, creating
   the context.

    python bench/bench_native.py --manifest large --workers 16 --device nvidia

Prints a table and one JSON line (``BENCH_NATIVE {...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

CACHES_OFF = {"PYOPENCL_NO_CACHE": "1", "POCL_KERNEL_CACHE": "0", "CUDA_CACHE_DISABLE": "1"}


def _env(home: Path, device: str | None, native: bool = True) -> dict[str, str]:
    env = dict(os.environ, FARM_HOME=str(home), FARM_NATIVE_BINARIES="1" if native else "0",
               **CACHES_OFF)
    if device:
        env["FARM_DEVICE"] = device
    return env


def _farm(args: list[str], env: dict[str, str]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "farm", *args, "--json"], env=env, text=True,
                          capture_output=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"farm {' '.join(args)} failed ({proc.returncode}): "
                         f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout), wall


LOADS = textwrap.dedent("""
    import json, sqlite3, sys, time
    from farm.core.device import DeviceContext, probe_devices, select_device
    from farm.compilation.load import load_binary
    from farm.compilation.native import unpack
    store, ptx_n = sys.argv[1], int(sys.argv[2])
    dev = select_device(probe_devices(), None)
    ctx, cl_dev = DeviceContext(dev).get()
    rows = [r[0] for r in sqlite3.connect(store).execute("SELECT binary FROM artifacts")]
    native, ptx, whole, plain = [], [], [], 0
    for i, binary in enumerate(rows):
        parts = unpack(binary)
        if parts is None:
            plain += 1
            continue
        t = time.perf_counter(); load_binary(ctx, cl_dev, parts.native)
        native.append(time.perf_counter() - t)
        t = time.perf_counter(); got = load_binary(ctx, cl_dev, binary, arch=dev.native_arch)
        whole.append(time.perf_counter() - t)
        assert got.form == "native", got.fallback
        if i < ptx_n:
            t = time.perf_counter(); load_binary(ctx, cl_dev, parts.portable)
            ptx.append(time.perf_counter() - t)
    print(json.dumps({"artifacts": len(rows), "plain": plain, "native_s": native,
                      "container_s": whole, "ptx_s": ptx,
                      "sizes": [len(r) for r in rows]}))
""")

STARTUP = textwrap.dedent("""
    import json, time
    t0 = time.perf_counter()
    import farm.cli.main  # noqa: F401
    t1 = time.perf_counter()
    from farm.core.device import DeviceContext, probe_devices, select_device
    dev = select_device(probe_devices(), None)
    t2 = time.perf_counter()
    DeviceContext(dev).get()
    t3 = time.perf_counter()
    print(json.dumps({"import_cli_s": t1 - t0, "probe_devices_s": t2 - t1,
                      "context_s": t3 - t2}))
""")


def _child(code: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, text=True,
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"median_ms": round(1000 * statistics.median(ordered), 3),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 3),
            "max_ms": round(1000 * ordered[-1], 3), "n": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="large")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--device", default=None, help="FARM_DEVICE (name or fingerprint)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--ptx-loads", type=int, default=40)
    parser.add_argument("--no-ptx-build", action="store_true",
                        help="skip the PTX-only cold build (no conversion cost measured)")
    args = parser.parse_args()
    out: dict[str, Any] = {"manifest": args.manifest, "workers": args.workers,
                           "cold": {"native": [], "ptx": []}}
    with tempfile.TemporaryDirectory(prefix="bench-native-") as tmp:
        home = Path(tmp) / "native-0"
        for r in range(args.repeat):
            for native in ((True,) if args.no_ptx_build else (True, False)):
                h = Path(tmp) / f"{'native' if native else 'ptx'}-{r}"
                report, wall = _farm(["build", args.manifest, "--local", "--workers",
                                      str(args.workers)], _env(h, args.device, native))
                s = report["summary"]
                out["cold"]["native" if native else "ptx"].append(
                    {"end_to_end_s": round(wall, 3), "batch_s": s["wall_s"],
                     "compiled": s["compiled"], "work_s": s["work_s"],
                     "failed": s["failed"], "unsupported": s["unsupported"]})
        env = _env(home, args.device)
        stored, wall = _farm(["build", args.manifest, "--local"], env)
        out["stored_build"] = {"end_to_end_s": round(wall, 3),
                               "batch_s": stored["summary"]["wall_s"],
                               "loaded": stored["summary"]["loaded"]}
        warmed, wall = _farm(["warm", args.manifest], env)
        ws = warmed["summary"]
        out["warm"] = {"end_to_end_s": round(wall, 3), "batch_s": ws["wall_s"],
                       "local": ws["local"], "native_fallbacks": ws.get("native_fallbacks"),
                       "failed": ws["failed"], "phases": ws["phases"]}
        store = next(home.glob("envs/*/store.sqlite"))
        loads = _child(LOADS, [str(store), str(args.ptx_loads)], env)
        out["loads"] = {"artifacts": loads["artifacts"], "plain": loads["plain"],
                        "cubin": _ms(loads["native_s"]), "container": _ms(loads["container_s"]),
                        "ptx": _ms(loads["ptx_s"]),
                        "mean_artifact_bytes": round(statistics.mean(loads["sizes"]))
                        if loads["sizes"] else 0}
        out["startup"] = _child(STARTUP, [], env)
    nat, ptx = out["cold"]["native"], out["cold"]["ptx"]
    med = statistics.median
    compiled = max(1, nat[0]["compiled"])
    if ptx:
        out["conversion_per_kernel_ms"] = {
            "batch": round(1000 * (med([r["batch_s"] for r in nat]) -
                                   med([r["batch_s"] for r in ptx])) / compiled, 2),
            "work": round(1000 * (med([r["work_s"] for r in nat]) -
                                  med([r["work_s"] for r in ptx])) / compiled, 2)}
    print("drivers' caches off: PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1")
    for kind in ("native", "ptx"):
        for r in out["cold"][kind]:
            print(f"cold build ({kind:6}): {r['compiled']} compiled, batch {r['batch_s']:.2f} s, "
                  f"end to end {r['end_to_end_s']:.2f} s, work {r['work_s']:.1f} s")
    print(f"conversion per compiled kernel: {out.get('conversion_per_kernel_ms')}")
    print(f"build, all stored: {out['stored_build']}")
    print(f"warm, fresh process: {out['warm']['local']} loaded, batch "
          f"{out['warm']['batch_s']:.3f} s, end to end {out['warm']['end_to_end_s']:.3f} s, "
          f"fallbacks {out['warm']['native_fallbacks']}")
    print(f"loads: cubin {out['loads']['cubin']}, ptx {out['loads']['ptx']}")
    print(f"start-up: {out['startup']}")
    print("BENCH_NATIVE " + json.dumps(out))


if __name__ == "__main__":
    main()
