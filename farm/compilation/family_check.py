"""``farm families check``: a family's examples compiled by the farm's own compile step
and run on a device, against numpy.

Here rather than beside the families: checking a family compiles and loads it
(:mod:`farm.compilation.finalize`, :mod:`farm.compilation.load`), and the families sit
below the compile path. Launching an example is :mod:`farm.families.run`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from farm.compilation.finalize import finalize
from farm.compilation.load import load
from farm.core.device import DeviceInfo
from farm.core.errors import ParameterError, UnsupportedFeature
from farm.core.model import LaunchSettings
from farm.core.outcomes import Fate
from farm.families.base import KernelFamily
from farm.families.run import check_example, run_example

if TYPE_CHECKING:
    import pyopencl as cl


@dataclass
class FamilyCheck:
    """What running a family's examples on one device showed.

    ``status``: ``ok`` (every example matches numpy), ``differs`` (an output does not),
    ``failed`` (lowering or compiling raised), ``unsupported`` (the device cannot run
    an example, e.g. ``half`` without fp16), ``no-example`` (the family has none, or no
    parameters to run it with). Only ``differs`` and ``failed`` are failures.
    """

    family: str
    status: str
    examples: int = 0
    problems: list[str] = field(default_factory=list)
    #: the platform compiler's whole log when it refused the source (as ``farm build``
    #: shows it), "" otherwise
    build_log: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("differs", Fate.FAILED)


def check_family(family: KernelFamily[Any], queue: cl.CommandQueue,
                 device: DeviceInfo, seed: int = 0) -> FamilyCheck:
    """Run ``family``'s example for each of its ``example_params`` (or its defaults) on
    ``queue``'s device, compiled from the lowered source by the farm's own compile step
    (no store is touched; a refused source comes back with the compiler's whole log),
    against the outputs numpy expects."""
    import pyopencl as cl

    result = FamilyCheck(family=family.name, status="ok")
    for raw in family.example_params or ({},):
        try:
            params = family.validate(raw)
        except ParameterError as exc:
            if family.example_params:
                return FamilyCheck(family.name, Fate.FAILED, problems=[str(exc)])
            return FamilyCheck(family.name, "no-example",
                               problems=["no example_params, and its parameters have no "
                                         "defaults to run the example with"])
        launch = LaunchSettings()
        label = f"{family.name}({','.join(f'{k}={v}' for k, v in raw.items())})"
        try:
            example = family.example(params, launch, np.random.default_rng(seed))
            if example is None:
                return FamilyCheck(family.name, "no-example", problems=["no example()"])
            lowered = family.lower_id(family.artifact_id(raw, launch), device)
            built = finalize(queue.context, queue.device, lowered)  # as farm build does
            if not built.ok:
                return FamilyCheck(family.name, Fate.FAILED, result.examples,
                                   [f"{label}: {built.error}"], build_log=built.build_log)
            program = load(queue.context, queue.device, built.binary)
            kernel = cl.Kernel(program, example.kernel_name)
            outputs = run_example(queue, kernel, example)
        except UnsupportedFeature as exc:
            return FamilyCheck(family.name, Fate.UNSUPPORTED, result.examples,
                               [f"{label}: {exc}"])
        except Exception as exc:  # a family's own code: report it, check the next one
            text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            return FamilyCheck(family.name, Fate.FAILED, result.examples, [f"{label}: {text}"])
        result.examples += 1
        problems = check_example(outputs, example)
        if problems:
            result.status = "differs"
            result.problems += [f"{label}: {p}" for p in problems]
    return result
