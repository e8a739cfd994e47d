"""Which device a binary says it is for, and which one a device is: the architecture check.

The namespace keeps a binary away from other devices in the store; this check is the
last line at load, on every device whose binaries say what they are for, because a store
writer, a bundle or a copy between prefixes can put any bytes under any key:

* **PoCL** writes a ``poclbin`` header: 8 bytes of magic, then the *device id*, an FNV-1
  hash (multiply, then xor, per byte) of the device's *build hash* (the LLVM target and
  CPU, e.g. ``pthread-x86_64-unknown-linux-gnu-rocketlake``). PoCL reports the same build
  hash after ``HSTR:`` in ``CL_DEVICE_VERSION``, so the device's identity is known
  without compiling anything (``lib/CL/pocl_binary.c``, ``clGetDeviceInfo.c``). A binary
  that is not a ``poclbin`` is refused on PoCL: the farm stores nothing else there, and
  PoCL's own parser trusts the bytes it reads (a truncated binary crashes it).
* **NVIDIA**'s binary is PTX, whose ``.target sm_XY`` line names the architecture; the
  device's is its compute capability (:func:`farm.core.fingerprint.device_arch`). A
  cubin (a native container's machine code) is checked by the container's header.
* Other devices: their binaries are opaque here (``None``), and the driver decides.

Targets read ``pocl:<device id, 16 hex digits>`` and ``nvidia:sm_XY``.
"""

from __future__ import annotations

import re
import struct
import threading
from typing import TYPE_CHECKING

from farm.core.errors import LoadError

if TYPE_CHECKING:
    import pyopencl as cl

POCL_MAGIC = b"poclbin\x00"
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
_HSTR = re.compile(r"HSTR:\s*(\S+)")
#: PTX starts with comments and ``.version``; the target comes within the first lines
_PTX_TARGET = re.compile(rb"^\s*\.target\s+sm_(\d+)", re.MULTILINE)
_PTX_HEAD = 4096


def pocl_device_id(build_hash: str) -> int:
    """PoCL's ``pocl_binary_get_device_id``: FNV-1 over the build hash's bytes (as C
    ``char``, so a byte over 127 is sign-extended before the xor)."""
    result = _FNV_OFFSET
    for byte in build_hash.encode("utf-8", "surrogateescape"):
        result = (result * _FNV_PRIME) & _MASK
        result ^= (byte - 256) & _MASK if byte > 127 else byte
    return result


def binary_target(binary: bytes) -> str | None:
    """What ``binary`` says it is for, or ``None`` when its format does not say."""
    if binary.startswith(POCL_MAGIC):
        if len(binary) < len(POCL_MAGIC) + 8:
            return "pocl:truncated"
        (device_id,) = struct.unpack_from("<Q", binary, len(POCL_MAGIC))
        return f"pocl:{device_id:016x}"
    found = _PTX_TARGET.search(binary[:_PTX_HEAD])
    if found is not None:
        return f"nvidia:sm_{int(found.group(1))}"
    return None


def target_of_device(version: str, native_arch: str) -> str | None:
    """The target of a device from its ``CL_DEVICE_VERSION`` and native architecture."""
    if native_arch.startswith("sm_"):
        return f"nvidia:sm_{int(native_arch[3:])}"
    found = _HSTR.search(version)
    if found is not None:
        return f"pocl:{pocl_device_id(found.group(1)):016x}"
    return None


_targets: dict[int, str | None] = {}
_targets_lock = threading.Lock()


def device_target(cl_device: cl.Device) -> str | None:
    """The target of ``cl_device`` (kept per device handle: asked on every load)."""
    handle = int(cl_device.int_ptr)
    with _targets_lock:
        if handle in _targets:
            return _targets[handle]
    from farm.core.fingerprint import device_arch

    try:
        version = str(cl_device.version)
    except Exception:  # a driver that will not say: nothing to check against
        version = ""
    found = target_of_device(version, device_arch(cl_device))
    with _targets_lock:
        _targets[handle] = found
    return found


def check_target(binary: bytes, cl_device: cl.Device) -> None:
    """Raise :class:`LoadError` when ``binary`` is for another device than ``cl_device``.

    Refused: a binary whose recorded target differs from the device's, and on PoCL one
    that records none (not a ``poclbin``). Allowed: any binary on a device whose target
    is unknown, and an unreadable format on NVIDIA (a cubin: its container's header
    names its architecture, checked by the caller)."""
    want = device_target(cl_device)
    if want is None:
        return
    got = binary_target(binary)
    if got == want or (got is None and not want.startswith("pocl:")):
        return
    raise LoadError(f"the binary is for {got or 'an unknown target'}, the device is {want}")
