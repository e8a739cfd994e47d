"""Ready artifacts on PoCL: the binary carries the machine code its first launch needs.

PoCL's CPU drivers compile a kernel to OpenCL C's program IR (``program.bc``) at build,
and make its machine code, the *work-group function*, at the first **execution** of a
launch, specialised by local size, by a zero global offset and by grid class (every
dimension under 65,535 work-items: "smallgrid"). A binary taken before any launch holds
none of it, so every process that loads it compiles again at its first launch (100 to
400 ms a kernel). And taking the binary makes PoCL generate, for every kernel, a
*generic* work-group function that a launch never uses while the binary carries
``program.bc`` (which it always does). See docs/DESIGN.md, "Ready artifacts on PoCL".

So, in the process that compiled, before taking the binary (:func:`ready_binary`):

1. launch the kernel's :class:`~farm.core.model.ReadyLaunch` once (:func:`launch`):
   zero-filled buffers of its sizes, its scalars; one work-group when that makes the same
   specialisation (a fixed local size, a small grid), else its whole geometry;
2. find the work-group function that launch made: the one new ``<spec>/<name>.so``
   mapped into this process (``/proc/self/maps``);
3. hard-link it where PoCL looks for the generic one (``<kernel>/0-0-0/``), so taking the
   binary finds a file and generates nothing (PoCL keeps that handle under a grid width
   of 0, which no launch can match);
4. take the binary, remove the link, and drop that ``0-0-0`` entry from the binary
   (:func:`farm.compilation.poclbin.rewrite`): no mislabelled code leaves the process.

The work-group function stored is byte for byte the one a plain build's first launch of
the same geometry makes. Anything unexpected (no new function found, a binary layout
this farm cannot walk) keeps the binary PoCL returned: an artifact like before, never a
wrong one. NVIDIA and other devices never come here.

**An application's program** (:mod:`farm.programs`) declares no launch, so nothing can
be launched before its binary is taken (a worker never runs opaque kernels on made-up
buffers). What is left is the waste: taking the binary would generate a generic
work-group function for every kernel of the program. :func:`program_binary` puts a stub
there instead (:mod:`farm.compilation.elfstub`: a file PoCL opens and finds the kernel's
symbol in, holding no code), takes the binary, removes the stubs, drops their entries and
names the program by its content, as above. It needs the folder PoCL built the program
in, which PoCL does not tell: the build gets a private folder (:data:`PRIVATE_MACRO`
defined, so its folder is new even with PoCL's kernel cache on, and no other program
uses it) and :func:`farm.compilation.poclcache.built_folder` finds it, or says it cannot
be sure, and then the binary is taken the plain way. The work-group functions the
application's launches make are stored later, beside the artifact
(:mod:`farm.programs.supplements`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from farm.compilation.elfstub import MARKER, is_stub, stub, stubs_load
from farm.compilation.poclbin import (
    GENERIC,
    PoclBinaryError,
    function_folder,
    kernel_file_data,
    rewrite,
)
from farm.compilation.poclcache import KERNEL, built_folder
from farm.core.model import ReadyLaunch

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.compilation.load import BuiltProgram

#: PoCL's ``grid_width_specialization_limit`` on CPU devices (``USHRT_MAX``)
GRID_LIMIT = 65535
#: defined (with a random suffix) on the build of an application's program, so that
#: PoCL's folder for it is new and private (its name hashes the options); no source
#: can mean it, and PoCL keeps no trace of options in the binary
PRIVATE_MACRO = "__KERNEL_FARM_PRIVATE_BUILD_"
#: one program build and binary at a time in a process on that route: its folder is
#: then told from this process's other builds by time alone
_PROGRAM_ROUTE = threading.Lock()
#: a work-group function's folder: local size, zero offset, small grid
_SPEC = re.compile(r"^\d+-\d+-\d+(-goffs0)?(-smallgrid)?$")
_MAPS = Path("/proc/self/maps")


@dataclass(frozen=True)
class ReadyBinary:
    """A binary taken after the warm-up launch, and what it carries."""

    binary: bytes
    #: the specialisation stored (``16-16-1-goffs0-smallgrid``), "" when none
    spec: str = ""
    #: why none was stored ("" when one was)
    error: str = ""
    #: seconds of the warm-up launch (the work-group function's generation)
    launch_s: float = 0.0


def applies(device: cl.Device) -> bool:
    """A PoCL CPU device, where this process can see its own mappings (Linux)."""
    import pyopencl as cl

    try:
        return ("Portable Computing Language" in device.platform.name
                and bool(device.type & cl.device_type.CPU) and _MAPS.exists())
    except cl.Error:
        return False


def grid_width(global_size: tuple[int, ...], local_size: tuple[int, ...]) -> int:
    """PoCL's ``pocl_cmd_max_grid_dim_width``, as it computes it (the third term is
    ``local_z * local_z`` there, not ``local_z * groups_z``)."""
    g = (*global_size, 1, 1)[:3]
    lz = (*local_size, 1, 1)[2]
    return max(g[0], g[1], lz * lz)


def launch(queue: cl.CommandQueue, kernel: cl.Kernel, ready: ReadyLaunch, *,
           one_group: bool = True) -> float:
    """Launch ``ready`` on zero-filled buffers and wait; its seconds (buffers excluded).

    With ``one_group``, a launch with a fixed local size and a small grid runs one
    work-group only: PoCL specialises by local size and grid *class*, not by the number
    of groups, so that makes the same code, however large the real grid."""
    import numpy as np
    import pyopencl as cl

    args: list[Any] = []
    for arg in ready.args:
        if arg.kind == "local":
            args.append(cl.LocalMemory(max(1, arg.nbytes)))
        elif arg.kind == "scalar":
            args.append(np.dtype(arg.dtype).type(arg.value))
        else:
            nbytes = max(1, arg.nbytes)
            buf = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, nbytes)
            cl.enqueue_fill_buffer(queue, buf, np.zeros(1, np.uint8), 0, nbytes)
            args.append(buf)
    queue.finish()
    size = ready.global_size
    if (one_group and ready.local_size is not None
            and grid_width(ready.global_size, ready.local_size) < GRID_LIMIT):
        size = ready.local_size
    start = time.perf_counter()
    kernel.set_args(*args)
    cl.enqueue_nd_range_kernel(queue, kernel, size, ready.local_size)
    queue.finish()
    return time.perf_counter() - start


def mapped_functions() -> set[str]:
    """Paths of the work-group functions mapped into this process."""
    found = set()
    with _MAPS.open() as fh:
        for line in fh:
            path = line.rstrip("\n").split(None, 5)[-1]
            if path.endswith(".so") and _SPEC.match(os.path.basename(os.path.dirname(path))):
                found.add(path)
    return found


def ready_binary(ctx: cl.Context, device: cl.Device, program: BuiltProgram,
                 ready: ReadyLaunch) -> ReadyBinary:
    """``program``'s binary with the work-group function of ``ready`` and no generic one
    for that kernel (see the module doc); the plain binary, with ``error``, otherwise."""
    import pyopencl as cl

    queue = cl.CommandQueue(ctx, device)
    before = mapped_functions()
    try:
        launch_s = launch(queue, cl.Kernel(cast("cl.Program", program), ready.kernel_name),
                          ready)
    except (cl.Error, ValueError, TypeError) as exc:
        return ReadyBinary(_binary(program), error=f"warm-up launch failed: {exc}"[:300])
    made = [p for p in sorted(mapped_functions() - before) if _ours(Path(p), ready)]
    if len(made) != 1:
        return ReadyBinary(_binary(program), launch_s=launch_s,
                           error=f"the warm-up launch mapped {len(made)} new work-group "
                                 "functions, not 1")
    spec = Path(made[0])
    with _generic_link(spec):
        raw = _binary(program)
    try:
        binary = rewrite(raw, frozenset({ready.kernel_name}))
    except PoclBinaryError as exc:
        return ReadyBinary(raw, launch_s=launch_s, error=f"binary not rewritten: {exc}")
    return ReadyBinary(binary, spec=spec.parent.name, launch_s=launch_s)


def _ours(path: Path, ready: ReadyLaunch) -> bool:
    """Whether a newly mapped work-group function can be the warm-up's: its kernel's
    folder, and its local size where the launch fixed one (an application's threads may
    be launching other kernels in this process meanwhile)."""
    if path.parent.parent.name != ready.kernel_name:
        return False
    if ready.local_size is None:
        return True
    local = (*ready.local_size, 1, 1)[:3]
    return path.parent.name.startswith(f"{local[0]}-{local[1]}-{local[2]}-goffs0")


@contextlib.contextmanager
def _generic_link(spec: Path) -> Any:
    """``spec`` linked as its kernel's generic work-group function for the duration;
    only what this made is removed (another process may have made the same link)."""
    folder = spec.parent.parent / GENERIC
    target = folder / spec.name
    made_folder = not folder.exists()
    made_link = False
    try:
        folder.mkdir(exist_ok=True)
        os.link(spec, target)
        made_link = True
    except OSError:
        pass  # already there, or not possible here: PoCL then makes the generic itself
    try:
        yield
    finally:
        if made_link:
            with contextlib.suppress(OSError):
                target.unlink()
        if made_folder:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _binary(program: BuiltProgram) -> bytes:
    import pyopencl as cl

    binaries: Any = program.get_info(cl.program_info.BINARIES)
    return bytes(binaries[0])


# -- an application's program: no launch, no generic functions -----------------------------
def program_route_applies(device: cl.Device) -> bool:
    """A PoCL CPU device, on a host whose loader accepts the stubs."""
    return applies(device) and stubs_load()


def private_option() -> str:
    """The option that gives one build its own folder (see :data:`PRIVATE_MACRO`)."""
    return f"-D{PRIVATE_MACRO}{secrets.token_hex(8)}"


@contextlib.contextmanager
def program_route() -> Iterator[float]:
    """Hold the route for one build and its binary; yields the time before the build."""
    with _PROGRAM_ROUTE:
        yield time.time()


def program_binary(program: BuiltProgram, since: float) -> ReadyBinary:
    """The binary of ``program`` (built after ``since`` with :func:`private_option`)
    without PoCL generating any generic work-group function, under a content-hash name;
    the plain binary, with ``error``, where its folder cannot be told for certain."""
    from farm.compilation.load import listed_kernels

    names = listed_kernels(program)  # every kernel PoCL holds, reserved names too
    if not names:  # PoCL generates nothing for a program without kernels
        return _named(_binary(program))
    folder = built_folder(since, names)
    if isinstance(folder, str):
        return ReadyBinary(_binary(program), error=f"program folder not found: {folder}")
    try:
        with stubs_at(folder, [(name, GENERIC) for name in names]):
            raw = _binary(program)
    finally:
        if not folder.name.startswith("_UNCACHED_"):  # PoCL's kernel cache keeps it
            shutil.rmtree(folder, ignore_errors=True)  # private: nobody else reads it
    try:
        files = kernel_file_data(raw)
        stubbed = frozenset(k for k, held in files.items()
                            if any(is_stub(data) for path, data in held.items()
                                   if function_folder(path) == GENERIC))
        return ReadyBinary(rewrite(raw, stubbed))
    except PoclBinaryError as exc:
        # A layout this farm cannot walk: fetch again, the stubs gone. PoCL keeps the
        # handles it opened, so nothing is generated, and no stub is in the bytes.
        again = _binary(program)
        if MARKER in again:
            return ReadyBinary(b"", error=f"binary not rewritten, stubs in it: {exc}")
        return ReadyBinary(again, error=f"binary not rewritten: {exc}")


def _named(binary: bytes) -> ReadyBinary:
    """``binary`` under its content-hash name (as is, if it cannot be walked)."""
    try:
        return ReadyBinary(rewrite(binary, frozenset()))
    except PoclBinaryError as exc:
        return ReadyBinary(binary, error=f"binary not rewritten: {exc}")


@contextlib.contextmanager
def stubs_at(folder: Path, pairs: list[tuple[str, str]]) -> Iterator[None]:
    """A stub at each (kernel, specialisation)'s work-group function in ``folder`` for the
    duration, where no file is (PoCL then opens it instead of generating that function);
    what this made is removed (files first, then the folders it created)."""
    made: list[Path] = []
    try:
        for name, spec in pairs:
            data = stub(name) if KERNEL.match(name) else None
            if data is None:
                continue  # PoCL then generates that function itself
            target = folder / name / spec / f"{name}.so"
            for parent in (target.parent.parent, target.parent):
                if not parent.exists():
                    parent.mkdir()
                    made.append(parent)
            try:
                with open(target, "xb") as fh:
                    fh.write(data)
            except FileExistsError:
                continue
            made.append(target)
        yield
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.unlink() if path.is_file() else path.rmdir()
