"""finalize: compile a source with the device's platform compiler.

This is the only place the farm calls the platform compiler (``Program.build`` on
source). Errors come back as values (:class:`FinalizeResult` with ``error``), not
exceptions, because results cross process boundaries (a process pool, a Celery task)
where exception pickling loses the build log.

Two kinds of source reach it: a family's :class:`~farm.core.model.Lowered` (built
through ``pyopencl.Program``, which adds its own ``-I`` folder and
``PYOPENCL_BUILD_OPTIONS``), and an application's program, :class:`RawSource`: the bytes
and the option string that application's pyopencl already processed, handed to the
driver as they are (``farm.programs``). Every farm compile runs inside
:func:`farm_compiling`, so a hook on ``pyopencl.Program.build`` in the same process
(``farm.programs.hook``) lets it through untouched instead of serving it.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

from farm.compilation.compiling import farm_compiling, in_farm_compile  # noqa: F401 (theirs)
from farm.compilation.load import BuiltProgram, load
from farm.compilation.ready import (
    applies,
    private_option,
    program_binary,
    program_route,
    program_route_applies,
    ready_binary,
)
from farm.core.errors import LoadError, first_error_line
from farm.core.isolation import compile_slot
from farm.core.model import Lowered

if TYPE_CHECKING:
    import pyopencl as cl

    from farm.compilation.native import NativeLinker

logger = logging.getLogger(__name__)


class FinalizeResult(BaseModel):
    """A binary and its build log, or the error that stopped the compiler."""

    model_config = ConfigDict(frozen=True)

    binary: bytes = b""
    build_log: str = ""
    work_s: float = 0.0
    error: str = ""
    #: which step failed: the compiler, or the validating load of its binary
    error_kind: str = "compile"
    #: the binary was loaded on a device of the fingerprint where it was made
    validated: bool = False
    host: str = ""
    worker: str = ""
    #: the binary is a native container with machine code for this architecture
    #: (:mod:`farm.compilation.native`); "" when it is the plain binary the compiler returned
    native_arch: str = ""
    #: seconds spent turning the portable binary into machine code (part of ``work_s``)
    native_s: float = 0.0
    #: seconds spent loading the stored binary to validate it (part of ``work_s``)
    validate_s: float = 0.0
    #: why no machine code was stored where a linker exists ("" when it was, or none)
    native_error: str = ""
    #: the launch specialisation whose machine code the binary carries, ready for a
    #: load's first launch (:mod:`farm.compilation.ready`; PoCL), "" when none
    ready_spec: str = ""
    #: why none is carried where the device needed one ("" when it is, or none needed)
    ready_error: str = ""
    #: the kernels of the built program, in the driver's order (an application's
    #: program records them in its stored body: ``farm.programs.body``)
    kernel_names: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.error

    # JSON-safe: Celery payloads are JSON only, so bytes travel as base64.
    @field_serializer("binary", when_used="json")
    def _b64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @field_validator("binary", mode="before")
    @classmethod
    def _unb64(cls, value: object) -> object:
        if isinstance(value, str):
            return base64.b64decode(value, validate=True)
        return value


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class RawSource:
    """An application's program as its pyopencl hands it to the driver.

    ``options`` is the byte string ``pyopencl.Program._process_build_options`` made (its
    ``-I`` folder included); the driver gets it unchanged. A program may hold no kernel
    (pyopencl builds an empty source), so its load checks none.
    """

    source: bytes
    options: bytes
    kernel_names: tuple[str, ...] = ()


def _start_build(ctx: cl.Context, device: cl.Device, lowered: Lowered | RawSource,
                 extra_options: tuple[str, ...]) -> BuiltProgram:
    """The program of ``lowered``, built on ``device``; raises ``pyopencl.Error``."""
    import pyopencl as cl

    if isinstance(lowered, RawSource):
        raw = cl._cl._Program(ctx, lowered.source)
        options = b" ".join([lowered.options, *(o.encode() for o in extra_options)])
        try:
            raw.build(options.strip(), [device])
        except cl.Error as exc:
            raise _Failed(raw, exc) from None
        return raw
    program = cl.Program(ctx, lowered.source)
    try:
        program.build(options=[*lowered.options, *extra_options], devices=[device])
    except cl.Error as exc:
        raise _Failed(program, exc) from None
    return program


class _Failed(Exception):
    """The platform compiler refused a source: the program (for its log) and why."""

    def __init__(self, program: BuiltProgram, error: Exception) -> None:
        super().__init__(str(error))
        self.program = program


def finalize(ctx: cl.Context, device: cl.Device, lowered: Lowered | RawSource,
             extra_options: tuple[str, ...] = (), ready: bool = True) -> FinalizeResult:
    """Compile ``lowered`` on ``device``; the binary is what ``load`` takes.

    ``extra_options`` are the native linker's
    (:attr:`farm.compilation.native.NativeLinker.build_options`):
    they change how the build spends its time, never the binary, so they are not part
    of the kernel's options or its key.

    With ``ready``, where the device makes machine code at a kernel's first launch
    (PoCL's CPU drivers) and a family's ``lowered`` declares a launch, the binary is
    taken after one launch and carries that launch's machine code
    (:mod:`farm.compilation.ready`). An application's program declares none: its binary
    is taken without the generic machine code PoCL would make for every kernel first
    (:func:`farm.compilation.ready.program_binary`).

    It runs in a slot of the host's cores (:func:`farm.core.isolation.compile_slot`): a
    measurement of a CPU device on this host waits for it, and it waits for one.
    """
    with compile_slot():
        return _finalize(ctx, device, lowered, extra_options, ready)


def _finalize(ctx: cl.Context, device: cl.Device, lowered: Lowered | RawSource,
              extra_options: tuple[str, ...], ready: bool) -> FinalizeResult:
    import pyopencl as cl

    start = time.perf_counter()
    route = isinstance(lowered, RawSource) and ready and program_route_applies(device)
    made = None
    try:
        with farm_compiling(), program_route() if route else contextlib.nullcontext(
                time.time()) as since:
            program = _start_build(ctx, device, lowered,
                                   (*extra_options, private_option()) if route
                                   else extra_options)
            if route:
                made = program_binary(program, since)
    except _Failed as exc:
        log = _build_log(exc.program, device) or str(exc)
        return FinalizeResult(error=f"the platform compiler refused the source: "
                                    f"{first_error_line(log)}", build_log=log,
                              work_s=time.perf_counter() - start, host=socket.gethostname(),
                              worker=worker_name())
    spec = error = ""
    declared = lowered.ready if isinstance(lowered, Lowered) else None
    if made is not None:
        binary, error = made.binary, made.error
        if error:
            logger.info("program binary taken the plain way (%s)", error)
        if not binary:
            return FinalizeResult(error=error, error_kind="validation",
                                  work_s=time.perf_counter() - start,
                                  host=socket.gethostname(), worker=worker_name())
    elif ready and declared is not None and applies(device):
        made = ready_binary(ctx, device, program, declared)
        binary, spec, error = made.binary, made.spec, made.error
        if error:  # stored all the same: its first launch compiles, as before
            logger.warning("%s: binary stored without its launch's machine code (%s)",
                           declared.kernel_name, error)
    else:
        binaries = cast("list[bytes]", program.get_info(cl.program_info.BINARIES))
        binary = bytes(binaries[0])
    work = time.perf_counter() - start
    return FinalizeResult(binary=binary, build_log=_build_log(program, device),
                          work_s=work, host=socket.gethostname(), worker=worker_name(),
                          ready_spec=spec, ready_error=error,
                          kernel_names=_kernel_names(program))


def finalize_and_validate(ctx: cl.Context, device: cl.Device,
                          lowered: Lowered | RawSource,
                          linker: NativeLinker | Literal["auto"] | None = "auto",
                          ready: bool = True, validate: bool = True) -> FinalizeResult:
    """Compile, then load the binary where it was made, so nothing unloadable is stored.

    Validating in the compiling process keeps loads parallel: on NVIDIA a load from a
    binary is a PTX JIT of tens of milliseconds, which would serialize a build if every
    load happened in the requesting process.

    Where the device has a native linker (``"auto"``: this process's
    :func:`farm.compilation.native.linker_for` the device; NVIDIA through the CUDA driver), the
    portable binary is also turned into machine code here, and the *machine code* is
    what the validating load checks: the artifact becomes a native container that every
    later process loads in about a millisecond. A conversion or load that fails leaves
    the plain binary, validated as before (``native_error`` says why).

    ``ready``: see :func:`finalize` (PoCL's CPU drivers; ``Settings.pocl_ready``).

    Without ``validate`` a plain binary comes back unloaded (``validated`` False): for a
    caller that loads it for its own use next and stores it only after that load (the
    program hook: a second load here would cost as much again). Machine code from a
    linker is always loaded here: which part of the container to keep depends on it.
    """
    from farm.compilation.native import linker_for

    native = linker_for(device) if linker == "auto" else linker
    extra = native.build_options if native is not None else ()
    built = finalize(ctx, device, lowered, extra, ready)
    if not built.ok and extra:
        # A driver that refuses the linker's options must not fail a kernel it compiles:
        # the plain build decides (this costs a second build only for failing kernels).
        built = finalize(ctx, device, lowered, ready=ready)
    if not built.ok:
        return built
    if native is not None:
        converted = _with_native(ctx, device, lowered, built, native)
        if converted.native_arch:
            return converted
        built = converted
    if not validate:
        return built
    start = time.perf_counter()
    try:
        load(ctx, device, built.binary, lowered.kernel_names,
             require_kernel=not isinstance(lowered, RawSource))
    except LoadError as exc:
        return built.model_copy(update={"error": str(exc), "error_kind": "load",
                                        "binary": b""})
    spent = time.perf_counter() - start
    return built.model_copy(update={"validated": True, "validate_s": spent,
                                    "work_s": built.work_s + spent})


def _with_native(ctx: cl.Context, device: cl.Device, lowered: Lowered | RawSource,
                 built: FinalizeResult, linker: NativeLinker) -> FinalizeResult:
    """``built`` as a validated native container, or with ``native_error`` set."""
    from farm.compilation.native import pack

    start = time.perf_counter()
    try:
        machine_code = linker.link(built.binary)
    except Exception as exc:  # a linker is a driver: any refusal means "store PTX"
        return _spent(built, start, f"{type(exc).__name__}: {exc}"[:500])
    linked = time.perf_counter()
    try:
        load(ctx, device, machine_code, lowered.kernel_names,
             require_kernel=not isinstance(lowered, RawSource))
    except LoadError as exc:
        return _spent(built, start, f"machine code refused: {exc}")
    done = time.perf_counter()
    return built.model_copy(update={
        "binary": pack(linker.arch, machine_code, built.binary), "validated": True,
        "native_arch": linker.arch, "native_s": linked - start, "validate_s": done - linked,
        "work_s": built.work_s + done - start})


def _spent(built: FinalizeResult, start: float, error: str) -> FinalizeResult:
    """``built`` after a failed conversion: the time it took counts as native work."""
    spent = time.perf_counter() - start
    return built.model_copy(update={"native_error": error, "native_s": spent,
                                    "work_s": built.work_s + spent})


def _kernel_names(program: BuiltProgram) -> tuple[str, ...]:
    import pyopencl as cl

    from farm.compilation.load import program_kernels

    try:
        return program_kernels(program)
    except cl.Error:
        return ()


def _build_log(program: BuiltProgram, device: cl.Device) -> str:
    import pyopencl as cl

    try:
        return str(program.get_build_info(device, cl.program_build_info.LOG)).strip()
    except cl.Error:
        return ""
