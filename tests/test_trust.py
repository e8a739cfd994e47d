"""Trust in artifacts (issue 19, items 1 and 2), on the local PoCL device.

* A binary is served only as the kernels its family declares: an artifact under relu's
  key holding gelu's binary (plain, or as a native container's parts) is refused, and
  the kernel is compiled instead.
* The architecture check applies on every device: a PoCL binary records the identity of
  the device it was built for (``poclbin`` header, an FNV-1 hash of the device's build
  hash, which PoCL also reports after ``HSTR:`` in the device version); a binary of
  another identity is refused before the driver parses it.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from farm.compilation.load import load_binary
from farm.compilation.native import pack
from farm.compilation.target import binary_target, device_target
from farm.core.device import DeviceContext, probe_devices, select_device
from farm.core.errors import LoadError
from farm.core.model import Artifact, Lowered
from farm.core.settings import Settings
from farm.store import SQLiteStore
from loader import ArtifactMissing, KernelLoader

UNARY = "elementwise_unary"
X = np.array([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=np.float32)


def settings_for(home: Path, **extra: Any) -> Settings:
    return Settings(home=home, environment="default", records_url=None, device=None,
                    redis_url=None, minio_endpoint=None, workers=0, **extra)


def run_unary(loader: KernelLoader, op: str) -> np.ndarray:
    """``op`` of X on the device, through the loader's kernel."""
    import pyopencl as cl

    kernel = loader.kernel(UNARY, {"op": op})
    mf = cl.mem_flags
    x = cl.Buffer(loader.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=X)
    out = cl.Buffer(loader.context, mf.WRITE_ONLY, X.nbytes)
    kernel(loader.queue, (64,), None, x, out, np.uint32(len(X)))
    got = np.empty_like(X)
    cl.enqueue_copy(loader.queue, got, out)
    loader.queue.finish()
    return got


def gelu_under_relus_key(settings: Settings, wrap: bool = False) -> None:
    """Compile gelu, then store its binary under relu's key (as a store writer could)."""
    with KernelLoader(settings) as loader:
        loader.kernel(UNARY, {"op": "gelu"})
        ns = loader.namespace
        gelu_key = loader.key_of(loader.artifact_id(UNARY, {"op": "gelu"}))
        relu_key = loader.key_of(loader.artifact_id(UNARY, {"op": "relu"}))
    store = SQLiteStore(settings.store_path)
    gelu = store.get(ns, gelu_key)
    assert gelu is not None
    binary = pack("fake_1", gelu.binary, gelu.binary) if wrap else gelu.binary
    store.put(ns, Artifact.create(relu_key, UNARY, binary, gelu.meta.source_hash))
    store.close()


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "native-container"])
def test_another_kernels_binary_under_a_key_is_never_served(tmp_path: Path,
                                                            wrap: bool) -> None:
    """Issue 19 item 2: relu's key holding gelu's binary ran as relu and gave gelu's
    values. Now the declared kernel names are checked at load: a miss, compiled."""
    settings = settings_for(tmp_path / "home")
    gelu_under_relus_key(settings, wrap)
    with KernelLoader(settings, on_miss="fail") as loader, \
            pytest.raises(ArtifactMissing):
        loader.kernel(UNARY, {"op": "relu"})
    with KernelLoader(settings) as loader:
        assert run_unary(loader, "relu").tolist() == [0.0, 0.0, 0.0, 1.0, 2.0]
        assert loader.stats.local == 0 and loader.stats.compiled == 1


def test_the_architecture_check_applies_to_pocl_binaries(tmp_path: Path) -> None:
    """Issue 19 item 2: the check was skipped on every non-NVIDIA device. A PoCL binary
    names its device (header); this device's identity comes from its version string."""
    from farm.compilation.finalize import finalize

    device = select_device(probe_devices())
    ctx, cl_device = DeviceContext(device).get()
    want = device_target(cl_device)
    assert want is not None and want.startswith("pocl:")
    with KernelLoader(settings_for(tmp_path / "home")) as loader:
        family = loader.registry.get(UNARY)
        lowered = family.lower_id(family.artifact_id({"op": "neg"}), device)
    binary = finalize(ctx, cl_device, lowered).binary
    assert binary_target(binary) == want
    assert load_binary(ctx, cl_device, binary, lowered.kernel_names).names == ("unary_neg",)

    (device_id,) = struct.unpack_from("<Q", binary, 8)
    foreign = binary[:8] + struct.pack("<Q", device_id ^ 0x5A5A) + binary[16:]
    with pytest.raises(LoadError, match="is for pocl:"):
        load_binary(ctx, cl_device, foreign, lowered.kernel_names)
    with pytest.raises(LoadError, match="is for an unknown target"):
        load_binary(ctx, cl_device, b"\x00not a pocl binary" * 8, lowered.kernel_names)
    with pytest.raises(LoadError, match=r"lacks kernel\(s\) unary_relu"):
        load_binary(ctx, cl_device, binary, ("unary_relu",))
    two = Lowered(source="__kernel void a(__global float *x) { x[0] = 1.0f; }\n"
                         "__kernel void b(__global float *x) { x[0] = 2.0f; }\n",
                  kernel_names=("a", "b"))
    both = finalize(ctx, cl_device, two).binary
    assert set(load_binary(ctx, cl_device, both, ("a", "b")).names) == {"a", "b"}
    with pytest.raises(LoadError, match=r"holds kernel\(s\) b that the family does not"):
        load_binary(ctx, cl_device, both, ("a",))
