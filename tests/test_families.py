"""The built-in kernel families against numpy, on the real OpenCL device (PoCL here).

Every registered family is lowered, compiled with pyopencl and run on its example; the
device's refusals (fp16, work-group size, local memory) must be ``UnsupportedFeature``,
malformed parameters a ``ParameterError`` naming the field, and kernel ids stable.
Compiling dominates the run time (about a second a kernel on two cores), so each case
is small and the number of compiled kernels is kept to about twenty.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyopencl as cl
import pytest

from farm.core.device import DeviceInfo, open_device, probe_devices, select_device
from farm.core.errors import ParameterError, UnsupportedFeature
from farm.core.model import LaunchSettings
from farm.families.registry import Registry
from farm.families.run import check_example, run_example

#: (family, params): small shapes, and shape parameters that are deliberately not
#: multiples of the work-group or tile sizes, so the bounds guards are exercised
CASES: list[tuple[str, dict[str, Any]]] = [
    ("elementwise_binary", {"op": "mul", "width": 4}),
    ("elementwise_unary", {"op": "gelu"}),
    ("elementwise_unary", {"op": "silu", "width": 4}),
    ("elementwise_unary", {"op": "sqrt", "width": 2, "dtype": "double"}),
    ("reduce", {"op": "sum", "cols": 100, "group_size": 32}),
    ("reduce", {"op": "max", "cols": 100}),
    ("reduce", {"op": "mean", "cols": 100, "group_size": 16, "dtype": "double"}),
    ("softmax", {"cols": 100, "group_size": 32}),
    ("rmsnorm", {"hidden": 100, "group_size": 32}),
    ("matmul", {"m": 37, "n": 45, "k": 29}),
    ("matmul", {"m": 37, "n": 45, "k": 29, "tile_m": 32, "tile_n": 16, "tile_k": 8,
                "wpt_m": 4, "wpt_n": 2}),
    ("transpose", {"rows": 37, "cols": 45, "tile": 8}),
    ("rotary", {"head_dim": 16, "heads": 3}),
    ("attention", {"head_dim": 16, "group_size": 16}),
    ("attention", {"head_dim": 24, "causal": False, "group_size": 8}),
    ("swiglu", {"hidden": 96, "width": 4}),
    ("swiglu", {"hidden": 100}),
]


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, params = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in params.items())


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load()


@pytest.fixture(scope="module")
def device() -> DeviceInfo:
    return select_device(probe_devices())  # the device the farm uses


@pytest.fixture(scope="module")
def queue(device: DeviceInfo) -> Iterator[cl.CommandQueue]:
    """One context for the module: creating one per test would cost more than the tests."""
    ctx, _ = open_device(device)
    yield cl.CommandQueue(ctx)


@pytest.fixture(scope="module")
def no_fp16(device: DeviceInfo) -> DeviceInfo:
    """The device as it is here, asserted to lack fp16 (so half is refused)."""
    assert not device.has_fp16, "this test suite expects a device without cl_khr_fp16"
    return device


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_family_matches_numpy(registry: Registry, device: DeviceInfo,
                              queue: cl.CommandQueue,
                              case: tuple[str, dict[str, Any]]) -> None:
    name, params = case
    family = registry.get(name)
    lowered = family.lower_id(family.artifact_id(params), device)
    program = cl.Program(queue.context, lowered.source).build(options=list(lowered.options))
    example = family.example(family.validate(params), LaunchSettings(),
                             np.random.default_rng(1234))
    assert example.kernel_name in lowered.kernel_names
    outputs = run_example(queue, cl.Kernel(program, example.kernel_name), example)
    assert check_example(outputs, example) == []


def test_launch_local_size_is_compiled_in(registry: Registry, device: DeviceInfo,
                                         queue: cl.CommandQueue) -> None:
    """A launch that fixes the work-group: the global size is rounded up to it, so the
    kernel's bounds guard must hold off the surplus work-items."""
    family = registry.get("rotary")
    params, launch = {"head_dim": 16, "heads": 3}, LaunchSettings(local_size=(64,))
    lowered = family.lower_id(family.artifact_id(params, launch), device)
    assert "reqd_work_group_size(64, 1, 1)" in lowered.source
    program = cl.Program(queue.context, lowered.source).build(options=list(lowered.options))
    example = family.example(family.validate(params), launch, np.random.default_rng(7))
    assert example.global_size[0] % 64 == 0
    outputs = run_example(queue, cl.Kernel(program, example.kernel_name), example)
    assert check_example(outputs, example) == []


def test_cases_cover_every_family(registry: Registry) -> None:
    assert len(registry) >= 8
    assert {name for name, _ in CASES} == set(registry.names())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_half_is_unsupported_without_fp16(registry: Registry, no_fp16: DeviceInfo,
                                          case: tuple[str, dict[str, Any]]) -> None:
    name, params = case
    family = registry.get(name)
    with pytest.raises(UnsupportedFeature, match="cl_khr_fp16"):
        family.lower_id(family.artifact_id({**params, "dtype": "half"}), no_fp16)


def test_half_lowers_with_fp16(registry: Registry, device: DeviceInfo) -> None:
    """On a device with fp16 every family expands half (enabling the extension)."""
    with_fp16 = device.model_copy(update={"extensions": (*device.extensions, "cl_khr_fp16")})
    for name, params in CASES:
        family = registry.get(name)
        lowered = family.lower_id(family.artifact_id({**params, "dtype": "half"}), with_fp16)
        assert "cl_khr_fp16 : enable" in lowered.source


