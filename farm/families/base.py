"""What a kernel family is: parameters, lowering to OpenCL C, and a runnable example.

A family is a registered kernel definition. A task names a family and carries its
parameters as data; a worker only ever expands families its registry knows, so no code
travels with a task.

A family's *build id* hashes the code that defines it (its module's source, and the
modules it names in ``depends_on``) together with the farm version. Changing a kernel's
definition therefore gives new keys, and its old artifacts are never served. Keep one
family per module so that changing one family leaves the others' build ids alone.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from farm.device import DeviceInfo
from farm.errors import ParameterError, UnsupportedFeature
from farm.hashing import sha256_hex
from farm.model import ArtifactId, KernelId, LaunchSettings, Lowered, Variant
from farm.version import __version__


class Params(BaseModel):
    """Base of every family's parameter model: strict, immutable, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


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

    # -- parameters -------------------------------------------------------------------
    def validate(self, params: Mapping[str, Any]) -> P:
        """Validate raw parameters; one line naming the field on error."""
        try:
            return self.params_model.model_validate(dict(params))  # type: ignore[return-value]
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "params"
            what = str(err["msg"]).removeprefix("Value error, ")  # pydantic's prefix
            raise ParameterError(f"{self.name}: parameter {where}: {what}") from None

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
        """Lower an artifact id: validate, check limits, expand to OpenCL C."""
        params = self.validate(artifact.kernel.params)
        lowered = self.lower(params, artifact.kernel.launch, device)
        options = tuple(self.base_options) + lowered.options + artifact.variant.options
        return lowered.model_copy(update={"options": options})

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

    def check_launch(self, params: Mapping[str, Any], launch: LaunchSettings) -> None:
        """Raise :class:`ParameterError` when ``launch`` cannot go with ``params`` on
        any device (a ``local_size`` other than the work-group the parameters fix).

        Called where a manifest is expanded, so that such a mistake is bad input
        (exit status 2, with its line) rather than a build failure. The default lowers
        for a device without limits and keeps only a :class:`ParameterError`: what a
        real device refuses, or any other failure, is left to the real lowering."""
        try:
            self.lower(self.validate(params), launch, _UNLIMITED)
        except ParameterError:
            raise
        except Exception:  # the real lowering reports it, for its kernel
            return

    # -- identity of the code -----------------------------------------------------------
    @property
    def build_id(self) -> str:
        """Hash of the code that defines this family, and of the farm version."""
        return _build_id(type(self))

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


@functools.cache
def _build_id(cls: type) -> str:
    """Hash module sources; cached per process because source files do not change under
    a running process (a changed family is seen by the next process)."""
    parts = [f"farm {__version__}"]
    modules = [cls.__module__, *getattr(cls, "depends_on", ())]
    for name in modules:
        module = sys.modules.get(name) or importlib.import_module(name)
        try:
            parts.append(inspect.getsource(module))
        except (OSError, TypeError):
            parts.append(f"{name}:{getattr(module, '__file__', '')}")
    return sha256_hex("\n\0".join(parts))[:24]
