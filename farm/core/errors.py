"""Every exception kernel-farm raises on purpose, in one place.

Hierarchy::

    FarmError                      anything the farm raises on purpose
    +-- InputError                 bad input from a person; the CLI prints one line, exits 2
    |   +-- ManifestError          a manifest file is malformed (file, line, field)
    |   +-- UnknownFamilyError     a kernel names a family that is not registered
    |   +-- ParameterError         parameters of a family are out of range / malformed
    |   +-- SettingsError          configuration cannot be used
    |   +-- BundleError            a bundle file is refused (untrusted input)
    +-- KernelError                one kernel could not be obtained; the batch goes on
    |   +-- UnsupportedFeature     the device cannot run this kernel (work-group size,
    |   |                          local memory, a missing extension); expected in tuning
    |   +-- CompileError           the platform compiler refused the source (has build log)
    |   +-- LoadError              the device refused a binary
    |   +-- VersionSkewError       client and worker compute different build ids
    +-- StoreError                 the artifact store cannot be used
    |   +-- ForeignStoreError      a file that is not a kernel-farm store (or another format)
    +-- DeviceError                no OpenCL device, or not the one asked for
    +-- ClusterError               no worker serves a fingerprint, broker unreachable...

Why a hierarchy: the CLI turns every ``FarmError`` into one readable line and a
non-zero exit status, while anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pydantic import ValidationError


class FarmError(Exception):
    """Base of every error the farm raises on purpose."""

    exit_code = 1


class InputError(FarmError):
    """Bad input: a file, a flag or a parameter a person gave us."""

    exit_code = 2


class ManifestError(InputError):
    """A manifest is malformed; the message names file, line or field."""


class UnknownFamilyError(InputError):
    """A kernel names a family that no registry entry provides."""


class ParameterError(InputError):
    """Parameters of a kernel family do not validate."""


class SettingsError(InputError):
    """Settings (environment variables, flags) that cannot be used."""


class BundleError(InputError):
    """A bundle file is refused; the target store is left unchanged."""


class KernelError(FarmError):
    """One kernel could not be obtained. The rest of its batch goes on."""

    kind = "error"

    def __init__(self, message: str, *, build_log: str = "") -> None:
        super().__init__(message)
        self.build_log = build_log


class UnsupportedFeature(KernelError):
    """The device cannot run this kernel; counted apart from failures."""

    kind = "unsupported"


class CompileError(KernelError):
    """The platform compiler refused the source; ``build_log`` says why."""

    kind = "compile"


class LoadError(KernelError):
    """The device refused a binary; nothing of it is stored."""

    kind = "load"


class VersionSkewError(KernelError):
    """Client and worker run different kernel code for one family."""

    kind = "version-skew"


class StoreError(FarmError):
    """The artifact store cannot be used."""


class ForeignStoreError(StoreError):
    """A file is not a kernel-farm store, or a store of another format version."""

    exit_code = 2


class DeviceError(FarmError):
    """No OpenCL device, or not the one asked for."""


class ClusterError(FarmError):
    """The cluster cannot serve a request (no worker for a fingerprint, ...)."""


def first_error(exc: ValidationError, default_where: str = "") -> tuple[str, str]:
    """(where, why) of a pydantic ``ValidationError``'s first error, for one line.

    ``where`` is the dotted field path (``default_where`` when the error is about the
    whole value), ``why`` pydantic's message without its ``Value error, `` prefix, which
    reads as noise to a person. The one place that turns a validation error into words:
    every boundary (settings, manifests, bundles, payloads, records) says it this way.
    """
    errors = exc.errors()
    if not errors:
        return default_where, one_line(exc)
    err = errors[0]
    where = ".".join(str(p) for p in err["loc"]) or default_where
    return where, str(err["msg"]).removeprefix("Value error, ")


def one_line(exc: BaseException) -> str:
    """Any exception as one line: ``where: why`` for a validation error, else its first
    line of text (or its type's name when it has none)."""
    if isinstance(exc, ValidationError):
        where, why = first_error(exc)
        return f"{where}: {why}" if where else why
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
