"""An application's programs on PoCL: compiled without waste, ready at first launch.

What this file proves, on the local PoCL:

* the farm's compile of an opaque program takes its binary without PoCL generating a
  generic work-group function per kernel (a stub stands where PoCL looks, and never
  leaves the process), names it by its content, and loads; with the route off
  (``ready=False``) PoCL generates them, so the check can fail;
* the stub is a shared object this host's loader opens, exporting the kernel's symbol
  and no code; the export check refuses stubs, truncated and foreign files;
* a record of work-group functions is refused whole for every hostile or malformed
  detail (and never raises anything else), an ignored record leaves the others merged;
* real processes against MinIO: ``farm run`` of an application stores the work-group
  functions its launches made (a program the application released early included), and
  a fresh process with a fresh local tier, an empty PoCL cache folder and the same
  bucket runs every launch without one work-group compile (PoCL's own debug output says
  "Using a cached WG function", never "Built a"), with results equal to a plain run;
* hostile records in the store are ignored: the run behaves as a plain one (its first
  launches compile), with the same results and one warning line;
* a binary compiled in the application is stored only once the application's own load
  took it; a bundle of a program's namespace carries its records.

On the H200 host (PoCL 5 beside NVIDIA) the same file runs on PoCL:
``bench/nvidia_host.sh python3 -m pytest -x -q tests/test_programs_ready.py``.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from farm.compilation.elfstub import MARKER, exports, is_stub, stub, workgroup_symbol
from farm.compilation.poclbin import (
    add_files,
    build_hash,
    function_path,
    kernel_file_data,
    kernel_files,
    layout,
)
from farm.core.keys import PROGRAM_FUNCTIONS_FAMILY, Namespace, program_functions_key
from farm.core.model import Artifact, Key
from farm.programs.prepared import merge
from farm.programs.supplements import (
    MAGIC,
    SlotReader,
    SupplementError,
    decode,
    encode,
    read_records,
)
from farm.store.memory import MemoryStore
from farm.store.tiers import Tier

SOURCE = b"""
__kernel void scale(__global float *a, float k) { int i = get_global_id(0); a[i] *= k; }
__kernel void shift(__global float *a, float k) { int i = get_global_id(0); a[i] += k; }
__kernel void never(__global float *a) { a[0] = 0; }
"""
PROGRAM = Key(id_hash="ab" * 32, build_id="cd" * 12)
DEVICE = "pocl-test-0123456789ab"
#: a child process's context on the PoCL device (a GPU host lists NVIDIA first)
POCL_CONTEXT = ("ctx = cl.Context([next(d for p in cl.get_platforms() if 'Portable' in p.name"
                " for d in p.get_devices())])")


# -- the farm's compile: no generic functions ------------------------------------------------
@pytest.fixture(scope="module")
def pocl() -> tuple[Any, Any]:
    import pyopencl as cl  # a missing OpenCL or PoCL fails these tests: they never skip

    for platform in cl.get_platforms():
        if "Portable Computing Language" in platform.name:
            dev = platform.get_devices()[0]
            return cl.Context([dev]), dev
    pytest.fail("no PoCL device: the test install brings one (pyopencl's wheel)",
                pytrace=False)


def _compile(pocl: tuple[Any, Any], source: bytes, ready: bool) -> Any:
    from farm.compilation.finalize import RawSource, finalize_and_validate

    ctx, dev = pocl
    built = finalize_and_validate(ctx, dev, RawSource(source, b""), None, ready=ready)
    assert built.ok, built.error
    return built


def _generic(binary: bytes) -> list[str]:
    return [p for paths in kernel_files(binary).values() for p in paths if "/0-0-0/" in p]


def test_a_program_binary_is_taken_without_generic_functions(pocl: tuple[Any, Any]) -> None:
    salt = f"// {uuid.uuid4()}\n".encode()  # a source no earlier build made
    built = _compile(pocl, salt + SOURCE, ready=True)
    assert built.validated and not built.ready_error, built.ready_error
    assert sorted(kernel_files(built.binary)) == ["never", "scale", "shift"]
    assert _generic(built.binary) == []
    assert MARKER not in built.binary
    assert build_hash(built.binary).startswith("kf")
    plain = _compile(pocl, salt + SOURCE + b"\n", ready=False)
    assert len(_generic(plain.binary)) == 3  # what the route spares: one per kernel


def test_with_pocl_kernel_cache_on_the_private_folder_is_removed(tmp_path: Path) -> None:
    """PoCL's kernel cache keeps every program folder; the compile's own is removed, and
    the stubs never stay anywhere."""
    script = (
        "import os, sys, pyopencl as cl\n"
        "from farm.compilation.finalize import RawSource, finalize_and_validate\n"
        "from farm.compilation.poclbin import kernel_files\n"
        f"{POCL_CONTEXT}\n"
        f"b = finalize_and_validate(ctx, ctx.devices[0], RawSource({SOURCE!r}, b''), None)\n"
        "print(b.ok, b.ready_error == '', sum('/0-0-0/' in p for v in "
        "kernel_files(b.binary).values() for p in v))\n")
    cache = tmp_path / "pocl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("POCL_")}
    proc = subprocess.run([sys.executable, "-c", script], env={**env, "POCL_CACHE_DIR":
                                                             str(cache)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "0"]
    programs = [p.parent for p in cache.rglob("program.bc")]
    assert programs and all(p.name.startswith("kf") for p in programs), programs
    assert not [p for p in cache.rglob("*.so") if is_stub(p.read_bytes())]


def test_a_binary_compiled_here_is_stored_only_once_the_application_loaded_it(
        pocl: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """The application's own load is the validating one (no second load at compile
    time): a compile whose binary the device refuses is built the plain way and nothing
    is stored; one it loads is stored."""
    import pyopencl as cl

    from farm.compilation import finalize
    from farm.core.settings import Settings
    from farm.programs.serve import ProgramServer

    ctx, _ = pocl
    store = MemoryStore()
    server = ProgramServer(Settings(home=tmp_path, device=None, records_url=None),
                           store=store)
    real = finalize.finalize_and_validate
    monkeypatch.setattr(finalize, "finalize_and_validate", lambda *a, **k: real(
        *a, **k).model_copy(update={"binary": b"garbage"}))
    src = f"// {uuid.uuid4()}\n".encode() + SOURCE
    program = cl.Program(ctx, src)
    server.build(program, None, None, lambda: cl.Program.build(program))
    assert server.counts.snapshot()["fallbacks"] == 1 and store.namespaces() == []
    assert "refused" in capfd.readouterr().err
    monkeypatch.setattr(finalize, "finalize_and_validate", real)
    program = cl.Program(ctx, src + b"\n")
    server.build(program, None, None, lambda: pytest.fail("built the plain way"))
    assert server.counts.snapshot()["compiled"] == 1 and len(store.namespaces()) == 1
    server.close()


# -- the stub and the export check ---------------------------------------------------------
@pytest.fixture(scope="module")
def real_function(pocl: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A work-group function PoCL made for ``scale`` (a launch in a child process)."""
    cache = tmp_path_factory.mktemp("wg")
    script = (
        "import numpy as np, pyopencl as cl\n"
        f"{POCL_CONTEXT}; q = cl.CommandQueue(ctx)\n"
        f"p = cl.Program(ctx, {SOURCE.decode()!r}).build()\n"
        "a = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4096)\n"
        "p.scale(q, (1024,), (16,), a, np.float32(2)); q.finish()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POCL_")}
    proc = subprocess.run([sys.executable, "-c", script],
                          env={**env, "POCL_CACHE_DIR": str(cache), "PYOPENCL_NO_CACHE": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    found = list(cache.rglob("scale/16-1-1-goffs0-smallgrid/scale.so"))
    assert len(found) == 1, list(cache.rglob("*.so"))
    return found[0].read_bytes()


def test_the_stub_loads_exports_the_symbol_and_is_never_taken_for_code(
        tmp_path: Path, real_function: bytes) -> None:
    import ctypes

    data = stub("scale")
    assert data is not None and is_stub(data) and not exports(data, "scale")
    path = tmp_path / "scale.so"
    path.write_bytes(data)
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    assert getattr(lib, workgroup_symbol("scale")) is not None
    assert exports(real_function, "scale")
    assert not exports(real_function, "shift")  # another kernel's symbol
    assert not exports(real_function[:len(real_function) // 2], "scale")  # truncated
    assert not exports(b"\x7fELF" + bytes(200), "scale")
    assert not exports(b"not an elf", "scale")


def _damaged(data: bytes, rng: random.Random) -> bytes:
    """``data`` cut somewhere and with a few bytes changed (seeded: the same cases every
    run; no hypothesis, so the file also runs on the GPU host's kit)."""
    out = bytearray(data[:rng.randint(1, len(data))])
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def test_damaged_functions_never_raise(real_function: bytes) -> None:
    rng = random.Random(18)
    for _ in range(300):
        assert exports(_damaged(real_function, rng), "scale") in (True, False)


# -- records: what a reader accepts --------------------------------------------------------
@pytest.fixture(scope="module")
def base_binary(pocl: tuple[Any, Any]) -> bytes:
    return bytes(_compile(pocl, SOURCE + b"// records\n", ready=True).binary)


def _raw_record(header: dict[str, Any], bodies: list[bytes]) -> bytes:
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack(">I", len(raw)) + raw + b"".join(bodies)


def _header(base: str, kernel: str, local: list[Any], body: bytes, device: str = DEVICE
            ) -> dict[str, Any]:
    import hashlib

    return {"format": 2, "program": str(PROGRAM), "base": base, "device": device,
            "functions": [{"kernel": kernel, "local_size": local, "zero_offset": True,
                           "small_grid": False, "size": len(body),
                           "sha256": hashlib.sha256(body).hexdigest()}]}


def _enc(base: str, functions: dict[tuple[str, str], bytes], device: str = DEVICE,
         **launches: Any) -> bytes:
    return encode(PROGRAM, base, device, functions, launches.get("launches"))


def _launch(kernel: str, local: tuple[int, ...], glob: tuple[int, ...] = (1024,)) -> Any:
    from farm.core.model import ReadyLaunch

    return ReadyLaunch(kernel_name=kernel, global_size=glob, local_size=local,
                       args=({"kind": "buffer", "nbytes": 4096},
                             {"kind": "scalar", "dtype": "<f4", "value": 2.0}))


HOSTILE = {
    "path out of the folder": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "../../../tmp/x", [16, 1, 1], f, d), [f]),
    "the generic function": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "scale", [0, 0, 0], f, d), [f]),
    "a local size PoCL never makes": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "scale", [16, 1, 99999], f, d), [f]),
    "a local size that is text": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "scale", ["16/../../x", 1, 1], f, d), [f]),
    "a kernel the program lacks": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "nosuch", [16, 1, 1], f, d), [f]),
    "not ELF": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "scale", [16, 1, 1], b"x" * 64, d), [b"x" * 64]),
    "a stub": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "scale", [16, 1, 1], stub("scale") or b"", d), [stub("scale") or b""]),
    "another kernel's code": lambda b, f, d=DEVICE: _raw_record(
        _header(b, "shift", [16, 1, 1], f, d), [f]),
    "truncated": lambda b, f, d=DEVICE: _enc(b, {("scale", "16-1-1-goffs0"): f}, d)[:-10],
    "bytes after": lambda b, f, d=DEVICE: _enc(b, {("scale", "16-1-1-goffs0"): f}, d) + b"!",
    "digest wrong": lambda b, f, d=DEVICE: _raw_record(
        {**_header(b, "scale", [16, 1, 1], f, d), "functions": [
            {**_header(b, "scale", [16, 1, 1], f, d)["functions"][0], "sha256": "0" * 64}]},
        [f]),
    "another program's binary": lambda b, f, d=DEVICE: _enc(
        "kf" + "0" * 38, {("scale", "16-1-1-goffs0"): f}, d),
    "another device's record": lambda b, f, d=DEVICE: _enc(
        b, {("scale", "16-1-1-goffs0"): f}, "pocl-other-0123456789ab"),
    "a function twice": lambda b, f, d=DEVICE: _raw_record(
        {**_header(b, "scale", [16, 1, 1], f, d), "functions": 2 * _header(
            b, "scale", [16, 1, 1], f, d)["functions"]}, [f, f]),
    "a launch of another kernel": lambda b, f, d=DEVICE: _enc(
        b, {("scale", "16-1-1-goffs0-smallgrid"): f}, d,
        launches={("scale", "16-1-1-goffs0-smallgrid"): _launch("shift", (16,))}),
    "a launch of another local size": lambda b, f, d=DEVICE: _enc(
        b, {("scale", "16-1-1-goffs0-smallgrid"): f}, d,
        launches={("scale", "16-1-1-goffs0-smallgrid"): _launch("scale", (128,))}),
    "a launch of another grid class": lambda b, f, d=DEVICE: _enc(
        b, {("scale", "16-1-1-goffs0-smallgrid"): f}, d,
        launches={("scale", "16-1-1-goffs0-smallgrid"): _launch("scale", (16,), (1 << 20,))}),
    "an old format record": lambda b, f, d=DEVICE: b"KFWGSUP1" + _enc(
        b, {("scale", "16-1-1-goffs0"): f}, d)[8:],
    "header not JSON": lambda b, f, d=DEVICE: MAGIC + struct.pack(">I", 5) + b"{{{{{" + f,
    "header nested too deep": lambda b, f, d=DEVICE: (
        MAGIC + struct.pack(">I", 200000) + b"[" * 200000),
    "header length past the end": lambda b, f, d=DEVICE: MAGIC + struct.pack(">I", 1 << 30),
    "no magic": lambda b, f, d=DEVICE: b"KFWGSUP9" + _enc(b, {("scale", "16-1-1"): f}, d)[8:],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_record_is_refused_whole(kind: str, base_binary: bytes,
                                           real_function: bytes) -> None:
    base = build_hash(base_binary)
    kernels = frozenset(kernel_files(base_binary))
    good = decode(_enc(base, {("scale", "16-1-1-goffs0-smallgrid"): real_function},
                       launches={("scale", "16-1-1-goffs0-smallgrid"): _launch(
                           "scale", (16,))}), PROGRAM, base, DEVICE, kernels)
    assert list(good.functions) == [("scale", "16-1-1-goffs0-smallgrid")]
    assert list(good.launches) == [("scale", "16-1-1-goffs0-smallgrid")]
    with pytest.raises(SupplementError):
        decode(HOSTILE[kind](base, real_function), PROGRAM, base, DEVICE, kernels)


