"""A simulated device and a benchmark-only kernel family, for the control-plane benchmark.

Never in the default registry: ``bench/bench_control_plane.py`` puts this folder on
``PYTHONPATH`` and sets ``FARM_FAMILY_MODULES='["simfleet"]'`` (the family) and
``FARM_DEVICE_BACKEND=simfleet`` (the device, see ``farm/compilation/backend.py``) in
every worker and client it starts. Nothing here touches OpenCL, so hundreds of worker
processes fit on one host, and what the benchmark measures is the farm's own control
plane: Celery, Redis, MinIO, leases, records.

- The family ``sim_compile`` has one kernel per ``index`` (and a ``run`` tag, so that
  runs never share artifacts); its source is a few lines of text.
- The device's compile sleeps ``SIM_COMPILE_MS`` milliseconds (default 50: an NVIDIA
  compile is 74 to 98 ms, a warm-cache one less) and returns a binary of
  ``SIM_BINARY_BYTES`` bytes (default 32768: the mean artifact on the H200 was 32.5 KB)
  derived from the source, so every kernel's artifact is distinct. Its load checks the
  binary's magic in microseconds.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Any

import numpy as np

from farm.compilation.finalize import FinalizeResult, worker_name
from farm.compilation.load import LoadedBinary
from farm.core.device import DeviceInfo
from farm.core.errors import LoadError
from farm.core.model import Lowered
from farm.families.base import Example, KernelFamily, Params

MAGIC = b"SIMBIN1\n"


def compile_ms() -> float:
    return float(os.environ.get("SIM_COMPILE_MS", "50"))


def binary_bytes() -> int:
    return int(os.environ.get("SIM_BINARY_BYTES", "32768"))


# -- the family -----------------------------------------------------------------------------
class SimParams(Params):
    index: int = 0
    run: str = ""


class SimCompile(KernelFamily[SimParams]):
    """One trivial kernel per index; what matters is what its compile costs."""

    name = "sim_compile"
    params_model = SimParams

    def lower(self, params: SimParams, launch: Any, device: Any) -> Lowered:
        return Lowered(source=(f"/* sim {params.run} {params.index} */\n"
                               "__kernel void sim(__global float *x) { x[0] = "
                               f"{params.index}.0f; }}"), kernel_names=("sim",))

    def example(self, params: SimParams, launch: Any, rng: Any) -> Example:
        x = np.zeros(1, dtype=np.float32)
        return Example("sim", [x], (1,), None, {0: np.full(1, params.index, np.float32)})


FAMILIES = [SimCompile]


# -- the device -----------------------------------------------------------------------------
def device_info(index: int = 0) -> DeviceInfo:
    return DeviceInfo(
        platform_index=0, device_index=index, platform_name="Simulated",
        platform_version="sim 1", device_name="simulated compiler", vendor="kernel-farm bench",
        device_version="sim 1", driver_version="1", opencl_c_version="OpenCL C 1.2",
        max_work_group_size=1024, max_work_item_sizes=(1024, 1024, 64),
        local_mem_size=48 * 1024, global_mem_size=1 << 34, max_compute_units=132,
        extensions=("cl_khr_fp64",))


def discover() -> list[DeviceInfo]:
    return [device_info()]


class SimBackend:
    """Compiles by sleeping, returns a binary of the set size, loads by checking it."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device

    def finalize(self, lowered: Lowered, native: bool, ready: bool = True) -> FinalizeResult:
        start = time.perf_counter()
        time.sleep(compile_ms() / 1000)
        seed = hashlib.sha256(lowered.source.encode()).digest()
        size = max(binary_bytes(), len(MAGIC) + len(seed))
        body = (seed * (size // len(seed) + 1))[:size - len(MAGIC)]
        return FinalizeResult(binary=MAGIC + body, build_log="", validated=True,
                              work_s=time.perf_counter() - start,
                              host=socket.gethostname(), worker=worker_name())

    def load(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
        if not binary.startswith(MAGIC):
            raise LoadError("not a simulated binary")
        return LoadedBinary(program=None, names=("sim",))  # type: ignore[arg-type]


def open_backend(device: DeviceInfo) -> SimBackend:
    return SimBackend(device)
