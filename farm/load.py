"""load: create a program from a binary on the device and list its kernels.

An artifact is only ever stored after this succeeds, so a binary the device refuses is
never served to anyone.

Kernel names come from ``CL_PROGRAM_KERNEL_NAMES`` rather than by making every
``Kernel`` object (``all_kernels()``): pyopencl generates the argument-setting code of
each kernel it makes, 1 to 4 ms a program on PoCL, more than the load itself. Kernels are
made when an application asks for one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.errors import LoadError

if TYPE_CHECKING:
    import pyopencl as cl


def load(ctx: cl.Context, device: cl.Device, binary: bytes,
         kernel_names: tuple[str, ...] = ()) -> cl.Program:
    """Program built from ``binary``; checks it holds a kernel and each of ``kernel_names``."""
    return load_with_names(ctx, device, binary, kernel_names)[0]


def load_with_names(ctx: cl.Context, device: cl.Device, binary: bytes,
                    kernel_names: tuple[str, ...] = ()) -> tuple[cl.Program, tuple[str, ...]]:
    """Like :func:`load`, also returning the names of the program's kernels."""
    import pyopencl as cl

    try:
        program = cl.Program(ctx, [device], [binary]).build()
        names = tuple(n for n in str(program.get_info(cl.program_info.KERNEL_NAMES))
                      .split(";") if n)
    except cl.Error as exc:
        raise LoadError(f"the device refused the binary: {str(exc).splitlines()[0]}") from None
    if not names:
        raise LoadError("the binary holds no kernel")
    missing = [n for n in kernel_names if n not in names]
    if missing:
        raise LoadError(f"binary lacks kernel(s) {', '.join(missing)}")
    return program, names