def test_damaged_records_are_refused_or_read_never_anything_else(
        base_binary: bytes, real_function: bytes) -> None:
    base = build_hash(base_binary)
    record = _enc(base, {("scale", "16-1-1-goffs0"): real_function})
    rng = random.Random(17)
    for _ in range(300):
        try:
            decode(_damaged(record, rng), PROGRAM, base, DEVICE, frozenset({"scale", "shift"}))
        except SupplementError:
            pass


def _put(store: MemoryStore, ns: Namespace, base: str, slot: int, data: bytes,
         family: str = PROGRAM_FUNCTIONS_FAMILY) -> None:
    store.put(ns, Artifact.create(program_functions_key(PROGRAM, slot), family, data,
                                  "0" * 64))


def test_records_are_read_in_order_refused_or_merged_under_a_name_of_their_own(
        base_binary: bytes, real_function: bytes) -> None:
    ns = Namespace.for_fingerprint(DEVICE)
    base = build_hash(base_binary)
    kernels = frozenset(kernel_files(base_binary))
    store = MemoryStore()
    _put(store, ns, base, 0, _enc(base, {("scale", "16-1-1-goffs0-smallgrid"):
                                         real_function}))
    _put(store, ns, base, 1, HOSTILE["not ELF"](base, real_function))
    _put(store, ns, base, 2, _enc(base, {("scale", "8-1-1-goffs0-smallgrid"):
                                         real_function}), family="program")
    _put(store, ns, base, 3, _enc(base, {("scale", "32-1-1-goffs0"): real_function}))
    _put(store, ns, base, 4, HOSTILE["another program's binary"](base, real_function))
    with ThreadPoolExecutor(4) as pool:  # slots read ahead, two at a time
        found = read_records(SlotReader([Tier("local", store)], ns, PROGRAM, pool), PROGRAM,
                             base, DEVICE, kernels)
    # slot 4 is stale (a record of another binary of the program): skipped in silence
    assert [c.slot for c in found.candidates] == [0, 3]
    assert [r.slot for r in found.refused] == [1, 2] and found.next_slot == 5
    prep = merge(base_binary, base, found.candidates, found.next_slot)
    assert prep.merged == 2 and prep.base == base
    files = kernel_file_data(prep.binary)["scale"]
    assert files[function_path("scale", "16-1-1-goffs0-smallgrid")] == real_function
    assert function_path("scale", "32-1-1-goffs0") in files
    # a folder of its own: never the stored binary's, and another for other records
    assert build_hash(prep.binary) == prep.folder != base
    assert merge(base_binary, base, found.candidates[:1], 5).folder != prep.folder
    assert merge(base_binary, base, [], 5).folder not in (base, prep.folder)
    layout(prep.binary)


