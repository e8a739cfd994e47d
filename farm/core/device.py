"""OpenCL devices, their limits and their fingerprints.

A *fingerprint* names everything that makes a binary invalid elsewhere: platform name
and version, device name and vendor, driver version, OpenCL C version and (for PoCL,
whose device version names the LLVM target CPU) the target. It reads as a slug and is
made unique by a hash of those fields, e.g. ``pocl-pthread-intel-r-xeon-r-processor-1a2b3c4d5e6f``.

OpenCL state never crosses a fork: :func:`discover_devices` asks a short-lived child
interpreter (``farm.core.device._main``) so that the calling process, which may later fork a
worker pool, never initialises a driver. :func:`probe_devices` is the in-process probe
for processes that will hold a context anyway.

Which device the farm uses (:func:`select_device`; docs/DESIGN.md "Which device"): never
one whose compiler fails a trivial build (:mod:`farm.core.device_probe` finds out, once
per fingerprint); of the others, ``FARM_DEVICE``'s match, else the first in
:func:`preference` order.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, TypeAdapter

from farm.core.errors import DeviceChoiceError, DeviceError, InputError, printable
from farm.core.fingerprint import (
    compiles_at_launch,
    device_identity,
    fingerprint_of,
    identity_of,
)

if TYPE_CHECKING:
    import pyopencl as cl

log = logging.getLogger(__name__)


class DeviceInfo(BaseModel):
    """One OpenCL device as the farm sees it: identity and the limits ``lower`` checks.

    Identity: ``platform_index``/``device_index`` (its place in OpenCL's lists here),
    ``platform_name``, ``platform_version``, ``device_name``, ``vendor``,
    ``device_version``, ``opencl_c_version``, ``driver_version``, and ``native_arch`` (the
    machine-code architecture where native code is stored, e.g. ``sm_90``; else "").
    Limits: ``max_work_group_size``, ``max_work_item_sizes`` (per dimension),
    ``local_mem_size`` and ``global_mem_size`` (bytes), ``max_compute_units``,
    ``extensions`` (``has_fp16``, ``has_fp64`` read them). docs/PLUGINS.md has the table
    a family author reads."""

    model_config = ConfigDict(frozen=True)

    platform_index: int
    device_index: int
    platform_name: str
    platform_version: str
    device_name: str
    vendor: str
    device_version: str
    driver_version: str
    opencl_c_version: str
    max_work_group_size: int
    max_work_item_sizes: tuple[int, ...]
    local_mem_size: int
    global_mem_size: int
    max_compute_units: int
    extensions: tuple[str, ...]
    #: the machine-code architecture where the farm stores native code (``sm_90`` on an
    #: H200), else "" (see :mod:`farm.compilation.native`)
    native_arch: str = ""

    @property
    def has_fp16(self) -> bool:
        return "cl_khr_fp16" in self.extensions

    @property
    def has_fp64(self) -> bool:
        return "cl_khr_fp64" in self.extensions

    @property
    def compiles_at_launch(self) -> bool:
        """:func:`farm.core.fingerprint.compiles_at_launch` (PoCL's CPU drivers)."""
        return compiles_at_launch(self.platform_name, self.device_name)

    def identity(self) -> dict[str, str]:
        """The fields a binary's validity depends on (:func:`farm.core.fingerprint.
        identity_of`)."""
        return identity_of(self.platform_name, self.platform_version, self.device_name,
                           self.vendor, self.device_version, self.driver_version,
                           self.opencl_c_version, self.native_arch)

    @property
    def fingerprint(self) -> str:
        """Readable slug plus a hash of :meth:`identity`; stable from run to run."""
        return fingerprint_of(self.identity())


def info_from_device(platform_index: int, device_index: int, dev: cl.Device) -> DeviceInfo:
    """Read a pyopencl device's identity and limits."""
    return DeviceInfo(
        platform_index=platform_index,
        device_index=device_index,
        **device_identity(dev),
        max_work_group_size=int(dev.max_work_group_size),
        max_work_item_sizes=tuple(int(x) for x in dev.max_work_item_sizes),
        local_mem_size=int(dev.local_mem_size),
        global_mem_size=int(dev.global_mem_size),
        max_compute_units=int(dev.max_compute_units),
        extensions=tuple(sorted(dev.extensions.split())),
    )


def probe_devices() -> list[DeviceInfo]:
    """List devices in this process (initialises the OpenCL drivers here)."""
    import pyopencl as cl

    found: list[DeviceInfo] = []
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # the ICD loader raises when no platform is installed
        return found
    for pi, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:
            continue
        for di, dev in enumerate(devices):
            found.append(info_from_device(pi, di, dev))
    return found


_DEVICES = TypeAdapter(list[DeviceInfo])


def discover_devices(timeout_s: float = 120.0) -> list[DeviceInfo]:
    """List devices from a child process, leaving this process free of OpenCL state."""
    try:
        proc = subprocess.run([sys.executable, "-c", "from farm.core.device import _main; _main()"],
                              capture_output=True,
                              text=True, timeout=timeout_s, env=os.environ.copy(), check=False)
    except subprocess.TimeoutExpired as exc:
        raise DeviceError(f"device discovery did not answer within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DeviceError(f"device discovery failed: {last}")
    return _DEVICES.validate_json(proc.stdout)


class ProbeResult(BaseModel):
    """Whether a device's compiler builds a trivial program (:mod:`farm.core.device_probe`).

    ``reason``: why not, in one line (the compiler's first error line, or how the probe
    failed); ``fresh``: probed by this process rather than read from the cache (what is
    said once, when it is learnt)."""

    model_config = ConfigDict(frozen=True)

    usable: bool
    reason: str = ""
    fresh: bool = False


#: what to install when no device compiles (what scripts/bootstrap installs)
INSTALL_HINT = ("install an OpenCL driver that compiles here, e.g. Debian's PoCL for the "
                "CPU (apt-get install pocl-opencl-icd; scripts/bootstrap does)")


def platform_label(dev: DeviceInfo) -> str:
    """The platform's name and version as people say it: ``PoCL 3.0-rc2``, ``CUDA 12.8``
    (its version string without the OpenCL version before and the build flags after)."""
    text = re.sub(r"^OpenCL\s+\d+(\.\d+)*\s*", "", " ".join(dev.platform_version.split()))
    return (text.split(",")[0].removesuffix(" Linux").strip() or dev.platform_name)[:40]


def _version(dev: DeviceInfo) -> tuple[int, ...]:
    found = re.search(r"\d+(\.\d+)*", platform_label(dev))
    return tuple(int(x) for x in found.group().split(".")) if found else ()


def preference(devices: list[DeviceInfo],
               probes: Mapping[str, ProbeResult] | None = None) -> list[DeviceInfo]:
    """``devices`` in the order the farm prefers them: those whose compiler works first
    (``probes``; a device not probed counts as working); then OpenCL's listing order,
    except that of two platforms of the same name (the PoCL of pyopencl's wheel and the
    system's), the newer version comes first. Deterministic for a given machine."""
    first_seen: dict[str, int] = {}
    for i, d in enumerate(devices):
        first_seen.setdefault(d.platform_name, i)

    def key(d: DeviceInfo) -> tuple[bool, int, tuple[int, ...], int, int]:
        return (not usable(d, probes), first_seen[d.platform_name],
                tuple(-x for x in _version(d)), d.platform_index, d.device_index)

    return sorted(devices, key=key)


def usable(dev: DeviceInfo, probes: Mapping[str, ProbeResult] | None) -> bool:
    """Whether ``dev``'s compiler works, as far as ``probes`` say (unprobed: yes)."""
    probe = (probes or {}).get(dev.fingerprint)
    return probe is None or probe.usable


def cannot_compile(dev: DeviceInfo, probes: Mapping[str, ProbeResult] | None) -> str:
    """``dev`` and why its compiler fails, for one line."""
    probe = (probes or {}).get(dev.fingerprint)
    why = probe.reason if probe is not None else "not probed"
    return f"{dev.fingerprint} ({platform_label(dev)}): {printable(why, 300)}"


def select_device(devices: list[DeviceInfo], selector: str | None = None,
                  probes: Mapping[str, ProbeResult] | None = None) -> DeviceInfo:
    """The device to use: the first usable one in :func:`preference` order, or, with a
    ``selector`` (``FARM_DEVICE``, ``--device``: a whole fingerprint, its start, or part
    of the device's name), the first usable one it matches, naming the choice in a
    warning when it matches devices of several fingerprints.

    Raises :class:`DeviceChoiceError` (exit 2) when the selector matches nothing, and
    :class:`DeviceError` when no device that would be chosen can compile, naming each
    and its compiler's reason in one line."""
    if not devices:
        raise DeviceError(f"no OpenCL device found: {INSTALL_HINT}")
    ordered = preference(devices, probes)
    candidates = ordered
    if selector:
        exact = [d for d in ordered if d.fingerprint == selector]
        candidates = exact or [d for d in ordered if d.fingerprint.startswith(selector)
                               or selector.lower() in d.device_name.lower()]
        if not candidates:
            known = ", ".join(dict.fromkeys(d.fingerprint for d in devices))
            raise DeviceChoiceError(
                f"device {printable(selector, 100)!r} (FARM_DEVICE or --device) matches no "
                f"device here; devices here: {known}")
    chosen = next((d for d in candidates if usable(d, probes)), None)
    if chosen is None:
        broken = "; ".join(dict.fromkeys(cannot_compile(d, probes) for d in candidates))
        what = f"no device matching {printable(selector, 100)!r}" if selector \
            else "no OpenCL device here"
        raise DeviceError(f"{what} can compile: {broken}; {INSTALL_HINT}")
    fingerprints = list(dict.fromkeys(d.fingerprint for d in candidates))
    if selector and len(fingerprints) > 1:
        log.warning("device %r matches %d devices (%s): using %s, the first that compiles "
                    "in the farm's order (newest first); give more of a fingerprint to "
                    "choose another", printable(selector, 100), len(fingerprints),
                    ", ".join(fingerprints), chosen.fingerprint)
    return chosen


def resolve_fingerprint(text: str, known: Iterable[str]) -> str:
    """``text`` as a whole fingerprint: itself when it is one of ``known``, else the one
    fingerprint of ``known`` it is a prefix of (as ``FARM_DEVICE`` takes it), so people
    can type the first characters of what ``farm devices`` or ``farm workers`` print.
    Text that starts none of them comes back as it is, for the caller to say what is
    known; a prefix of several is an error naming them."""
    known = sorted(set(known))
    if text in known:
        return text
    matches = [fp for fp in known if fp.startswith(text)]
    if len(matches) > 1:
        raise InputError(f"fingerprint {text!r} is the start of {len(matches)} "
                         f"fingerprints ({', '.join(matches)}): give more of it")
    return matches[0] if matches else text


def open_device(info: DeviceInfo) -> tuple[cl.Context, cl.Device]:
    """Create a context on the device ``info`` describes (verifying its fingerprint).

    Its indices are a hint, tried first: the device is the one whose fingerprint is
    ``info``'s, wherever this process lists it (an application's device, described by a
    served process that never knew its indices, is not always platform 0, device 0: on
    a host with NVIDIA and PoCL a proof's child opened the GPU for a PoCL binary)."""
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise DeviceError(f"device {info.fingerprint} is not present here") from exc
    found = ""
    hint = (info.platform_index, info.device_index)
    places = [hint, *((p, d) for p, platform in enumerate(platforms)
                      for d in range(_device_count(platform)) if (p, d) != hint)]
    for p, d in places:
        try:
            dev = platforms[p].get_devices()[d]
        except (IndexError, cl.Error):
            continue
        here = info_from_device(p, d, dev)
        if here.fingerprint == info.fingerprint:
            return _create_context(dev), dev
        found = found or here.fingerprint
    if found:
        raise DeviceError(f"device changed: expected {info.fingerprint}, found {found}")
    raise DeviceError(f"device {info.fingerprint} is not present here")


def _device_count(platform: cl.Platform) -> int:
    import pyopencl as cl

    try:
        return len(platform.get_devices())
    except cl.Error:
        return 0


def _create_context(dev: cl.Device) -> cl.Context:
    """A context on ``dev``, made with the GIL released.

    pyopencl holds the GIL inside ``clCreateContext``, which takes 1.5 to 2.4 s on an
    H200: measured, a thread creating the context let the other threads of its process
    run about 12 thousand Python loop turns a second instead of millions. Calling the same
    ICD loader through ctypes (which releases the GIL) and handing the handle to pyopencl
    lets a loader read and verify its artifacts while the driver works. Anything
    unexpected falls back to pyopencl's own call, which also reports errors properly.
    """
    import pyopencl as cl

    lib = _opencl_loader()
    if lib is not None:
        try:
            create = lib.clCreateContext
            create.restype = ctypes.c_void_p
            create.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
            status = ctypes.c_int32(0)
            devices = (ctypes.c_void_p * 1)(dev.int_ptr)
            handle = create(None, 1, devices, None, None, ctypes.byref(status))
            if status.value == 0 and handle:
                return cl.Context.from_int_ptr(handle, retain=False)
        except (AttributeError, OSError, cl.Error):
            pass
    return cl.Context([dev])


def _opencl_loader() -> ctypes.CDLL | None:
    """The OpenCL ICD loader this process already uses (the one pyopencl links), or None.

    Found in the process's own memory map, so it is the very library pyopencl calls,
    whether a wheel bundles it or the system provides it; never a second copy.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libOpenCL" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if path.startswith("/"):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


class DeviceContext:
    """A device's OpenCL context, created on first use and at most once (thread-safe).

    Why lazy: creating a context costs up to seconds (2.4 s seen on an H200), and a
    ``farm build`` whose kernels are all stored needs none: it verifies digests and stops.
    :meth:`start` begins the creation on a thread for a caller that will surely need the
    context (a loader), so it overlaps the store reads instead of preceding them.
    """

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self._lock = threading.Lock()
        self._opened: tuple[cl.Context, cl.Device] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> DeviceContext:
        """Begin creating the context on a background thread; returns ``self``."""
        with self._lock:
            if self._opened is None and self._thread is None:
                self._thread = threading.Thread(target=self._open_quietly,
                                                name="farm-open-device", daemon=True)
                self._thread.start()
        return self

    def _open_quietly(self) -> None:
        try:
            self.get()
        except BaseException as exc:  # handed to whoever calls get()
            self._error = exc

    def get(self) -> tuple[cl.Context, cl.Device]:
        """The (context, device), creating them now if nobody has."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            if self._error is not None:
                raise self._error
        with self._lock:
            if self._opened is None:
                self._opened = open_device(self.info)
            return self._opened

    @property
    def ctx(self) -> cl.Context:
        """The context (made now if it is not yet)."""
        return self.get()[0]

    @property
    def cl_device(self) -> cl.Device:
        """The pyopencl device the context is on (made now if it is not yet)."""
        return self.get()[1]

    @property
    def opened(self) -> bool:
        """Whether the context exists (for tests and start-up measurements)."""
        return self._opened is not None


def _main() -> None:
    print(json.dumps([d.model_dump(mode="json") for d in probe_devices()]))


if __name__ == "__main__":
    _main()
