"""What a process pays on NVIDIA before and around its first native link, in pieces.

Answers three questions with numbers, in a fresh process (drivers' caches off):

1. does creating an OpenCL context let other Python threads run (is the GIL released)?
   A thread creates the context while this one counts loop turns;
2. what the CUDA side of a native link costs: ``cuInit``, whether NVIDIA's OpenCL left a
   CUDA context current, retaining the device's primary context, the first link and the
   median of the next ones;
3. what a PTX load (a JIT) and a cubin load cost, for the same kernels.

    python bench/probe_nvidia.py [--kernels 40]

Prints one JSON line (``PROBE_NVIDIA {...}``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time
from typing import Any


def distinct_lowered(manifest: str, info: Any, limit: int) -> list[Any]:
    """The first ``limit`` distinct sources of ``manifest`` lowered for ``info`` (kernels
    the device cannot run left out); shared by the NVIDIA probes."""
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    registry = Registry.load([])
    sources: list[Any] = []
    seen: set[str] = set()
    for entry in expand(load_manifest(resolve_manifest(manifest)), registry):
        try:
            lowered = registry.get(entry.artifact.kernel.family).lower_id(entry.artifact, info)
        except Exception:
            continue
        if lowered.source_hash not in seen:
            seen.add(lowered.source_hash)
            sources.append(lowered)
        if len(sources) >= limit:
            break
    return sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=40)
    args = parser.parse_args()
    t0 = time.perf_counter()
    import pyopencl as cl

    from farm.compilation.finalize import finalize
    from farm.compilation.load import load_binary
    from farm.core.device import info_from_device, probe_devices, select_device

    out: dict[str, object] = {"import_s": time.perf_counter() - t0}
    t = time.perf_counter()
    platforms = cl.get_platforms()
    out["get_platforms_s"] = time.perf_counter() - t
    for i, platform in enumerate(platforms):
        t = time.perf_counter()
        found = [info_from_device(i, j, d) for j, d in enumerate(platform.get_devices())]
        out[f"platform_{i}_devices_s"] = time.perf_counter() - t
        out[f"platform_{i}"] = [d.fingerprint for d in found]
    t = time.perf_counter()
    info = select_device(probe_devices(), "nvidia")
    out["probe_s"] = time.perf_counter() - t
    dev = cl.get_platforms()[info.platform_index].get_devices()[info.device_index]

    made: dict[str, Any] = {}

    from farm.core.device import _create_context

    # First the farm's way (ctypes, GIL released): the cold cost; then pyopencl's own.
    for name, make_one in (("farm", lambda: _create_context(dev)),
                           ("pyopencl", lambda: cl.Context([dev]))):
        def make(make_one: Any = make_one, name: str = name) -> None:
            start = time.perf_counter()
            made[name] = make_one()
            made[f"{name}_s"] = time.perf_counter() - start

        thread = threading.Thread(target=make)
        turns = 0
        start = time.perf_counter()
        thread.start()
        while thread.is_alive():
            turns += 1
        out[f"context_{name}_s"] = made[f"{name}_s"]
        out[f"turns_per_s_during_context_{name}"] = round(
            turns / max(1e-9, time.perf_counter() - start))
    ctx = made["farm"]

    lib = ctypes.CDLL("libcuda.so.1")
    t = time.perf_counter()
    lib.cuInit(0)
    out["cuInit_s"] = time.perf_counter() - t
    current = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(current))
    out["cuda_context_current_after_opencl"] = bool(current.value)

    from farm.compilation.native import linker_for

    t = time.perf_counter()
    linker = linker_for(dev)
    out["open_linker_s"] = time.perf_counter() - t
    assert linker is not None, "no linker on an NVIDIA device"

    sources = distinct_lowered("medium", info, args.kernels)
    compile_s, link_s, ptx_load_s, cubin_load_s = [], [], [], []
    for lowered in sources:
        built = finalize(ctx, dev, lowered)
        compile_s.append(built.work_s)
        t = time.perf_counter()
        cubin = linker.link(built.binary)
        link_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        load_binary(ctx, dev, built.binary)
        ptx_load_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        load_binary(ctx, dev, cubin)
        cubin_load_s.append(time.perf_counter() - t)

    def ms(values: list[float]) -> dict[str, float]:
        return {"median_ms": round(1000 * statistics.median(values), 3),
                "first_ms": round(1000 * values[0], 3), "max_ms": round(1000 * max(values), 3)}

    out.update({"kernels": len(sources), "compile": ms(compile_s), "link": ms(link_s),
                "ptx_load_after_compile": ms(ptx_load_s), "cubin_load": ms(cubin_load_s)})
    print("PROBE_NVIDIA " + json.dumps(out))


if __name__ == "__main__":
    main()
