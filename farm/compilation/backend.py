"""What a worker does with its device, behind one seam: find it, compile on it, load on it.

A worker's compile path needs three things of its device: the devices and their
fingerprints (in the main process, before the pool forks), ``finalize`` (compile and
validate a source) and ``load`` (check that a stored binary loads) in each pool process.
OpenCL is the only backend the farm ships. The seam exists so that a benchmark of the
control plane (``bench/simdevice.py``: a device whose compile takes a set time and
returns a set-size binary) can run hundreds of worker processes with no OpenCL at all,
through the same worker, task, store, lease and records code a real fleet runs.

``FARM_DEVICE_BACKEND`` names the module of such a backend; it is for benchmarks only
(a simulated binary is no program), and a worker that uses one says so in its log. The
module provides ``discover() -> list[DeviceInfo]`` and ``open_backend(DeviceInfo) ->
DeviceBackend``.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from farm.core.device import DeviceInfo, ProbeResult, discover_devices, open_device
from farm.core.errors import SettingsError

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.compilation.finalize import FinalizeResult
    from farm.compilation.load import LoadedBinary
    from farm.core.model import Lowered
    from farm.core.settings import Settings

log = logging.getLogger(__name__)


class DeviceBackend(Protocol):
    """One worker process's device: opened once, used for every kernel it obtains."""

    device: DeviceInfo

    def finalize(self, lowered: Lowered, native: bool, ready: bool = True) -> FinalizeResult:
        """Compile ``lowered`` and validate the binary by loading it (errors as values);
        ``native``: store the device's machine code where it has a linker; ``ready``:
        what a first launch would generate is made now where the device needs it
        (``FARM_POCL_READY``)."""
        ...

    def load(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
        """Load ``binary`` (holding exactly ``kernel_names`` when given: those its family
        declares); :class:`~farm.core.errors.LoadError` when the device refuses it."""
        ...


class OpenCLBackend:
    """The device through OpenCL: one context, made at construction."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.ctx: cl.Context
        self.cl_device: cl.Device
        self.ctx, self.cl_device = open_device(device)

    @classmethod
    def on(cls, device: DeviceInfo, ctx: cl.Context, cl_device: cl.Device) -> OpenCLBackend:
        """A backend over a context the caller already made (in-process tests: one
        context for many worker states, as a pool process has one for its tasks)."""
        backend = cls.__new__(cls)
        backend.device, backend.ctx, backend.cl_device = device, ctx, cl_device
        return backend

    def finalize(self, lowered: Lowered, native: bool, ready: bool = True) -> FinalizeResult:
        from farm.compilation.finalize import finalize_and_validate

        return finalize_and_validate(self.ctx, self.cl_device, lowered,
                                     "auto" if native else None, ready)

    def load(self, binary: bytes, kernel_names: tuple[str, ...] = ()) -> LoadedBinary:
        from farm.compilation.load import load_binary

        return load_binary(self.ctx, self.cl_device, binary, kernel_names,
                           arch=self.device.native_arch)


def _module(settings: Settings) -> ModuleType | None:
    name = settings.device_backend
    if not name:
        return None
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise SettingsError(f"setting FARM_DEVICE_BACKEND: cannot import {name}: {exc}") \
            from None
    for attr in ("discover", "open_backend"):
        if not callable(getattr(module, attr, None)):
            raise SettingsError(f"setting FARM_DEVICE_BACKEND: module {name} has no "
                                f"{attr}()")
    return module


def discover(settings: Settings) -> list[DeviceInfo]:
    """The devices a worker may serve (OpenCL's from a short-lived child process)."""
    module = _module(settings)
    if module is None:
        return discover_devices()
    log.warning("simulated devices from FARM_DEVICE_BACKEND=%s (benchmarks only)",
                settings.device_backend)
    found: list[DeviceInfo] = module.discover()
    return found


def device_probes(settings: Settings,
                  devices: list[DeviceInfo]) -> dict[str, ProbeResult] | None:
    """Whose compiler works among ``devices`` (``farm.core.device_probe``, kept per
    fingerprint); None for a simulated backend's devices, which have no compiler."""
    if _module(settings) is not None:
        return None
    from farm.core.device_probe import probe_builds

    return probe_builds(devices, settings.device_probes)


def open_backend(settings: Settings, device: DeviceInfo) -> DeviceBackend:
    """Open ``device`` in this (pool) process."""
    module = _module(settings)
    if module is None:
        return OpenCLBackend(device)
    backend: DeviceBackend = module.open_backend(device)
    return backend
