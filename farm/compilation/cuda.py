"""The CUDA driver's own JIT linker, through ``ctypes`` over ``libcuda.so.1``.

Why this exists: NVIDIA's OpenCL hands back PTX as a program's binary, and loading PTX
is a JIT to the GPU's machine code (SASS) that the driver runs one at a time inside a
process, 28 to 50 ms a kernel on an H200. The same driver exports the linker it uses for
that JIT (``cuLinkCreate`` / ``cuLinkAddData`` / ``cuLinkComplete``); running it once,
where the kernel was compiled, gives an ELF *cubin* for the device's exact architecture,
which NVIDIA's OpenCL accepts through ``clCreateProgramWithBinary`` and loads in about a
millisecond (a copy, no JIT).

Why ctypes and not ``cuda-bindings`` or ``ptxas``: a GPU host always has the driver,
and the driver is the one thing guaranteed to produce code its own OpenCL accepts;
``ptxas`` (CUDA toolkit) or nvJitLink would be one more package to install and keep in
step with the driver. Ten entry points are all we call (``cuInit``, ``cuDeviceGetCount``,
``cuDeviceGetAttribute``, ``cuDevicePrimaryCtxRetain``, ``cuCtxSetCurrent``, the linker's
``cuLinkCreate`` / ``cuLinkAddData`` / ``cuLinkComplete`` / ``cuLinkDestroy``, and
``cuGetErrorString``), so a thin layer is the smaller dependency.

Nothing here is imported unless a device is NVIDIA's: :func:`open_cuda_linker` returns
``None`` wherever ``libcuda.so.1`` is missing or refuses, and the farm then stores PTX
exactly as before. The CUDA context used is the device's *primary* context, the one
NVIDIA's OpenCL itself runs on, so the linker adds no context of its own.
"""

from __future__ import annotations

import ctypes
import logging
import threading

from farm.core.errors import FarmError

log = logging.getLogger(__name__)

# CUDA driver API constants (cuda.h); stable across driver versions.
_CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
_CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
_CU_JIT_ERROR_LOG_BUFFER = 5
_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6
_CU_JIT_INPUT_PTX = 1
_LOG_BYTES = 16384


class CudaError(FarmError):
    """A CUDA driver call failed (the message names the call and the driver's words)."""


def _check(lib: ctypes.CDLL, call: str, status: int, log_text: str = "") -> None:
    """Raise :class:`CudaError` naming ``call`` and the driver's words unless ``status``
    is CUDA_SUCCESS (0)."""
    if status == 0:
        return
    text = ctypes.c_char_p()
    lib.cuGetErrorString(ctypes.c_int(status), ctypes.byref(text))
    words = text.value.decode(errors="replace") if text.value else f"error {status}"
    detail = f": {log_text.strip()[:500]}" if log_text.strip() else ""
    raise CudaError(f"{call} failed: {words}{detail}")


def _attribute(lib: ctypes.CDLL, device: int, attribute: int) -> int:
    value = ctypes.c_int()
    _check(lib, "cuDeviceGetAttribute", lib.cuDeviceGetAttribute(
        ctypes.byref(value), ctypes.c_int(attribute), ctypes.c_int(device)))
    return value.value


