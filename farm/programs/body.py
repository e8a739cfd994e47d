"""A program artifact's body: the device binary, and what it is for, in one digested blob.

An application's program is opaque: its key says which source, options and headers it
was built from, but nothing in a driver's binary says which program it is. Stored as the
bare binary, another program's valid binary under a key was served as that program (its
values, or pyopencl's ``'twice' was not found``), and a build log stored beside it was
neither digested nor signed. So the stored bytes of a program are a **body**::

    b"KFPROG01" | u32 big endian N | N bytes of JSON (:class:`BodyHeader`) | the binary

the header naming the program's key, the device fingerprint it was built for, the
kernels the built program holds (in the driver's order) and the source build's log. The
artifact's digest covers all of it, and so does its signature where signing is
configured: a binary copied under another key, into another device's namespace, with its
kernels or its log changed, is refused (:func:`read_body`, against the key and device it
is being served for), and the isolated proof checks that the binary holds exactly the
kernels the header names (:mod:`farm.programs.proving`). What a digest alone cannot stop
is a writer who makes a whole new body: that is what a signing key is for (docs/SECURITY.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, StringConstraints, ValidationError

from farm.core.keys import PROGRAM_FAMILY
from farm.core.model import Artifact, Frozen, Key, LogText
from farm.programs.headers import BODY_MAGIC as MAGIC
from farm.programs.headers import DEVICE_PATTERN, KERNEL_PATTERN, MAX_KERNELS, PROGRAM_PATTERN
from farm.programs.headers import LENGTH as _LEN
from farm.programs.headers import MAX_BODY_HEADER as MAX_HEADER
from farm.programs.headers import BodyError as BodyError

if TYPE_CHECKING:
    from farm.compilation.finalize import FinalizeResult

ProgramKernel = Annotated[str, StringConstraints(pattern=KERNEL_PATTERN)]


class BodyHeader(Frozen):
    """What a body says it is (the patterns and limits: :mod:`farm.programs.headers`,
    whose reader accepts exactly what this model does)."""

    format: Literal[1] = 1
    program: str = Field(pattern=PROGRAM_PATTERN)
    device: str = Field(pattern=DEVICE_PATTERN)
    kernels: tuple[ProgramKernel, ...] = Field(default=(), max_length=MAX_KERNELS)
    log: LogText = ""


@dataclass(frozen=True)
class Body:
    """A program's stored body, read: its header and the device binary."""

    header: BodyHeader
    binary: bytes

    @property
    def kernels(self) -> tuple[str, ...]:
        return self.header.kernels

    @property
    def log(self) -> str:
        return self.header.log


def encode_body(program: Key, device: str, kernels: tuple[str, ...], log: str,
                binary: bytes) -> bytes:
    """The stored bytes of ``binary``, built for ``program`` on ``device``."""
    header = BodyHeader(program=str(program), device=device, kernels=kernels, log=log)
    raw = header.model_dump_json().encode("utf-8")
    return MAGIC + _LEN.pack(len(raw)) + raw + binary


def read_body(data: bytes, program: Key, device: str) -> Body:
    """The body ``data`` holds, checked to be ``program``'s for ``device``;
    :class:`BodyError` (one line) otherwise."""
    start = len(MAGIC) + _LEN.size
    if not data.startswith(MAGIC) or len(data) < start:
        raise BodyError("not a program body (no 'KFPROG01' magic)")
    size = _LEN.unpack_from(data, len(MAGIC))[0]
    if size > MAX_HEADER or start + size >= len(data):
        raise BodyError("the body's header runs past its end, or no binary follows it")
    try:
        header = BodyHeader.model_validate(json.loads(data[start:start + size]))
    except (ValidationError, ValueError, RecursionError) as exc:
        raise BodyError(f"the body's header does not validate: "
                        f"{' '.join(str(exc).split())}"[:300]) from None
    if header.program != str(program):
        raise BodyError(f"the body is program {header.program[:24]}'s, not "
                        f"{str(program)[:24]}'s")
    if header.device != device:
        raise BodyError(f"the body was built for device {header.device}, not {device}")
    if len(set(header.kernels)) != len(header.kernels):
        raise BodyError("the body names a kernel twice")
    return Body(header=header, binary=data[start + size:])


def program_artifact(program: Key, device: str, built: FinalizeResult, binary: bytes,
                     spec_digest: str) -> Artifact:
    """The artifact of ``binary``, compiled (``built``: its kernels, log, where and how
    long) for ``program`` on ``device`` (``spec_digest``: its spec blob's, which the
    artifact names as its source)."""
    return Artifact.create(program, PROGRAM_FAMILY,
                           encode_body(program, device, built.kernel_names, built.build_log,
                                       binary), spec_digest,
                           host=built.host, worker=built.worker, work_s=built.work_s)