def test_a_bundle_carries_a_programs_records(base_binary: bytes, real_function: bytes,
                                            tmp_path: Path) -> None:
    """Records are artifacts of the program's namespace: a bundle of it carries them, and
    the importing store's reader finds them."""
    from farm.store.bundle import export_bundle, import_bundle
    from farm.store.sqlite import SQLiteStore

    ns = Namespace.for_fingerprint(DEVICE)
    base = build_hash(base_binary)
    source = SQLiteStore(tmp_path / "a.sqlite")
    source.put(ns, Artifact.create(PROGRAM, "program", base_binary, "0" * 64))
    source.put(ns, Artifact.create(program_functions_key(PROGRAM, 0),
                                   PROGRAM_FUNCTIONS_FAMILY, _enc(base, {
                                       ("scale", "16-1-1-goffs0-smallgrid"): real_function}),
                                   "0" * 64))
    export_bundle(source, None, tmp_path / "b.tar")
    target = SQLiteStore(tmp_path / "b.sqlite")
    import_bundle(tmp_path / "b.tar", target)
    found = read_records(SlotReader([Tier("local", target)], ns, PROGRAM), PROGRAM, base,
                         DEVICE, frozenset(kernel_files(base_binary)))
    assert len(found.candidates) == 1 and not found.refused
    source.close()
    target.close()


