"""load: create a program from a binary on the device and list its kernels.

An artifact is only ever stored after this succeeds, so a binary the device refuses is
never served to anyone.

A binary is either plain (what the device's OpenCL returned) or a native container
(:mod:`farm.compilation.native`: machine code plus the portable binary it came from). A container's
machine code is tried first; where the device refuses it, or it was made for another
architecture, the portable part is loaded instead and the fallback is reported in
:attr:`LoadedBinary.fallback` for the caller to count and record. Only when no part
loads is the binary refused.

Before the driver sees a part, :func:`farm.compilation.target.check_target` checks that
it was made for this device (every device whose binaries say so, PoCL included), and
after the load its kernels must be exactly the ones the family declares
(``kernel_names``, from lowering): a binary of another kernel stored under this key is
refused, never run as this one.

Kernel names come from ``CL_PROGRAM_KERNEL_NAMES`` rather than by making every
``Kernel`` object (``all_kernels()``): pyopencl generates the argument-setting code of
each kernel it makes, 1 to 4 ms a program on PoCL, more than the load itself. Kernels are
made when an application asks for one. Every part of the farm reads a built program's
kernels through :func:`program_kernels` (the compile's record of them, this load's
check, the program server, the proof's child, the served quick path), which leaves out
names reserved to the implementation (:func:`reserved`): NVIDIA's driver lists CUDA's
internal helpers (``__cuda_sm20_div_u64``, ``__cuda_sm20_dblrcp_rn_slowpath_v3``) among
the kernels of a program loaded from a cubin, and not among those of the same program
built from source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from farm.compilation.native import unpack
from farm.compilation.target import check_target
from farm.core.errors import LoadError

if TYPE_CHECKING:
    import pyopencl as cl

log = logging.getLogger(__name__)

#: which part of a binary the device loaded
Form = Literal["plain", "native", "portable"]


class BuiltProgram(Protocol):
    """A built OpenCL program as the farm asks it things: pyopencl's ``Program``, or the
    low-level ``_cl._Program`` an application's program is served as (farm.programs)."""

    def get_info(self, arg: cl.program_info, /) -> object: ...

    def get_build_info(self, device: cl.Device, param: cl.program_build_info, /
                       ) -> object: ...


def reserved(name: str) -> bool:
    """Whether ``name`` is reserved to the implementation: OpenCL C takes C99's rule
    (7.1.3: every identifier that begins with two underscores, or with one and a capital
    letter, is reserved for any use), and drivers use such names for their own code
    (NVIDIA's ``__cuda_*`` helpers, listed as kernels of a program loaded from a cubin).
    Only the two-underscore form is left out of a program's kernels (that is the form
    drivers use); a kernel an application names so anyway is still built and served, the
    farm only does not check it by name."""
    return name.startswith("__")


def listed_kernels(program: BuiltProgram) -> tuple[str, ...]:
    """Every name the driver lists in ``CL_PROGRAM_KERNEL_NAMES``, in its order."""
    import pyopencl as cl

    return tuple(n for n in str(program.get_info(cl.program_info.KERNEL_NAMES)).split(";")
                 if n)


def program_kernels(program: BuiltProgram, declared: Iterable[str] = ()) -> tuple[str, ...]:
    """The kernels of a built ``program``, in the driver's order, without the names
    reserved to the implementation (:func:`reserved`) unless ``declared`` names them (a
    family may declare any valid name). The one reader of a program's kernel names."""
    keep = frozenset(declared)
    return tuple(n for n in listed_kernels(program) if n in keep or not reserved(n))


@dataclass(frozen=True)
class LoadedBinary:
    """A program on the device, its kernels' names, and which part of the binary it is."""

    program: cl.Program
    names: tuple[str, ...]
    form: Form = "plain"
    #: why a container's native part was not used ("" when it was, or for plain binaries)
    fallback: str = ""


def load(ctx: cl.Context, device: cl.Device, binary: bytes,
         kernel_names: tuple[str, ...] = (), *, arch: str = "",
         require_kernel: bool = True) -> cl.Program:
    """Program built from ``binary``; checks it holds a kernel (unless not
    ``require_kernel``: an application's program may hold none), and exactly
    ``kernel_names`` when they are given."""
    return load_binary(ctx, device, binary, kernel_names, arch=arch,
                       require_kernel=require_kernel).program


def load_binary(ctx: cl.Context, device: cl.Device, binary: bytes,
                kernel_names: tuple[str, ...] = (), *, arch: str = "",
                require_kernel: bool = True) -> LoadedBinary:
    """Load ``binary`` (plain or native container) on ``device``.

    ``arch`` is the device's native architecture (``DeviceInfo.native_arch``); a
    container for another one goes straight to its portable part. Raises
    :class:`LoadError` when nothing in ``binary`` loads.
    """
    parts = unpack(binary)
    if parts is None:
        program, names = _load_one(ctx, device, binary, kernel_names, require_kernel)
        return LoadedBinary(program, names)
    if arch and parts.arch != arch:
        fallback = f"native code is for {parts.arch}, the device is {arch}"
    else:
        try:
            program, names = _load_one(ctx, device, parts.native, kernel_names,
                                       require_kernel)
            return LoadedBinary(program, names, "native")
        except LoadError as exc:
            fallback = f"native code refused: {exc}"
    program, names = _load_one(ctx, device, parts.portable, kernel_names, require_kernel)
    log.warning("loaded the portable binary instead (%s)", fallback)
    return LoadedBinary(program, names, "portable", fallback)


def _load_one(ctx: cl.Context, device: cl.Device, binary: bytes,
              kernel_names: tuple[str, ...], require_kernel: bool = True
              ) -> tuple[cl.Program, tuple[str, ...]]:
    import pyopencl as cl

    check_target(binary, device)
    try:
        program = cl.Program(ctx, [device], [binary]).build()
        names = program_kernels(program, kernel_names)
    except cl.Error as exc:
        raise LoadError(f"the device refused the binary: {str(exc).splitlines()[0]}") from None
    if not names and require_kernel:
        raise LoadError("the binary holds no kernel")
    missing = [n for n in kernel_names if n not in names]
    if missing:
        raise LoadError(f"binary lacks kernel(s) {', '.join(missing)}")
    extra = [n for n in names if kernel_names and n not in kernel_names]
    if extra:
        raise LoadError(f"binary holds kernel(s) {', '.join(extra)} that the family does "
                        "not declare")
    return program, names
