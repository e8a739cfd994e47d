"""The baseline every compile benchmark compares against: a plain pyopencl loop.

Run in a process of its own (``python bench/plain_loop.py MANIFEST [--with-binaries]``):
lower every kernel of the manifest with the farm's registry exactly as the farm does,
then, one after the other, ``cl.Program(ctx, source).build(options)`` and make its
kernels, which is what a user's own pyopencl program does on a first run.

``--with-binaries`` also asks each program for its binary, as the farm's ``finalize``
does to store it. On PoCL that is where the kernels' machine code is generated (a plain
build leaves it to the first launch), so this is the same compile work as the farm's.

Prints one JSON line: kernels, built, unsupported, distinct_sources, loop_wall_s
(the loop alone), setup_s, fingerprint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def plain_loop(manifest: str, binaries: bool) -> dict[str, object]:
    t0 = time.perf_counter()
    import pyopencl as cl

    from farm.core.device import open_device, probe_devices, select_device
    from farm.core.errors import UnsupportedFeature
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    info = select_device(probe_devices(), settings.device)
    ctx, dev = open_device(info)
    entries = expand(load_manifest(resolve_manifest(manifest)), registry)
    t_loop = time.perf_counter()
    built = unsupported = 0
    sources: set[str] = set()
    for entry in entries:
        try:
            lowered = registry.get(entry.family).lower_id(entry.artifact, info)
        except UnsupportedFeature:
            unsupported += 1
            continue
        sources.add(lowered.source_hash)
        program = cl.Program(ctx, lowered.source).build(options=list(lowered.options),
                                                        devices=[dev])
        if not program.all_kernels():
            sys.exit(f"no kernels in {entry.artifact.kernel.label()}")
        if binaries and not program.get_info(cl.program_info.BINARIES)[0]:
            sys.exit(f"no binary for {entry.artifact.kernel.label()}")
        built += 1
    end = time.perf_counter()
    return {"kernels": len(entries), "built": built, "unsupported": unsupported,
            "distinct_sources": len(sources), "loop_wall_s": round(end - t_loop, 4),
            "setup_s": round(t_loop - t0, 4), "fingerprint": info.fingerprint}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the plain pyopencl baseline loop")
    parser.add_argument("manifest")
    parser.add_argument("--with-binaries", action="store_true")
    args = parser.parse_args()
    print(json.dumps(plain_loop(args.manifest, args.with_binaries)))
