"""A process opens the device a :class:`~farm.core.device.DeviceInfo` describes by its
fingerprint; its indices are only a hint. A served application describes its device
without knowing where it is listed (``info_from_device(0, 0, dev)``), and on the H200
host (NVIDIA listed first, PoCL second) a proof's child opened the GPU for a PoCL
binary, so a node prepared from a capture refused every stored program as unproven
(found by ``bench/bench_pyopencl_app.py --capture-row`` on PoCL 5 there).
"""

from __future__ import annotations

import pyopencl as cl
import pytest

from farm.core.device import info_from_device, open_device
from farm.core.errors import DeviceError


def _every_device() -> list[tuple[int, int, cl.Device]]:
    return [(p, d, dev) for p, platform in enumerate(cl.get_platforms())
            for d, dev in enumerate(platform.get_devices())]


def test_a_wrong_hint_still_opens_the_device_of_that_fingerprint() -> None:
    listed = _every_device()
    assert listed, "no OpenCL device here"
    for p, d, dev in listed:
        info = info_from_device(p, d, dev)
        for wrong in [(99, 0), (p, 99), *((q, e) for q, e, _ in listed if (q, e) != (p, d))]:
            moved = info.model_copy(update={"platform_index": wrong[0],
                                            "device_index": wrong[1]})
            ctx, opened = open_device(moved)
            assert info_from_device(p, d, opened).fingerprint == info.fingerprint
            assert ctx.devices[0].int_ptr == opened.int_ptr


def test_a_device_not_listed_here_is_a_device_error() -> None:
    p, d, dev = _every_device()[0]
    info = info_from_device(p, d, dev).model_copy(update={"device_name": "no such device"})
    with pytest.raises(DeviceError, match=r"device changed: expected .*no-such-device"):
        open_device(info)
