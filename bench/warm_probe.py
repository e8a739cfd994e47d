"""Warm a manifest in this (fresh) process with the compiler forbidden; print one JSON line.

Used by ``tests/test_gpu_cluster.py`` and ``bench/bench_gpu_cluster.py`` on the GPU host:
the process's store is whatever ``FARM_*`` says (a cluster's MinIO behind an empty local
tier, or the local tier a previous warm filled), ``FARM_DEVICE`` picks the device.
``farm.compilation.finalize.finalize`` is replaced by a function that exits, and the
loader's ``on_miss="fail"``, so a kernel that is not stored fails the warm instead of
being compiled. Then every ``--run``-th kernel (0: none) runs its family's example on
the device and is checked against numpy, so "loaded" also means "computes right".

    python bench/warm_probe.py large [--run 20]
"""

from __future__ import annotations

import argparse
import json
import time

import farm.compilation.finalize


def _forbidden(*args: object, **kwargs: object) -> None:
    raise SystemExit("the compiler was called in the loading process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("manifest")
    parser.add_argument("--run", type=int, default=0,
                        help="run every N-th warmed kernel's example against numpy (0: none)")
    args = parser.parse_args()
    farm.compilation.finalize.finalize = _forbidden  # type: ignore[assignment]

    import numpy as np

    from farm.core.errors import UnsupportedFeature
    from farm.families.run import check_example, run_example
    from loader import KernelLoader
    from loader.warming import artifacts_of

    t0 = time.perf_counter()
    with KernelLoader(on_miss="fail", label="warm probe") as loader:
        artifacts = []
        for art in artifacts_of(args.manifest, loader)[0]:
            try:  # lowering only checks the device's limits; the build skipped these
                loader.registry.get(art.kernel.family).lower_id(art, loader.device)
            except UnsupportedFeature:
                continue
            artifacts.append(art)
        report = loader.warm(artifacts)
        warm_end = time.perf_counter()
        problems: list[str] = []
        ran = 0
        rng = np.random.default_rng(3)
        for art in artifacts[::args.run] if args.run > 0 else []:
            family = loader.registry.get(art.kernel.family)
            example = family.example(family.validate(art.kernel.params), art.kernel.launch, rng)
            kernel = loader.kernel_for(art, name=example.kernel_name)
            bad = check_example(run_example(loader.queue, kernel, example), example)
            problems += [f"{art.kernel.label()}: {p}" for p in bad]
            ran += 1
        print(json.dumps({"summary": report.summary(), "stats": loader.stats.snapshot(),
                          "fingerprint": loader.device.fingerprint,
                          "arch": loader.device.native_arch, "ran": ran,
                          "problems": problems,
                          "warm_end_to_end_s": round(warm_end - t0, 4),
                          "end_to_end_s": round(time.perf_counter() - t0, 4)}))


if __name__ == "__main__":
    main()