class CudaLinker:
    """PTX -> cubin for one CUDA device, with the driver's JIT linker.

    Thread-safe: a link makes the device's primary context current in the calling
    thread, and one lock keeps links of one process one at a time (the driver serializes
    them anyway).
    """

    #: NVIDIA's ``clBuildProgram`` runs ptxas on the PTX it makes (its log shows it with
    #: ``-cl-nv-verbose``) and keeps that SASS inside the program, where nothing can read
    #: it; the farm stores the SASS of its own link instead. ``-cl-nv-opt-level`` is
    #: ptxas's optimisation level only: at 0 the build's ptxas takes about half as long
    #: (18 ms against 33 ms a kernel on an H200) and the PTX it returns is byte for
    #: byte the same (``bench/probe_nv_options.py``; ``tests/test_nvidia.py`` checks it).
    build_options: tuple[str, ...] = ("-cl-nv-opt-level=0",)

    def __init__(self, lib: ctypes.CDLL, device: int) -> None:
        self._lib = lib
        self._device = device
        self._lock = threading.Lock()
        major = _attribute(lib, device, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = _attribute(lib, device, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        #: the architecture the cubins are for, e.g. ``sm_90``
        self.arch = f"sm_{major}{minor}"
        ctx = ctypes.c_void_p()
        _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(
            ctypes.byref(ctx), ctypes.c_int(device)))
        self._ctx = ctx

    def link(self, ptx: bytes) -> bytes:
        """The cubin of ``ptx`` for :attr:`arch` (raises :class:`CudaError`)."""
        lib = self._lib
        data = ptx if ptx.endswith(b"\0") else ptx + b"\0"  # the linker reads a C string
        error_log = ctypes.create_string_buffer(_LOG_BYTES)
        options = (ctypes.c_int * 2)(_CU_JIT_ERROR_LOG_BUFFER,
                                     _CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (ctypes.c_void_p * 2)(ctypes.cast(error_log, ctypes.c_void_p),
                                       ctypes.c_void_p(_LOG_BYTES))
        with self._lock:
            _check(lib, "cuCtxSetCurrent", lib.cuCtxSetCurrent(self._ctx))
            state = ctypes.c_void_p()
            _check(lib, "cuLinkCreate", lib.cuLinkCreate_v2(
                ctypes.c_uint(2), options, values, ctypes.byref(state)))
            try:
                _check(lib, "cuLinkAddData", lib.cuLinkAddData_v2(
                    state, ctypes.c_int(_CU_JIT_INPUT_PTX), ctypes.c_char_p(data),
                    ctypes.c_size_t(len(data)), ctypes.c_char_p(b"kernel.ptx"),
                    ctypes.c_uint(0), None, None), error_log.value.decode(errors="replace"))
                cubin = ctypes.c_void_p()
                size = ctypes.c_size_t()
                _check(lib, "cuLinkComplete", lib.cuLinkComplete(
                    state, ctypes.byref(cubin), ctypes.byref(size)),
                    error_log.value.decode(errors="replace"))
                # The cubin lives in the link state: copy it out before destroying that.
                return ctypes.string_at(cubin, size.value)
            finally:
                lib.cuLinkDestroy(state)


def open_cuda_linker(pci_bus_id: int | None = None, pci_slot_id: int | None = None,
                     ordinal: int = 0) -> CudaLinker | None:
    """A linker for the CUDA device that is the given OpenCL device, or ``None``.

    The CUDA device is matched by PCI bus (and slot, where several GPUs share a bus),
    which NVIDIA's OpenCL reports through ``cl_nv_device_attribute_query``; without PCI
    ids it is the ``ordinal``-th CUDA device (the order NVIDIA's OpenCL lists them in).
    ``None`` (logged) wherever the driver library is absent or refuses: conversion is an
    optimisation, never a requirement.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        _check(lib, "cuInit", lib.cuInit(ctypes.c_uint(0)))
        count = ctypes.c_int()
        _check(lib, "cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
        device = _match_device(lib, count.value, pci_bus_id, pci_slot_id, ordinal)
        if device is None:
            log.warning("no CUDA device matches PCI bus %s slot %s; storing PTX",
                        pci_bus_id, pci_slot_id)
            return None
        return CudaLinker(lib, device)
    except (CudaError, AttributeError) as exc:  # AttributeError: an entry point is missing
        log.warning("CUDA driver linker unavailable (%s); storing PTX", exc)
        return None


def _match_device(lib: ctypes.CDLL, count: int, bus: int | None, slot: int | None,
                  ordinal: int) -> int | None:
    if count <= 0:
        return None
    if bus is None:
        return ordinal if ordinal < count else None
    same_bus: list[tuple[int, int]] = []
    for dev in range(count):
        if _attribute(lib, dev, _CU_DEVICE_ATTRIBUTE_PCI_BUS_ID) == bus:
            same_bus.append((dev, _attribute(lib, dev, _CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)))
    if len(same_bus) == 1 or (same_bus and slot is None):
        return same_bus[0][0]
    for dev, pci_device in same_bus:
        # NVIDIA's OpenCL slot id is either the PCI device number or device << 3 | function
        if slot in (pci_device, pci_device << 3):
            return dev
    return None
