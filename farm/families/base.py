"""What a kernel family is: parameters, lowering to OpenCL C, and a runnable example.

A family is a registered kernel definition. A task names a family and carries its
parameters as data; a worker only ever expands families its registry knows, so no code
travels with a task.

A family's *build id* hashes the code that defines it (for a built-in family its module
and the farm modules it imports; for a plugin's family its whole package, data files
included) and the farm version: :mod:`farm.families.buildid` holds the rule. Changing
anything that could change a generated source therefore gives new keys, and old
artifacts are never served as ``Loaded`` (a change that leaves the source as it was
costs only a rekey, never a compile).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from farm.core.device import DeviceInfo
from farm.core.errors import (
    FarmError,
    ParameterError,
    PluginError,
    UnsupportedFeature,
    every_error,
    first_error,
)
from farm.core.model import (
    ArtifactId,
    KernelId,
    LaunchArg,
    LaunchSettings,
    Lowered,
    ReadyLaunch,
    Variant,
)
from farm.families import boundary, buildid

log = logging.getLogger(__name__)


class Params(BaseModel):
    """Base of every family's parameter model: strict, immutable, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


P = TypeVar("P", bound=Params)


@dataclass(frozen=True)
class LocalMem:
    """A ``__local`` kernel argument of ``nbytes`` bytes."""

    nbytes: int


@dataclass
class Example:
    """One launch of a lowered kernel with inputs and the outputs numpy expects.

    ``args`` are passed in order: numpy arrays become buffers (copied to the device and,
    when their index is in ``expected``, read back), numpy scalars pass by value,
    :class:`LocalMem` becomes local memory.
    """

    kernel_name: str
    args: list[np.ndarray | np.generic | LocalMem]
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None
    expected: dict[int, np.ndarray]
    rtol: float = 1e-4
    atol: float = 1e-5
    notes: dict[str, Any] = field(default_factory=dict)
    #: outputs checked at some elements only (a reference too costly to compute whole:
    #: a large matrix product): argument index -> flat indices into that output, and
    #: ``expected[index]`` holds the values at those elements, in that order
    sampled: dict[int, np.ndarray] = field(default_factory=dict)

    def ready_launch(self) -> ReadyLaunch:
        """This launch without its data: sizes, scalars and local memory only."""
        args = []
        for arg in self.args:
            if isinstance(arg, LocalMem):
                args.append(LaunchArg(kind="local", nbytes=arg.nbytes))
            elif isinstance(arg, np.ndarray):
                args.append(LaunchArg(kind="buffer", nbytes=arg.nbytes))
            else:
                args.append(LaunchArg(kind="scalar", dtype=np.asarray(arg).dtype.str,
                                      value=arg.item()))
        return ReadyLaunch(kernel_name=self.kernel_name, global_size=self.global_size,
                           local_size=self.local_size, args=tuple(args))


#: a device that refuses nothing, for :meth:`KernelFamily.check_launch`
_UNLIMITED = DeviceInfo(
    platform_index=0, device_index=0, platform_name="any", platform_version="any",
    device_name="any", vendor="any", device_version="OpenCL 3.0", driver_version="any",
    opencl_c_version="OpenCL C 3.0", max_work_group_size=1 << 30,
    max_work_item_sizes=(1 << 30, 1 << 30, 1 << 30), local_mem_size=1 << 40,
    global_mem_size=1 << 50, max_compute_units=1,
    extensions=("cl_khr_fp16", "cl_khr_fp64"))


