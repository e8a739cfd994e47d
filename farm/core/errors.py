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
    |   +-- PluginError            a family's own code failed, hung or returned nonsense
    +-- InfrastructureError        the farm's machinery failed, not the kernel: never a
    |   |                          kernel's failure (a worker gives its chunk back)
    |   +-- StoreError             the artifact store cannot be used
    |   |   +-- StoreAccessDenied  the credentials may not do this (read-only, another pool)
    |   |   +-- ForeignStoreError  a file that is not a kernel-farm store (or another format)
    |   +-- ClusterError           no worker serves a fingerprint, broker unreachable...
    |   |   +-- OutageError        (farm.core.outage) Redis or MinIO away past the limit
    |   +-- WorkerUnavailable      a worker's own state is broken (its process could not
    |                              open its device), or it is not ready to serve
    +-- DeviceError                no OpenCL device, or not the one asked for, or none
        |                          that can compile (farm.core.device_probe)
        +-- DeviceChoiceError      FARM_DEVICE / --device matches no device here (also
                                   an InputError: exits 2)

Why a hierarchy: the CLI turns every ``FarmError`` into one readable line and a
non-zero exit status, while anything else is a bug and keeps its traceback.

Every message that may carry input (a bundle's JSON keys, a manifest's names, a plugin's
exception text) is passed through :func:`printable` before it can reach a terminal: one
line, control characters escaped, bounded in length.

Why ``KernelError`` and ``InfrastructureError`` apart (docs/RELIABILITY.md): on a
worker, only a ``KernelError`` (the kernel's own compile, load or validation failure,
and bad input about it) fails a kernel. An ``InfrastructureError`` says nothing about the
kernel: the worker puts the whole chunk back on its queue and another worker builds it,
so one broken worker (a wrong secret, a store it cannot reach) never fails a build.
"""

from __future__ import annotations

import sys

from farm.core.outcomes import Fate

#: typing.TYPE_CHECKING without importing typing: ``farm run``'s own process imports this
#: module and nothing of typing, re or pydantic (each import is paid on every run)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from collections.abc import Sequence
    from typing import TypeGuard

    from pydantic import ValidationError

#: C0 and C1 control characters and DEL: what moves a terminal's cursor, clears its
#: screen (ESC [2J) or starts a new line, when echoed from input
_CONTROL = r"[\x00-\x1f\x7f-\x9f\u2028\u2029]"
#: the longest message that echoes input (a plugin's 8 MiB text becomes this much)
MAX_ECHO = 500


def printable(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` safe to print: control characters as Python escapes (``\\x1b``,
    ``\\n``), so nothing from input can move a terminal's cursor or forge a line of its
    own, and cut to ``limit`` characters (with "...")."""
    escaped = _control().sub(lambda m: m.group().encode("unicode_escape").decode("ascii"),
                           text)
    return escaped if len(escaped) <= limit else escaped[:max(0, limit - 3)] + "..."


_compiled: list[re.Pattern[str]] = []


def _control() -> re.Pattern[str]:
    """:data:`_CONTROL`, compiled at its first use (see ``TYPE_CHECKING`` above)."""
    if not _compiled:
        import re

        _compiled.append(re.compile(_CONTROL))
    return _compiled[0]


class FarmError(Exception):
    """Base of every error the farm raises on purpose."""

    exit_code = 1

    @property
    def lines(self) -> list[str]:
        """What to show a person, one line per problem (the CLI prints each)."""
        return [str(self)]


class InputError(FarmError):
    """Bad input: a file, a flag or a parameter a person gave us."""

    exit_code = 2


