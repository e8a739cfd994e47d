"""What choosing a device that compiles costs a process (farm/core/device_probe.py).

Side by side in one run, on the devices found here (in a child, as every farm process
finds them): a start with nothing kept (each device's trivial probe build, in a child
process per device, all at once: what the first farm process on a machine or after a
driver change pays) against a start that reads the kept outcomes (every later one).
The drivers' caches are off in the probes (they switch them off themselves):
``PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1``.

    .venv/bin/python bench/bench_device_probe.py            # 3 rounds
    .venv/bin/python bench/bench_device_probe.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from cpu import cpu_model

from farm.core.device import discover_devices
from farm.core.device_probe import probe_builds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="starts of each kind")
    args = parser.parse_args()
    os.environ.update(PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0", CUDA_CACHE_DISABLE="1")
    devices = discover_devices()
    probing, reading = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="farm-probes-") as folder:
            start = time.perf_counter()
            found = probe_builds(devices, Path(folder))
            probing.append(time.perf_counter() - start)
            start = time.perf_counter()
            probe_builds(devices, Path(folder))
            reading.append(time.perf_counter() - start)
    probe_ms = statistics.median(probing) * 1000
    read_ms = statistics.median(reading) * 1000
    print("caches off: PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0 CUDA_CACHE_DISABLE=1")
    print(f"{len(devices)} device(s) on {os.cpu_count()} x {cpu_model()}; usable: "
          + ", ".join(f"{fp} {'yes' if p.usable else 'no: ' + p.reason}"
                      for fp, p in found.items()))
    print(f"a start that probes        median {probe_ms:9.1f} ms  "
          f"({', '.join(f'{x * 1000:.0f}' for x in probing)})")
    print(f"a start that reads kept    median {read_ms:9.3f} ms")
    print(f"ratio                      {probe_ms / read_ms:,.0f}x")
    print(json.dumps({"bench": "device_probe", "devices": len(devices), "rounds": args.rounds,
                      "probe_ms": round(probe_ms, 1), "kept_ms": round(read_ms, 4),
                      "cpu": cpu_model(), "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
