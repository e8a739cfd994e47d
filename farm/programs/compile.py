"""Compiling a program away from the application that built it (a worker, ``farm build``).

The application's own folders are not there, so the headers are laid out again from
their blobs under a private folder (:func:`farm.programs.includes.lay_out`: one folder
per root, the application's current folder first), the ``-I`` options point at those
folders, and the compile runs with the first of them as the current folder (PoCL
searches the current folder before any ``-I``). Before anything is compiled, the source
is resolved again over that layout, in memory: if its include lines do not come out as
the spec says (a spec edited by hand, a blob that is not what its header was), nothing
is compiled, because the binary would be stored under a key its inputs do not produce.

The compile itself is the farm's one compile path,
:func:`~farm.compilation.finalize.finalize_and_validate` (native code where the device
has a linker, the validating load).
"""

from __future__ import annotations

import base64
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import field_serializer, field_validator

from farm.compilation.finalize import FinalizeResult, RawSource, finalize_and_validate
from farm.core.hashing import sha256_hex
from farm.core.model import Frozen
from farm.programs.includes import lay_out, reaches_outside, scan_laid_out
from farm.programs.options import portable_options, remote_options
from farm.programs.spec import ProgramSpec

if TYPE_CHECKING:
    import pyopencl as cl

#: ``os.chdir`` is process-wide: one laid-out compile at a time per process
_CWD_LOCK = threading.Lock()


def check_inputs(spec: ProgramSpec, blobs: Mapping[str, bytes]) -> str:
    """Why ``blobs`` cannot be compiled as ``spec`` ("" when they can)."""
    if not spec.portable:
        return ("the program's headers lie outside its folders; it is compiled only where "
                "the application runs")
    missing = [d for d in spec.digests() if d not in blobs]
    if missing:
        return f"blob {missing[0]} is not in the store"
    bad = [d for d in spec.digests() if sha256_hex(blobs[d]) != d]
    if bad:
        return f"blob {bad[0]} does not hold the bytes its digest names"
    why = portable_options(spec.options)
    if why:
        return f"{why}; nothing compiled"
    outside: set[str] = set()
    directives, _, read = scan_laid_out(blobs[spec.source], spec.roots, spec.layout(),
                                        dict(blobs), outside)
    if directives != spec.includes:
        return "the headers do not resolve as the spec says (edited?); nothing compiled"
    why = reaches_outside([blobs[spec.source], *read.values()], outside)
    return f"{why}; nothing compiled" if why else ""


def compile_laid_out(ctx: cl.Context, device: cl.Device, spec: ProgramSpec,
                     blobs: Mapping[str, bytes], native: bool = True,
                     ready: bool = True) -> FinalizeResult:
    """Compile ``spec`` from ``blobs`` on ``device``; errors come back as values.
    ``ready``: ``Settings.pocl_ready`` (see :func:`~farm.compilation.finalize.finalize`)."""
    why = check_inputs(spec, blobs)
    if why:
        return FinalizeResult(error=why, error_kind="validation")
    with tempfile.TemporaryDirectory(prefix="farm-program-") as folder:
        try:
            roots = lay_out(folder, spec.layout(), dict(blobs), max(spec.roots, 1))
        except OSError as exc:  # a name this file system will not take (too long...)
            return FinalizeResult(error=f"the headers cannot be laid out here: "
                                        f"{exc.strerror or exc}", error_kind="validation")
        options = remote_options(spec.options, roots)
        with _CWD_LOCK:
            before = os.getcwd()
            os.chdir(roots[0])
            try:
                return finalize_and_validate(ctx, device,
                                             RawSource(blobs[spec.source], options),
                                             "auto" if native else None, ready)
            finally:
                os.chdir(before)


class ProgramJob(Frozen):
    """A program and its blobs, for a compile process of this machine's pool."""

    spec: ProgramSpec
    blobs: dict[str, bytes]
    #: ``Settings.pocl_ready`` of the process that asked
    ready: bool = True

    @field_serializer("blobs", when_used="json")
    def _b64(self, value: dict[str, bytes]) -> dict[str, str]:
        return {k: base64.b64encode(v).decode("ascii") for k, v in value.items()}

    @field_validator("blobs", mode="before")
    @classmethod
    def _unb64(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: base64.b64decode(v, validate=True) if isinstance(v, str) else v
                    for k, v in value.items()}
        return value


def pool_compile(ctx: Any, device: Any, native: bool, job_json: str) -> str:
    """:data:`~farm.compilation.compiler.PoolJob` of a :class:`ProgramJob`."""
    job = ProgramJob.model_validate_json(job_json)
    return compile_laid_out(ctx, device, job.spec, job.blobs, native,
                            job.ready).model_dump_json()
