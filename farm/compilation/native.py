"""Native artifacts: the device's machine code stored beside the portable binary.

Where a device's OpenCL binary is itself a portable form that every load compiles again
(NVIDIA: PTX, JIT-compiled to SASS on each load, one at a time per process), the process
that compiled a kernel also turns that binary into the device's machine code (a cubin,
:mod:`farm.compilation.cuda`) and stores both, in one artifact::

    b"KFNATIVE"                    8 bytes, magic
    header length                  4 bytes, little-endian, at most 4 KiB
    header                         JSON (:class:`NativeHeader`): arch, sizes
    native part                    the cubin: what a loader tries first (~1 ms load)
    portable part                  the PTX: what a loader falls back to (a JIT)

One artifact rather than two variants because the two are one compile's output: they
share a key, a digest and a signature, are stored, bundled and verified together, and
an old loader that finds a plain binary (every store written before this) still loads it.

Who decides where a cubin may be served: the namespace. A cubin is valid for one GPU
architecture and loadable by drivers at least as new as the one that made it; the
fingerprint names the device's compute capability and the exact driver version
(:meth:`farm.core.device.DeviceInfo.identity`), so a cubin is only ever looked up by a device
of that architecture under that driver. The header's ``arch`` is checked again at load,
and a refused native part falls back to the portable one: counted, recorded, never a
failed kernel.

The CUDA calls sit behind one seam, :func:`open_linker`: tests replace it to exercise
conversion, fallback and routing on machines with no GPU.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from farm.core.errors import LoadError
from farm.core.fingerprint import device_arch, nv_attribute

if TYPE_CHECKING:
    import pyopencl as cl

log = logging.getLogger(__name__)

MAGIC = b"KFNATIVE"
_LENGTH = struct.Struct("<I")
_MAX_HEADER = 4096


class NativeLinker(Protocol):
    """Turns the device's portable binary into its machine code."""

    #: the architecture of the code it makes, e.g. ``sm_90``
    arch: str
    #: options added to the platform build of a kernel this linker converts. The build's
    #: own machine code is thrown away (the link makes the stored code), so these make
    #: the build spend less on it; they must leave the portable binary byte for byte as
    #: it is without them.
    build_options: tuple[str, ...]

    def link(self, portable: bytes) -> bytes:
        """Machine code of ``portable``; raises an exception when it cannot."""
        ...


#: what a container's header holds (it comes from a store: checked field by field)
_ARCH = re.compile(r"[a-z0-9_]{1,32}")
_HEADER_FIELDS = frozenset({"v", "arch", "native_format", "native_size", "portable_size"})


def _header(raw: bytes) -> tuple[str, int, int]:
    """``(arch, native size, portable size)`` of a container's JSON header, checked:
    version 1, no other field, names of the allowed form, sizes at least 1. Checked by
    hand rather than by a pydantic model so that a served application's load imports
    no pydantic (:mod:`farm.programs.quick`)."""
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise LoadError("native container has a malformed header") from None
    if not isinstance(header, dict) or not header.keys() <= _HEADER_FIELDS \
            or header.get("v", 1) != 1 or header.get("v", 1) is True:
        raise LoadError("native container has a malformed header")
    arch, form = header.get("arch"), header.get("native_format", "cubin")
    sizes = header.get("native_size"), header.get("portable_size")
    if not (isinstance(arch, str) and _ARCH.fullmatch(arch) and isinstance(form, str)
            and _ARCH.fullmatch(form) and all(type(n) is int and n >= 1 for n in sizes)):
        raise LoadError("native container has a malformed header")
    return arch, sizes[0], sizes[1]  # type: ignore[return-value]


@dataclass(frozen=True)
class NativeParts:
    """A container, unpacked."""

    arch: str
    native: bytes
    portable: bytes


def pack(arch: str, native: bytes, portable: bytes) -> bytes:
    """One artifact binary holding ``native`` (tried first) and ``portable``."""
    if not _ARCH.fullmatch(arch):
        raise ValueError(f"not an architecture name: {arch!r:.60}")
    header = json.dumps({"v": 1, "arch": arch, "native_format": "cubin",
                         "native_size": len(native), "portable_size": len(portable)},
                        separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + native + portable


def unpack(binary: bytes) -> NativeParts | None:
    """The parts of a container; ``None`` for a plain binary. A damaged container is a
    :class:`LoadError` (the artifact is then a miss that recompiling repairs)."""
    if not binary.startswith(MAGIC):
        return None
    start = len(MAGIC) + _LENGTH.size
    if len(binary) < start:
        raise LoadError("native container truncated in its header")
    (length,) = _LENGTH.unpack_from(binary, len(MAGIC))
    if length > _MAX_HEADER or len(binary) < start + length:
        raise LoadError("native container has a malformed header")
    arch, native_size, portable_size = _header(binary[start:start + length])
    body = start + length
    if len(binary) != body + native_size + portable_size:
        raise LoadError("native container sizes do not add up")
    mid = body + native_size
    return NativeParts(arch=arch, native=binary[body:mid], portable=binary[mid:])


def open_linker(cl_device: cl.Device) -> NativeLinker | None:
    """The seam: a linker for ``cl_device``, or ``None`` where no conversion is possible
    (not NVIDIA, no ``libcuda.so.1``, the driver refuses). Tests replace this."""
    if not device_arch(cl_device):
        return None
    from farm.compilation.cuda import open_cuda_linker

    linker = open_cuda_linker(nv_attribute(cl_device, "PCI_BUS_ID_NV"),
                              nv_attribute(cl_device, "PCI_SLOT_ID_NV"),
                              ordinal=_nvidia_ordinal(cl_device))
    if linker is not None and linker.arch != device_arch(cl_device):
        log.warning("CUDA device is %s but the OpenCL device is %s; storing PTX",
                    linker.arch, device_arch(cl_device))
        return None
    return linker


def _nvidia_ordinal(cl_device: cl.Device) -> int:
    try:
        return list(cl_device.platform.get_devices()).index(cl_device)
    except ValueError:
        return 0


_linkers: dict[int, NativeLinker | None] = {}
_linkers_lock = threading.Lock()


def linker_for(cl_device: cl.Device) -> NativeLinker | None:
    """This process's linker for ``cl_device``, opened on first use and kept.

    Kept per process (keyed by the device's handle) for the same reason a worker keeps
    its context: opening it retains the CUDA primary context, which costs far more than
    a link. Opened lazily, in the process that compiles, never before a fork.
    """
    handle = int(cl_device.int_ptr)
    with _linkers_lock:
        if handle not in _linkers:
            _linkers[handle] = open_linker(cl_device)
        return _linkers[handle]
