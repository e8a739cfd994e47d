"""Native artifacts (farm/compilation/native.py) with the CUDA seam faked, on PoCL.

CI has no GPU, so the linker seam (:func:`farm.compilation.native.open_linker`) is replaced by
fakes:
one that hands back the PoCL binary itself as "machine code" (which PoCL loads), one that
raises, one that returns bytes no device loads. What is proved:

* the container: round trip, and every damaged form refused as a :class:`LoadError`;
* conversion: the compiling process stores a container, validated by loading its machine
  code; a linker that raises or makes unloadable code leaves the plain binary, validated;
* loading: machine code first; a refused or foreign-architecture native part falls back
  to the portable one, which the loader counts and records, and the kernel still runs;
* routing: the native architecture is part of a device's fingerprint where it is known,
  and absent (fingerprints unchanged) where it is not;
* no GPU here: the real seam answers ``None`` and the build stores plain binaries.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import farm.compilation.native
from farm.compilation.load import load_binary
from farm.compilation.native import MAGIC, pack, unpack
from farm.core.device import DeviceInfo, probe_devices, select_device
from farm.core.errors import LoadError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key
from farm.core.settings import Settings
from farm.families import Registry
from farm.families.run import check_example, run_example
from farm.store import SQLiteStore

FAKE_ARCH = "fake_1"


class Echo:
    """A linker whose "machine code" is the portable binary (PoCL loads its own)."""

    arch = FAKE_ARCH
    build_options: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.calls = 0

    def link(self, portable: bytes) -> bytes:
        self.calls += 1
        return portable


class Raises:
    arch = FAKE_ARCH
    build_options: tuple[str, ...] = ()

    def link(self, portable: bytes) -> bytes:
        raise RuntimeError("cuLinkComplete failed: a driver refusal")


class Garbage:
    arch = FAKE_ARCH
    build_options: tuple[str, ...] = ()

    def link(self, portable: bytes) -> bytes:
        return b"\x7fELF not a binary any device loads"


def settings_for(home: Path, **extra: Any) -> Settings:
    return Settings(home=home, environment="default", records_url=None, device=None,
                    redis_url=None, minio_endpoint=None, workers=0, **extra)


def use_linker(monkeypatch: pytest.MonkeyPatch, linker: Any) -> None:
    """Replace the seam and forget the linkers this process already opened."""
    monkeypatch.setattr(farm.compilation.native, "open_linker", lambda cl_device: linker)
    monkeypatch.setattr(farm.compilation.native, "_linkers", {})


def stored_binaries(home: Path) -> list[bytes]:
    with sqlite3.connect(home / "envs" / "default" / "store.sqlite") as conn:
        return [row[0] for row in conn.execute("SELECT binary FROM artifacts")]


def build_tiny(home: Path, **extra: Any) -> Any:
    from farm.compilation.local import local_farm
    from farm.manifest import expand, load_manifest, resolve_manifest

    with local_farm(settings_for(home, **extra), label="test native", workers=0) as f:
        artifacts = [e.artifact for e in expand(load_manifest(resolve_manifest("tiny")),
                                                f.registry)]
        return f.batch(label="build").run(artifacts)


# -- the container ----------------------------------------------------------------------------
def test_container_round_trip_and_plain_binaries_pass_through() -> None:
    binary = pack("sm_90", b"\x7fELF machine", b"// PTX text")
    parts = unpack(binary)
    assert parts is not None
    assert (parts.arch, parts.native, parts.portable) == ("sm_90", b"\x7fELF machine",
                                                          b"// PTX text")
    assert unpack(b"// a plain PTX binary") is None


@pytest.mark.parametrize("damage", [
    lambda b: b[:len(MAGIC) + 2],                          # truncated in the length
    lambda b: b[:-1],                                      # truncated in the body
    lambda b: b + b"x",                                    # trailing bytes
    lambda b: MAGIC + (2**31).to_bytes(4, "little") + b,   # a huge header length
    lambda b: MAGIC + (7).to_bytes(4, "little") + b"{notjs}" + b"xx",
    lambda b: b.replace(b'"arch":"sm_90"', b'"arch":"../x"'),
    lambda b: b.replace(b'"native_size":5', b'"native_size":-5'),
])
def test_damaged_containers_are_refused_as_load_errors(damage: Any) -> None:
    binary = pack("sm_90", b"ELFxx", b"PTXyy")
    with pytest.raises(LoadError):
        unpack(damage(binary))


# -- conversion where the kernel is compiled --------------------------------------------------
def test_build_stores_containers_validated_by_their_machine_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    linker = Echo()
    use_linker(monkeypatch, linker)
    report = build_tiny(tmp_path)
    assert report.summary()["failed"] == 0 and report.count(report.results[0].outcome) > 0
    binaries = stored_binaries(tmp_path)
    assert binaries and linker.calls == report.compiler_invocations
    for binary in binaries:
        parts = unpack(binary)
        assert parts is not None and parts.arch == FAKE_ARCH
        assert parts.native == parts.portable  # what the fake linker made


@pytest.mark.parametrize("linker", [Raises(), Garbage()], ids=["raises", "unloadable"])
def test_a_failed_conversion_stores_the_plain_binary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linker: Any) -> None:
    use_linker(monkeypatch, linker)
    report = build_tiny(tmp_path)
    assert report.summary()["failed"] == 0
    binaries = stored_binaries(tmp_path)
    assert binaries and all(unpack(b) is None for b in binaries)


def test_native_binaries_off_never_calls_the_linker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    linker = Echo()
    use_linker(monkeypatch, linker)
    build_tiny(tmp_path, native_binaries=False)
    assert linker.calls == 0
    assert all(unpack(b) is None for b in stored_binaries(tmp_path))


def test_finalize_reports_the_architecture_and_the_conversion_time() -> None:
    from farm.compilation.finalize import finalize_and_validate
    from farm.core.device import DeviceContext

    device = select_device(probe_devices())
    ctx, cl_device = DeviceContext(device).get()
    registry = Registry.load([])
    family = registry.get("elementwise_binary")
    lowered = family.lower_id(family.artifact_id({"op": "add"}), device)
    built = finalize_and_validate(ctx, cl_device, lowered, Echo())
    assert built.ok and built.validated and built.native_arch == FAKE_ARCH
    assert 0 < built.native_s <= built.work_s
    failed = finalize_and_validate(ctx, cl_device, lowered, Garbage())
    assert failed.ok and failed.validated and failed.native_arch == ""
    assert "machine code refused" in failed.native_error


def test_the_linkers_build_options_reach_the_build_and_a_refusal_falls_back_to_a_plain_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pyopencl as cl

    from farm.compilation.finalize import finalize, finalize_and_validate
    from farm.core.device import DeviceContext

    device = select_device(probe_devices())
    ctx, cl_device = DeviceContext(device).get()
    family = Registry.load([]).get("elementwise_binary")
    lowered = family.lower_id(family.artifact_id({"op": "add"}), device)
    plain = finalize(ctx, cl_device, lowered).binary
    seen: list[list[str]] = []
    real_build = cl.Program.build

    def spy(self: Any, options: Any = None, devices: Any = None, **kw: Any) -> Any:
        seen.append(list(options or []))
        return real_build(self, options=options, devices=devices, **kw)

    monkeypatch.setattr(cl.Program, "build", spy)

    class Cheap(Echo):
        build_options: tuple[str, ...] = ("-DKF_LINKER_BUILD=1",)

    built = finalize_and_validate(ctx, cl_device, lowered, Cheap())
    assert built.ok and built.native_arch == FAKE_ARCH
    assert seen[0] == [*lowered.options, "-DKF_LINKER_BUILD=1"]
    parts = unpack(built.binary)
    assert parts is not None and len(parts.portable) > 0

    class Refused(Echo):
        build_options: tuple[str, ...] = ("-this-option-no-compiler-takes",)

    seen.clear()
    fallback = finalize_and_validate(ctx, cl_device, lowered, Refused())
    assert fallback.ok and fallback.native_arch == FAKE_ARCH, fallback.error
    # two builds from source (then the validating loads build from the binary)
    assert seen[:2] == [[*lowered.options, "-this-option-no-compiler-takes"],
                        list(lowered.options)]
    parts = unpack(fallback.binary)  # PoCL names each uncached build anew: no byte compare
    assert parts is not None and parts.portable.startswith(plain[:7])
    assert load_binary(ctx, cl_device, parts.portable).form == "plain"


# -- loading ----------------------------------------------------------------------------------
def test_load_tries_machine_code_first_and_falls_back_to_the_portable_part() -> None:
    from farm.compilation.finalize import finalize
    from farm.core.device import DeviceContext

    device = select_device(probe_devices())
    ctx, cl_device = DeviceContext(device).get()
    family = Registry.load([]).get("elementwise_binary")
    lowered = family.lower_id(family.artifact_id({"op": "add"}), device)
    portable = finalize(ctx, cl_device, lowered).binary

    good = load_binary(ctx, cl_device, pack(FAKE_ARCH, portable, portable))
    assert (good.form, good.fallback) == ("native", "")
    refused = load_binary(ctx, cl_device, pack(FAKE_ARCH, b"no device loads this", portable))
    assert refused.form == "portable" and "refused" in refused.fallback
    foreign = load_binary(ctx, cl_device, pack("sm_80", portable, portable), arch="sm_90")
    assert foreign.form == "portable" and "sm_80" in foreign.fallback
    with pytest.raises(LoadError):
        load_binary(ctx, cl_device, pack(FAKE_ARCH, b"bad", b"bad too"))


def test_loader_counts_records_and_survives_a_refused_cubin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from farm.compilation.local import local_farm
    from farm.records import SessionStorage
    from loader import KernelLoader

    use_linker(monkeypatch, None)
    settings = settings_for(tmp_path)
    family = Registry.load([]).get("elementwise_binary")
    artifact = family.artifact_id({"op": "add"})
    with local_farm(settings, label="seed", workers=0) as f:  # a plain binary...
        assert f.batch().run([artifact]).summary()["compiled"] == 1
    # ... made a container whose machine code no device loads
    device = select_device(probe_devices())
    ns = Namespace.for_fingerprint(device.fingerprint)
    key = Key(id_hash=artifact.id_hash, build_id=family.build_id)
    store = SQLiteStore(settings.store_path)
    old = store.get(ns, key)
    assert old is not None
    store.delete(ns, key)
    store.put(ns, Artifact.create(key, old.meta.family, pack(FAKE_ARCH, b"bad cubin",
                                                              old.binary),
                                  old.meta.source_hash))
    store.close()

    with KernelLoader(settings, on_miss="fail", label="fallback test") as loader:
        kernel = loader.kernel_for(artifact)
        example = family.example(family.validate({"op": "add"}), artifact.kernel.launch,
                                 np.random.default_rng(0))
        assert check_example(run_example(loader.queue, kernel, example), example) == []
        assert loader.stats.native_fallbacks == 1 and loader.stats.local == 1
    with SessionStorage(settings.effective_records_url) as storage:
        records = [r for s in storage.sessions() for r in storage.records(s.id)]
    fallbacks = [r for r in records if getattr(r, "native_fallback", "")]
    assert len(fallbacks) == 1 and "refused" in fallbacks[0].native_fallback


# -- routing ----------------------------------------------------------------------------------
def test_the_native_architecture_and_the_driver_name_the_namespace() -> None:
    device = select_device(probe_devices())
    assert device.native_arch == ""  # PoCL: no machine-code form of its own
    assert "native_arch" not in device.identity()  # so its fingerprint never changed
    h200 = device.model_copy(update={"native_arch": "sm_90"})
    a100 = device.model_copy(update={"native_arch": "sm_80"})
    newer = h200.model_copy(update={"driver_version": device.driver_version + ".1"})
    fingerprints = {d.fingerprint for d in (device, h200, a100, newer)}
    assert len(fingerprints) == 4
    assert DeviceInfo.model_validate_json(h200.model_dump_json()).fingerprint == h200.fingerprint


def test_without_a_gpu_the_real_seam_answers_none(tmp_path: Path) -> None:
    from farm.compilation.cuda import open_cuda_linker
    from farm.core.device import DeviceContext

    device = select_device(probe_devices())
    _, cl_device = DeviceContext(device).get()
    assert farm.compilation.native.open_linker(cl_device) is None  # not an NVIDIA device
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert open_cuda_linker() is None  # no driver library: conversion is off


def test_contexts_are_made_through_the_loader_pyopencl_uses_with_the_gil_released() -> None:
    """pyopencl holds the GIL in clCreateContext (1.5 s and more on an H200); the farm
    calls the same ICD loader through ctypes instead, which releases it."""
    import pyopencl as cl

    from farm.core.device import _create_context, _opencl_loader

    device = select_device(probe_devices())
    dev = cl.get_platforms()[device.platform_index].get_devices()[device.device_index]
    assert _opencl_loader() is not None  # found in this process's own memory map
    ctx = _create_context(dev)
    assert ctx.devices == [dev]
    queue = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 16)
    host = np.arange(4, dtype=np.float32)
    cl.enqueue_copy(queue, buf, host)
    back = np.empty_like(host)
    cl.enqueue_copy(queue, back, buf)
    assert (back == host).all()
