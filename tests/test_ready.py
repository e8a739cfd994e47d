"""Ready artifacts on PoCL: a stored kernel's first launch compiles nothing.

What this file proves, on the local PoCL (the drivers' own caches off everywhere):

* ``farm build tiny`` stores binaries that carry each kernel's work-group function for
  its declared launch and no generic one;
* ``farm warm`` reports the time to first result per kernel (load + first launch)
  beside the load;
* a fresh process with an empty PoCL cache folder loads every stored kernel and runs its
  example: PoCL writes no work-group function (its cache folder gains no ``.so``), the
  one each first launch maps into the process is the file the load unpacked from the
  stored binary, and every result matches numpy;
* the same check fails where it should: artifacts made as before (``FARM_POCL_READY=0``,
  what every store written before this holds) still load and run right, and their first
  launch compiles (writes and maps a new ``.so``);
* in-process: the work-group function stored is the one a plain build's first launch
  makes, byte for byte; a warm-up that cannot run keeps the plain binary;
* the binary's parser refuses malformed, truncated and hostile bytes with one error
  type, never another exception.

The proof reads what PoCL does to its cache folder and what the process maps, never
``POCL_DEBUG``: PoCL 3.1 (Debian's) crashes when ``POCL_DEBUG=general`` is set and a
kernel is made from a program loaded from a binary, so its word cannot be asked on
every PoCL the farm supports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from farm.compilation.poclbin import PoclBinaryError, build_hash, kernel_files, layout, rewrite
from farm.core.model import LaunchArg, ReadyLaunch

FARM = Path(sys.executable).with_name("farm")

# The fresh process: load every stored kernel of FARM_HOME's tiny build (no compiler:
# on_miss="fail"), run its example once, and report the work-group functions PoCL wrote
# during that first launch, those it mapped (and whether each was in the cache folder
# before the launch: unpacked from the stored binary), and whether the outputs match numpy.
_CHILD = r"""
import glob, json, os, sys
import numpy as np
from farm.compilation.ready import mapped_functions
from farm.core.settings import load_settings
from farm.families.run import check_example, run_example
from farm.manifest import expand, load_manifest, resolve_manifest
from loader import KernelLoader

top = os.environ["POCL_CACHE_DIR"]
so = lambda: set(glob.glob(os.path.join(top, "**", "*.so"), recursive=True))
rows = []
with KernelLoader(load_settings(), on_miss="fail", label="ready test") as loader:
    for entry in expand(load_manifest(resolve_manifest(sys.argv[1])), loader.registry):
        family = loader.registry.get(entry.family)
        example = family.example(family.validate(entry.artifact.kernel.params),
                                 entry.artifact.kernel.launch, np.random.default_rng(0))
        kernel = loader.kernel_for(entry.artifact, name=example.kernel_name)
        before, mapped = so(), mapped_functions()
        print(f"=== launch {entry.artifact.kernel.label()}", file=sys.stderr, flush=True)
        outputs = run_example(loader.queue, kernel, example)
        new = sorted(mapped_functions() - mapped)
        rows.append({"kernel": entry.artifact.kernel.label(),
                     "written": sorted(so() - before), "mapped": new,
                     "unpacked": [p in before for p in new],
                     "problems": check_example(outputs, example)})
