"""Does NVIDIA's OpenCL build run ptxas, and can a farm build skip that part?

The farm links each kernel's PTX into a cubin itself (``farm.compilation.native``), so whatever
machine code NVIDIA's ``clBuildProgram`` makes internally is thrown away. This probe
builds the same kernels with several option sets, interleaved, and reports per set:
the build's median time, whether the PTX it returns is byte-identical to the plain
build's, and (``-cl-nv-verbose``) whether the build log shows ptxas at work.

    python bench/probe_nv_options.py [--kernels 40] [--manifest large]

Prints one JSON line (``PROBE_NV_OPTIONS {...}``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=40)
    parser.add_argument("--manifest", default="large")
    args = parser.parse_args()
    import pyopencl as cl
    from probe_nvidia import distinct_lowered  # bench/ is on sys.path when run as a script

    from farm.compilation.native import linker_for
    from farm.core.device import probe_devices, select_device

    info = select_device(probe_devices(), "nvidia")
    dev = cl.get_platforms()[info.platform_index].get_devices()[info.device_index]
    ctx = cl.Context([dev])
    linker = linker_for(dev)
    sources = distinct_lowered(args.manifest, info, args.kernels)
    variants = {"plain": [], "O0": ["-cl-nv-opt-level=0"], "verbose": ["-cl-nv-verbose"],
                "O0_verbose": ["-cl-nv-opt-level=0", "-cl-nv-verbose"],
                "arch_compute_90": ["-cl-nv-arch", "compute_90"],
                "arch_sm_90": ["-cl-nv-arch", "sm_90"]}
    times: dict[str, list[float]] = {v: [] for v in variants}
    same_ptx = {v: 0 for v in variants}
    same_cubin = {v: 0 for v in variants}
    link_s: dict[str, list[float]] = {v: [] for v in variants}
    logs: dict[str, str] = {}
    ptxas_ms: dict[str, list[float]] = {}
    targets: dict[str, list[str]] = {}
    names = list(variants)
    for i, lowered in enumerate(sources):
        ptx = {}
        order = names[i % len(names):] + names[:i % len(names)]
        for v in order:
            start = time.perf_counter()
            program = cl.Program(ctx, lowered.source)
            try:
                program.build(options=list(lowered.options) + variants[v], devices=[dev])
            except cl.Error as exc:
                logs[v] = f"refused: {exc}"[:300]
                ptx[v] = b""
                continue
            ptx[v] = bytes(program.get_info(cl.program_info.BINARIES)[0])
            times[v].append(time.perf_counter() - start)
            log = str(program.get_build_info(dev, cl.program_build_info.LOG))
            for m in re.finditer(r"Compile time = ([0-9.]+) ms", log):
                ptxas_ms.setdefault(v, []).append(float(m.group(1)))
            if i == 0:
                logs[v] = log[-600:]
                targets[v] = [ln for ln in ptx[v].decode(errors="replace").splitlines()
                              if ln.startswith((".target", ".version"))]
        cubins = {}
        for v in names:
            if not ptx[v]:
                continue
            start = time.perf_counter()
            cubins[v] = linker.link(ptx[v]) if linker else b""
            link_s[v].append(time.perf_counter() - start)
            same_ptx[v] += ptx[v] == ptx["plain"]
        for v in cubins:
            same_cubin[v] += cubins[v] == cubins["plain"]
    overlap = _overlap(cl, ctx, dev, linker, sources)
    out = {"kernels": len(sources), "overlap": overlap, "targets": targets,
           "ptxas_compile_median_ms": {v: statistics.median(t) for v, t in ptxas_ms.items()},
           "build_median_ms": {v: round(1000 * statistics.median(t), 2)
                               for v, t in times.items() if t},
           "build_sum_s": {v: round(sum(t), 3) for v, t in times.items()},
           "link_median_ms": {v: round(1000 * statistics.median(t), 2)
                              for v, t in link_s.items() if t},
           "same_ptx_as_plain": same_ptx, "same_cubin_as_plain": same_cubin, "logs": logs}
    print("PROBE_NV_OPTIONS " + json.dumps(out))


def _overlap(cl: Any, ctx: Any, dev: Any, linker: Any, sources: list[Any]) -> dict[str, float]:
    """Build each kernel (O0) and link the previous one on a second thread at once,
    against the same done one after the other: can one process overlap the two?"""
    from concurrent.futures import ThreadPoolExecutor

    def build(lowered: Any) -> bytes:
        program = cl.Program(ctx, lowered.source)
        program.build(options=[*lowered.options, "-cl-nv-opt-level=0"], devices=[dev])
        return bytes(program.get_info(cl.program_info.BINARIES)[0])

    start = time.perf_counter()
    for lowered in sources:
        linker.link(build(lowered))
    serial = time.perf_counter() - start
    start = time.perf_counter()
    with ThreadPoolExecutor(1) as side:
        pending = None
        for lowered in sources:
            ptx = build(lowered)
            if pending is not None:
                pending.result()
            pending = side.submit(linker.link, ptx)
        if pending is not None:
            pending.result()
    overlapped = time.perf_counter() - start
    return {"serial_s": round(serial, 3), "overlapped_s": round(overlapped, 3)}


if __name__ == "__main__":
    main()
