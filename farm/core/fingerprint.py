"""A device's identity and fingerprint, with the standard library only.

What :class:`farm.core.device.DeviceInfo` says about a device's identity
(:meth:`~farm.core.device.DeviceInfo.identity`, ``fingerprint``, ``compiles_at_launch``)
is computed here, so that a served application's quick path
(:mod:`farm.programs.quick`) names the namespace of its device without importing
pydantic; ``DeviceInfo`` delegates to these functions, so both always agree.
"""

from __future__ import annotations

import re

from farm.core.hashing import stable_hash

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import pyopencl as cl

_SLUG = re.compile(r"[^a-z0-9]+")


def slug(text: str) -> str:
    """``Intel(R) Xeon(R)`` -> ``intel-r-xeon-r``."""
    return _SLUG.sub("-", text.lower()).strip("-")


def identity_of(platform_name: str, platform_version: str, device_name: str, vendor: str,
                device_version: str, driver_version: str, opencl_c_version: str,
                native_arch: str) -> dict[str, str]:
    """The fields a binary's validity depends on.

    ``native_arch`` joins them only where it is known (NVIDIA), so that a cubin is
    served only to its architecture while every other device keeps the fingerprint
    it always had; the driver version is already here, so a driver upgrade starts a
    new namespace rather than serving code an older driver made.
    """
    identity = {
        "platform_name": platform_name,
        "platform_version": platform_version,
        "device_name": device_name,
        "vendor": vendor,
        "device_version": device_version,
        "driver_version": driver_version,
        "opencl_c_version": opencl_c_version,
    }
    if native_arch:
        identity["native_arch"] = native_arch
    return identity


def fingerprint_of(identity: dict[str, str]) -> str:
    """Readable slug plus a hash of ``identity``; stable from run to run."""
    name = identity["platform_name"]
    platform = "pocl" if "pocl" in name.lower() or "portable" in name.lower() \
        else slug(name)[:16]
    return f"{platform}-{slug(identity['device_name'])[:40]}-{stable_hash(identity, 12)}"


def compiles_at_launch(platform_name: str, device_name: str) -> bool:
    """PoCL's CPU drivers (``pthread``/``basic`` in 3.x, ``cpu``/``cpu-minimal`` in 5.x)
    make a kernel's machine code at its first launch, per local size and grid class:
    its artifacts are made ready for a declared launch (:mod:`farm.compilation.ready`)."""
    return (platform_name == "Portable Computing Language"
            and device_name.startswith(("pthread-", "basic-", "cpu-")))


def device_arch(cl_device: cl.Device) -> str:
    """``sm_XY`` for an NVIDIA device (from ``cl_nv_device_attribute_query``), else ``""``."""
    major, minor = nv_attribute(cl_device, "COMPUTE_CAPABILITY_MAJOR_NV"), \
        nv_attribute(cl_device, "COMPUTE_CAPABILITY_MINOR_NV")
    return f"sm_{major}{minor}" if major is not None and minor is not None else ""


def nv_attribute(cl_device: cl.Device, name: str) -> int | None:
    import pyopencl as cl

    if "cl_nv_device_attribute_query" not in str(getattr(cl_device, "extensions", "")):
        return None
    param = getattr(cl.device_info, name, None)
    if param is None:
        return None
    try:
        return int(cl_device.get_info(param))  # type: ignore[call-overload]
    except (cl.Error, TypeError, ValueError):
        return None


def device_identity(dev: cl.Device) -> dict[str, str]:
    """:func:`identity_of` a pyopencl device, as :func:`farm.core.device.info_from_device`
    reads it."""
    platform = dev.platform
    return identity_of(platform.name.strip(), platform.version.strip(), dev.name.strip(),
                       dev.vendor.strip(), dev.version.strip(), dev.driver_version.strip(),
                       dev.opencl_c_version.strip(), device_arch(dev))