print(json.dumps(rows))
"""


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "POCL_"))}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def _build(home: Path, manifest: str | Path, **extra: str) -> dict[str, Any]:
    proc = subprocess.run([str(FARM), "build", str(manifest), "--workers", "2", "--json"],
                          env=_env(home, **extra), capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout))


def _fresh_launch(home: Path, manifest: str | Path, cache: Path) -> list[dict[str, Any]]:
    """Run ``_CHILD`` in a new process whose PoCL cache folder is ``cache`` (empty)."""
    cache.mkdir()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(manifest)],
                          env=_env(home, POCL_CACHE_DIR=str(cache)),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def _stored_binaries(home: Path) -> list[bytes]:
    from farm.core.settings import Settings
    from farm.store import open_store

    settings = Settings(home=home, environment="default", records_url=None, device=None,
                        family_modules=[])
    store = open_store(settings)
    try:
        out = []
        for ns in store.namespaces():
            for key in store.keys(ns):
                art = store.get(ns, key)
                assert art is not None
                out.append(art.binary)
        return out
    finally:
        store.close()


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("ready-home")
    report = _build(home, "tiny")
    assert report["summary"]["compiled"] == 20, report["summary"]
    return home


# -- the artifacts -------------------------------------------------------------------------
def test_stored_binaries_carry_their_launch_code_and_no_generic(tiny_home: Path) -> None:
    binaries = _stored_binaries(tiny_home)
    assert len(binaries) == 20
    for binary in binaries:
        (files,) = kernel_files(binary).values()
        specs = [p.strip("/").split("/")[-2] for p in files if p.endswith(".so")]
        assert len(specs) == 1 and specs[0].endswith("-goffs0-smallgrid"), files
        assert "0-0-0" not in specs
        assert build_hash(binary).startswith("kf")


# -- a fresh process -------------------------------------------------------------------------
def test_first_launch_in_a_fresh_process_compiles_nothing(tiny_home: Path,
                                                           tmp_path: Path) -> None:
    rows = _fresh_launch(tiny_home, "tiny", tmp_path / "pocl-cache")
    assert len(rows) == 20
    assert [r for r in rows if r["written"]] == []
    assert [r for r in rows if r["problems"]] == []
    # each first launch ran the machine code the load unpacked from the stored binary
    assert [r for r in rows if r["unpacked"] != [True]] == [], rows


def test_artifacts_made_as_before_still_load_and_compile_at_first_launch(
        tmp_path: Path) -> None:
    manifest = tmp_path / "two.toml"
    manifest.write_text('format = 1\nname = "two"\n'
                        '[[kernels]]\nfamily = "softmax"\nparams = { cols = 128 }\n'
                        '[[kernels]]\nfamily = "matmul"\nparams = { m = 32, n = 32, k = 32 }\n')
    home = tmp_path / "home"
    _build(home, manifest, FARM_POCL_READY="0")
    for binary in _stored_binaries(home):
        (files,) = kernel_files(binary).values()
        assert [p.strip("/").split("/")[-2] for p in files] == ["0-0-0"]
    rows = _fresh_launch(home, manifest, tmp_path / "pocl-cache")
    assert [r for r in rows if r["problems"]] == []
    assert all(len(r["written"]) == 1 for r in rows), rows  # the check sees a compile
    # ... and the code each launch ran is the one it made, not one the load unpacked
    assert all(r["mapped"] == r["written"] and r["unpacked"] == [False] for r in rows), rows
    # farm warm's launches leave the functions they made beside the stored ones
    _, kept = _warm(home, manifest, tmp_path / "warm-cache", "--launch")
    made = kept - _stored_functions(home)
    assert len(made) == 2 and all("-goffs0-" in p for p in made), sorted(kept)


def test_farm_warm_reports_time_to_first_result_beside_the_load(tiny_home: Path,
                                                                 tmp_path: Path) -> None:
    runs = {flag: _warm(tiny_home, "tiny", tmp_path / f"pocl-cache{flag}", flag)
            for flag in ("--launch", "--no-launch")}
    summary, kept = runs["--launch"]
    ready = summary["readiness"]
    assert ready["kernels"] == 20 and summary["phases"]["launch"]["kernels"] == 20
    assert ready["first_result_ms"] >= ready["load_ms"] > 0
    assert runs["--no-launch"][0]["readiness"] == {"kernels": 0}
    # each first launch found its machine code (the files of the stored binaries); none
    # made any (a launch of another geometry would have added its own .so)
    stored = _stored_functions(tiny_home)
    assert len(stored) == 20 and kept == stored, sorted(kept ^ stored)


def _warm(home: Path, manifest: str | Path, cache: Path,
          flag: str) -> tuple[dict[str, Any], set[str]]:
    """``farm warm`` with PoCL's kernel cache on, in a folder of its own: its summary, and
    the work-group functions left there (every one it unpacked from a stored binary or
    made at a launch), as ``<build hash>/<kernel>/<launch>/<kernel>.so``."""
    cache.mkdir()
    proc = subprocess.run([str(FARM), "warm", str(manifest), "--json", flag],
                          env=_env(home, POCL_CACHE_DIR=str(cache), POCL_KERNEL_CACHE="1"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (json.loads(proc.stdout)["summary"],
            {str(p.relative_to(cache)) for p in cache.rglob("*.so")})


def _stored_functions(home: Path) -> set[str]:
    """The work-group functions the stored binaries carry, named as :func:`_warm` does."""
    return {f"{build_hash(b)}/{p.strip('/')}" for b in _stored_binaries(home)
            for files in kernel_files(b).values() for p in files if p.endswith(".so")}


# -- in-process ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pocl() -> Iterator[tuple[Any, Any, Any]]:
    from farm.core.device import open_device, probe_devices, select_device

    info = select_device(probe_devices())  # the device the farm builds on
    assert info.compiles_at_launch, info.device_name
    ctx, dev = open_device(info)
    yield info, ctx, dev


def _lowered(info: Any, family: str, params: dict[str, Any]) -> Any:
    from farm.families import Registry
    from farm.families.builtin import FAMILIES

    fam = Registry([f() for f in FAMILIES]).get(family)
    return fam.lower_id(fam.artifact_id(params), info)


def test_stored_code_is_what_a_plain_first_launch_makes(pocl: tuple[Any, Any, Any]) -> None:
    import pyopencl as cl

    from farm.compilation.finalize import finalize
    from farm.compilation.ready import launch, mapped_functions

    info, ctx, dev = pocl
    lowered = _lowered(info, "matmul", {"m": 37, "n": 45, "k": 29})
    assert lowered.ready is not None and lowered.ready.local_size == (16, 16)
    built = finalize(ctx, dev, lowered)
    assert built.ok and built.ready_spec == "16-16-1-goffs0-smallgrid", built.ready_error
    program = cl.Program(ctx, lowered.source).build(options=list(lowered.options))
    before = mapped_functions()
    launch(cl.CommandQueue(ctx), cl.Kernel(program, "matmul"), lowered.ready,
           one_group=False)  # the whole grid, as an application launches it
    (made,) = mapped_functions() - before
    stored = _file(built.binary, "/matmul/16-16-1-goffs0-smallgrid/matmul.so")
    assert Path(made).read_bytes() == stored


def _file(binary: bytes, path: str) -> bytes:
    from farm.compilation.poclbin import entries

    (k,) = layout(binary).kernels
    for p, a, _ in entries(binary, k.files_start, k.end):
        if p == path:
            n = int.from_bytes(binary[a:a + 4], "little")
            size = int.from_bytes(binary[a + 4 + n:a + 8 + n], "little")
            return binary[a + 8 + n:a + 8 + n + size]
    raise AssertionError(f"{path} not in the binary")


def test_a_warm_up_that_cannot_run_keeps_the_plain_binary(
        pocl: tuple[Any, Any, Any]) -> None:
    from farm.compilation.finalize import finalize_and_validate

    info, ctx, dev = pocl
    lowered = _lowered(info, "softmax", {"cols": 64})
    assert lowered.ready is not None
    wrong = lowered.model_copy(update={"ready": lowered.ready.model_copy(
        update={"args": lowered.ready.args[:1]})})  # one argument of two
    built = finalize_and_validate(ctx, dev, wrong)
    assert built.ok and built.validated
    assert built.ready_spec == "" and "warm-up launch failed" in built.ready_error
    (files,) = kernel_files(built.binary).values()
    assert [p.strip("/").split("/")[-2] for p in files] == ["0-0-0"]


def test_rewrite_drops_the_generic_and_the_device_loads_the_result(
        pocl: tuple[Any, Any, Any]) -> None:
    import pyopencl as cl

    from farm.compilation.finalize import finalize

    info, ctx, dev = pocl
    plain = finalize(ctx, dev, _lowered(info, "softmax", {"cols": 64}), ready=False).binary
    assert build_hash(plain).startswith("_UNCACHED_")  # POCL_KERNEL_CACHE=0: random
    out = rewrite(plain, frozenset({"softmax"}))
    assert kernel_files(out) == {"softmax": []}
    assert rewrite(plain, frozenset({"softmax"})) == out  # the hash is the content's
    assert rewrite(plain, frozenset()) != out and build_hash(out).startswith("kf")
    program = cl.Program(ctx, [dev], [out]).build()
    x = np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32)
    mf = cl.mem_flags
    buf, res = (cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=x),
                cl.Buffer(ctx, mf.READ_WRITE, x.nbytes))
    queue = cl.CommandQueue(ctx)
    lowered = _lowered(info, "softmax", {"cols": 64})
    assert lowered.ready is not None and lowered.ready.local_size is not None
    group = lowered.ready.local_size[0]
    program.softmax(queue, (2 * group,), (group,), buf, res)
    got = np.empty_like(x)
    cl.enqueue_copy(queue, got, res)
    want = np.exp(x - x.max(axis=1, keepdims=True))
    assert np.allclose(got, want / want.sum(axis=1, keepdims=True), atol=1e-5)


# -- bad bytes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_binary(pocl: tuple[Any, Any, Any]) -> bytes:
    from farm.compilation.finalize import finalize

    info, ctx, dev = pocl
    return finalize(ctx, dev, _lowered(info, "reduce", {"op": "sum", "cols": 64}),
                    ready=False).binary


@pytest.mark.parametrize("mangle", [
    lambda b: b"",
    lambda b: b"notpocl!" + b[8:],
    lambda b: b[:40],
    lambda b: b[:-1],
    lambda b: b + b"\0",
    lambda b: b[:16] + (99).to_bytes(4, "little") + b[20:],         # unknown version
    lambda b: b[:20] + (7).to_bytes(4, "little") + b[24:],          # 7 kernels claimed
], ids=["empty", "magic", "header", "truncated", "trailing", "version", "count"])
def test_malformed_binaries_are_refused_with_one_error(plain_binary: bytes,
                                                       mangle: Any) -> None:
    with pytest.raises(PoclBinaryError):
        rewrite(mangle(plain_binary), frozenset({"reduce_sum"}))


def test_hostile_kernel_sizes_are_refused(plain_binary: bytes) -> None:
    (k,) = layout(plain_binary).kernels
    for size in (0, 2**63, len(plain_binary)):
        bad = plain_binary[:k.start] + size.to_bytes(8, "little") + plain_binary[k.start + 8:]
        with pytest.raises(PoclBinaryError):
            layout(bad)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_binaries_never_raise_anything_else(plain_binary: bytes,
                                                    data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(plain_binary) - 1))
    value = data.draw(st.integers(0, 255))
    damaged = plain_binary[:at] + bytes([value]) + plain_binary[at + 1:]
    try:
        rewrite(damaged, frozenset({"reduce_sum"}))
    except PoclBinaryError:
        pass


# -- the declared launch ---------------------------------------------------------------------
def test_ready_launch_is_validated() -> None:
    from pydantic import ValidationError

    ok = ReadyLaunch(kernel_name="k", global_size=(64, 8), local_size=(16, 8),
                     args=(LaunchArg(kind="scalar", dtype="<u4", value=3),))
    assert ok.local_size == (16, 8)
    for bad in ({"global_size": (64,), "local_size": (16, 1)}, {"global_size": ()},
                {"global_size": (0,)}, {"global_size": (1, 1, 1, 1)},
                {"kernel_name": "a b", "global_size": (1,)},
                {"global_size": (1,), "args": ({"kind": "scalar", "dtype": "object"},)}):
        with pytest.raises(ValidationError):
            ReadyLaunch.model_validate({"kernel_name": "k", **bad})


def test_families_declare_the_launch_of_their_example(pocl: tuple[Any, Any, Any]) -> None:
    from farm.families import Registry
    from farm.families.builtin import FAMILIES
    from farm.manifest import expand, load_manifest, resolve_manifest

    info = pocl[0]
    registry = Registry([f() for f in FAMILIES])
    for entry in expand(load_manifest(resolve_manifest("tiny")), registry):
        family = registry.get(entry.family)
        params = family.validate(entry.artifact.kernel.params)
        example = family.example(params, entry.artifact.kernel.launch,
                                 np.random.default_rng(0))
        assert example is not None
        lowered = family.lower_id(entry.artifact, info)
        assert lowered.ready == example.ready_launch(), entry.artifact.kernel.label()
    nvidia = info.model_copy(update={"platform_name": "NVIDIA CUDA"})
    assert _lowered(nvidia, "softmax", {"cols": 64}).ready is None  # only where it is used
