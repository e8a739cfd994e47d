"""On an NVIDIA GPU host: stored kernels are cubins, and a fresh process loads them all
without any compiler or JIT and computes the right results.

Marked ``gpu``: the README's test command deselects it (``-m "not gpu"``), because CI has
no GPU. Run it on a GPU host with ``pytest -m gpu tests/test_nvidia.py``; there it fails
(never skips) when no NVIDIA OpenCL device is present.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from farm.compilation.native import unpack

pytestmark = pytest.mark.gpu

# Runs in a fresh process: warm the manifest with the compiler forbidden (on_miss="fail",
# and finalize replaced by a function that fails the test), then run every kernel of it
# against numpy.
WARM_AND_RUN = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import farm.compilation.finalize
    def forbidden(*a, **k):
        raise SystemExit("the compiler was called in the loading process")
    farm.compilation.finalize.finalize = forbidden
    from farm.core.errors import UnsupportedFeature
    from farm.families.run import check_example, run_example
    from loader import KernelLoader
    from loader.warming import artifacts_of
    t0 = time.perf_counter()
    with KernelLoader(on_miss="fail", label="gpu test") as loader:
        artifacts = []
        for art in artifacts_of(sys.argv[1], loader)[0]:
            try:  # lowering only checks the device's limits; the build skipped these
                loader.registry.get(art.kernel.family).lower_id(art, loader.device)
            except UnsupportedFeature:
                continue
            artifacts.append(art)
        report = loader.warm(artifacts)
        problems = []
        rng = np.random.default_rng(3)
        ran = 0
        for art in artifacts:
            family = loader.registry.get(art.kernel.family)
            example = family.example(family.validate(art.kernel.params), art.kernel.launch, rng)
            kernel = loader.kernel_for(art, name=example.kernel_name)
            bad = check_example(run_example(loader.queue, kernel, example), example)
            problems += [f"{art.kernel.label()}: {p}" for p in bad]
            ran += 1
        print(json.dumps({"summary": report.summary(), "stats": loader.stats.snapshot(),
                          "ran": ran, "problems": problems,
                          "arch": loader.device.native_arch,
                          "end_to_end_s": time.perf_counter() - t0}))
""")


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "FARM_HOME": str(home), "FARM_DEVICE": os.environ.get(
        "FARM_DEVICE", "nvidia"), "CUDA_CACHE_DISABLE": "1", "PYOPENCL_NO_CACHE": "1"}


def test_build_stores_cubins_and_a_fresh_process_loads_them_without_a_jit(
        tmp_path: Path) -> None:
    env = _env(tmp_path)
    built = subprocess.run([sys.executable, "-m", "farm", "build", "tiny", "--workers", "2",
                            "--json"], capture_output=True, text=True, env=env, check=False)
    assert built.returncode == 0, built.stderr + built.stdout
    summary = json.loads(built.stdout)["summary"]
    print("build:", json.dumps(summary))
    assert summary["compiled"] > 0 and summary["failed"] == 0

    stores = list(tmp_path.glob("envs/*/store.sqlite"))
    assert len(stores) == 1
    with sqlite3.connect(stores[0]) as conn:
        binaries = [row[0] for row in conn.execute("SELECT binary FROM artifacts")]
    assert binaries, "the build stored nothing"
    arches = set()
    for binary in binaries:
        parts = unpack(binary)
        assert parts is not None, "an artifact is plain PTX, not a native container"
        assert parts.native.startswith(b"\x7fELF"), "the native part is not an ELF cubin"
        assert b".version" in parts.portable[:4096], "the portable part is not PTX"
        arches.add(parts.arch)
    assert len(arches) == 1 and next(iter(arches)).startswith("sm_")

    warmed = subprocess.run([sys.executable, "-c", WARM_AND_RUN, "tiny"], capture_output=True,
                            text=True, env=env, check=False)
    assert warmed.returncode == 0, warmed.stderr + warmed.stdout
    result = json.loads(warmed.stdout.strip().splitlines()[-1])
    print("warm:", json.dumps(result))
    assert result["arch"] == next(iter(arches))
    assert result["problems"] == []
    assert result["ran"] == summary["kernels"] - summary["unsupported"]
    assert result["summary"]["failed"] == 0
    assert result["stats"]["native_fallbacks"] == 0
    assert result["stats"]["compiler_invocations"] == 0
    assert result["stats"]["local"] == result["summary"]["local"] > 0


def test_the_linkers_cheaper_build_returns_the_same_ptx_as_a_plain_build() -> None:
    """The build options a native linker adds (``-cl-nv-opt-level=0``) must leave the PTX
    byte for byte as a plain build makes it: the PTX is what a loader falls back to."""
    from farm.compilation.finalize import finalize, finalize_and_validate
    from farm.compilation.native import linker_for
    from farm.core.device import DeviceContext, probe_devices, select_device
    from farm.families import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest

    device = select_device(probe_devices(), os.environ.get("FARM_DEVICE", "nvidia"))
    ctx, cl_device = DeviceContext(device).get()
    linker = linker_for(cl_device)
    assert linker is not None and linker.build_options, "no native linker on this device"
    registry = Registry.load([])
    compared = 0
    for entry in expand(load_manifest(resolve_manifest("tiny")), registry):
        family = registry.get(entry.artifact.kernel.family)
        try:
            lowered = family.lower_id(entry.artifact, device)
        except Exception:  # unsupported on this device: the build skips it too
            continue
        plain = finalize(ctx, cl_device, lowered)
        cheap = finalize(ctx, cl_device, lowered, linker.build_options)
        assert plain.ok and cheap.ok
        assert cheap.binary == plain.binary, f"{entry.artifact.kernel.label()}: PTX differs"
        stored = unpack(finalize_and_validate(ctx, cl_device, lowered).binary)
        assert stored is not None and stored.portable == plain.binary
        compared += 1
    print(f"compared {compared} kernels")
    assert compared > 0


def test_every_device_here_names_the_target_its_binaries_record() -> None:
    """Issue 19 item 2 on the GPU host: the architecture check reads what the binary
    says it is for (PTX ``.target``, PoCL 5's ``poclbin`` device id) and compares it with
    what the device says it is (compute capability, PoCL's ``HSTR:``); both must agree
    for a binary the device itself made, or every load here would be refused."""
    from farm.compilation.finalize import finalize
    from farm.compilation.load import load_binary
    from farm.compilation.target import binary_target, device_target
    from farm.core.device import DeviceContext, probe_devices
    from farm.families import Registry

    family = Registry.load([]).get("elementwise_unary")
    checked = []
    for device in probe_devices():
        ctx, cl_device = DeviceContext(device).get()
        lowered = family.lower_id(family.artifact_id({"op": "neg"}), device)
        built = finalize(ctx, cl_device, lowered)
        assert built.ok, built.error
        want = device_target(cl_device)
        checked.append((device.device_name, want, binary_target(built.binary)))
        if want is not None:
            assert binary_target(built.binary) == want, checked[-1]
        loaded = load_binary(ctx, cl_device, built.binary, lowered.kernel_names,
                             arch=device.native_arch)
        assert loaded.names == ("unary_neg",)
    print(f"targets: {checked}")
    assert any(w and w.startswith("nvidia:") for _, w, _ in checked), checked
