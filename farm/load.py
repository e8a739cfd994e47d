"""load: create a program from a binary on the device and make its kernels.

An artifact is only ever stored after this succeeds, so a binary the device refuses is
never served to anyone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from farm.errors import LoadError

if TYPE_CHECKING:
    import pyopencl as cl


def load(ctx: cl.Context, device: cl.Device, binary: bytes,
         kernel_names: tuple[str, ...] = ()) -> cl.Program:
    """Program built from ``binary`` with its kernels made (checks every name exists)."""
    import pyopencl as cl

    try:
        program = cl.Program(ctx, [device], [binary]).build()
        kernels = {k.function_name for k in program.all_kernels()}
    except cl.Error as exc:
        raise LoadError(f"the device refused the binary: {str(exc).splitlines()[0]}") from None
    missing = [n for n in kernel_names if n not in kernels]
    if missing:
        raise LoadError(f"binary lacks kernel(s) {', '.join(missing)}")
    return program
