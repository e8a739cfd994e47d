"""The peer of a cold build: a bare ``multiprocessing`` pool of pyopencl builds.

What a user who does not adopt the farm writes: lower the manifest's kernels (with the
farm's registry, so both build the very same sources), drop the duplicates and the
kernels the device cannot run, then N *spawned* processes, each opening its OpenCL
context once in its initializer, build one source at a time (``chunksize=1``) and fetch
its binary (``CL_PROGRAM_BINARIES``), which is what storing it needs. No validation, no
store, no records.

``--load``: each process also loads the binary it fetched, once. That is the peer that
delivers what the farm's artifacts are: known to load, and on NVIDIA turned into the
GPU's machine code once (the PTX JIT, which CUDA's JIT cache would keep, where the farm
stores a cubin). Without it, the pool's PTX still costs that JIT at every later load.

Run in a process of its own (``python bench/bare_pool.py MANIFEST --workers N``); prints
one JSON line: built, distinct sources, ``pool_wall_s`` (pool start to the last binary:
the peer of the farm's batch wall), ``work_s`` (the children's build time summed),
``setup_s`` (imports, device, lowering).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from typing import Any

_CTX: Any = None
_LOAD = False


def _init(device_json: str, load: bool) -> None:
    global _CTX, _LOAD
    from farm.core.device import DeviceInfo, open_device

    _CTX = open_device(DeviceInfo.model_validate_json(device_json))
    _LOAD = load


def _build(job: tuple[str, list[str]]) -> tuple[int, float]:
    import pyopencl as cl

    ctx, dev = _CTX
    source, options = job
    start = time.perf_counter()
    program = cl.Program(ctx, source).build(options=options, devices=[dev])
    binary = program.get_info(cl.program_info.BINARIES)[0]
    if _LOAD:
        cl.Program(ctx, [dev], [binary]).build(options=options, devices=[dev])
    return len(binary), time.perf_counter() - start


def bare_pool(manifest: str, workers: int, load: bool = False) -> dict[str, object]:
    t0 = time.perf_counter()
    from farm.core.device import probe_devices, select_device
    from farm.core.errors import UnsupportedFeature
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    info = select_device(probe_devices(), settings.device)
    jobs: dict[str, tuple[str, list[str]]] = {}
    for entry in expand(load_manifest(resolve_manifest(manifest)), registry):
        try:
            lowered = registry.get(entry.family).lower_id(entry.artifact, info)
        except UnsupportedFeature:
            continue
        jobs.setdefault(lowered.source_hash, (lowered.source, list(lowered.options)))
    t_pool = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(workers, initializer=_init, initargs=(info.model_dump_json(), load)) as pool:
        results = list(pool.imap_unordered(_build, list(jobs.values()), chunksize=1))
    end = time.perf_counter()
    if any(size == 0 for size, _ in results):
        raise SystemExit("a build returned no binary")
    return {"manifest": manifest, "workers": workers, "load": load, "built": len(results),
            "distinct_sources": len(jobs), "pool_wall_s": round(end - t_pool, 4),
            "work_s": round(sum(w for _, w in results), 4),
            "setup_s": round(t_pool - t0, 4), "fingerprint": info.fingerprint,
            "caches": {k: os.environ.get(k) for k in ("PYOPENCL_NO_CACHE",
                                                      "POCL_KERNEL_CACHE",
                                                      "CUDA_CACHE_DISABLE")}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the bare process pool peer")
    parser.add_argument("manifest")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--load", action="store_true", help="also load each binary once")
    args = parser.parse_args()
    print(json.dumps(bare_pool(args.manifest, args.workers, args.load)))
