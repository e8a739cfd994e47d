"""Programs (farm.programs): the key, the includes, the options, and the hook on
``pyopencl.Program.build`` in this process, on the real PoCL device.

What must hold: a served program behaves as pyopencl's own (results, kernel names,
options, log); a source that does not compile raises what pyopencl raises; when the
farm cannot help the program is built the plain way with one warning line; a changed
header is a new key; nothing the device refuses or that failed is stored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyopencl as cl  # a missing OpenCL fails the suite: it never skips
import pytest

from farm.core.errors import StoreError
from farm.core.keys import PROGRAM_FAMILY, Namespace
from farm.core.model import Artifact
from farm.core.settings import Settings
from farm.programs import hook
from farm.programs.includes import resolve, root_folders
from farm.programs.options import UnservedOptions, parse_options
from farm.programs.serve import ProgramServer
from farm.programs.spec import describe
from farm.store import MemoryStore

KERNEL = "__kernel void f(__global int *a) { a[get_global_id(0)] = VALUE; }\n"


# -- the key -------------------------------------------------------------------------------
def _key(source: bytes, options: bytes, cwd: Path) -> str:
    return describe(source, options, str(cwd)).spec.key.id_hash


def test_key_covers_headers_by_content_not_by_where_they_live(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
        (folder / "v.h").write_text("#define VALUE 1\n")
    src = b'#include "v.h"\n' + KERNEL.encode()
    a = _key(src, f"-I {one}".encode(), tmp_path)
    assert _key(src, f"-I{two}".encode(), tmp_path) == a  # another folder, same bytes
    (two / "v.h").write_text("#define VALUE 2\n")
    assert _key(src, f"-I {two}".encode(), tmp_path) != a  # a changed header
    assert _key(src, f"-I {one} -DX=1".encode(), tmp_path) != a  # another option
    both = _key(src, f"-I {one} -I {two}".encode(), tmp_path)
    assert _key(src, f"-I {two} -I {one}".encode(), tmp_path) != both  # order decides


def test_includes_follow_the_includer_folder_and_record_what_is_missing(
        tmp_path: Path) -> None:
    (tmp_path / "lib" / "sub").mkdir(parents=True)
    (tmp_path / "lib" / "sub" / "a.h").write_text('#include "b.h"\n#include <nope.h>\n')
    (tmp_path / "lib" / "sub" / "b.h").write_text("#define B 1\n")
    found = resolve(b'#include "sub/a.h"\n', root_folders(str(tmp_path), [
        str(tmp_path / "lib")]))
    names = {name: digests for name, _, digests in found.directives}
    assert len(names["b.h"]) == 1 and names["nope.h"] == ()
    # laid out under every root that holds them: the current folder (0) and -I lib (1)
    assert found.portable and {(h.root, h.path) for h in found.layout} == {
        (0, "lib/sub/a.h"), (0, "lib/sub/b.h"), (1, "sub/a.h"), (1, "sub/b.h")}
    (tmp_path / "elsewhere").mkdir()
    outside = resolve(f'#include "{tmp_path}/lib/sub/b.h"\n'.encode(),
                      root_folders(str(tmp_path / "elsewhere"), []))
    assert not outside.portable and "outside" in outside.why_local
    # an absolute name inside a root still does not resolve the same elsewhere
    inside = resolve(f'#include "{tmp_path}/lib/sub/b.h"\n'.encode(),
                     root_folders(str(tmp_path), []))
    assert not inside.portable


def test_options_are_split_as_the_driver_splits_them() -> None:
    parsed = parse_options(b'-DX=1 -I "/a b" -I/c -cl-mad-enable')
    assert parsed.kept == ("-DX=1", "b\"", "-cl-mad-enable")
    assert parsed.include_dirs == ('"/a', "/c")
    with pytest.raises(UnservedOptions, match="-include"):
        parse_options(b"-include x.h")
    with pytest.raises(UnservedOptions, match="UTF-8"):
        parse_options(b"-DX=\xff")


# -- the hook -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx() -> Any:
    return cl.create_some_context(interactive=False)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ProgramServer]:
    server = hook.install(Settings(home=tmp_path / "home", device=None, records_url=None),
                          summary=False)
    try:
        yield server
    finally:
        hook.uninstall()


def _plain(ctx: Any, source: str | bytes, options: Any = None) -> Any:
    return cl.Program(ctx, source).build(options)


def _run(ctx: Any, program: Any, name: str = "f") -> np.ndarray:
    queue = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * 4)
    cl.Kernel(program, name)(queue, (4,), None, buf)
    out = np.empty(4, np.int32)
    cl.enqueue_copy(queue, out, buf)
    return out


def test_a_served_program_is_pyopencls_and_a_second_build_compiles_nothing(
        ctx: Any, served: ProgramServer) -> None:
    src = KERNEL.replace("VALUE", "7") + "__kernel void g(__global int *a) { a[0] = 1; }\n"
    first = cl.Program(ctx, src).build(options=["-DUNUSED=1"])
    assert served.counts.snapshot()["compiled"] == 1
    again = cl.Program(ctx, src).build(options=["-DUNUSED=1"])
    assert served.counts.snapshot() == {"programs": 2, "loaded": 1, "compiled": 1,
                                        "fallbacks": 0, "failed": 0}
    assert again._prg is not first._prg  # a fresh cl_program per build, as pyopencl does
    dev = ctx.devices[0]
    for prg in (first, again):
        assert sorted(prg.kernel_names.split(";")) == ["f", "g"]
        assert len(prg.all_kernels()) == 2
        assert list(_run(ctx, prg)) == [7] * 4
        assert prg.get_build_info(dev, cl.program_build_info.OPTIONS) == \
            first.get_build_info(dev, cl.program_build_info.OPTIONS)
        assert prg.get_build_info(dev, cl.program_build_info.STATUS) == 0  # SUCCESS
    # a new process (a fresh server on the same store) loads it from the local tier
    fresh = ProgramServer(served.settings, store=served.store, recorder=served.recorder)
    program = cl.Program(ctx, src)
    fresh.build(program, ["-DUNUSED=1"], None, lambda: pytest.fail("built the plain way"))
    assert fresh.counts.snapshot()["loaded"] == 1 and list(_run(ctx, program)) == [7] * 4


def test_a_source_that_does_not_compile_raises_what_pyopencl_raises(
        ctx: Any, served: ProgramServer, tmp_path: Path) -> None:
    bad = "__kernel void f(__global int *a) { a[0] = undeclared; }"
    with pytest.raises(cl.RuntimeError) as farm_err:
        cl.Program(ctx, bad).build()
    hook.uninstall()
    with pytest.raises(cl.RuntimeError) as plain_err:
        _plain(ctx, bad)
    assert farm_err.value.code == plain_err.value.code == cl.status_code.BUILD_PROGRAM_FAILURE
    assert "undeclared" in str(farm_err.value) and "undeclared" in str(plain_err.value)
    server = hook.install(Settings(home=tmp_path / "home", device=None, records_url=None),
                          summary=False)
    with pytest.raises(cl.RuntimeError) as bad_option:
        cl.Program(ctx, KERNEL.replace("VALUE", "1")).build(["-DX=(1+ 2)"])
    assert bad_option.value.code == cl.status_code.INVALID_BUILD_OPTIONS
    missing = '#include "not-there.h"\n' + KERNEL.replace("VALUE", "1")
    with pytest.raises(cl.RuntimeError, match=r"not-there\.h"):
        cl.Program(ctx, missing).build()
    assert server.counts.snapshot()["failed"] == 2
    for ns in server.store.namespaces():  # nothing of a failure is stored
        assert list(server.store.keys(ns)) == []


def test_odd_sources_are_served_like_any_other(ctx: Any, served: ProgramServer) -> None:
    latin1 = b"// caf\xe9 \xff\n" + KERNEL.replace("VALUE", "3").encode()
    assert list(_run(ctx, cl.Program(ctx, latin1).build())) == [3] * 4
    empty = cl.Program(ctx, "").build()
    assert empty.get_info(cl.program_info.KERNEL_NAMES) == ""
    quoted = cl.Program(ctx, KERNEL.replace("VALUE", "X")).build("-D 'X=(1+2)'")
    assert list(_run(ctx, quoted)) == [3] * 4
    counts = served.counts.snapshot()
    assert counts["compiled"] == 3 and counts["fallbacks"] == counts["failed"] == 0
    # and a second time, all three from memory
    cl.Program(ctx, latin1).build()
    cl.Program(ctx, "").build()
    cl.Program(ctx, KERNEL.replace("VALUE", "X")).build("-D 'X=(1+2)'")
    assert served.counts.snapshot()["loaded"] == 3


def test_a_header_changed_during_the_run_is_a_new_key_and_a_new_result(
        ctx: Any, served: ProgramServer, tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "value.h").write_text("#define VALUE 1\n")
    src = '#include "value.h"\n' + KERNEL
    assert list(_run(ctx, cl.Program(ctx, src).build(["-I", str(inc)]))) == [1] * 4
    (inc / "value.h").write_text("#define VALUE 2\n")
    assert list(_run(ctx, cl.Program(ctx, src).build(["-I", str(inc)]))) == [2] * 4
    assert served.counts.snapshot()["compiled"] == 2


def test_builds_the_farm_does_not_serve_pass_through_untouched(
        ctx: Any, served: ProgramServer) -> None:
    plain = _plain(ctx, KERNEL.replace("VALUE", "5"))
    binary = cl.Program(ctx, ctx.devices, plain.binaries).build()
    assert list(_run(ctx, binary)) == [5] * 4
    plain.build()  # a second build of a built program: pyopencl's own
    assert served.counts.snapshot()["programs"] == 1  # only the source build


def test_options_the_farm_cannot_key_are_built_the_plain_way_with_one_warning(
        ctx: Any, served: ProgramServer, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import farm.programs.spec as spec

    monkeypatch.setattr(spec, "MAX_SOURCE_BYTES", 100)
    big = "// " + "x" * 200 + "\n" + KERNEL.replace("VALUE", "4")
    for _ in range(2):
        assert list(_run(ctx, cl.Program(ctx, big).build())) == [4] * 4
    warned = [line for line in capfd.readouterr().err.splitlines() if "kernel-farm" in line]
    assert len(warned) == 1 and "limit" in warned[0] and "plain way" in warned[0]
    assert served.counts.snapshot()["fallbacks"] == 2


class _Down(MemoryStore):
    def get(self, ns: Any, key: Any) -> Any:
        raise StoreError("store minio://down: read: connection refused")


def test_a_store_that_fails_makes_the_rest_of_the_run_plain(
        ctx: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    server = ProgramServer(Settings(home=tmp_path, device=None, records_url=None),
                           store=_Down())
    for value in (1, 2):
        program = cl.Program(ctx, KERNEL.replace("VALUE", str(value)))
        server.build(program, None, None, lambda p=program: _original_build(p))
        assert list(_run(ctx, program)) == [value] * 4
    warned = [line for line in capfd.readouterr().err.splitlines() if "kernel-farm" in line]
    assert len(warned) == 1 and "connection refused" in warned[0]
    assert server.counts.snapshot()["fallbacks"] == 2
    server.close()


def _original_build(program: Any) -> Any:
    return cl.Program.build(program)


def test_a_corrupt_or_refused_stored_binary_never_reaches_the_application(
        ctx: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    store = MemoryStore()
    settings = Settings(home=tmp_path, device=None, records_url=None)
    server = ProgramServer(settings, store=store)
    src = KERNEL.replace("VALUE", "6")
    program = cl.Program(ctx, src)
    server.build(program, None, None, lambda: pytest.fail("plain build"))
    ns = store.namespaces()[0]
    key = next(iter(store.keys(ns)))
    good = store.get(ns, key)
    assert good is not None and good.meta.family == PROGRAM_FAMILY
    # corrupt: the digest fails, the store answers a miss, the farm compiles and repairs
    store._items[(ns, key)] = Artifact(meta=good.meta, binary=good.binary[:-1] + b"x")
    again = ProgramServer(settings, store=store)
    program = cl.Program(ctx, src)
    again.build(program, None, None, lambda: pytest.fail("plain build"))
    assert again.counts.snapshot()["compiled"] == 1 and list(_run(ctx, program)) == [6] * 4
    assert store.get(ns, key) is not None
    # refused: an entry that is not this program's is quarantined and built again from
    # the source the application gave, one warning; the next process loads the repair
    store.delete(ns, key)
    store.put(ns, Artifact.create(key, PROGRAM_FAMILY, b"garbage", key.id_hash))
    capfd.readouterr()
    third = ProgramServer(settings, store=store)
    program = cl.Program(ctx, src)
    third.build(program, None, None, lambda: pytest.fail("plain build"))
    assert third.counts.snapshot()["compiled"] == 1 and list(_run(ctx, program)) == [6] * 4
    warned = [line for line in capfd.readouterr().err.splitlines() if "kernel-farm" in line]
    assert len(warned) == 1 and "refused" in warned[0] and "quarantined" in warned[0]
    assert [q.artifact.binary for q in store.quarantined(ns)] == [b"garbage"]
    fourth = ProgramServer(settings, store=store)
    program = cl.Program(ctx, src)
    fourth.build(program, None, None, lambda: pytest.fail("plain build"))
    assert fourth.counts.snapshot()["loaded"] == 1 and list(_run(ctx, program)) == [6] * 4


def test_the_farm_compile_never_enters_the_hook(ctx: Any, served: ProgramServer) -> None:
    from farm.compilation.finalize import finalize
    from farm.core.model import Lowered

    built = finalize(ctx, ctx.devices[0], Lowered(source=KERNEL.replace("VALUE", "1"),
                                                  kernel_names=("f",)))
    assert built.ok and served.counts.snapshot()["programs"] == 0


def test_store_keeps_blobs_by_digest(tmp_path: Path) -> None:
    from farm.core.hashing import sha256_hex
    from farm.store import SQLiteStore

    store = SQLiteStore(tmp_path / "s.sqlite")
    digest = store.put_blob(b"\xffsource")
    assert digest == sha256_hex(b"\xffsource") and store.get_blob(digest) == b"\xffsource"
    assert store.existing_blobs([digest, "0" * 64]) == {digest}
    store._conn.execute("UPDATE blobs SET data = ?", (b"edited",))
    assert store.get_blob(digest) is None and store.stats.corrupt == 1
    store.put_blob(b"\xffsource")  # repairs
    assert store.get_blob(digest) == b"\xffsource"
    assert Namespace.for_fingerprint("x") not in store.namespaces()
    store.close()


def test_two_devices_of_one_program(tmp_path: Path) -> None:
    """PoCL with two devices: one compile serves both, each device runs it."""
    import subprocess
    import sys

    script = tmp_path / "two.py"
    script.write_text(
        "import numpy as np, pyopencl as cl\n"
        "devs = cl.get_platforms()[0].get_devices(); ctx = cl.Context(devs)\n"
        "assert len(devs) == 2\n"
        f"src = {KERNEL.replace('VALUE', '9')!r}\n"
        "for devices in (None, [devs[1]]):\n"
        "    p = cl.Program(ctx, src).build(devices=devices)\n"
        "    for d in devices or devs:\n"
        "        q = cl.CommandQueue(ctx, d); b = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 16)\n"
        "        cl.Kernel(p, 'f')(q, (4,), None, b); o = np.empty(4, np.int32)\n"
        "        cl.enqueue_copy(q, o, b); assert list(o) == [9] * 4, o\n")
    env = {**os.environ, "POCL_DEVICES": "pthread pthread", "FARM_HOME": str(tmp_path / "h")}
    runs = [subprocess.run([sys.executable, "-m", "farm", "run", "--json",
                            str(tmp_path / f"{i}.json"), "--", sys.executable, str(script)],
                           env=env, capture_output=True, text=True, timeout=300)
            for i in range(2)]
    import json

    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    assert first == {"programs": 2, "loaded": 1, "compiled": 1, "fallbacks": 0, "failed": 0}
    assert second["loaded"] == 2 and second["compiled"] == 0


def test_a_bundle_carries_programs_and_their_sources(ctx: Any, tmp_path: Path) -> None:
    from farm.programs.bundles import blobs_of
    from farm.store import SQLiteStore
    from farm.store.bundle import export_bundle, import_bundle

    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "value.h").write_text("#define VALUE 8\n")
    src = '#include "value.h"\n' + KERNEL
    store = SQLiteStore(tmp_path / "a.sqlite")
    settings = Settings(home=tmp_path, device=None, records_url=None)
    ProgramServer(settings, store=store).build(cl.Program(ctx, src), ["-I", str(inc)], None,
                                               lambda: pytest.fail("plain build"))
    described = describe(src.encode(), cl.Program._process_build_options(
        ctx, ["-I", str(inc)])[0], os.getcwd())
    export_bundle(store, None, tmp_path / "b.tar", blobs_of=blobs_of(store))
    other = SQLiteStore(tmp_path / "b.sqlite")
    import_bundle(tmp_path / "b.tar", other)
    assert other.existing_blobs(described.blobs()) == set(described.blobs())
    served = ProgramServer(settings, store=other)
    program = cl.Program(ctx, src)
    served.build(program, ["-I", str(inc)], None, lambda: pytest.fail("plain build"))
    assert served.counts.snapshot()["loaded"] == 1 and list(_run(ctx, program)) == [8] * 4
