"""Making the application's program from stored binaries, on its own context and devices.

pyopencl's ``Program.build`` ends with ``self._prg`` holding a built ``_cl._Program``;
everything the application does next (``prg.kernel_name``, ``all_kernels()``,
``get_info``, ``get_build_info``) goes through that object. So the farm's answer to a
build is a ``_cl._Program`` made with ``clCreateProgramWithBinary`` for exactly the
devices the build named, built with exactly the option string pyopencl made (so
``get_build_info(OPTIONS)`` reads the same), and put in ``_prg``. A fresh one for every
build, as pyopencl does: two wrappers sharing one ``cl_program`` could not rebuild it.

A native artifact (:mod:`farm.compilation.native`, a cubin beside its PTX) gives its
machine code where the device's architecture matches, else its portable part; when the
device refuses the machine code the portable parts are tried before giving up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from farm.compilation.load import BuiltProgram
from farm.compilation.native import unpack
from farm.core.errors import LoadError

if TYPE_CHECKING:
    import pyopencl as cl


@dataclass(frozen=True)
class Assembled:
    """A built program for the application, and why machine code was not used."""

    program: BuiltProgram  # pyopencl._cl._Program
    native_fallback: str = ""


def assemble(ctx: cl.Context, devices: Sequence[cl.Device], binaries: Sequence[bytes],
             options: bytes, archs: Sequence[str]) -> Assembled:
    """The program of ``binaries`` (one per device, with its ``archs``) on ``devices``."""
    native: list[bytes] = []
    portable: list[bytes] = []
    fallback = ""
    for binary, arch in zip(binaries, archs, strict=True):
        parts = unpack(binary)
        if parts is None:
            native.append(binary)
            portable.append(binary)
        elif arch and parts.arch == arch:
            native.append(parts.native)
            portable.append(parts.portable)
        else:
            fallback = f"native code is for {parts.arch}, the device is {arch or 'unknown'}"
            native.append(parts.portable)
            portable.append(parts.portable)
    try:
        return Assembled(_build(ctx, devices, native, options), fallback)
    except LoadError as exc:
        if native == portable:
            raise
        fallback = f"native code refused: {exc}"
    return Assembled(_build(ctx, devices, portable, options), fallback)


def _build(ctx: cl.Context, devices: Sequence[cl.Device], binaries: list[bytes],
           options: bytes) -> BuiltProgram:
    """Build the binaries with the application's options; a driver that refuses options
    on a program made from binaries (they were for the source) gets none."""
    import pyopencl as cl

    error: Exception | None = None
    for opts in dict.fromkeys((options, b"")):
        try:
            program = cl._cl._Program(ctx, list(devices), binaries)
            program.build(opts, list(devices))
            return program
        except cl.Error as exc:
            error = exc
    first = str(error).splitlines()[0] if error else "no answer"
    raise LoadError(f"the device refused the binary: {first}")


def put_in_place(program: Any, built: BuiltProgram, logs: dict[int, str], *, loaded: bool,
                 seconds: float) -> None:
    """Make the application's ``program`` what pyopencl's build would have made: ``built``
    in its ``_prg``, the source build's ``logs`` (device ``int_ptr`` -> log) for
    ``get_build_info(LOG)``, and, for a program ``loaded`` from a binary, pyopencl's
    warning about a non-empty log said as its own source build would have said it."""
    program._prg = built
    program._build_duration_info = ("kernel-farm load" if loaded else "kernel-farm compile",
                                    loaded, seconds)
    program._farm_build_logs = logs
    if loaded:
        _say_log(built, logs)


def escaped_log(log: str) -> str:
    """A stored build log as the application may see it: its lines kept, every other
    control character shown as an escape (``\\x1b``), like every text the farm echoes
    from input (``farm.core.errors.printable``): a log from the store moves no cursor."""
    from farm.core.errors import printable

    return "\n".join(printable(line, 1 << 30) for line in log.splitlines())


def _say_log(built: BuiltProgram, logs: dict[int, str]) -> None:
    """pyopencl warns about a source build's non-empty log (``compiler_output``); a
    program served from a binary says what its source build said, the same way, each
    line indented (``    | ``, as ``farm build`` prints a log): no line of it can pass
    for one of the farm's or the application's own."""
    import pyopencl as cl

    devices: list[cl.Device] = built.get_info(cl.program_info.DEVICES)  # type: ignore[assignment]
    said = [(dev, logs.get(dev.int_ptr, "")) for dev in devices]
    message = ("=" * 75 + "\n").join(
        f"Build on {dev} succeeded, but said:\n\n"
        + "".join(f"    | {line}\n" for line in log.splitlines())
        for dev, log in said if log and log.strip())
    if message:
        cl.compiler_output("From-source build succeeded, but resulted in non-empty logs:\n"
                           f"{message}")
