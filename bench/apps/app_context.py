"""The OpenCL context of a benchmark application: ``argv[1]`` (optional) names the device
(a substring of its name, vendor or platform), default the first listed. One helper for
the applications of this folder, each a script run as a user runs one."""

import sys

import pyopencl as cl


def device(want: str) -> cl.Device:
    for platform in cl.get_platforms():
        for dev in platform.get_devices():
            if not want or want.lower() in f"{platform.name} {platform.vendor} {dev.name}".lower():
                return dev
    raise SystemExit(f"no OpenCL device matches {want!r}")


def context_from_argv() -> cl.Context:
    """A context on the device ``argv[1]`` names."""
    return cl.Context([device(sys.argv[1] if len(sys.argv) > 1 else "")])