class ManifestError(InputError):
    """A manifest is malformed; the message names file, line or field.

    ``problems`` holds every error found in the manifest, one line each (the message is
    the first), so a person fixes them all in one go rather than one per run."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]

    @property
    def lines(self) -> list[str]:
        return self.problems


class UnknownFamilyError(InputError):
    """A kernel names a family that no registry entry provides."""


class ParameterError(InputError):
    """Parameters of a kernel family do not validate. ``fields``: (parameter, why) of
    each error, so that a manifest can point at each parameter's line."""

    def __init__(self, message: str, fields: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.fields = list(fields)


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

    kind = Fate.UNSUPPORTED


class CompileError(KernelError):
    """The platform compiler refused the source; ``build_log`` says why."""

    kind = "compile"


class LoadError(KernelError):
    """The device refused a binary; nothing of it is stored."""

    kind = "load"


class PluginError(KernelError):
    """A family's own code (a plugin) raised, hung, exited or returned something that is
    not what the farm asked for; the kernel fails, the build goes on."""


class VersionSkewError(KernelError):
    """Client and worker run different kernel code for one family."""

    kind = "version-skew"


class InfrastructureError(FarmError):
    """The farm's own machinery failed (store, broker, a worker's state), not the kernel.

    On a worker this never fails a kernel: its chunk goes back to the queue."""


class StoreError(InfrastructureError):
    """The artifact store cannot be used."""


class StoreAccessDenied(StoreError):
    """The store's credentials may not do this (``AccessDenied``): read-only ones
    writing, or a pool's writing another fingerprint's namespace. Not retried; a
    read-only client keeps what it compiled in its local tier instead."""


class ForeignStoreError(StoreError):
    """A file is not a kernel-farm store, or a store of another format version."""

    exit_code = 2


class DeviceError(FarmError):
    """No OpenCL device, or not the one asked for, or none whose compiler works."""


class DeviceChoiceError(InputError, DeviceError):
    """``FARM_DEVICE`` (or ``--device``, ``--fingerprint``) names no device here: bad
    input, so it exits 2 like every ``InputError``."""


class ClusterError(InfrastructureError):
    """The cluster cannot serve a request (no worker for a fingerprint, ...)."""


class WorkerUnavailable(InfrastructureError):
    """This worker cannot serve now: one of its processes could not open its state
    (device, connections), or its checks say it must not consume. Its chunk goes back."""


def first_error(exc: ValidationError, default_where: str = "") -> tuple[str, str]:
    """(where, why) of a pydantic ``ValidationError``'s first error, for one line.

    ``where`` is the dotted field path (``default_where`` when the error is about the
    whole value), ``why`` pydantic's message without its ``Value error, `` prefix, which
    reads as noise to a person. The one place that turns a validation error into words:
    every boundary (settings, manifests, bundles, payloads, records) says it this way.
    """
    return every_error(exc, default_where)[0]


def every_error(exc: ValidationError, default_where: str = "") -> list[tuple[str, str]]:
    """(where, why) of each of a ``ValidationError``'s errors, as :func:`first_error`
    says one; a field nobody declared is an ``unknown field`` (pydantic: "Extra inputs
    are not permitted")."""
    errors = exc.errors()
    if not errors:
        return [(default_where, one_line(exc))]
    out = []
    for err in errors:
        where = ".".join(str(p) for p in err["loc"]) or default_where
        why = ("unknown field" if err["type"] == "extra_forbidden"
               else str(err["msg"]).removeprefix("Value error, "))
        out.append((printable(where, 200), printable(why)))
    return out


def first_error_line(log: str) -> str:
    """The line of a compiler's build log that says what went wrong (the first that
    names an error, else its first line), bounded: what a failure shows in one line."""
    for line in log.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return (log.strip().splitlines() or ["no build log"])[0][:300]


def one_line(exc: BaseException) -> str:
    """Any exception as one line: ``where: why`` for a validation error, else its first
    line of text (or its type's name when it has none)."""
    if _is_validation_error(exc):
        where, why = first_error(exc)
        return f"{where}: {why}" if where else why
    text = str(exc).strip()
    return printable(text.splitlines()[0]) if text else type(exc).__name__


def _is_validation_error(exc: BaseException) -> TypeGuard[ValidationError]:
    """Whether ``exc`` is pydantic's ``ValidationError``, without importing pydantic
    here: this module is imported by ``farm run``'s own process, which never loads
    pydantic, and an instance can exist only once pydantic_core is loaded."""
    core = sys.modules.get("pydantic_core")
    return core is not None and isinstance(exc, core.ValidationError)