def test_a_merged_binary_loads_and_runs_the_stored_function(
        pocl: tuple[Any, Any], base_binary: bytes, real_function: bytes) -> None:
    """add_files writes what PoCL reads: the merged program loads and computes."""
    import pyopencl as cl

    ctx, dev = pocl
    merged = add_files(base_binary, {"scale": {
        function_path("scale", "16-1-1-goffs0-smallgrid"): real_function}})
    program = cl.Program(ctx, [dev], [merged]).build()
    q = cl.CommandQueue(ctx)
    host = np.arange(1024, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
    program.scale(q, (1024,), (16,), buf, np.float32(3))
    out = np.empty_like(host)
    cl.enqueue_copy(q, out, buf)
    assert np.array_equal(out, host * 3)


# -- real processes against MinIO ------------------------------------------------------------
APP = """
import gc, sys
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
from pyopencl.elementwise import ElementwiseKernel
SOURCE = sys.argv[2]
ctx = cl.Context([next(d for p in cl.get_platforms() if "Portable" in p.name
                      for d in p.get_devices())])
q = cl.CommandQueue(ctx)
x = np.random.default_rng(7).random(4096).astype(np.float32)
gx = cla.to_device(q, x)
out = {}
prg = cl.Program(ctx, SOURCE).build()
a = gx.copy()
prg.scale(q, (4096,), (64,), a.data, np.float32(3))
prg.shift(q, (4096,), (16,), a.data, np.float32(1))
prg.shift(q, (4096,), None, a.data, np.float32(1))
out["custom"] = a.get()
lin = ElementwiseKernel(ctx, "float *z, const float *x, float k", "z[i] = k*x[i] + 1", "lin")
z = cla.empty_like(gx)
lin(z, gx, np.float32(2))
out["lin"] = z.get()
out["sum"] = np.array(cla.sum(gx).get())
once = cl.Program(ctx, "__kernel void once(__global float *a) { a[get_global_id(0)] -= 1; }")
once = once.build()
b = gx.copy()
once.once(q, (4096,), (128,), b.data)
out["once"] = b.get()
del once  # released before the end: PoCL's cache off removes its folder then
gc.collect()
np.savez(sys.argv[1], **out)
ok = (np.allclose(out["custom"], x * 3 + 2) and np.allclose(out["lin"], 2 * x + 1)
      and np.allclose(out["once"], x - 1))
print("OK" if ok else "MISMATCH")
"""


def _env(home: Path, cache: Path, minio: Any = None, bucket: str = "",
         **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "POCL_"))}
    cache.mkdir(parents=True, exist_ok=True)
    env.update(FARM_HOME=str(home), POCL_CACHE_DIR=str(cache), PYOPENCL_NO_CACHE="1",
               POCL_KERNEL_CACHE="0", PYOPENCL_CTX="0", POCL_DEBUG="general", **extra)
    if minio is not None:
        env.update(FARM_MINIO_ENDPOINT=minio.endpoint, FARM_MINIO_ACCESS_KEY=minio.access_key,
                   FARM_MINIO_SECRET_KEY=minio.secret_key, FARM_MINIO_BUCKET=bucket)
    return env