def test_double_is_unsupported_without_fp64(registry: Registry, device: DeviceInfo) -> None:
    no_fp64 = device.model_copy(
        update={"extensions": tuple(e for e in device.extensions if e != "cl_khr_fp64")})
    family = registry.get("softmax")
    with pytest.raises(UnsupportedFeature, match="cl_khr_fp64"):
        family.lower_id(family.artifact_id({"cols": 100, "dtype": "double"}), no_fp64)


def test_matmul_work_group_beyond_device_is_unsupported(registry: Registry,
                                                        device: DeviceInfo) -> None:
    family = registry.get("matmul")
    params = {"m": 256, "n": 256, "k": 256, "tile_m": 128, "tile_n": 128}  # 16384 items
    assert 128 * 128 > device.max_work_group_size
    with pytest.raises(UnsupportedFeature, match="work-group size 16384"):
        family.lower_id(family.artifact_id(params), device)


def test_group_size_beyond_device_is_unsupported(registry: Registry,
                                                 device: DeviceInfo) -> None:
    small = device.model_copy(update={"max_work_group_size": 256})
    family = registry.get("reduce")
    with pytest.raises(UnsupportedFeature, match="work-group size 1024"):
        family.lower_id(family.artifact_id({"op": "sum", "cols": 10, "group_size": 1024}),
                        small)


def test_local_memory_beyond_device_is_unsupported(registry: Registry,
                                                   device: DeviceInfo) -> None:
    """No config within the documented ranges needs more than PoCL's 2 MiB of local
    memory, so the device is a GPU-sized (32 KiB) copy of this one."""
    small = device.model_copy(update={"local_mem_size": 32 * 1024})
    family = registry.get("matmul")
    big = {"m": 64, "n": 64, "k": 64, "tile_m": 64, "tile_n": 64, "tile_k": 64,
           "wpt_m": 4, "wpt_n": 4, "dtype": "double"}  # (64*64 + 64*64) * 8 = 64 KiB
    with pytest.raises(UnsupportedFeature, match="local memory"):
        family.lower_id(family.artifact_id(big), small)
    family.lower_id(family.artifact_id({**big, "dtype": "float", "tile_k": 16}), small)


@pytest.mark.parametrize(("name", "params", "field"), [
    ("matmul", {"m": 8, "n": 8, "k": 8, "tile_m": 4, "wpt_m": 8}, "wpt_m"),
    ("matmul", {"m": 8, "n": 8, "k": 8, "tile_n": 24}, "tile_n"),
    ("matmul", {"m": 0, "n": 8, "k": 8}, "m"),
    ("matmul", {"m": 8, "n": 8}, "k"),
    ("reduce", {"op": "sum", "cols": 100, "group_size": 48}, "group_size"),
    ("reduce", {"op": "median", "cols": 100}, "op"),
    ("softmax", {"cols": 100, "colour": "red"}, "colour"),
    ("rmsnorm", {"hidden": 100, "eps": -1.0}, "eps"),
    ("rotary", {"head_dim": 15, "heads": 2}, "head_dim"),
    ("transpose", {"rows": 4, "cols": 4, "tile": 64}, "tile"),
    ("swiglu", {"hidden": 98, "width": 4}, "width"),
    ("elementwise_unary", {"op": "relu", "width": 3}, "width"),
    ("attention", {"head_dim": 64, "dtype": "bfloat16"}, "dtype"),
])
def test_bad_params_name_the_field(registry: Registry, name: str, params: dict[str, Any],
                                   field: str) -> None:
    with pytest.raises(ParameterError, match=rf"parameter {field}\b"):
        registry.get(name).kernel_id(params)


def test_launch_shape_must_match_fixed_work_group(registry: Registry,
                                                  device: DeviceInfo) -> None:
    family = registry.get("matmul")
    params = {"m": 8, "n": 8, "k": 8, "wpt_m": 2}  # work-group (8, 16)
    family.lower_id(family.artifact_id(params, LaunchSettings(local_size=(8, 16))), device)
    with pytest.raises(ParameterError, match="local_size"):
        family.lower_id(family.artifact_id(params, LaunchSettings(local_size=(16, 16))),
                        device)


def test_kernel_ids_are_stable(registry: Registry) -> None:
    family = registry.get("matmul")
    one = family.kernel_id({"m": 37, "n": 45, "k": 29, "tile_k": 8, "dtype": "float"})
    other = family.kernel_id({"dtype": "float", "tile_k": 8, "k": 29, "n": 45, "m": 37})
    spelled_out = family.kernel_id({"m": 37, "n": 45, "k": 29, "tile_m": 16, "tile_n": 16,
                                    "tile_k": 8, "wpt_m": 1, "wpt_n": 1, "dtype": "float"})
    assert one.id_hash == other.id_hash == spelled_out.id_hash
    assert one.params == {"m": 37, "n": 45, "k": 29, "tile_m": 16, "tile_n": 16,
                          "tile_k": 8, "wpt_m": 1, "wpt_n": 1, "dtype": "float"}
    assert family.kernel_id({"m": 37, "n": 45, "k": 30}).id_hash != one.id_hash
    # floats too: 1e-6 and 0.000001 are one eps
    rms = registry.get("rmsnorm")
    assert rms.kernel_id({"hidden": 64, "eps": 1e-6}).id_hash == \
        rms.kernel_id({"eps": 0.000001, "hidden": 64}).id_hash == \
        rms.kernel_id({"hidden": 64}).id_hash


def test_each_built_in_family_has_its_own_build_id(registry: Registry) -> None:
    """A built-in family's build id hashes its module and the farm modules it imports
    (issue 32: one fix to softmax must not rekey every matmul), so the ten differ; each
    is a hex id of fixed length."""
    ids = {family.name: family.build_id for family in registry}
    assert len(set(ids.values())) == len(ids) == 10
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids.values())


