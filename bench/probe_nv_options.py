"""Does NVIDIA's OpenCL build run ptxas, and can a farm build skip that part?

The farm links each kernel's PTX into a cubin itself (``farm.native``), so whatever
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
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=40)
    parser.add_argument("--manifest", default="large")
    args = parser.parse_args()
    import pyopencl as cl

    from farm.device import probe_devices, select_device
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest
    from farm.native import linker_for

    info = select_device(probe_devices(), "nvidia")
    dev = cl.get_platforms()[info.platform_index].get_devices()[info.device_index]
    ctx = cl.Context([dev])
    linker = linker_for(dev)
    registry = Registry.load([])
    sources = []
    seen = set()
    for entry in expand(load_manifest(resolve_manifest(args.manifest)), registry):
        try:
            lowered = registry.get(entry.artifact.kernel.family).lower_id(entry.artifact, info)
        except Exception:
            continue
        if lowered.source_hash not in seen:
            seen.add(lowered.source_hash)
            sources.append(lowered)
        if len(sources) >= args.kernels:
            break
    variants = {"plain": [], "O0": ["-cl-nv-opt-level=0"], "verbose": ["-cl-nv-verbose"]}
    times: dict[str, list[float]] = {v: [] for v in variants}
    same_ptx = {v: 0 for v in variants}
    same_cubin = {v: 0 for v in variants}
    link_s: dict[str, list[float]] = {v: [] for v in variants}
    logs = {}
    names = list(variants)
    for i, lowered in enumerate(sources):
        ptx = {}
        order = names[i % len(names):] + names[:i % len(names)]
        for v in order:
            start = time.perf_counter()
            program = cl.Program(ctx, lowered.source)
            program.build(options=list(lowered.options) + variants[v], devices=[dev])
            ptx[v] = bytes(program.get_info(cl.program_info.BINARIES)[0])
            times[v].append(time.perf_counter() - start)
            if i == 0:
                logs[v] = str(program.get_build_info(dev, cl.program_build_info.LOG))[:1500]
        cubins = {}
        for v in names:
            start = time.perf_counter()
            cubins[v] = linker.link(ptx[v]) if linker else b""
            link_s[v].append(time.perf_counter() - start)
            same_ptx[v] += ptx[v] == ptx["plain"]
        for v in names:
            same_cubin[v] += cubins[v] == cubins["plain"]
    out = {"kernels": len(sources),
           "build_median_ms": {v: round(1000 * statistics.median(t), 2) for v, t in times.items()},
           "build_sum_s": {v: round(sum(t), 3) for v, t in times.items()},
           "link_median_ms": {v: round(1000 * statistics.median(t), 2) for v, t in link_s.items()},
           "same_ptx_as_plain": same_ptx, "same_cubin_as_plain": same_cubin, "logs": logs}
    print("PROBE_NV_OPTIONS " + json.dumps(out))


if __name__ == "__main__":
    main()