def _run(script: Path, out: Path, env: dict[str, str], plain: bool = False
         ) -> tuple[dict[str, int], str]:
    command = [sys.executable, str(script), str(out), SOURCE.decode()]
    counts = out.with_suffix(".json")
    if not plain:
        command = [sys.executable, "-m", "farm", "run", "--json", str(counts), "--", *command]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "OK" in proc.stdout, proc.stdout
    return ({} if plain else json.loads(counts.read_text())), proc.stderr


def _binary(ns: Namespace, art: Artifact) -> bytes:
    """The device binary of a stored program (its body's)."""
    from farm.programs.body import read_body

    return read_body(art.binary, art.meta.key, ns.fingerprint).binary


def _same(a: Path, b: Path) -> None:
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files)
        for name in x.files:
            assert np.array_equal(x[name], y[name]), name


def _records(minio: Any, bucket: str) -> list[tuple[Namespace, Artifact]]:
    from farm.core.settings import Settings
    from farm.store.open import open_store

    store = open_store(Settings(
        minio_endpoint=minio.endpoint, minio_access_key=minio.access_key,
        minio_secret_key=minio.secret_key, minio_bucket=bucket), shared=True, signed=False)
    try:
        return [(ns, art) for ns in store.namespaces() for key in store.keys(ns)
                if (art := store.get(ns, key)) is not None]
    finally:
        store.close()