class KernelFamily(ABC, Generic[P]):
    """A registered kernel definition. Subclasses set ``name`` and ``params_model``."""

    name: ClassVar[str]
    params_model: ClassVar[type[Params]]
    #: other modules whose source is part of this family's definition
    depends_on: ClassVar[tuple[str, ...]] = ()
    #: build options every kernel of this family is compiled with
    base_options: ClassVar[tuple[str, ...]] = ()
    #: parameters ``farm families check`` runs :meth:`example` with, one check each
    #: (empty: the defaults, for a family whose every parameter has one)
    example_params: ClassVar[tuple[dict[str, Any], ...]] = ()

    #: the parameters that are tuning choices (tile shapes, work per thread), not part of
    #: the problem a kernel solves: kernels whose parameters differ only in these are
    #: candidates of one tuning key, timed against each other (docs/TUNING.md). Their
    #: ``example`` must draw the same inputs for every candidate of a problem.
    tuning_params: ClassVar[tuple[str, ...]] = ()
    #: the candidates tried where no list is given (``KernelLoader.tuned`` with
    #: ``on_miss="tune"``): each a mapping of tuning parameters, the first the default
    tuning_space: ClassVar[tuple[dict[str, Any], ...]] = ()

    #: seconds this family's ``lower()`` or parameter validation may take before the
    #: kernel fails (a plugin's only: see :mod:`farm.families.boundary`, which caps it)
    time_limit_s: ClassVar[float] = 60.0

    # -- parameters -------------------------------------------------------------------
    def validate(self, params: Mapping[str, Any]) -> P:
        """Validate raw parameters; one line naming the field on error.

        Parameters that do not validate are bad input (:class:`ParameterError`); a
        validator that raises anything else, exits, or does not return is the family's
        own failure (:class:`PluginError`: that kernel fails, the build goes on)."""
        try:
            return boundary.call(self, "parameter validation",  # type: ignore[return-value]
                                 lambda: self.params_model.model_validate(dict(params)))
        except ValidationError as exc:
            raise self._parameter_error(exc) from None

    def _parameter_error(self, exc: ValidationError) -> ParameterError:
        """Every error of the parameters, an unknown one named with those allowed
        (``alpha`` for ``a`` is ``parameter alpha: unknown parameter (allowed: a, b)``,
        not only ``parameter a: Field required``)."""
        allowed = ", ".join(self.params_model.model_fields) or "none"
        fields = [(where, f"unknown parameter (allowed: {allowed})" if why == "unknown field"
                   else why) for where, why in every_error(exc, "params")]
        text = "; ".join(f"parameter {where}: {why}" for where, why in fields)
        return ParameterError(f"{self.name}: {text}", fields)

    def kernel_id(self, params: Mapping[str, Any],
                  launch: LaunchSettings | None = None) -> KernelId:
        """The canonical kernel id for raw parameters."""
        model = self.validate(params)
        return KernelId(family=self.name, params=model.model_dump(mode="json"),
                        launch=launch or LaunchSettings())

    def artifact_id(self, params: Mapping[str, Any], launch: LaunchSettings | None = None,
                    variant: Variant | None = None) -> ArtifactId:
        return ArtifactId(kernel=self.kernel_id(params, launch), variant=variant or Variant())

    # -- lowering ---------------------------------------------------------------------
    def lower_id(self, artifact: ArtifactId, device: DeviceInfo) -> Lowered:
        """Lower an artifact id: validate, check limits, expand to OpenCL C.

        A family may be a plugin's code: an exception it raises that is not one of the
        farm's becomes a :class:`KernelError` of this kernel (the batch goes on), and so
        does a ``lower`` that returns something other than a :class:`Lowered`."""
        params = self.validate(artifact.kernel.params)
        try:
            returned = boundary.call(self, "lower()", lambda: self.lower(
                params, artifact.kernel.launch, device))
        except ValidationError as exc:  # a Lowered(...) the plugin made wrongly
            where, why = first_error(exc)
            raise PluginError(f"family {boundary.say(self.name)}: lower() made a Lowered "
                              f"that does not validate: {where}: {why}") from None
        lowered = boundary.checked_lowered(self, returned)
        options = tuple(self.base_options) + lowered.options + artifact.variant.options
        ready = (self._ready(params, artifact.kernel.launch, lowered.kernel_names)
                 if device.compiles_at_launch else None)
        return lowered.model_copy(update={"options": options, "ready": ready})

    def _ready(self, params: P, launch: LaunchSettings,
               names: tuple[str, ...]) -> ReadyLaunch | None:
        """:meth:`ready_launch`, or ``None`` where it fails or names another kernel: an
        artifact without one is stored as before (its first launch compiles), never
        refused."""
        try:  # a plugin's example: through the boundary (caught, bounded, trimmed)
            ready = boundary.call(self, "ready_launch()",
                                  lambda: self.ready_launch(params, launch))
        except (FarmError, ValidationError) as exc:  # no ready launch, not a failed kernel
            log.warning("family %s: no ready launch (%s: %s)", boundary.say(self.name),
                        type(exc).__name__, boundary.say(exc)[:200])
            return None
        if ready is not None and not isinstance(ready, ReadyLaunch):
            log.warning("family %s: ready_launch() returned %s, not ReadyLaunch", self.name,
                        type(ready).__name__)
            return None
        return ready if ready is not None and ready.kernel_name in names else None

    @abstractmethod
    def lower(self, params: P, launch: LaunchSettings, device: DeviceInfo) -> Lowered:
        """Expand to OpenCL C for ``device``; raise :class:`UnsupportedFeature` when the
        device's limits or extensions cannot run this kernel."""

    def example(self, params: P, launch: LaunchSettings,
                rng: np.random.Generator) -> Example | None:
        """A small launch with inputs and numpy's expected outputs, or ``None``.

        Optional: a family without one builds and loads all the same. With one,
        ``farm families check`` runs it on the local device against numpy, the one
        test a family author gets for free (see docs/PLUGINS.md)."""
        return None

    def ready_launch(self, params: P, launch: LaunchSettings) -> ReadyLaunch | None:
        """The launch a compiled artifact is made ready for, or ``None``.

        On a device that makes a kernel's machine code at its first launch (PoCL's CPU
        drivers), the compiling process launches this once, with zero-filled buffers of
        these sizes, and stores the code it made, so a load's first launch with the same
        local size (and grid class) compiles nothing (docs/LOADER.md). The default is
        :meth:`example`'s launch without its data; a family whose example is costly to make
        (large arrays, a reference computation) overrides this with the sizes alone."""
        example = self.example(params, launch, np.random.default_rng(0))
        return None if example is None else example.ready_launch()

    def check_launch(self, params: Mapping[str, Any], launch: LaunchSettings) -> None:
        """Raise :class:`ParameterError` when ``launch`` cannot go with ``params`` on
        any device (a ``local_size`` other than the work-group the parameters fix).

        Called where a manifest is expanded, so that such a mistake is bad input
        (exit status 2, with its line) rather than a build failure. The default lowers
        for a device without limits and keeps only a :class:`ParameterError`: what a
        real device refuses, or any other failure, is left to the real lowering."""
        try:
            validated = self.validate(params)
            boundary.call(self, "lower()", lambda: self.lower(validated, launch, _UNLIMITED))
        except ParameterError:
            raise
        except (FarmError, ValidationError):  # the real lowering reports it, for its kernel
            return

    # -- identity of the code -----------------------------------------------------------
    @property
    def build_id(self) -> str:
        """Hash of the code that defines this family, and of the farm version
        (:mod:`farm.families.buildid` says which code)."""
        return buildid.build_id(type(self))

    # -- helpers for subclasses -----------------------------------------------------------
    @staticmethod
    def check_work_group(device: DeviceInfo, local_size: tuple[int, ...]) -> None:
        """Raise :class:`UnsupportedFeature` when the device cannot run this shape."""
        total = int(np.prod(local_size))
        if total > device.max_work_group_size:
            raise UnsupportedFeature(
                f"work-group size {total} exceeds the device limit {device.max_work_group_size}")
        for dim, (want, limit) in enumerate(zip(local_size, device.max_work_item_sizes,
                                                strict=False)):
            if want > limit:
                raise UnsupportedFeature(
                    f"work-group dimension {dim} of {want} exceeds the device limit {limit}")

    @staticmethod
    def check_local_mem(device: DeviceInfo, nbytes: int) -> None:
        if nbytes > device.local_mem_size:
            raise UnsupportedFeature(
                f"needs {nbytes} bytes of local memory, the device has {device.local_mem_size}")

    @staticmethod
    def check_dtype(device: DeviceInfo, dtype: str) -> None:
        if dtype == "half" and not device.has_fp16:
            raise UnsupportedFeature("element type half needs cl_khr_fp16, which the "
                                     "device lacks")
        if dtype == "double" and not device.has_fp64:
            raise UnsupportedFeature("element type double needs cl_khr_fp64, which the "
                                     "device lacks")
