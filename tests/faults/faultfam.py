"""A fault-injection kernel family for the reliability tests; never in the shipped registry.

``fault`` kernels are ordinary kernels whose source carries a marker naming a fault.
When a process has ``FARM_FAULT_INJECT=1`` (and this folder on ``PYTHONPATH``, so that
``sitecustomize`` arms it at start, in every process including spawned pool processes),
compiling such a source kills the compiling process the way a compiler abort
(``abort``: SIGABRT) or an out-of-memory kill (``kill``: SIGKILL) would. A ``mode`` of
``none`` compiles normally, so the family also gives innocent kernels next to a bad one.
Register it with ``FARM_FAMILY_MODULES='["faultfam"]'``.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any, Literal

import numpy as np

from farm.core.model import Lowered
from farm.families.base import Example, KernelFamily, Params

MARKER = re.compile(r"FARM_FAULT:(abort|kill)")


class FaultParams(Params):
    mode: Literal["none", "abort", "kill"] = "none"
    salt: int = 0


class Fault(KernelFamily[FaultParams]):
    name = "fault"
    params_model = FaultParams

    def lower(self, params: FaultParams, launch: Any, device: Any) -> Lowered:
        return Lowered(source=(
            f"/* FARM_FAULT:{params.mode} salt {params.salt} */\n"
            "__kernel void fault(__global float *x) { x[get_global_id(0)] += "
            f"{params.salt}.0f; }}"), kernel_names=("fault",))

    def example(self, params: FaultParams, launch: Any, rng: Any) -> Example:
        x = rng.uniform(size=8).astype(np.float32)
        return Example("fault", [x], (8,), None, {0: x + params.salt})


FAMILIES = [Fault]


def die_if_marked(source: str) -> None:
    """Kill this process when ``source`` asks for it (and injection is on)."""
    found = MARKER.search(source)
    if found is None or os.environ.get("FARM_FAULT_INJECT") != "1":
        return
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dump to wait for
    if found.group(1) == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)


def arm() -> None:
    """Wrap ``farm.compilation.finalize.finalize``: a marked source kills the compiling process."""
    import farm.compilation.finalize as fin

    if getattr(fin.finalize, "_fault_armed", False):
        return
    real = fin.finalize

    def finalize(ctx: Any, device: Any, lowered: Lowered, *extra: Any) -> Any:
        die_if_marked(lowered.source)
        return real(ctx, device, lowered, *extra)

    finalize._fault_armed = True  # type: ignore[attr-defined]
    fin.finalize = finalize  # type: ignore[assignment]