@pytest.fixture(scope="module")
def served(minio_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        dict[str, Any]]:
    """A plain run, then ``farm run`` on node A: programs compiled, functions stored."""
    root = tmp_path_factory.mktemp("progready")
    script = root / "app.py"
    script.write_text(APP)
    _run(script, root / "plain.npz", _env(root / "plain", root / "plain-pocl"), plain=True)
    bucket = f"r-{uuid.uuid4().hex[:12]}"
    counts, _ = _run(script, root / "a.npz", _env(root / "a", root / "a-pocl", minio_server,
                                                  bucket))
    assert counts["compiled"] > 0 and counts["fallbacks"] == counts["failed"] == 0, counts
    _same(root / "plain.npz", root / "a.npz")
    yield {"root": root, "script": script, "bucket": bucket, "counts": counts}


@pytest.mark.integration
def test_a_run_stores_the_work_group_functions_its_launches_made(
        served: dict[str, Any], minio_server: Any) -> None:
    stored = _records(minio_server, served["bucket"])
    programs = [(ns, a) for ns, a in stored if a.meta.family == "program"]
    records = [a for _, a in stored if a.meta.family == PROGRAM_FUNCTIONS_FAMILY]
    assert len(programs) == served["counts"]["compiled"]
    assert all(_generic(_binary(ns, a)) == [] for ns, a in programs)
    functions: dict[str, set[str]] = {}
    for rec in records:
        ns, program = next((ns, p) for ns, p in programs
                           if rec.meta.key == program_functions_key(
                               p.meta.key, int(rec.meta.key.id_hash[-2:], 16)))
        binary = _binary(ns, program)
        for (kernel, spec) in decode(rec.binary, program.meta.key, build_hash(binary),
                                     ns.fingerprint, frozenset(kernel_files(binary))).functions:
            functions.setdefault(kernel, set()).add(spec)
    assert functions["scale"] == {"64-1-1-goffs0-smallgrid"}
    assert "16-1-1-goffs0-smallgrid" in functions["shift"] and len(functions["shift"]) == 2
    assert functions["once"] == {"128-1-1-goffs0-smallgrid"}  # released before the end
    assert "lin" in functions and "never" not in functions


