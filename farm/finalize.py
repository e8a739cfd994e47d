"""finalize: compile a source with the device's platform compiler.

This is the only place the farm calls the platform compiler (``Program.build`` on
source). Errors come back as values (:class:`FinalizeResult` with ``error``), not
exceptions, because results cross process boundaries (a process pool, a Celery task)
where exception pickling loses the build log.
"""

from __future__ import annotations

import base64
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, field_serializer, field_validator

from farm.model import Lowered

if TYPE_CHECKING:
    import pyopencl as cl


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


def finalize(ctx: cl.Context, device: cl.Device, lowered: Lowered) -> FinalizeResult:
    """Compile ``lowered`` on ``device``; the binary is what ``load`` takes."""
    import pyopencl as cl

    start = time.perf_counter()
    program = cl.Program(ctx, lowered.source)
    try:
        program.build(options=list(lowered.options), devices=[device])
    except cl.Error as exc:
        log = _build_log(program, device) or str(exc)
        return FinalizeResult(error=f"the platform compiler refused the source: "
                                    f"{_first_error(log)}", build_log=log,
                              work_s=time.perf_counter() - start, host=socket.gethostname(),
                              worker=worker_name())
    binaries: Any = program.get_info(cl.program_info.BINARIES)
    work = time.perf_counter() - start
    return FinalizeResult(binary=bytes(binaries[0]), build_log=_build_log(program, device),
                          work_s=work, host=socket.gethostname(), worker=worker_name())


def finalize_and_validate(ctx: cl.Context, device: cl.Device,
                          lowered: Lowered) -> FinalizeResult:
    """Compile, then load the binary where it was made, so nothing unloadable is stored.

    Validating in the compiling process keeps loads parallel: on NVIDIA a load from a
    binary is a PTX JIT of tens of milliseconds, which would serialize a build if every
    load happened in the requesting process.
    """
    from farm.errors import LoadError
    from farm.load import load

    built = finalize(ctx, device, lowered)
    if not built.ok:
        return built
    start = time.perf_counter()
    try:
        load(ctx, device, built.binary, lowered.kernel_names)
    except LoadError as exc:
        return built.model_copy(update={"error": str(exc), "error_kind": "load",
                                        "binary": b""})
    return built.model_copy(update={"validated": True,
                                    "work_s": built.work_s + time.perf_counter() - start})


def _build_log(program: cl.Program, device: cl.Device) -> str:
    import pyopencl as cl

    try:
        return str(program.get_build_info(device, cl.program_build_info.LOG)).strip()
    except cl.Error:
        return ""


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return (log.strip().splitlines() or ["no build log"])[0][:300]
