"""What a prover's device context costs, by which driver cache it finds warm.

The prover ahead (``farm/programs/ahead.py``) opens its device with every driver cache
private and new (``farm.compilation.validate.private_caches``): on the H200 host its
NVIDIA context took 1.9 s against 0.24 s with the node's caches warm (docs/BENCHMARKS.md,
"Where NVIDIA's fixed cost goes"). This says which cache that is: each variant runs in a
new process (``--rounds`` times) that imports pyopencl, lists the platforms and opens a
context on the device ``--device`` names (``nvidia`` or ``pocl``), and prints the medians.

* ``node caches``: the node's own caches (the application's case);
* ``all private, new``: what the prover does now;
* ``CUDA kept``: ``CUDA_CACHE_PATH`` one private folder kept from run to run, the rest new;
* ``PoCL and XDG kept``: ``POCL_CACHE_DIR`` and ``XDG_CACHE_HOME`` kept, CUDA's new.

    python3 bench/probe_prover_context.py --device nvidia --rounds 3
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
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import pyopencl as cl
t1 = time.perf_counter()
platforms = cl.get_platforms()
t2 = time.perf_counter()
want = sys.argv[1]
device = next(d for p in platforms for d in p.get_devices()
              if want in (p.name + " " + d.name + " " + p.vendor).lower())
ctx = cl.Context([device])
t3 = time.perf_counter()
print(json.dumps({"import_ms": 1000 * (t1 - t0), "platforms_ms": 1000 * (t2 - t1),
                  "context_ms": 1000 * (t3 - t2)}))
"""

KEYS = ("POCL_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME")


def run(env: dict[str, str], device: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, device], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="nvidia", help="nvidia, pocl or cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    want = {"nvidia": "nvidia", "pocl": "portable", "cpu": "portable"}.get(args.device,
                                                                           args.device)
    base = {k: v for k, v in os.environ.items()
            if k not in KEYS and not k.startswith(("PYOPENCL_", "CUDA_CACHE"))}
    work = Path(tempfile.mkdtemp(prefix="farm-probe-prover-"))
    kept = work / "kept"
    variants: dict[str, list[dict[str, float]]] = {}
    try:
        for name in ("node caches", "all private, new", "CUDA kept", "PoCL and XDG kept"):
            rows = []
            for i in range(args.rounds):
                fresh = work / f"{name.split()[0]}-{i}"
                env = dict(base)
                if name != "node caches":
                    env["PYOPENCL_NO_CACHE"] = "1"
                    for key, sub in zip(KEYS, ("pocl", "cuda", "xdg"), strict=True):
                        keep = (name == "CUDA kept" and key == "CUDA_CACHE_PATH") or (
                            name == "PoCL and XDG kept" and key != "CUDA_CACHE_PATH")
                        folder = (kept / name.split()[0] if keep else fresh) / sub
                        folder.mkdir(parents=True, exist_ok=True)
                        env[key] = str(folder)
                rows.append(run(env, want))
            variants[name] = rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {}
    for name, rows in variants.items():
        med = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        firsts = {k: round(rows[0][k], 1) for k in rows[0]}
        report[name] = {"median": med, "first": firsts}
        print(f"{name:20s} median: import {med['import_ms']:7.1f} ms, platforms "
              f"{med['platforms_ms']:7.1f} ms, context {med['context_ms']:7.1f} ms "
              f"(first run: context {firsts['context_ms']:.1f} ms)")
    print("PROBE_PROVER_CONTEXT " + json.dumps({"device": args.device, **report}))


if __name__ == "__main__":
    main()
