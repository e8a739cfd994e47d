"""Is a ready PoCL kernel as fast as after a plain build? Same process, same data, launches
interleaved, and the work-group functions compared byte for byte.

``bench_ready.py``'s "second launch" columns come from different processes with
different histories (one loads 201 binaries back to back, the other compiles between
launches), so they cannot tell a slower kernel from a slower moment. Here, for each
stored kernel of a manifest that was built into ``FARM_HOME`` (``farm build M --local``):
its stored binary is loaded and the same source is built with pyopencl, both launched
once (the stored one makes nothing: its work-group function came in the binary; the
source build compiles its own), then both launched ``--rounds`` times alternating which
goes first; medians. The work-group function each used is read from the PoCL cache
folder (``POCL_CACHE_DIR``, which this probe needs set, empty) and hashed.

    FARM_HOME=/tmp/h PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 farm build medium --local
    FARM_HOME=/tmp/h PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 POCL_CACHE_DIR=$(mktemp -d) \\
        python bench/probe_ready_speed.py medium --limit 40

Prints a line per kernel and one JSON line (``PROBE_READY_SPEED {...}``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--family", help="only this family")
    parser.add_argument("--limit", type=int, default=40, help="kernels at most")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if not os.environ.get("POCL_CACHE_DIR"):
        sys.exit("probe_ready_speed: set POCL_CACHE_DIR to an empty folder")

    import pyopencl as cl
    from bench_ready import stored_kernels  # this folder: the same device and store set-up

    from farm.compilation.load import load_binary
    from farm.families.run import run_example

    top = Path(os.environ["POCL_CACHE_DIR"])

    def new_functions(before: set[Path]) -> list[str]:
        return sorted(hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                      for p in set(top.rglob("*.so")) - before)

    rows = []
    fingerprint = ""
    for ctx, dev, queue, info, family, entry, example, art in stored_kernels(args.manifest):
        fingerprint = info.fingerprint
        if art is None or (args.family and entry.family != args.family):
            continue
        before = set(top.rglob("*.so"))
        stored = cl.Kernel(load_binary(ctx, dev, art.binary, arch=info.native_arch).program,
                           example.kernel_name)
        run_example(queue, stored, example)
        stored_fn = new_functions(before)
        lowered = family.lower_id(entry.artifact, info)
        before = set(top.rglob("*.so"))
        plain = cl.Kernel(cl.Program(ctx, lowered.source).build(options=list(lowered.options)),
                          example.kernel_name)
        run_example(queue, plain, example)
        plain_fn = new_functions(before)
        times: dict[str, list[float]] = {"stored": [], "plain": []}
        for i in range(args.rounds):
            pair = [("stored", stored), ("plain", plain)]
            for name, kernel in pair if i % 2 == 0 else pair[::-1]:
                t = time.perf_counter()
                run_example(queue, kernel, example)
                times[name].append(time.perf_counter() - t)
        s, p = (1000 * statistics.median(times[n]) for n in ("stored", "plain"))
        same = bool(stored_fn) and stored_fn == plain_fn
        rows.append({"kernel": entry.artifact.describe()[:60], "stored_ms": round(s, 3),
                     "plain_ms": round(p, 3), "ratio": round(s / p, 3),
                     "same_function": same})
        print(f"{rows[-1]['kernel']:<60} stored {s:8.3f} ms  plain {p:8.3f} ms  "
              f"x{s / p:5.2f}  {'same' if same else 'DIFFERENT'} work-group function",
              flush=True)
        if len(rows) >= args.limit:
            break
    ratios = [r["ratio"] for r in rows]
    summary = {"manifest": args.manifest, "device": fingerprint, "kernels": len(rows),
               "same_function": sum(r["same_function"] for r in rows),
               "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
               "max_ratio": max(ratios, default=None), "rounds": args.rounds}
    print(f"{summary['kernels']} kernels: {summary['same_function']} with the same "
          f"work-group function; stored / plain median x{summary['median_ratio']}, "
          f"worst x{summary['max_ratio']}")
    print("PROBE_READY_SPEED " + json.dumps({**summary, "rows": rows}))


if __name__ == "__main__":
    main()
