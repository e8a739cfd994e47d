"""What the loader raises, and how a failed kernel of a batch becomes an exception."""

from __future__ import annotations

from farm.core.errors import (
    CompileError,
    FarmError,
    InputError,
    KernelError,
    LoadError,
    ParameterError,
    UnsupportedFeature,
    VersionSkewError,
)
from farm.core.model import KernelFailure


class ArtifactMissing(KernelError):
    """No store tier holds the kernel and the loader was told not to compile it."""

    kind = "missing"


class TuningMissing(ArtifactMissing):
    """The problem was never tuned on this device and ``tuned`` was told to fail."""


class UnknownKernelName(InputError):
    """The program has no kernel of the name asked for."""


_FAILURE_ERRORS: dict[str, type[KernelError]] = {
    UnsupportedFeature.kind: UnsupportedFeature,
    "compile": CompileError,
    "load": LoadError,
    "version-skew": VersionSkewError,
    "missing": ArtifactMissing,
}


def failure_error(label: str, failure: KernelFailure) -> FarmError:
    """The exception a failed kernel raises from the loader, build log included."""
    if failure.kind == "validation":
        return ParameterError(f"{label}: {failure.message}")
    cls = _FAILURE_ERRORS.get(failure.kind, KernelError)
    return cls(f"{label}: {failure.message}", build_log=failure.build_log)