@pytest.mark.integration
def test_a_fresh_node_launches_every_kernel_without_compiling(
        served: dict[str, Any], minio_server: Any) -> None:
    root = served["root"]
    cache = root / "b-pocl"
    counts, stderr = _run(served["script"], root / "b.npz",
                          _env(root / "b", cache, minio_server, served["bucket"]))
    assert counts == {**served["counts"], "loaded": served["counts"]["programs"],
                      "compiled": 0}, counts
    _same(root / "plain.npz", root / "b.npz")
    assert "Built a" not in stderr, [line for line in stderr.splitlines() if "Built a" in line]
    used = [line for line in stderr.splitlines() if "Using a cached WG function" in line]
    assert len(used) >= 6, stderr[-3000:]  # scale, shift twice, lin, the sum's, once
    assert "kernel-farm: warning" not in stderr


@pytest.mark.integration
def test_hostile_records_are_ignored_and_the_run_behaves_as_a_plain_one(
        served: dict[str, Any], minio_server: Any, real_function: bytes) -> None:
    """Node C has the programs in its local tier (no MinIO) and a hostile record in the
    first slot of each: nothing is merged, the launches compile as without the farm,
    the results are the plain run's, and the run says so in one warning line."""
    from farm.core.settings import Settings
    from farm.store.sqlite import SQLiteStore

    root = served["root"]
    home = root / "c"
    store = SQLiteStore(Settings(home=home).store_path)
    kinds = sorted(HOSTILE)
    try:
        programs = [(ns, a) for ns, a in _records(minio_server, served["bucket"])
                    if a.meta.family == "program"]
        for i, (ns, art) in enumerate(programs):
            store.put(ns, art)
            base = build_hash(_binary(ns, art))
            data = HOSTILE[kinds[i % len(kinds)]](base, real_function, ns.fingerprint)
            store.put(ns, Artifact.create(program_functions_key(art.meta.key, 0),
                                          PROGRAM_FUNCTIONS_FAMILY, data, "0" * 64))
    finally:
        store.close()
    counts, stderr = _run(served["script"], root / "c.npz", _env(home, root / "c-pocl"))
    assert counts["loaded"] == counts["programs"] and counts["compiled"] == 0, counts
    _same(root / "plain.npz", root / "c.npz")
    assert "Built a" in stderr  # the first launches compile, as without stored functions
    warnings = [line for line in stderr.splitlines() if line.startswith("kernel-farm: warn")]
    assert len(warnings) == 1 and "refused" in warnings[0], warnings
